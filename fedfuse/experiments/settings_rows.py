"""The stored result rows behind ``docs/settings.md``: ``fedfuse report`` CSVs of ``fedfuse
compare`` sweeps (``docs/results/*/results.csv``) and :mod:`~fedfuse.experiments.plain_models`
runs (``docs/results/user-models/*.json``), read into one :class:`Table` per architecture."""

from __future__ import annotations

import csv
import json
import logging
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedfuse.experiments.report.rows import BASE_LABEL, ZERO_SHOT, Stat
from fedfuse.fusion import FUSION_METHODS

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = ROOT / "docs" / "results"
REFERENCE_KIND = "reference"
#: the JSON keys of :mod:`~fedfuse.experiments.plain_models` that are references, not methods
_JSON_REFERENCES = ("best site", "ensemble")


@dataclass(frozen=True)
class Result:
    """One method (or reference) in one setting, over the seeds that succeeded."""

    label: str
    kind: str
    accuracy: Stat
    seeds: tuple[int, ...]
    upload: float | None = None
    rounds: int = 0
    round_upload: float | None = None
    size: float | None = None  # the fused model's parameters over a site model's


@dataclass
class Table:
    """The stored results of one architecture from one source, by (partition, sites)."""

    model: str
    title: str
    sources: list[str]
    cells: dict[tuple[str, int], list[Result]]
    site_label: str  # which single site the rows hold: "mean site" or "best site"
    site_row: str  # the label of that reference row
    experiment: str | None = None  # a fedfuse compare preset
    #: a plain_models cell: the arguments of the run that measured it
    plain_args: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)


def _shown(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def _number(text: str | None) -> float | None:
    return float(text) if text not in ("", None) else None


def read_compare_csv(path: Path) -> list[Table]:
    """The tables of one ``fedfuse report`` CSV, one per (experiment, model); zero-shot rows."""
    tables: dict[tuple[str, str], Table] = {}
    with path.open(newline="") as handle:
        for row in csv.DictReader(handle):
            if row.get("stage") not in (None, "", ZERO_SHOT):
                continue
            key = (row["experiment"], row["model"])
            if key not in tables:
                tables[key] = Table(
                    model=row["model"],
                    title=f"`{row['model']}` on {row['dataset']} (preset `{row['experiment']}`)",
                    sources=[_shown(path)],
                    cells=defaultdict(list),
                    site_label="mean site",
                    site_row=BASE_LABEL,
                    experiment=row["experiment"],
                )
            n = int(row["n"] or 0)
            std = _number(row["accuracy_pct_std"])
            result = Result(
                label=row["label"],
                kind=row["kind"],
                accuracy=Stat(_number(row["accuracy_pct_mean"]), std, n),
                seeds=tuple(int(s) for s in row["seeds"].split()),
                upload=_number(row.get("upload_bytes_per_site_mean", "")),
                rounds=int(row.get("statistics_rounds") or 0),
                round_upload=_number(row.get("round_upload_bytes_per_site_max_mean", "")),
                size=_number(row.get("fused_size_vs_site_mean")),
            )
            tables[key].cells[(row["partition"], int(row["sites"]))].append(result)
    return list(tables.values())


def read_plain_json(path: Path) -> Table:
    """A :mod:`~fedfuse.experiments.plain_models` run: the user's model (``own`` rows left
    out), mean ± sample std over its seeds, accuracy in %."""
    data = json.loads(path.read_text())
    args, seeds_rows = data["args"], data["rows"]
    names = [k for k in seeds_rows[0] if not k.startswith("own ")]
    cell = (args["partitioner"], int(args["sites"]))
    results = []
    for name in names:
        values = [100 * r[name]["accuracy"] for r in seeds_rows if name in r]
        if name in _JSON_REFERENCES:
            kind = REFERENCE_KIND
        else:  # e.g. "trains on the fusion set" for kd and linear-probe, as compare's rows say
            kind = FUSION_METHODS[name].kind if name in FUSION_METHODS else "fusion"
        results.append(Result(name, kind, Stat.of(values), tuple(args["seeds"])))
    return Table(
        model=f"torchvision {args['model']}",
        title=f"torchvision `{args['model']}` (a user's own model class) on {args['dataset']}",
        sources=[_shown(path)],
        cells={cell: results},
        site_label="best site",
        site_row="best site",
        plain_args={cell: args},
    )


def _merge(tables: Iterable[Table]) -> list[Table]:
    """Tables of one architecture and source merged; a cell stored twice keeps its first
    results and adds the other's methods it lacks (a plain_models cell: the first run only)."""
    merged: dict[tuple[str, str | None], Table] = {}
    for table in tables:
        key = (table.model, table.experiment)
        if key not in merged:
            merged[key] = table
            continue
        into = merged[key]
        into.sources += [s for s in table.sources if s not in into.sources]
        for cell, results in table.cells.items():
            if cell in into.cells and table.experiment is None:
                log.warning("%s: %s stored twice; the first run kept", table.model, cell)
                continue
            known = {r.label for r in into.cells.get(cell, [])}
            into.cells.setdefault(cell, []).extend(r for r in results if r.label not in known)
            if cell in table.plain_args:
                into.plain_args[cell] = table.plain_args[cell]
    return list(merged.values())


def load_tables(results_dir: Path = RESULTS_DIR) -> list[Table]:
    """Every stored table under ``results_dir``: the compare reports, then the plain_models
    runs, each architecture once."""
    tables: list[Table] = []
    for path in sorted(results_dir.glob("*/results.csv")):
        tables += read_compare_csv(path)
    tables += [read_plain_json(p) for p in sorted(results_dir.glob("user-models/*.json"))]
    return _merge(tables)
