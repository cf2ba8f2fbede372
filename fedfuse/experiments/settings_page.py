"""Which method for my setting: ``docs/settings.md``, generated from the stored result rows.

For each architecture, one table with a line per split × number of sites: the fused model that
leads there (zero-shot, one shot; never the ensemble), its accuracy against the ensemble and a
single site, what the sites send for it (read off the configured method's
:meth:`~fedfuse.fusion.base.FusionMethod.needs` and the rows' upload bytes) and the command that
reproduces its row. Rows come from ``docs/results/*/results.csv`` (``fedfuse report`` tables of
``fedfuse compare`` sweeps) and ``docs/results/user-models/*.json``
(:mod:`fedfuse.experiments.plain_models`).

Run: ``python -m fedfuse.experiments.settings_page`` writes the page; ``--check`` exits 1 when
the committed page differs from the one the rows give.
"""

from __future__ import annotations

import argparse
import logging
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from fedfuse.experiments.report.rows import ENSEMBLE_LABEL
from fedfuse.experiments.report.tables import format_stat, markdown_table
from fedfuse.experiments.settings_rows import (
    REFERENCE_KIND,
    RESULTS_DIR,
    ROOT,
    Result,
    Table,
    load_tables,
)
from fedfuse.federation.evaluation import human_bytes
from fedfuse.fusion import make_fusion_method
from fedfuse.fusion.base import INPUT_NEEDS
from fedfuse.runtime import configure_logging
from fedfuse.settings.hydra import (
    available_options,
    compose,
    config_dir,
    method_from_config,
    method_label,
)

log = logging.getLogger(__name__)

PAGE = ROOT / "docs" / "settings.md"
#: the method that chooses among the others: shown beside the leader, never the leader itself
AUTO = "auto"
#: how far below the leader ``auto`` may be and still count as holding (issue 52's goal)
AUTO_TOLERANCE_PP = 1.0
#: the fusion inputs the server holds itself; every other one a site sends
SERVER_INPUTS = ("data", "labels")
#: :mod:`~fedfuse.experiments.plain_models` arguments a command for one method leaves out
_JSON_SKIPPED_ARGS = ("own", "output", "methods")


# ------------------------------------------------------------------------------ choosing
def _is_auto(result: Result) -> bool:
    return result.label.split(" (")[0] == AUTO


def leading(results: Sequence[Result]) -> Result | None:
    """The best single fused model: highest mean accuracy among the non-reference results that
    succeeded on at least one seed (ties: more seeds, then the label), ``auto`` left out (it
    picks one of the others); None when there is none."""
    candidates = [
        r
        for r in results
        if r.kind != REFERENCE_KIND
        and not _is_auto(r)
        and r.accuracy.n
        and r.accuracy.mean is not None
    ]
    if not candidates:
        return None
    return max(candidates, key=lambda r: (r.accuracy.mean, r.accuracy.n, r.label))


def auto_result(results: Sequence[Result]) -> Result | None:
    """``auto`` with its default candidates in this setting (None: not run or failed)."""
    return next(
        (r for r in results if r.label == AUTO and r.accuracy.n and r.accuracy.mean is not None),
        None,
    )


def reference(results: Sequence[Result], label: str) -> Result | None:
    """The reference row ``label`` (e.g. the ensemble), or None."""
    return next((r for r in results if r.kind == REFERENCE_KIND and r.label == label), None)


# ------------------------------------------------------------------------------ describing
@cache
def method_config(label: str) -> str | None:
    """The packaged ``method`` config whose row label is ``label`` (its own name first)."""
    name = label.split(" (")[0]
    options = [o for o in available_options("method") if o == name or o.startswith(f"{name}-")]
    for option in sorted(options, key=lambda o: (o != name, o)):
        if method_label(method_from_config(compose([f"method={option}"]).method)) == label:
            return option
    return None


@cache
def method_needs(label: str, config: str | None) -> frozenset[str]:
    """The fusion inputs the configured method reads (defaults when no config matches)."""
    if config is not None:
        return method_from_config(compose([f"method={config}"]).method).needs()
    return make_fusion_method(label.split(" (")[0]).needs()


def _wording(need: str) -> str:
    return re.sub(r"\s*\(.*\)$", "", INPUT_NEEDS.get(need, need))


def sends(needs: Iterable[str], result: Result) -> str:
    """What a site sends (weights, then each site-side input, then the bytes), and what the
    server must hold itself."""
    needs = sorted(needs)
    items = ["weights", *(_wording(n) for n in needs if n not in SERVER_INPUTS)]
    text = ", ".join(items)
    if result.upload is not None:
        text += f" ({human_bytes(result.upload)} per site"
        if result.rounds:
            text += f", then {result.rounds} rounds of ≤{human_bytes(result.round_upload)}"
        text += ")"
    server = [_wording(n) for n in needs if n in SERVER_INPUTS]
    if server:
        text += f"; server side: {' and '.join(server)}"
    return text


