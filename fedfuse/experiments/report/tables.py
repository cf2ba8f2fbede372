"""The report's tables: markdown (one per configuration, sites as columns) and CSV files."""

from __future__ import annotations

import csv
import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fedfuse.experiments.report.rows import (
    ENSEMBLE_LABEL,
    FINETUNED,
    NO_STD,
    Stat,
    SummaryRow,
    Sweep,
    series_name,
)
from fedfuse.federation.evaluation import human_bytes
from fedfuse.io.atomic import atomic_path


def format_stat(stat: Stat, digits: int = 2, *, failed: int = 0, count: bool = True) -> str:
    """``"mean ± std (n=…)"``; the std of one value is ``–``; no value at all is ``–``."""
    note = f"n={stat.n}" + (f", {failed} failed" if failed else "")
    if stat.mean is None:
        return f"failed ({note})" if failed else NO_STD
    std = NO_STD if stat.std is None else f"{stat.std:.{digits}f}"
    text = f"{stat.mean:.{digits}f} ± {std}"
    return f"{text} ({note})" if count else text


def markdown_cell(text: Any) -> str:
    """``text`` escaped for one markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]], align: str) -> list[str]:
    """A markdown table; ``align`` has one ``l`` (left) or ``r`` (right) per column."""
    lines = ["| " + " | ".join(markdown_cell(h) for h in header) + " |"]
    lines.append("|" + "|".join(":--" if a == "l" else "--:" for a in align) + "|")
    lines += ["| " + " | ".join(markdown_cell(c) for c in row) + " |" for row in rows]
    return lines


def _tables(summary: Sequence[SummaryRow]) -> dict[tuple, list[SummaryRow]]:
    tables: dict[tuple, list[SummaryRow]] = defaultdict(list)
    for row in summary:
        tables[row.table].append(row)
    return tables


def _wide(
    rows: Sequence[SummaryRow], value: Callable[[SummaryRow], str], *, references: bool = True
) -> tuple[list[int], list[list[str]]]:
    """Series as rows, sites as columns; ``value(summary_row) -> str`` fills a cell."""
    sites = sorted({r.sites for r in rows})
    series: dict[tuple, dict[int, SummaryRow]] = {}
    for row in rows:
        if references or not row.reference:
            key = (row.label, row.scores, row.kind, row.runner, row.stage)
            series.setdefault(key, {})[row.sites] = row
    lines = []
    for cells in series.values():
        first = next(iter(cells.values()))
        name = series_name(first, rows)
        lines.append(
            [
                name,
                first.scores,
                first.kind,
                *(value(cells[s]) if s in cells else "" for s in sites),
            ]
        )
    return sites, lines


def format_results_markdown(summary: Sequence[SummaryRow]) -> list[str]:
    """Per table: accuracy (%) and cost (fusion seconds, upload per site), sites as columns."""
    lines: list[str] = []
    for (experiment, dataset, model, partition), rows in _tables(summary).items():
        lines += ["", f"### {dataset} · {model} · {partition} (experiment `{experiment}`)", ""]
        examples = next((r.test_examples for r in rows if r.test_examples), None)
        lines.append(
            "Test accuracy (%), mean ± sample std over seeds (n seeds"
            + (f"; {examples} test examples" if examples else "")
            + "):"
        )
        lines.append("")
        sites, body = _wide(rows, lambda r: format_stat(r.accuracy, failed=r.failed))
        header = ["method", "scores", "kind", *(f"{s} sites" for s in sites)]
        lines += markdown_table(header, body, "lll" + "r" * len(sites))
        if any(r.stage == FINETUNED for r in rows):
            lines += [
                "",
                "Rows labelled `+ft(<data>,<E>ep)` are fused models fine-tuned after fusion "
                "(on the fusion set, or on the sites in one more round); every other row is "
                "zero-shot.",
            ]
        lines += [
            "",
            "Fusion time (s), the fusion's peak memory over the process's memory at its start "
            "(where measured), the fused model's size where it is not a site model's, and "
            "upload per site, mean ± sample std over seeds (the train "
            "round's upload, then any further rounds, statistics or site fine-tuning: their "
            "count × a site's largest one; `+ ft` is the fine-tuning time):",
            "",
        ]

        def cost(r: SummaryRow) -> str:
            if r.seconds.mean is None:
                return "failed" if r.failed else NO_STD
            cell = f"{format_stat(r.seconds, count=False)} s"
            if r.finetune_seconds.mean is not None:
                cell += f" + ft {format_stat(r.finetune_seconds, count=False)} s"
            if r.peak_extra_mib.mean is not None:
                cell += f" · +{r.peak_extra_mib.mean:.0f} MiB"
            if r.size.mean is not None and abs(r.size.mean - 1) > 1e-9:  # not a site's size
                cell += f" · {r.size.mean:.2f}× a site's parameters"
            cell += f" · {human_bytes(r.upload.mean)}"
            if r.rounds:  # rounds after the train round: their count and largest
                cell += f" + {r.rounds} × ≤{human_bytes(r.round_upload.mean)}"
            return cell

        sites, body = _wide(rows, cost, references=False)
        lines += markdown_table(header, body, "lll" + "r" * len(sites))
    return lines


def format_gap_markdown(summary: Sequence[SummaryRow]) -> list[str]:
    """Per table: ensemble accuracy minus each method's (percentage points), sites as columns."""
    lines: list[str] = []
    for (experiment, dataset, model, partition), rows in _tables(summary).items():
        kept = [r for r in rows if r.label != ENSEMBLE_LABEL]
        sites, body = _wide(kept, lambda r: format_stat(r.gap, failed=r.failed))
        lines += ["", f"{dataset} · {model} · {partition} (`{experiment}`), pp:", ""]
        header = ["method", "scores", "kind", *(f"{s} sites" for s in sites)]
        lines += markdown_table(header, body, "lll" + "r" * len(sites))
    return lines


