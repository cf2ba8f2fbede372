"""A sweep directory's rows: read and validated, grouped by table, aggregated over seeds."""

from __future__ import annotations

import json
import logging
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

ROW_FORMAT = "fedfuse-compare-row/1"
#: a row's stage (rows written before fine-tuning existed are zero-shot)
ZERO_SHOT, FINETUNED = "zero-shot", "finetuned"
BASE_LABEL = "base models (mean)"
ENSEMBLE_LABEL = "ensemble"
#: the ensemble of mean logits, a second reference (rows from before it existed lack it)
LOGIT_ENSEMBLE_LABEL = "ensemble (mean logits)"
NO_STD = "–"  # shown for the std of a single value (and for any absent number)

_REQUIRED = ("row_id", "status", "experiment", "partition", "sites", "seed", "label")


# ------------------------------------------------------------------------------ the sweep
@dataclass
class Sweep:
    """The rows of a sweep directory, with the files that could not be read and why."""

    directory: Path
    rows: list[dict[str, Any]]
    problems: list[str] = field(default_factory=list)

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if not is_ok(r)]


def is_ok(row: dict[str, Any]) -> bool:
    """The job succeeded with a finite accuracy."""
    accuracy = row.get("accuracy")
    return row.get("status") == "ok" and isinstance(accuracy, int | float) and np.isfinite(accuracy)


def load_sweep(sweep_dir: str | Path) -> Sweep:
    """Read ``<sweep_dir>/rows/*.json``; unreadable or malformed files are listed, not raised.

    Raises:
        FileNotFoundError: ``sweep_dir`` has no ``rows/`` directory.
    """
    directory = Path(sweep_dir)
    rows_dir = directory / "rows"
    if not rows_dir.is_dir():
        raise FileNotFoundError(f"{directory}: not a sweep directory (no rows/ inside)")
    rows, problems = [], []
    for path in sorted(rows_dir.glob("*.json")):
        try:
            row = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            problems.append(f"{path.name}: unreadable ({error})")
            continue
        if not isinstance(row, dict) or row.get("format") != ROW_FORMAT:
            found = row.get("format") if isinstance(row, dict) else type(row).__name__
            problems.append(f"{path.name}: format {found!r}, expected {ROW_FORMAT!r}")
            continue
        missing = [k for k in _REQUIRED if row.get(k) is None]
        if missing:
            problems.append(f"{path.name}: lacks {missing}")
            continue
        try:
            row["sites"], row["seed"] = int(row["sites"]), int(row["seed"])
        except (TypeError, ValueError):
            problems.append(f"{path.name}: sites and seed must be integers")
            continue
        row.setdefault("dataset", row["experiment"])
        row.setdefault("model", "?")
        row["scores"] = row.get("scores") or NO_STD
        row["kind"] = row.get("kind") or "fusion"
        row["runner"] = row.get("runner") or "library"
        row["stage"] = row.get("stage") or ZERO_SHOT
        rows.append(row)
    rows = _unique_jobs(rows, problems)
    for problem in problems:
        log.warning("sweep %s: %s", directory, problem)
    if not rows:
        log.warning("sweep %s: no readable rows", directory)
    return Sweep(directory, rows, problems)


def _unique_jobs(rows: list[dict[str, Any]], problems: list[str]) -> list[dict[str, Any]]:
    """One row per job (a rerun may leave two): an ok row wins over a failed one, then the
    later row id; each dropped row is noted in ``problems``."""
    jobs: dict[tuple, dict[str, Any]] = {}
    for row in sorted(rows, key=lambda r: (is_ok(r), str(r["row_id"]))):
        key = (*table_key(row), row["scores"], row["label"], row["kind"], row["runner"])
        key += (row["stage"], row["sites"], row["seed"])
        if key in jobs:
            problems.append(f"{jobs[key]['row_id']}: the same job as {row['row_id']}, left out")
        jobs[key] = row
    return sorted(jobs.values(), key=lambda r: str(r["row_id"]))


# ------------------------------------------------------------------------------ aggregation
@dataclass(frozen=True)
class Stat:
    """Mean and sample standard deviation (None for fewer than two values) of ``n`` values."""

    mean: float | None
    std: float | None
    n: int

    @classmethod
    def of(cls, values: Iterable[float | None]) -> Stat:
        finite = [float(v) for v in values if v is not None and np.isfinite(v)]
        if not finite:
            return cls(None, None, 0)
        std = statistics.stdev(finite) if len(finite) > 1 else None
        return cls(statistics.fmean(finite), std, len(finite))


@dataclass(frozen=True)
class SummaryRow:
    """One (table, series, number of sites) cell group aggregated over seeds."""

    table: tuple[str, str, str, str]  # experiment, dataset, model, partition
    label: str
    scores: str
    kind: str
    runner: str
    sites: int
    seeds: tuple[int, ...]
    failed: int
    accuracy: Stat  # percent
    loss: Stat
    gap: Stat  # ensemble minus this accuracy, percentage points
    seconds: Stat
    upload: Stat  # bytes per site, the train round's upload
    test_examples: int | None
    rounds: int = 0  # rounds after the train round (statistics, site fine-tuning)
    round_upload: Stat = Stat(None, None, 0)  # bytes per site, its largest such round
    stage: str = ZERO_SHOT  # or FINETUNED: the fused model fine-tuned after fusion
    finetune_seconds: Stat = Stat(None, None, 0)  # of a fine-tuned row
    peak_extra_mib: Stat = Stat(None, None, 0)  # the fusion's peak RSS over its start
    size: Stat = Stat(None, None, 0)  # the fused model's parameters over a site model's

    @property
    def reference(self) -> bool:
        return self.kind == "reference"