def compare_command(experiment: str, partition: str, sites: int, result: Result) -> str:
    """The ``fedfuse compare`` sweep that writes ``result``'s rows."""
    config = method_config(result.label)
    if config is None:  # name (k=v, ...): the options as overrides
        name, _, rest = result.label.partition(" (")
        overrides = [f"method.{o.strip()}" for o in rest.rstrip(")").split(",") if o.strip()]
        method = " ".join([f"method={name}", *overrides])
        log.warning("%s: no packaged method config; options given as overrides", result.label)
    else:
        method = f"method={config}"
    seeds = ",".join(str(s) for s in result.seeds)
    return (
        f"fedfuse compare -m experiment={experiment} partition={partition} sites={sites} "
        f"seed={seeds} {method}"
    )


def plain_command(args: dict[str, Any], result: Result) -> str:
    """The ``plain_models`` run (``args``: the stored run's) that measures ``result``'s method
    alone, on the same seeds with the same recipe."""
    parts = ["python -m fedfuse.experiments.plain_models"]
    for key, value in args.items():
        if key in _JSON_SKIPPED_ARGS or value is None:
            continue
        flag = "--" + key.replace("_", "-")
        shown = " ".join(map(str, value)) if isinstance(value, list) else value
        parts.append(f"{flag} {shown}")
    parts.append(f"--methods {result.label}")
    return " ".join(parts)


# ------------------------------------------------------------------------------ the page
def _setting_line(table: Table, cell: tuple[str, int]) -> tuple[list[Any], Result | None]:
    """One table line (partition, sites, leader, ..., command) and the leader (None: no rows)."""
    partition, sites = cell
    results = table.cells.get(cell, [])
    leader = leading(results)
    if leader is None:
        return [partition, sites, "no stored rows yet", *[""] * 8], None
    ensemble = reference(results, ENSEMBLE_LABEL)
    site = reference(results, table.site_row)
    gap = ""
    if ensemble is not None and ensemble.accuracy.mean is not None:
        gap = f"{leader.accuracy.mean - ensemble.accuracy.mean:+.2f}"
    auto = auto_result(results)
    auto_gap = "" if auto is None else f"{auto.accuracy.mean - leader.accuracy.mean:+.2f}"
    name = f"`{leader.label}`" + ("" if leader.kind == "fusion" else f" ({leader.kind})")
    if leader.size is not None and abs(leader.size - 1) > 1e-9:
        name += f", {leader.size:.2f}× a site's parameters"
    if table.experiment:
        config = method_config(leader.label)
        command = compare_command(table.experiment, partition, sites, leader)
    else:
        config = None
        command = plain_command(table.plain_args[cell], leader)
    line = [
        partition,
        sites,
        name,
        format_stat(leader.accuracy),
        format_stat(ensemble.accuracy) if ensemble else "",
        gap,
        format_stat(auto.accuracy) if auto else "",
        auto_gap,
        format_stat(site.accuracy) if site else "",
        sends(method_needs(leader.label, config), leader),
        f"`{command}`",
    ]
    return line, leader


def _below(leader: Result, other: Result | None) -> bool:
    mean = None if other is None else other.accuracy.mean
    return mean is not None and leader.accuracy.mean < mean


def table_markdown(table: Table) -> list[str]:
    """One architecture's section: a line per split × sites (the preset's declared ones too),
    then how often the leader trails the ensemble or the single site, and the methods not run
    in every setting."""
    declared = _declared_cells(table.experiment) if table.experiment else set()
    body, leaders = [], []
    for cell in sorted(set(table.cells) | declared):
        line, leader = _setting_line(table, cell)
        body.append(line)
        if leader is not None:
            leaders.append((leader, table.cells[cell]))
    below = sum(_below(r, reference(rs, ENSEMBLE_LABEL)) for r, rs in leaders)
    below_site = sum(_below(r, reference(rs, table.site_row)) for r, rs in leaders)
    autos = [
        (auto, r, reference(rs, ENSEMBLE_LABEL))
        for r, rs in leaders
        if (auto := auto_result(rs)) is not None
    ]
    header = [
        "split",
        "sites",
        "leading fused model",
        "accuracy %",
        "ensemble %",
        "vs ensemble (pp)",
        "`auto` %",
        "`auto` vs leader (pp)",
        f"{table.site_label} %",
        "what the sites send",
        "command",
    ]
    sources = ", ".join(f"`{s}`" for s in table.sources)
    lines = [f"## {table.title}", "", f"Rows: {sources}.", ""]
    lines += markdown_table(header, body, "lrllrrlrrll")
    lines += [
        "",
        f"The leader is below the ensemble in {below} of {len(leaders)} settings "
        f"and below the {table.site_label} in {below_site}.",
    ]
    if autos:
        holding = sum(a.accuracy.mean >= r.accuracy.mean - AUTO_TOLERANCE_PP for a, r, _ in autos)
        # where some listed method is at or above the ensemble, auto should be too
        where = [(a, e) for a, r, e in autos if e is not None and not _below(r, e)]
        above = sum(not _below(a, e) for a, e in where)
        ensemble_part = (
            f"at or above the ensemble in {above} of the {len(where)} where the leader is"
            if where
            else "the leader is below the ensemble in each of them"
        )
        lines.append(
            f"`auto` was run in {len(autos)} of these settings: within "
            f"{AUTO_TOLERANCE_PP:g} point of the leader in {holding}; {ensemble_part}."
        )
    partial = _partial_methods(table)
    if partial:
        lines.append("Run in some settings only (where each ran): " + "; ".join(partial) + ".")
    return lines


