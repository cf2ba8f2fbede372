"""The report's model diagnostics: class distributions, importance scores, weight statistics,
first-layer templates and loss/accuracy landscapes, from a sweep's site sets and checkpoints.

A missing or unreadable checkpoint or dataset skips that figure (see :meth:`ReportFiles.attempt`).
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedfuse.experiments.report import plots
from fedfuse.experiments.report.files import ReportFiles
from fedfuse.experiments.report.rows import NO_STD, Sweep, is_ok, table_key
from fedfuse.experiments.report.tables import markdown_table, slug, write_csv
from fedfuse.io.atomic import atomic_path

log = logging.getLogger(__name__)

SITE_SET_FORMAT = "fedfuse-site-set/1"


class SweepModels:
    """Site sets, checkpoints and test sets of a sweep, each loaded once (checkpoints stay
    memory-mapped); errors name the missing or malformed file."""

    def __init__(self, sweep: Sweep) -> None:
        self.sweep = sweep
        self._site_sets: dict[str, dict[str, Any]] = {}
        self._models: dict[Path, Any] = {}
        self._tests: dict[str, tuple[Any, Any]] = {}

    def site_set(self, row: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
        """The row's site-set directory and its ``site_set.json``; errors name the path."""
        if not row.get("site_set_dir"):
            raise ValueError(f"row {row['row_id']} names no site_set_dir")
        directory = Path(row["site_set_dir"])
        if not directory.is_absolute():
            directory = self.sweep.directory / directory
        key = str(directory)
        if key not in self._site_sets:
            path = directory / "site_set.json"
            if not path.is_file():
                raise FileNotFoundError(f"{path}: no such site-set file")
            document = json.loads(path.read_text())
            if not isinstance(document, dict) or document.get("format") != SITE_SET_FORMAT:
                raise ValueError(f"{path}: not a {SITE_SET_FORMAT} document")
            self._site_sets[key] = document
        return directory, self._site_sets[key]

    def class_counts(self, row: dict[str, Any]) -> list[list[int]]:
        """The sites x classes table of the row's site set."""
        directory, document = self.site_set(row)
        counts = document.get("class_counts")
        if not isinstance(counts, list) or not counts:
            raise ValueError(f"{directory / 'site_set.json'}: no class_counts")
        return counts

    def site_paths(self, row: dict[str, Any]) -> list[Path]:
        directory, document = self.site_set(row)
        count = int(document.get("num_sites") or row["sites"])
        return [directory / f"site_{i}.safetensors" for i in range(count)]

    def fused_path(self, row: dict[str, Any]) -> Path | None:
        """The row's fused checkpoint when it exists, else None."""
        name = row.get("fused_checkpoint") or f"fused/{row['row_id']}.safetensors"
        path = Path(name) if Path(name).is_absolute() else self.sweep.directory / name
        return path if path.is_file() else None

    def model(self, path: Path) -> Any:
        from fedfuse.io.checkpoint import load_checkpoint

        if path not in self._models:
            self._models[path] = load_checkpoint(path).model
        return self._models[path]

    def test_batch(self, row: dict[str, Any], samples: int) -> tuple[Any, Any]:
        """A seeded subset of at most ``samples`` examples of the row's test set."""
        from fedfuse.federation.scenario import Scenario
        from fedfuse.settings.run import RunSettings

        settings = RunSettings.from_config(row.get("settings") or {}, allow_unknown=True)
        identity = (settings.dataset, settings.data_root, settings.test_data)
        key = json.dumps([*identity, settings.test_samples, settings.seed, samples])
        if key not in self._tests:
            test = Scenario(settings, int(row["sites"])).test_set
            if 0 < samples < len(test):
                index = np.random.default_rng(0).choice(len(test), samples, replace=False)
                test = test.subset(np.sort(index))
            self._tests[key] = (test.inputs(), test.labels)
        return self._tests[key]


def _configurations(rows: Sequence[dict[str, Any]]) -> dict[tuple, list[dict[str, Any]]]:
    """Rows by configuration (table, scores), each list sorted by (sites, seed, label)."""
    configs: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        configs[(*table_key(row), row["scores"])].append(row)
    for group in configs.values():
        group.sort(key=lambda r: (int(r["sites"]), int(r["seed"]), str(r["label"])))
    return dict(sorted(configs.items()))