def table_key(row: dict[str, Any]) -> tuple[str, str, str, str]:
    """(experiment, dataset, model, partition): the table the row belongs to."""
    return (str(row["experiment"]), str(row["dataset"]), str(row["model"]), str(row["partition"]))


def _pct(value: Any) -> float | None:
    return 100.0 * float(value) if isinstance(value, int | float) else None


def _gap(row: dict[str, Any], accuracy: Any) -> float | None:
    ensemble, own = _pct(row.get("ensemble_accuracy")), _pct(accuracy)
    return None if ensemble is None or own is None else ensemble - own


def _mean_upload(row: dict[str, Any]) -> float | None:
    upload = row.get("upload_bytes_per_site")
    if not isinstance(upload, list) or not upload:
        return None
    return float(np.mean([float(b) for b in upload]))


def _size(row: dict[str, Any]) -> float | None:
    fused, site = row.get("fused_parameters"), row.get("site_parameters")
    return fused / site if isinstance(fused, int) and isinstance(site, int) and site else None


def _round_upload(row: dict[str, Any]) -> tuple[int, float | None]:
    """(statistics rounds, mean over sites of a site's largest round in bytes) of a row."""
    rounds = row.get("round_upload_bytes")
    if not isinstance(rounds, list) or not rounds:
        return 0, None
    per_site = [max(float(r[site]) for r in rounds) for site in range(len(rounds[0]))]
    return len(rounds), float(np.mean(per_site)) if per_site else None


def summarize(rows: Sequence[dict[str, Any]]) -> list[SummaryRow]:
    """Aggregate rows over seeds: per table, per series (base mean, ensemble, each method) and
    per number of sites. The references are taken once per site set (table, sites, seed)."""
    methods: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    site_sets: dict[tuple, dict[str, Any]] = {}
    for row in rows:
        key = (table_key(row), row["label"], row["scores"], row["kind"], row["runner"])
        methods[(*key, row.get("stage") or ZERO_SHOT, int(row["sites"]))].append(row)
        if isinstance(row.get("base_mean_accuracy"), int | float):
            site_sets.setdefault((table_key(row), int(row["sites"]), int(row["seed"])), row)
    summary = []
    references: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for (table, sites, _seed), row in site_sets.items():
        references[(table, sites)].append(row)
    for (table, sites), group in references.items():
        seeds = tuple(sorted(int(r["seed"]) for r in group))
        examples = group[0].get("test_examples")
        series = [
            (BASE_LABEL, "base_mean_accuracy", None),
            (ENSEMBLE_LABEL, "ensemble_accuracy", "ensemble_loss"),
        ]
        if any(isinstance(r.get("logit_ensemble_accuracy"), int | float) for r in group):
            series.append((LOGIT_ENSEMBLE_LABEL, "logit_ensemble_accuracy", "logit_ensemble_loss"))
        for label, accuracy, loss in series:
            summary.append(
                SummaryRow(
                    table=table,
                    label=label,
                    scores=NO_STD,
                    kind="reference",
                    runner="",
                    sites=sites,
                    seeds=seeds,
                    failed=0,
                    accuracy=Stat.of(_pct(r.get(accuracy)) for r in group),
                    loss=Stat.of(r.get(loss) for r in group) if loss else Stat(None, None, 0),
                    gap=Stat.of(_gap(r, r.get(accuracy)) for r in group),
                    seconds=Stat(None, None, 0),
                    upload=Stat(None, None, 0),
                    test_examples=examples,
                )
            )
    for (table, label, scores, kind, runner, stage, sites), group in methods.items():
        good = [r for r in group if is_ok(r)]
        summary.append(
            SummaryRow(
                table=table,
                label=label,
                scores=scores,
                kind=kind,
                runner=runner,
                sites=sites,
                seeds=tuple(sorted(int(r["seed"]) for r in good)),
                failed=len(group) - len(good),
                accuracy=Stat.of(_pct(r["accuracy"]) for r in good),
                loss=Stat.of(r.get("loss") for r in good),
                gap=Stat.of(_gap(r, r["accuracy"]) for r in good),
                seconds=Stat.of(r.get("fusion_seconds") for r in good),
                upload=Stat.of(_mean_upload(r) for r in good),
                test_examples=next((r.get("test_examples") for r in good), None),
                rounds=max((_round_upload(r)[0] for r in good), default=0),
                round_upload=Stat.of(_round_upload(r)[1] for r in good),
                stage=stage,
                finetune_seconds=Stat.of(r.get("finetune_seconds") for r in good),
                peak_extra_mib=Stat.of(r.get("fusion_extra_rss_mib") for r in good),
                size=Stat.of(_size(r) for r in good),
            )
        )
    return sorted(summary, key=_order)


def _order(row: SummaryRow) -> tuple:
    """References first, then the zero-shot rows (fusion methods before trained ones), then
    the fine-tuned rows, each block by label."""
    rank = 0 if row.label == BASE_LABEL else 1 if row.label == ENSEMBLE_LABEL else 2
    tuned = row.stage != ZERO_SHOT
    return (
        row.table,
        rank,
        tuned,
        row.kind != "fusion",
        row.label,
        row.scores,
        row.runner,
        row.sites,
    )


def series_name(row: SummaryRow, rows: Sequence[SummaryRow]) -> str:
    """The row's label, qualified by its scores and runner where its table mixes several."""
    if row.reference:
        return row.label
    peers = [r for r in rows if r.table == row.table and not r.reference]
    name = row.label
    if len({r.scores for r in peers}) > 1:
        name += f" [{row.scores}]"
    if len({r.runner for r in peers}) > 1:
        name += f" ({row.runner})"
    return name
