"""``fedfuse speed --arch torchvision-resnet18``: a user's plain model timed beside fedfuse's own.

The plain model is torchvision's ``resnet18(num_classes=10)`` as a user would pass it:
:class:`~fedfuse.models.ModelAdapter` traces it (graph levels) and registers it under its name,
so the benchmark builds it like any architecture. fedfuse's own counterpart
(:data:`~fedfuse.experiments.speed_options.PLAIN_ARCHS`) has the same layers: the ImageNet stem
(7x7 conv of stride 2, BatchNorm, ReLU, 3x3 max-pool), two BasicBlocks per stage at widths
64/128/256/512 with 1x1 projection shortcuts, and the pooled linear head: 11,181,642
parameters each. Both are fused with the same methods on the same random fusion set of the same
input shape, in turn in this process, repeat by repeat (plain, own, plain, ...: on a shared
machine both see the same load); the comparison gives, per method, each model's median seconds
and peak memory and the ratio plain/own of each. The ratio of memory is that of the RSS
increase (the peak over the RSS when the method started), the part a fusion itself needs; the
process's peak RSS includes what the earlier runs left to the allocator.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from torch import nn

from fedfuse.experiments.speed_options import PLAIN_ARCHS
from fedfuse.fusion import parse_options
from fedfuse.models import ModelAdapter, ModelSpec

log = logging.getLogger(__name__)

#: the columns of the comparison; the memory ratio is that of the RSS increase
COLUMNS = (
    "method",
    "model",
    "seconds (median)",
    "peak RSS GiB",
    "RSS increase GiB",
    "peak CUDA GiB",
    "note",
)


def plain_factory(name: str, num_classes: int) -> Callable[[], nn.Module]:
    """A zero-argument function building a fresh plain model ``name`` (a ``PLAIN_ARCHS`` key)."""
    if name == "torchvision-resnet18":
        from torchvision.models import resnet18

        return functools.partial(resnet18, num_classes=num_classes)
    raise ValueError(f"unknown plain model {name!r}; known: {sorted(PLAIN_ARCHS)}")


def plain_spec(name: str, input_shape: tuple[int, ...], num_classes: int) -> ModelSpec:
    """The spec of plain model ``name`` adapted on ``input_shape``, its adapter registered so
    that ``build_model(spec)`` builds it (a later call with another shape replaces it)."""
    if len(input_shape) != 3 or input_shape[0] != 3:
        raise ValueError(
            f"{name} takes (3, H, W) images, got --input-shape "
            f"{','.join(str(d) for d in input_shape)}"
        )
    factory = plain_factory(name, num_classes)
    return ModelAdapter(factory, input_shape, name=name).register().spec


def own_counterpart(name: str) -> tuple[str, dict[str, Any]]:
    """fedfuse's own architecture of plain model ``name`` and its spec options."""
    arch, options = PLAIN_ARCHS[name]
    return arch, parse_options(options)


def _ratio(plain: dict[str, Any], own: dict[str, Any], key: str) -> float | None:
    """``plain[key] / own[key]`` when both ran and the own value is positive."""
    if plain["status"] != "ok" or own["status"] != "ok" or not own[key]:
        return None
    return plain[key] / own[key]


def compare(plain: list[dict[str, Any]], own: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per method, the plain model's row, the own model's row and their ratios (plain/own) of
    median seconds, peak RSS and RSS increase (None where either did not run)."""
    own_by = {row["method"]: row for row in own}
    compared = []
    for row in plain:
        other = own_by[row["method"]]
        compared.append(
            {
                "method": row["method"],
                "plain": row,
                "own": other,
                "seconds_ratio": _ratio(row, other, "seconds"),
                "peak_rss_ratio": _ratio(row, other, "peak_rss_gib"),
                "rss_increase_ratio": _ratio(row, other, "rss_increase_gib"),
            }
        )
        if compared[-1]["seconds_ratio"] is not None:
            log.info(
                "%s: %.2f s vs %.2f s, ratio %.2fx",
                row["method"],
                row["seconds"],
                other["seconds"],
                compared[-1]["seconds_ratio"],
            )
    return compared


def _cells(row: dict[str, Any], model: str) -> list[str]:
    def gib(value: float | None) -> str:
        return f"{value:.2f}" if value is not None else "-"

    if row["status"] != "ok":
        return [row["method"], model, row["status"].upper(), "-", "-", "-", row["note"]]
    return [
        row["method"],
        model,
        f"{row['seconds']:.2f}",
        gib(row["peak_rss_gib"]),
        gib(row["rss_increase_gib"]),
        gib(row["peak_cuda_gib"]),
        row["note"],
    ]


def format_comparison(compared: list[dict[str, Any]], header: str, names: tuple[str, str]) -> str:
    """A Markdown table: per method the plain model's row, the own model's and the ratio row
    (plain/own of the median seconds, the peak RSS and the RSS increase)."""

    def times(value: float | None) -> str:
        return f"{value:.2f}x" if value is not None else "-"

    plain_name, own_name = names
    lines = [header, "", "| " + " | ".join(COLUMNS) + " |", "| --- | --- |" + " ---: |" * 4]
    lines[-1] += " --- |"
    for entry in compared:
        ratio = [
            entry["method"],
            f"ratio {plain_name}/{own_name}",
            times(entry["seconds_ratio"]),
            times(entry["peak_rss_ratio"]),
            times(entry["rss_increase_ratio"]),
            "-",
            "",
        ]
        for cells in (
            _cells(entry["plain"], plain_name),
            _cells(entry["own"], own_name),
            ratio,
        ):
            text = (c.replace("|", "/").replace("\n", " ") for c in cells)
            lines.append("| " + " | ".join(text) + " |")
    return "\n".join(lines)
