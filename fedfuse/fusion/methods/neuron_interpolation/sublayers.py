"""Shared steps of the closed-form fits inside a block: run a piece of a base level chunk by
chunk, group its neurons into target centres, and ridge-fit a linear map to them from design
rows (the ridge chosen by GCV, as for the affine levels)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fedfuse.fusion.blocks.least_squares import (
    RidgeFit,
    accumulate_normal_equations,
    ridge_fit,
)
from fedfuse.fusion.methods.neuron_interpolation.grouping import (
    GroupFn,
    centre_weights,
    neuron_points,
)
from fedfuse.models.affine import output_rows


def chunks(samples: int, batch_size: int) -> list[slice]:
    """Consecutive slices of at most ``batch_size`` samples."""
    return [slice(s, s + batch_size) for s in range(0, samples, max(1, batch_size))]


def run_chunks(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, parts: list[slice]
) -> torch.Tensor:
    """``fn`` over ``x`` chunk by chunk (modules in eval mode: the function a fit targets)."""
    return torch.cat([fn(x[c]) for c in parts])


def group_targets(
    preacts: list[torch.Tensor],
    weights: torch.Tensor,
    k: int,
    labels: torch.Tensor | None,
    group: GroupFn,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the base neurons (columns of their output rows) into ``k`` unless ``labels`` are
    given (on :func:`~fedfuse.fusion.methods.neuron_interpolation.grouping.neuron_points`, which
    keep the columns' distances in at most one coordinate per neuron); return the labels and the
    groups' weighted centres (rows x k), summed model by model."""
    blocks = [output_rows(p) for p in preacts]
    if labels is None:
        points = neuron_points(blocks).to(weights.device)
        labels = group(points, weights.to(points), [b.shape[1] for b in blocks], k)
    mixing = centre_weights(labels.cpu(), weights.double().cpu(), k)
    targets, start = None, 0
    for block in blocks:  # Z M, one model's columns at a time
        part = mixing[start : start + block.shape[1]].to(block)
        targets = block @ part if targets is None else targets.addmm_(block, part)
        start += block.shape[1]
    assert targets is not None
    return labels, targets


def fit_rows(
    design: Callable[[slice], torch.Tensor],
    targets: Callable[[slice], torch.Tensor],
    parts: list[slice],
) -> tuple[RidgeFit, torch.Tensor, int]:
    """Ridge fit (GCV) of the target rows ``targets(c)`` on the design rows ``design(c)``,
    summed over the chunks ``parts``; returns the fit, the design's Gram and its row count."""
    rows = 0

    def counted(c: slice) -> torch.Tensor:
        nonlocal rows
        block = design(c)
        rows += len(block)
        return block

    gram, cross, norms = accumulate_normal_equations(
        (counted(c) for c in parts), (targets(c) for c in parts), dtype=torch.float32
    )
    return ridge_fit(gram, cross, norms, rows), gram, rows
