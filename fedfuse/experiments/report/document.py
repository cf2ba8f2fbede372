"""``fedfuse report``: a comparison sweep's rows turned into tables, figures and diagnostics.

A sweep directory (written by ``fedfuse compare``) holds one JSON row per job in ``rows/`` and the
fused models in ``fused/``; each row names the site-set directory its base models came from. The
report aggregates the rows over seeds (mean ± sample std, and n), one table per (experiment,
dataset, model, partition) with the number of sites as columns, lists every failed job with its
error, and draws:

- accuracy per method per partition (grouped bars), accuracy and the merge-vs-ensemble gap against
  the number of sites (Wang et al., "Rethinking weight-averaged model merging", Fig. 7a);
- per configuration, on its representative site set (fewest sites, then smallest seed): the
  sites' class distributions, their importance-score histograms per level (neuron-interpolation
  paper, Fig. 3), per-level weight statistics and first-layer templates of the sites and every
  fused model (Wang et al.), and the loss/accuracy landscape on the plane through two base models
  and one method's fused model (neuron-interpolation paper, Fig. 2).

A missing or unreadable checkpoint or dataset skips that figure with a logged warning and a line
in the report's "Skipped" section; the tables never need anything but the rows.

Rows and their aggregation: :mod:`.sweep_rows`; tables: :mod:`.report_tables`; model
diagnostics: :mod:`.report_diagnostics`.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedfuse.experiments.report import plots
from fedfuse.experiments.report.diagnostics import (
    SITE_SET_FORMAT,
    DiagnosticsOptions,
    SweepModels,
    choose_landscape_rows,
    diagnostics_section,
)
from fedfuse.experiments.report.files import ReportFiles
from fedfuse.experiments.report.rows import (
    BASE_LABEL,
    ENSEMBLE_LABEL,
    NO_STD,
    ROW_FORMAT,
    Stat,
    SummaryRow,
    Sweep,
    load_sweep,
    series_name,
    summarize,
)
from fedfuse.experiments.report.tables import (
    format_failures_markdown,
    format_gap_markdown,
    format_results_markdown,
    format_stat,
    human_bytes,
    markdown_cell,
    slug,
    summary_records,
    write_csv,
)
from fedfuse.io.atomic import atomic_path

__all__ = [
    "BASE_LABEL",
    "ENSEMBLE_LABEL",
    "NO_STD",
    "ROW_FORMAT",
    "SITE_SET_FORMAT",
    "ReportFiles",
    "Stat",
    "SummaryRow",
    "Sweep",
    "SweepModels",
    "add_arguments",
    "choose_landscape_rows",
    "DiagnosticsOptions",
    "diagnostics_section",
    "format_failures_markdown",
    "format_gap_markdown",
    "format_results_markdown",
    "format_stat",
    "human_bytes",
    "load_sweep",
    "main",
    "register_cli",
    "report_command",
    "summarize",
    "summary_figures",
    "summary_records",
    "write_report",
]

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------ figures from rows
def summary_figures(summary: Sequence[SummaryRow], figures_dir: Path) -> list[tuple[str, Path]]:
    """Per experiment: accuracy bars (panel per sites, partitions as groups), accuracy and
    merge-vs-ensemble gap against the number of sites (panel per partition)."""
    out = []
    experiments: dict[tuple, list[SummaryRow]] = defaultdict(list)
    for row in summary:
        experiments[row.table[:3]].append(row)
    for (experiment, dataset, model), rows in experiments.items():
        named = [(r, series_name(r, [x for x in rows if x.table == r.table])) for r in rows]
        heading = f"{dataset} · {model} (`{experiment}`)"
        bars = []
        for sites in sorted({r.sites for r in rows}):
            series: dict[str, list[SummaryRow]] = defaultdict(list)
            for r, name in named:
                if r.sites == sites:
                    series[name].append(r)
            bars.append(
                plots.Panel(
                    f"{sites} sites",
                    [
                        plots.Series(
                            name,
                            [r.table[3] for r in group],
                            [_nan(r.accuracy.mean) for r in group],
                            [_nan(r.accuracy.std) for r in group],
                            reference=group[0].reference,
                        )
                        for name, group in series.items()
                    ],
                )
            )
        lines, gaps = [], []
        for partition in sorted({r.table[3] for r in rows}):
            series = defaultdict(list)
            for r, name in named:
                if r.table[3] == partition:
                    series[name].append(r)
            lines.append(plots.Panel(partition, _site_series(series, "accuracy")))
            gap_series = {n: g for n, g in series.items() if n != ENSEMBLE_LABEL}
            gaps.append(plots.Panel(partition, _site_series(gap_series, "gap")))
        stem = slug(experiment)
        title = f"{dataset} · {model} ({experiment})"
        out.append(
            (
                f"Accuracy per method and partition, {heading}",
                plots.plot_accuracy_bars(
                    bars,
                    figures_dir / f"accuracy_bars_{stem}.png",
                    title=title,
                    ylabel="test accuracy (%)",
                ),
            )
        )
        out.append(
            (
                f"Accuracy against the number of sites, {heading}",
                plots.plot_accuracy_vs_sites(
                    lines, figures_dir / f"accuracy_vs_sites_{stem}.png", title=title
                ),
            )
        )
        out.append(
            (
                f"Merge-vs-ensemble gap against the number of sites, {heading}",
                plots.plot_gap_vs_sites(
                    gaps, figures_dir / f"gap_vs_sites_{stem}.png", title=title
                ),
            )
        )
    return out


def _nan(value: float | None) -> float:
    return float("nan") if value is None else value


def _site_series(series: dict[str, list[SummaryRow]], what: str) -> list[plots.Series]:
    result = []
    for name, group in series.items():
        group = sorted(group, key=lambda r: r.sites)
        stats = [getattr(r, what) for r in group]
        result.append(
            plots.Series(
                name,
                [r.sites for r in group],
                [_nan(s.mean) for s in stats],
                [_nan(s.std) for s in stats],
                reference=group[0].reference,
            )
        )
    return result


# ------------------------------------------------------------------------------ report entry point
def write_report(
    sweep_dir: str | Path,
    out_dir: str | Path | None = None,
    *,
    diagnostics: bool = True,
    options: DiagnosticsOptions | None = None,
) -> ReportFiles:
    """Write the report of a sweep directory: ``results.md``, ``results.csv`` and figures.

    Args:
        sweep_dir: the sweep (``rows/*.json``, ``fused/*.safetensors``).
        out_dir: where to write (default ``<sweep_dir>/report``); figures go to ``figures/``.
        diagnostics: also load the site sets and fused models for the class distributions,
            importance histograms, weight statistics and templates (else: tables and accuracy
            figures only, from the rows alone).
        options: how the diagnostics are drawn (:class:`DiagnosticsOptions`: landscapes,
            templates, device, progress bars; None: its defaults).
    """
    options = options if options is not None else DiagnosticsOptions()
    started = time.perf_counter()
    sweep = load_sweep(sweep_dir)
    out = Path(out_dir) if out_dir is not None else sweep.directory / "report"
    figures_dir = out / "figures"
    files = ReportFiles(
        directory=out,
        markdown=out / "results.md",
        csv=out / "results.csv",
        rows=len(sweep.rows),
        failed=len(sweep.failed),
    )
    summary = summarize(sweep.rows)
    write_csv(files.csv, summary_records(summary))
    md = [
        "# Comparison report",
        "",
        f"Sweep `{sweep.directory}`: {len(sweep.rows)} jobs, {len(sweep.rows) - files.failed} ok, "
        f"{files.failed} failed"
        + (f", {len(sweep.problems)} unreadable row file(s)" if sweep.problems else "")
        + ". Mean ± sample standard deviation over seeds; n counts the seeds that succeeded "
        f"(the std of a single seed is shown as {NO_STD}). Tables as CSV: `results.csv`.",
        "",
        "## Results",
    ]
    md += format_results_markdown(summary) or ["", "No rows."]
    figures: list[tuple[str, Path]] = []
    if summary:
        figures = files.attempt("summary figures", lambda: summary_figures(summary, figures_dir))
        figures = figures or []
    md += ["", "## Merge-vs-ensemble gap", ""]
    md.append(
        "Ensemble accuracy minus each model's, in percentage points, per seed on the same site "
        "set (Wang et al., *Rethinking weight-averaged model merging*: the gap widens with the "
        "number of merged models). The base row is the ensemble's lead over the average site."
    )
    md += format_gap_markdown(summary)
    md += ["", "## Figures", ""]
    md += [f"![{title}](figures/{path.name})" for title, path in figures]
    files.figures += [path for _, path in figures]
    md += format_failures_markdown(sweep)
    if diagnostics and sweep.rows:
        md += diagnostics_section(sweep, out, files, options)
    md += ["", f"## Skipped ({len(files.skipped)})", ""]
    md += [f"- {markdown_cell(s)}" for s in files.skipped] or ["Nothing."]
    md += ["", f"Report written in {time.perf_counter() - started:.1f} s."]
    with atomic_path(files.markdown) as tmp:
        tmp.write_text("\n".join(md) + "\n")
    log.info(
        "report of %s: %s, %s, %d figures, %d skipped",
        sweep.directory,
        files.markdown,
        files.csv,
        len(files.figures),
        len(files.skipped),
    )
    return files


# ------------------------------------------------------------------------------ CLI
_DESCRIPTION = "Tables, figures and model diagnostics of a `fedfuse compare` sweep directory."


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``fedfuse report`` options, on ``parser``."""
    parser.add_argument("sweep_dir", help="a sweep directory written by `fedfuse compare`")
    parser.add_argument("--out", default=None, help="output directory (default: <sweep>/report)")
    parser.add_argument(
        "--landscape-method",
        default=None,
        help="method or row label whose fused model spans the landscape plane "
        "(default: the most accurate fusion method)",
    )
    parser.add_argument("--no-landscape", action="store_true", help="skip the landscapes")
    parser.add_argument(
        "--no-diagnostics",
        action="store_true",
        help="tables and accuracy figures only (no checkpoints are read)",
    )
    parser.add_argument("--landscape-grid", type=int, default=11, help="grid points per axis")
    parser.add_argument(
        "--landscape-samples", type=int, default=1000, help="test examples per grid point"
    )
    parser.add_argument("--landscape-margin", type=float, default=0.25)
    parser.add_argument("--landscape-max-rows", type=int, default=4, help="landscapes at most")
    parser.add_argument("--templates", type=int, default=8, help="templates per model")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.set_defaults(handler=report_command)
    return parser


def register_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``report`` subcommand to an ``argparse`` subparsers object."""
    parser = subparsers.add_parser(
        "report", help="tables and figures of a compare sweep", description=_DESCRIPTION
    )
    return add_arguments(parser)


def report_command(args: argparse.Namespace) -> int:
    """Run ``fedfuse report``; prints the written files, exits 0 (failed jobs are reported)."""
    files = write_report(
        args.sweep_dir,
        args.out,
        diagnostics=not args.no_diagnostics,
        options=DiagnosticsOptions(
            landscape=not args.no_landscape,
            landscape_method=args.landscape_method,
            landscape_grid=args.landscape_grid,
            landscape_samples=args.landscape_samples,
            landscape_margin=args.landscape_margin,
            landscape_max_rows=args.landscape_max_rows,
            templates=args.templates,
            device=args.device,
        ),
    )
    print(f"report: {files.markdown}")
    print(f"table:  {files.csv}")
    print(f"{len(files.figures)} figures in {files.directory / 'figures'}")
    if files.failed:
        print(f"{files.failed} of {files.rows} jobs failed (listed in the report)")
    if files.skipped:
        print(f"{len(files.skipped)} figures skipped (listed in the report)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fedfuse.experiments.report.document <sweep dir> [options]``."""
    from fedfuse.runtime import configure_logging

    parser = argparse.ArgumentParser(prog="fedfuse report", description=_DESCRIPTION)
    args = add_arguments(parser).parse_args(sys.argv[1:] if argv is None else list(argv))
    configure_logging()
    try:
        return report_command(args)
    except (ValueError, OSError) as error:
        print(f"fedfuse report: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