def summary_records(summary: Sequence[SummaryRow]) -> list[dict[str, Any]]:
    """The summary as flat records (the CSV's lines): raw numbers, accuracy in %, bytes; None
    where absent (the std of a single seed included)."""
    records = []
    for r in summary:
        experiment, dataset, model, partition = r.table
        records.append(
            {
                "experiment": experiment,
                "dataset": dataset,
                "model": model,
                "partition": partition,
                "scores": None if r.reference else r.scores,
                "label": r.label,
                "kind": r.kind,
                "stage": None if r.reference else r.stage,
                "runner": r.runner or None,
                "sites": r.sites,
                "n": r.accuracy.n,
                "failed": r.failed,
                "seeds": " ".join(str(s) for s in r.seeds),
                "accuracy_pct_mean": r.accuracy.mean,
                "accuracy_pct_std": r.accuracy.std,
                "loss_mean": r.loss.mean,
                "loss_std": r.loss.std,
                "gap_pp_mean": r.gap.mean,
                "gap_pp_std": r.gap.std,
                "fusion_seconds_mean": r.seconds.mean,
                "fusion_seconds_std": r.seconds.std,
                "fusion_peak_extra_mib_mean": r.peak_extra_mib.mean,
                "fused_size_vs_site_mean": r.size.mean,
                "finetune_seconds_mean": r.finetune_seconds.mean,
                "finetune_seconds_std": r.finetune_seconds.std,
                "upload_bytes_per_site_mean": None
                if r.upload.mean is None
                else round(r.upload.mean),
                "statistics_rounds": r.rounds,
                "round_upload_bytes_per_site_max_mean": None
                if r.round_upload.mean is None
                else round(r.round_upload.mean),
                "test_examples": r.test_examples,
            }
        )
    return records


def format_failures_markdown(sweep: Sweep) -> list[str]:
    """The failed jobs, each with its error, and the row files that could not be read."""
    failed = sorted(sweep.failed, key=lambda r: str(r["row_id"]))
    lines = ["", f"## Failed jobs ({len(failed)})", ""]
    if failed:
        header = ["row", "experiment", "partition", "sites", "seed", "method", "error"]
        body = [
            [
                r["row_id"],
                r["experiment"],
                r["partition"],
                r["sites"],
                r["seed"],
                r["label"],
                str(r.get("error") or f"status {r.get('status')!r} without accuracy")[:300],
            ]
            for r in failed
        ]
        lines += markdown_table(header, body, "lllrrll")
    else:
        lines.append("None.")
    if sweep.problems:
        lines += ["", f"Row files left out ({len(sweep.problems)}):", ""]
        lines += [f"- {markdown_cell(p)}" for p in sweep.problems]
    return lines


def write_csv(path: Path, records: Sequence[dict[str, Any]]) -> Path:
    """Records as CSV (columns in first-seen order; None and missing keys as empty cells)."""
    columns = list(dict.fromkeys(k for r in records for k in r))
    with atomic_path(path) as tmp, tmp.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, columns, restval="")
        writer.writeheader()
        writer.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in records)
    return path


def slug(*parts: Any) -> str:
    """The parts joined into a file-name-safe stem."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", "_".join(str(p) for p in parts)).strip("_")