def _declared_cells(experiment: str) -> set[tuple[str, int]]:
    """The (partition, sites) cells a ``fedfuse compare`` preset declares in its sweep."""
    path = config_dir() / "experiment" / f"{experiment}.yaml"
    if not path.is_file():
        return set()
    params = (
        (yaml.safe_load(path.read_text()).get("hydra") or {}).get("sweeper", {}).get("params", {})
    )
    partitions = str(params.get("partition", "")).split(",")
    sites = str(params.get("sites", "")).split(",")
    return {(p.strip(), int(s)) for p in partitions if p.strip() for s in sites if s.strip()}


def _partial_methods(table: Table) -> list[str]:
    """``method (the settings it ran in)`` for every method missing from some stored setting.

    ``auto`` is left out: its own columns show where it ran.
    """
    ran: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for cell, results in sorted(table.cells.items()):
        for r in results:
            if r.kind != REFERENCE_KIND and r.accuracy.n and not _is_auto(r):
                ran[r.label].append(cell)
    stored = len(table.cells)
    return [
        f"`{label}` ({', '.join(f'{p} {s}' for p, s in cells)})"
        for label, cells in sorted(ran.items())
        if len(cells) < stored
    ]


def _models_without_rows(tables: Sequence[Table]) -> list[str]:
    """The packaged model configs no stored table covers, each with the presets that use it."""
    covered = {t.model for t in tables}
    presets: dict[str, list[str]] = defaultdict(list)
    for name in available_options("experiment"):
        text = (config_dir() / "experiment" / f"{name}.yaml").read_text()
        for entry in yaml.safe_load(text).get("defaults", []):
            if isinstance(entry, dict) and "override /model" in entry:
                presets[entry["override /model"]].append(name)
    lines = []
    for model in available_options("model"):
        if model not in covered:
            where = ", ".join(f"`experiment={p}`" for p in presets[model]) or "no preset"
            lines.append(f"- `{model}`: no stored rows yet ({where}).")
    return lines


def settings_markdown(results_dir: Path = RESULTS_DIR) -> str:
    """The page: how to read it, one table per architecture, the architectures without rows."""
    tables = load_tables(results_dir)
    lines = [
        "# Which method for my setting",
        "",
        "<!-- Generated by `python -m fedfuse.experiments.settings_page` from the stored rows "
        "under docs/results/; do not edit by hand. -->",
        "",
        "Find your architecture, then the line for your split (`sharded`: each site holds only "
        "some classes; `dirichlet`: every site holds every class in skewed proportions) and "
        "number of sites. It names the single fused model with the highest mean test accuracy "
        "among the stored one-shot, zero-shot rows (no fine-tuning after fusion; the ensemble, "
        "which keeps every site's model, is a reference and never the leader), with mean ± "
        "sample std over seeds (n seeds), beside the ensemble and a single site (the sites' mean, "
        "or the best site where the rows hold it; each over its own seeds), what each site "
        "must send and the command that reproduces the row. A positive "
        "'vs ensemble' means one fused model beats keeping all the sites' models. Only the "
        "methods that were run in a setting compete there. How these numbers came about, step "
        "by step: the lab notebook [results.md](results.md).",
        "",
        "Your setting is not here, or your models were trained another way? Let the run choose: "
        "`method=auto` fuses with each of its candidates (`kf-sites`, `hf-sites`, `kf-linear`, "
        "`hf-linear`, `kf-trust`, `hf-trust`, `regmean`, `regmean-fs`, `fedavg`, `vanilla`, "
        "`linear-probe`) and "
        "keeps the one the sites score best on their own rows (Flower's `evaluate` message), "
        "or, where the sites cannot score, the best on held-out fusion rows; "
        '`details["auto"]` in results.json says why. What it costs and how close it comes '
        "to the best candidate: results.md, section `auto`. Where `auto` was run in a "
        "setting, its columns give its accuracy over the same seeds' site sets (the sites "
        "retrained with the same recipe where its rows come from another sweep) and its "
        "distance to the leader.",
        "",
    ]
    for table in tables:
        lines += table_markdown(table) + [""]
    missing = _models_without_rows(tables)
    if missing:
        lines += ["## Architectures without stored rows", "", *missing, ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Write ``docs/settings.md``, or with ``--check`` exit 1 when it is not current."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check the page is current")
    parser.add_argument("--output", type=Path, default=PAGE)
    args = parser.parse_args(argv)
    configure_logging()
    page = settings_markdown()
    if args.check:
        current = args.output.read_text() if args.output.is_file() else ""
        if current != page:
            log.error(
                "%s is not current: run python -m fedfuse.experiments.settings_page", args.output
            )
            return 1
        log.info("%s is current", args.output)
        return 0
    args.output.write_text(page)
    log.info("wrote %s", args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