def _representative(group: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of the configuration's first site set: fewest sites, then smallest seed."""
    first = group[0]
    return [r for r in group if (r["sites"], r["seed"]) == (first["sites"], first["seed"])]


def _heading(row: dict[str, Any], *, scores: bool = True) -> str:
    text = f"{row['experiment']} · {row['partition']} · {row['sites']} sites · seed {row['seed']}"
    return text + (f" · {row['scores']} scores" if scores and row["scores"] != NO_STD else "")


def choose_landscape_rows(
    rows: Sequence[dict[str, Any]], method: str | None, models: SweepModels, limit: int
) -> tuple[list[dict[str, Any]], list[str]]:
    """One row per configuration whose fused model spans a landscape, and notes on the rest.

    ``method`` matches a row's method name or label; None picks the fusion method (label) with
    the highest mean accuracy over the ok rows that have a fused checkpoint and >= 2 sites.
    """
    usable = [r for r in rows if is_ok(r) and int(r["sites"]) >= 2 and models.fused_path(r)]
    notes = []
    if method is None:
        means: dict[str, list[float]] = defaultdict(list)
        for r in usable:  # zero-shot fusion rows (not the fine-tuned ones)
            if r["kind"] == "fusion" and r.get("stage", "zero-shot") == "zero-shot":
                means[r["label"]].append(float(r["accuracy"]))
        if not means:
            return [], ["landscapes: no ok fusion row with a fused checkpoint and >= 2 sites"]
        method = max(sorted(means), key=lambda label: statistics.fmean(means[label]))
    chosen = [r for r in usable if r["label"] == method]
    chosen = chosen or [
        r
        for r in usable
        if r.get("method") == method and r.get("stage", "zero-shot") == "zero-shot"
    ]
    if not chosen:
        return [], [f"landscapes: no ok row of method {method!r} with a fused checkpoint"]
    picked = [group[0] for group in _configurations(chosen).values()]
    if len(picked) > limit:
        notes.append(
            f"landscapes: {len(picked) - limit} of {len(picked)} configurations left out "
            f"(landscape_max_rows={limit})"
        )
    return picked[:limit], notes


@dataclass(frozen=True)
class DiagnosticsOptions:
    """How the report's diagnostics are drawn.

    Attributes:
        landscape: draw loss/accuracy landscapes.
        landscape_method: the method (registry name or row label) whose fused model spans the
            landscape's plane with sites 0 and 1; default: the fusion method with the highest
            mean accuracy over the sweep.
        landscape_grid, landscape_samples, landscape_margin: grid points per axis, test examples
            evaluated per point (a seeded subset of the run's test set), and the margin around
            the three models (a fraction of their bounding box).
        landscape_max_rows: at most this many landscapes (one per configuration, in table order).
        templates: first-layer templates shown per model (largest norm first).
        device: where models are evaluated (``auto``, ``cpu``, ``cuda``).
        progress: tqdm bars over the landscape grids.
    """

    landscape: bool = True
    landscape_method: str | None = None
    landscape_grid: int = 11
    landscape_samples: int = 1000
    landscape_margin: float = 0.25
    landscape_max_rows: int = 4
    templates: int = 8
    device: str = "auto"
    progress: bool = True

    def __post_init__(self) -> None:
        for name, low in (
            ("landscape_grid", 2),
            ("landscape_samples", 1),
            ("landscape_max_rows", 0),
            ("templates", 1),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if not self.landscape_margin >= 0:
            raise ValueError(f"landscape_margin must be >= 0, got {self.landscape_margin!r}")


def diagnostics_section(
    sweep: Sweep, out: Path, files: ReportFiles, options: DiagnosticsOptions
) -> list[str]:
    """The "Diagnostics" markdown section; writes its figures, weight_stats.csv, landscapes."""
    models = SweepModels(sweep)
    figures = out / "figures"
    md = ["", "## Diagnostics"]
    md += ["", "### Class distributions per site", ""]
    md.append("Per site set of the smallest seed, from its `site_set.json` class counts.")
    md.append("")
    for _, group in sorted(_by(sweep.rows, lambda r: (*table_key(r), r["sites"])).items()):
        row = min(group, key=lambda r: int(r["seed"]))
        stem = slug("class_counts", row["experiment"], row["partition"], f"{row['sites']}sites")
        path = files.attempt(
            f"class distribution of {_heading(row, scores=False)}",
            lambda row=row, stem=stem: plots.plot_class_distribution(
                models.class_counts(row), figures / f"{stem}_seed{row['seed']}.png"
            ),
        )
        md += _figure_line(files, path, f"class counts, {_heading(row, scores=False)}")

    configs = _configurations(sweep.rows)
    md += ["", "### Importance scores per level", ""]
    md.append(
        "Histograms of the sites' neuron importance scores (neuron-interpolation paper, Fig. 3); "
        "uniform scores are not drawn."
    )
    md.append("")
    for group in configs.values():
        row = group[0]
        if row["scores"] in (NO_STD, "uniform"):
            continue
        path = files.attempt(
            f"importance histograms of {_heading(row)}",
            lambda row=row: _importance_figure(models, row, figures),
        )
        md += _figure_line(files, path, f"importance scores, {_heading(row)}")

    md += ["", "### Weight statistics per level", ""]
    md.append(
        "Frobenius norm and (population) std of each neuron level's weights, the sites against "
        "the fused models: averaging shrinks both (Wang et al., Eqs. 5-9). All statistics: "
        "`weight_stats.csv`."
    )
    stats_rows: list[dict[str, Any]] = []
    template_lines: list[str] = []
    for group in configs.values():
        site_set = _representative(group)
        row = site_set[0]
        named = files.attempt(
            f"models of {_heading(row)}", lambda s=site_set: _named_models(models, s, files)
        )
        if not named:
            continue
        stats = files.attempt(
            f"weight statistics of {_heading(row)}",
            lambda n=named, r=row: _weight_stats(n, r, figures, stats_rows),
        )
        if stats:
            table, path = stats
            md += ["", f"{_heading(row)}:", "", *table, ""]
            md += _figure_line(files, path, f"weight statistics, {_heading(row)}")
        path = files.attempt(
            f"templates of {_heading(row)}",
            lambda n=named, r=row: _templates_figure(n, r, figures, options.templates),
        )
        template_lines += _figure_line(files, path, f"first-layer templates, {_heading(row)}")
    if stats_rows:
        files.weight_stats_csv = write_csv(out / "weight_stats.csv", stats_rows)

    md += ["", "### First-layer templates", ""]
    md.append(
        "The first layer's weights as images (MLP: each neuron's weight row reshaped to the "
        f"input; convolution: its filters), the {options.templates} of largest norm per model; the "
        "patterns the neurons match (Wang et al., template matching). Sites beyond the fourth "
        "are not shown."
    )
    md += ["", *template_lines]

    md += ["", "### Loss and accuracy landscapes", ""]
    if not options.landscape:
        md.append("Not drawn (`--no-landscape`).")
        return md
    grid = options.landscape_grid
    md.append(
        "Test loss and accuracy on the plane through sites 0 and 1 and the fused model "
        f"(neuron-interpolation paper, Fig. 2); a {grid}x{grid} grid, at most "
        f"{options.landscape_samples} test examples per point, margin {options.landscape_margin}."
    )
    md.append("")
    rows, notes = choose_landscape_rows(
        sweep.rows, options.landscape_method, models, options.landscape_max_rows
    )
    for note in notes:
        log.warning("%s", note)
        files.skipped.append(note)
    for row in rows:
        result = files.attempt(
            f"landscape of {row['row_id']} ({_heading(row)}, {row['label']})",
            lambda row=row: _landscape(
                models,
                row,
                out,
                grid=grid,
                samples=options.landscape_samples,
                margin=options.landscape_margin,
                device=options.device,
                progress=options.progress,
            ),
        )
        if result is None:
            continue
        path, data_path, text = result
        files.landscapes.append(data_path)
        md += _figure_line(files, path, f"landscape, {_heading(row)}, {row['label']}")
        md += [text, ""]
    return md


def _by(rows: Iterable[dict[str, Any]], key: Any) -> dict[Any, list[dict[str, Any]]]:
    groups: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[key(row)].append(row)
    return groups


def _figure_line(files: ReportFiles, path: Path | None, title: str) -> list[str]:
    if path is None:
        return [f"*{title}: skipped (see Skipped).*", ""]
    files.figures.append(path)
    return [f"![{title}](figures/{path.name})", ""]


def _importance_figure(models: SweepModels, row: dict[str, Any], figures: Path) -> Path:
    from fedfuse.io.checkpoint import read_metadata
    from fedfuse.models import ModelSpec, build_model

    per_site, names = [], {}
    for path in models.site_paths(row):
        document = read_metadata(path)
        saved = (document.get("scores") or {}).get(row["scores"])
        if saved is None:
            raise ValueError(f"{path}: no {row['scores']!r} scores in its metadata")
        per_site.append({int(level): np.asarray(v, float) for level, v in saved.items()})
        if not names:
            meta = build_model(ModelSpec.from_dict(document["model"]), device="meta")
            names = {i: meta.level_name(i) for i in meta.neuron_levels}
    stem = slug("importance", row["experiment"], row["partition"], row["scores"])
    return plots.plot_importance_histograms(
        per_site,
        figures / f"{stem}_{row['sites']}sites_seed{row['seed']}.png",
        level_names=names,
        title=f"{row['scores']} scores, {_heading(row, scores=False)}",
    )


def _named_models(
    models: SweepModels, site_set: Sequence[dict[str, Any]], files: ReportFiles
) -> dict[str, Any]:
    """``{"site k": model, ..., "fused: <label>": model, ...}`` for one site set; a fused model
    whose checkpoint is missing or unreadable is left out and noted as skipped."""
    from fedfuse.io.checkpoint import CheckpointError

    named = {f"site {k}": models.model(p) for k, p in enumerate(models.site_paths(site_set[0]))}
    for row in site_set:
        if not is_ok(row):
            continue
        path = models.fused_path(row)
        try:
            if path is None:
                raise CheckpointError("no checkpoint in the sweep")
            named[f"fused: {row['label']}"] = models.model(path)
        except CheckpointError as error:
            note = f"fused model of {row['row_id']} ({row['label']}): {error}"
            log.warning("%s", note)
            files.skipped.append(note)
    return named


def _weight_stats(
    named: dict[str, Any], row: dict[str, Any], figures: Path, sink: list[dict[str, Any]]
) -> tuple[list[str], Path]:
    from fedfuse.experiments.diagnostics import layer_weight_stats

    stats = {
        name: [s.to_dict() for s in layer_weight_stats(model)] for name, model in named.items()
    }
    context = {
        "experiment": row["experiment"],
        "dataset": row["dataset"],
        "model": row["model"],
        "partition": row["partition"],
        "scores": row["scores"],
        "sites": row["sites"],
        "seed": row["seed"],
    }
    for name, records in stats.items():
        sink += [{**context, "model_name": name, **record} for record in records]
    first = next(iter(stats.values()))
    header = ["model", *(f"{r['name']} norm (std)" for r in first)]
    body = [
        [name, *(f"{r['norm']:.3g} ({r['std']:.3g})" for r in records)]
        for name, records in stats.items()
    ]
    table = markdown_table(header, body, "l" + "r" * len(first))
    stem = slug("weight_stats", row["experiment"], row["partition"], row["scores"])
    path = plots.plot_weight_stats(
        stats,
        figures / f"{stem}_{row['sites']}sites_seed{row['seed']}.png",
        title=_heading(row),
    )
    return table, path


def _templates_figure(
    named: dict[str, Any], row: dict[str, Any], figures: Path, count: int
) -> Path:
    from fedfuse.experiments.diagnostics import first_layer_templates

    shown = {
        name: first_layer_templates(model, count=count, order="norm")
        for name, model in named.items()
        if not name.startswith("site ") or int(name.split()[1]) < 4
    }
    stem = slug("templates", row["experiment"], row["partition"], row["scores"])
    return plots.plot_templates(
        shown, figures / f"{stem}_{row['sites']}sites_seed{row['seed']}.png", title=_heading(row)
    )


def _landscape(
    models: SweepModels,
    row: dict[str, Any],
    out: Path,
    *,
    grid: int,
    samples: int,
    margin: float,
    device: str,
    progress: bool,
) -> tuple[Path, Path, str]:
    from fedfuse.experiments.diagnostics import landscape_on_plane

    started = time.perf_counter()
    sites = models.site_paths(row)[:2]
    fused = models.fused_path(row)
    assert fused is not None  # chosen rows have one
    anchors = [models.model(sites[0]), models.model(sites[1]), models.model(fused)]
    inputs, labels = models.test_batch(row, samples)
    result = landscape_on_plane(
        anchors, inputs, labels, grid=grid, margin=margin, device=device, progress=progress
    )
    seconds = time.perf_counter() - started
    labels_ = ["site 0", "site 1", f"fused: {row['label']}"]
    path = plots.plot_landscape(
        result,
        labels_,
        out / "figures" / f"landscape_{slug(row['row_id'])}.png",
        title=f"{_heading(row)} · {row['label']}",
    )
    document = {"row_id": row["row_id"], "label": row["label"], "anchors_named": labels_}
    document |= {"grid": grid, "margin": margin, "seconds": seconds, **result.to_dict()}
    data_path = out / "landscapes" / f"{slug(row['row_id'])}.json"
    with atomic_path(data_path) as tmp:
        tmp.write_text(json.dumps(document) + "\n")
    at = ", ".join(
        f"{name}: {100 * accuracy:.2f}% / {loss:.3f}"
        for name, accuracy, loss in zip(
            labels_, result.anchor_accuracy, result.anchor_loss, strict=True
        )
    )
    text = (
        f"Accuracy / loss at the anchors ({result.samples} test examples): {at}. "
        f"{grid * grid + 3} evaluations in {seconds:.1f} s; data: `landscapes/{data_path.name}`."
    )
    log.info("landscape of %s: %.1f s", row["row_id"], seconds)
    return path, data_path, text
