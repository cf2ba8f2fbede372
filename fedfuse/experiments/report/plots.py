"""The figures of a comparison report: one function per figure, each writes a PNG, returns its path.

Figures are drawn on matplotlib's Agg canvas directly (``Figure`` + ``FigureCanvasAgg``: no
pyplot, no global backend switch, safe in threads and on machines without a display); matplotlib
is imported when a figure is drawn. The functions take plain numbers (lists, arrays, tensors) and
know nothing of sweeps or rows; :mod:`fedfuse.experiments.report.document` prepares their inputs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any

import numpy as np

from fedfuse.experiments.diagnostics import Landscape

#: the weight statistics drawn by :func:`plot_weight_stats`, with their axis titles
WEIGHT_STAT_PANELS = (
    ("norm", "Frobenius norm"),
    ("std", "standard deviation"),
    ("max_abs", "largest |weight|"),
)


@dataclass(frozen=True)
class Series:
    """One line (or one bar series): a name, x positions, means and standard deviations.

    ``reference`` series (base models, ensemble) are drawn dashed and without markers; NaN
    means are gaps (a configuration without results), NaN stds draw no error bar.
    """

    name: str
    x: Sequence[Any]
    mean: Sequence[float]
    std: Sequence[float] = field(default_factory=list)
    reference: bool = False


@dataclass(frozen=True)
class Panel:
    """One axes of a multi-panel figure: a title and its series."""

    title: str
    series: Sequence[Series]


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: str | PathLike[str]) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100, bbox_inches="tight")
    return out


def _grid(count: int, columns: int = 3) -> tuple[int, int]:
    columns = max(1, min(columns, count))
    return math.ceil(count / columns), columns


def _colors(names: Sequence[str]) -> dict[str, Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if len(names) <= 10 else "tab20"]
    return {name: cmap(i % cmap.N) for i, name in enumerate(names)}


def _std(series: Series) -> np.ndarray:
    std = np.asarray(series.std if len(series.std) else [np.nan] * len(series.mean), float)
    return np.where(np.isfinite(std), std, 0.0)


def plot_accuracy_bars(
    panels: Sequence[Panel], path: str | PathLike[str], *, title: str = "", ylabel: str = ""
) -> Path:
    """Grouped bars: per panel, one group per category (``Series.x``), one bar per series.

    Used for accuracy per method per partition: one panel per number of sites, the partitions
    as groups, the methods (and base mean, ensemble) as bars with their std as error bars.
    """
    rows, columns = _grid(len(panels), 2)
    colors = _colors(
        list(dict.fromkeys(s.name for p in panels for s in p.series if not s.reference))
    )
    references = list(dict.fromkeys(s.name for p in panels for s in p.series if s.reference))
    colors |= {
        name: str(0.3 + 0.4 * i / max(1, len(references))) for i, name in enumerate(references)
    }
    fig = _figure(7.5 * columns, 4.0 * rows)
    for index, panel in enumerate(panels):
        ax = fig.add_subplot(rows, columns, index + 1)
        groups = list(dict.fromkeys(x for s in panel.series for x in s.x))
        width = 0.8 / max(1, len(panel.series))
        for k, series in enumerate(panel.series):
            where = {x: i for i, x in enumerate(series.x)}
            mean = np.array([series.mean[where[g]] if g in where else np.nan for g in groups])
            stds = _std(series)
            std = np.array([stds[where[g]] if g in where else 0.0 for g in groups])
            positions = np.arange(len(groups)) - 0.4 + width * (k + 0.5)
            ax.bar(
                positions,
                mean,
                width,
                yerr=std,
                capsize=2,
                color=colors[series.name],
                label=series.name,
                hatch="//" if series.reference else None,
                edgecolor="white" if series.reference else None,
            )
        ax.set_xticks(np.arange(len(groups)), [str(g) for g in groups])
        ax.set_title(panel.title)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    if panels:
        handles, labels = fig.axes[0].get_legend_handles_labels()
        for ax in fig.axes[1:]:
            for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
                if lab not in labels:
                    handles.append(h)
                    labels.append(lab)
        fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def _line_panels(
    panels: Sequence[Panel],
    path: str | PathLike[str],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    zero_line: bool = False,
) -> Path:
    rows, columns = _grid(len(panels))
    names = list(dict.fromkeys(s.name for p in panels for s in p.series if not s.reference))
    references = list(dict.fromkeys(s.name for p in panels for s in p.series if s.reference))
    colors = _colors(names)
    dashes = ("--", ":", "-.")
    greys = {
        name: (str(0.1 + 0.4 * i / max(1, len(references))), dashes[i % len(dashes)])
        for i, name in enumerate(references)
    }
    fig = _figure(5.5 * columns, 4.0 * rows)
    for index, panel in enumerate(panels):
        ax = fig.add_subplot(rows, columns, index + 1)
        for series in panel.series:
            x = np.asarray(series.x, float)
            mean = np.asarray(series.mean, float)
            style: dict[str, Any] = (
                {"color": greys[series.name][0], "linestyle": greys[series.name][1]}
                if series.reference
                else {"color": colors[series.name], "marker": "o", "markersize": 4}
            )
            ax.errorbar(x, mean, yerr=_std(series), capsize=2, label=series.name, **style)
        xs = sorted({float(x) for s in panel.series for x in s.x})
        if xs:
            ax.set_xticks(xs, [f"{x:g}" for x in xs])
        if zero_line:
            ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_title(panel.title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    if panels:
        seen: dict[str, Any] = {}
        for ax in fig.axes:
            for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
                seen.setdefault(label, handle)
        fig.legend(
            list(seen.values()),
            list(seen),
            loc="center left",
            bbox_to_anchor=(1.0, 0.5),
            fontsize="small",
        )
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def plot_accuracy_vs_sites(
    panels: Sequence[Panel], path: str | PathLike[str], *, title: str = ""
) -> Path:
    """Accuracy (%) against the number of sites: one panel per partition, one line per method;
    base-model mean and ensemble as dashed reference lines; std over seeds as error bars."""
    return _line_panels(panels, path, title=title, xlabel="sites", ylabel="test accuracy (%)")


def plot_gap_vs_sites(
    panels: Sequence[Panel], path: str | PathLike[str], *, title: str = ""
) -> Path:
    """The merge-vs-ensemble gap (ensemble accuracy minus the method's, percentage points)
    against the number of sites: one panel per partition, one line per method."""
    return _line_panels(
        panels,
        path,
        title=title,
        xlabel="sites",
        ylabel="ensemble − method accuracy (pp)",
        zero_line=True,
    )


def plot_class_distribution(class_counts: Any, path: str | PathLike[str]) -> Path:
    """Per-site class counts as stacked bars (``fedfuse.partitions.plot_class_counts``)."""
    from fedfuse.partitions import plot_class_counts

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return plot_class_counts(np.asarray(class_counts), path)


def plot_importance_histograms(
    scores: Sequence[Mapping[int, Any]],
    path: str | PathLike[str],
    *,
    level_names: Mapping[int, str] | None = None,
    title: str = "",
    bins: int = 40,
) -> Path:
    """Histograms of the neurons' importance scores (paper Fig. 3): one panel per level, the
    sites overlaid. ``scores[k]`` maps a level to site ``k``'s per-neuron scores."""
    levels = sorted({int(level) for site in scores for level in site})
    rows, columns = _grid(max(1, len(levels)), 4)
    fig = _figure(4.0 * columns, 3.0 * rows)
    colors = _colors([f"site {k}" for k in range(len(scores))])
    for index, level in enumerate(levels):
        ax = fig.add_subplot(rows, columns, index + 1)
        values = [np.asarray(site[level], float) for site in scores if level in site]
        pooled = np.concatenate(values) if values else np.zeros(1)
        high = float(pooled.max()) if pooled.size and pooled.max() > 0 else 1.0
        edges = np.linspace(0.0, high, bins + 1)
        for k, site in enumerate(scores):
            if level in site:
                ax.hist(
                    np.asarray(site[level], float),
                    bins=edges,
                    alpha=0.5,
                    color=colors[f"site {k}"],
                    label=f"site {k}",
                )
        ax.set_title((level_names or {}).get(level, f"level {level}"))
        ax.set_xlabel("importance score")
        ax.set_ylabel("neurons")
    if levels:
        fig.axes[0].legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def plot_weight_stats(
    stats: Mapping[str, Sequence[Mapping[str, Any]]],
    path: str | PathLike[str],
    *,
    title: str = "",
) -> Path:
    """Per-level weight statistics, one line per model: sites dashed grey, fused models coloured.

    ``stats`` maps a model's name (``"site 0"``, ``"fused: kf-linear"``) to its per-level
    records (:meth:`fedfuse.experiments.diagnostics.LevelWeightStats.to_dict`); names starting with
    ``"site"`` are drawn as references.
    """
    panels = [
        Panel(
            heading,
            [
                Series(
                    name,
                    [r["level"] for r in records],
                    [r[key] for r in records],
                    reference=name.startswith("site"),
                )
                for name, records in stats.items()
            ],
        )
        for key, heading in WEIGHT_STAT_PANELS
    ]
    return _line_panels(panels, path, title=title, xlabel="level", ylabel="")


def plot_templates(
    templates: Mapping[str, Any], path: str | PathLike[str], *, title: str = ""
) -> Path:
    """An image grid of first-layer templates: one row per model, one column per template.

    Each template ``(C, H, W)`` is scaled on its own: one channel in a diverging colour map
    centred on zero, three channels as RGB stretched to ``[0, 1]``.
    """
    names = list(templates)
    columns = max((len(t) for t in templates.values()), default=1)
    fig = _figure(1.1 * columns + 1.5, 1.1 * max(1, len(names)) + 0.6)
    for r, name in enumerate(names):
        images = np.asarray(templates[name], float)
        for c in range(columns):
            ax = fig.add_subplot(len(names), columns, r * columns + c + 1)
            ax.set_xticks([])
            ax.set_yticks([])
            if c == 0:
                ax.set_ylabel(name, rotation=0, ha="right", va="center", fontsize="small")
            if c >= len(images):
                ax.axis("off")
                continue
            image = images[c]
            if image.shape[0] == 3:
                low, high = image.min(), image.max()
                rgb = (image - low) / (high - low) if high > low else np.zeros_like(image)
                ax.imshow(rgb.transpose(1, 2, 0), interpolation="nearest")
            else:
                plane = image.mean(0)
                bound = float(np.abs(plane).max()) or 1.0
                ax.imshow(plane, cmap="RdBu_r", vmin=-bound, vmax=bound, interpolation="nearest")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def plot_landscape(
    landscape: Landscape,
    anchor_labels: Sequence[str],
    path: str | PathLike[str],
    *,
    title: str = "",
) -> Path:
    """Contour plots of test loss and accuracy on the plane through three models (paper Fig. 2),
    with the three models marked and named."""
    xs, ys = landscape.xs.numpy(), landscape.ys.numpy()
    fig = _figure(11.0, 4.6)
    panels = (
        ("test loss", landscape.loss.numpy(), "viridis_r"),
        ("test accuracy (%)", 100 * landscape.accuracy.numpy(), "viridis"),
    )
    anchors = landscape.anchors.numpy()
    for index, (heading, values, cmap) in enumerate(panels):
        ax = fig.add_subplot(1, 2, index + 1)
        finite = values[np.isfinite(values)]
        if finite.size and finite.max() > finite.min():
            filled = ax.contourf(xs, ys, values, levels=20, cmap=cmap)
            ax.contour(xs, ys, values, levels=10, colors="black", linewidths=0.4, alpha=0.5)
            fig.colorbar(filled, ax=ax)
        else:
            ax.pcolormesh(xs, ys, values, cmap=cmap, shading="nearest")
        for (x, y), label, marker in zip(anchors, anchor_labels, ("o", "s", "*"), strict=False):
            ax.plot(x, y, marker=marker, color="white", markeredgecolor="black", markersize=11)
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(6, 6), fontsize="small")
        ax.set_title(heading)
        ax.set_xlabel("x (weight-space distance)")
        ax.set_ylabel("y")
        extent = np.ptp(xs) / max(np.ptp(ys), 1e-12)
        if 0.2 <= extent <= 5:  # equal axes keep weight-space distances honest, if legible
            ax.set_aspect("equal", adjustable="box")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)
