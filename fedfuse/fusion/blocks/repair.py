r"""REPAIR (Jordan et al., 2022): restore the neuron statistics that averaging collapses.

Averaging aligned networks shrinks the variance of hidden pre-activations ("variance collapse"),
which costs most of the zero-shot accuracy of permutation-based fusion. REPAIR rescales and shifts
every hidden neuron of the fused model so that, on the fusion set, its output has the mean and
standard deviation interpolated from the corresponding neurons of the (aligned) base models:

.. math::
    \mu^\ast_j = \sum_k \alpha_k \mu^{(k)}_j, \qquad
    \sigma^\ast_j = \sum_k \alpha_k \sigma^{(k)}_j, \qquad
    z_j \leftarrow \frac{\sigma^\ast_j}{\sigma_j} (z_j - \mu_j) + \mu^\ast_j,

where :math:`\mu^{(k)}_j, \sigma^{(k)}_j` are the mean and standard deviation of neuron ``j``'s
level output (the pre-activation) in base model ``k`` over the fusion set's samples and spatial
positions, and :math:`\mu_j, \sigma_j` those of the fused model. Our models have no BatchNorm, so
instead of inserting a normalisation layer the correction is folded into the affine level:
``w_j <- (sigma*_j / sigma_j) w_j`` and ``b_j <- (sigma*_j / sigma_j)(b_j - mu_j) + mu*_j``. The
levels are corrected bottom-up, each with the fused statistics measured *after* the corrections
below it (they change its inputs). The classifier level is left alone.

Reference: K. Jordan, H. Sedghi, O. Saukh, R. Entezari, B. Neyshabur. "REPAIR: REnormalizing
Permuted Activations for Interpolation Repair". ICLR 2023 (arXiv:2211.08403, 2022).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import torch

from fedfuse.fusion.blocks.alignment import affine_levels
from fedfuse.models import LeveledModel
from fedfuse.models.affine import output_rows
from fedfuse.runtime import resolve_device

log = logging.getLogger(__name__)

#: fused neurons whose standard deviation is below this fraction of the target's (dead on the
#: fusion set) are only shifted, not rescaled (a huge scale would act off the fusion set only)
DEAD_RATIO = 1e-6


def _moments(sums: torch.Tensor, squares: torch.Tensor, rows: int) -> tuple[torch.Tensor, ...]:
    mean = sums / rows
    var = (squares / rows - mean * mean).clamp_min(0)
    return mean, var.sqrt()


@torch.no_grad()
def neuron_statistics(
    model: LeveledModel,
    data: torch.Tensor,
    levels: Iterable[int] | None = None,
    *,
    batch_size: int = 256,
    device: str | torch.device = "auto",
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per-neuron mean and (population) standard deviation of level outputs on ``data``.

    Args:
        model: the model (put in eval mode for the pass, restored afterwards).
        data: the inputs ``(N, ...)``.
        levels: neuron levels to measure (default: the hidden ones, all but the classifier).
        batch_size: samples per forward pass; statistics are accumulated in float64, so memory
            stays at one batch.
        device: where to compute.

    Returns:
        ``{level: (mean, std)}``, float64 CPU tensors of the level's width; statistics are over
        samples and spatial positions.
    """
    wanted = set(model.neuron_levels[:-1] if levels is None else levels)
    compute = resolve_device(device)
    was_training, home = model.training, next(model.parameters()).device
    sums: dict[int, torch.Tensor] = {}
    squares: dict[int, torch.Tensor] = {}
    rows: dict[int, int] = {}
    model.eval().to(compute)
    try:
        for start in range(0, len(data), batch_size):
            x = data[start : start + batch_size].to(compute)
            for index, level in enumerate(model.levels):
                x = level(x)
                if index in wanted:
                    _accumulate(output_rows(x), index, sums, squares, rows)
    finally:
        model.to(home).train(was_training)
    return {
        index: tuple(t.cpu() for t in _moments(sums[index], squares[index], rows[index]))
        for index in sorted(wanted)
    }


def _accumulate(
    z: torch.Tensor,
    index: int,
    sums: dict[int, torch.Tensor],
    squares: dict[int, torch.Tensor],
    rows: dict[int, int],
) -> None:
    z = z.double()
    if index not in sums:
        sums[index] = z.new_zeros(z.shape[1])
        squares[index] = z.new_zeros(z.shape[1])
        rows[index] = 0
    sums[index] += z.sum(0)
    squares[index] += (z * z).sum(0)
    rows[index] += len(z)


def target_statistics(
    stats: Sequence[dict[int, tuple[torch.Tensor, torch.Tensor]]],
    alpha: Sequence[float] | None = None,
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The ``alpha``-interpolation of several models' :func:`neuron_statistics`.

    ``alpha`` (default uniform) is normalised to sum to 1; means and standard deviations are
    interpolated separately, as in REPAIR.
    """
    weights = _alpha(alpha, len(stats))
    return {
        index: (
            sum(w * s[index][0] for w, s in zip(weights, stats, strict=True)),
            sum(w * s[index][1] for w, s in zip(weights, stats, strict=True)),
        )
        for index in stats[0]
    }


def _alpha(alpha: Sequence[float] | None, count: int) -> list[float]:
    if alpha is None:
        return [1.0 / count] * count
    values = [float(a) for a in alpha]
    if len(values) != count or any(a < 0 for a in values) or sum(values) <= 0:
        raise ValueError(f"alpha must be {count} non-negative weights with a positive sum")
    return [a / sum(values) for a in values]


@torch.no_grad()
def repair(
    fused: LeveledModel,
    base_models: Sequence[LeveledModel],
    data: torch.Tensor,
    alpha: Sequence[float] | None = None,
    *,
    batch_size: int = 256,
    device: str | torch.device = "auto",
) -> LeveledModel:
    r"""Rescale and shift the fused model's hidden neurons to the interpolated base statistics.

    Args:
        fused: the fused model; **modified in place** (and returned).
        base_models: the base models *as aligned* (permuted / transported) to the fused model, so
            that neuron ``j`` of every level corresponds across them and ``fused``.
        data: the fusion set's inputs ``(N, ...)``.
        alpha: interpolation weight of each base model (default uniform; normalised to sum 1),
            normally the weights the fusion averaged the parameters with.
        batch_size: samples per forward pass.
        device: where to compute.

    Returns:
        ``fused``, whose hidden level outputs on ``data`` now have per-neuron means
        :math:`\mu^\ast` and standard deviations :math:`\sigma^\ast` (up to dead neurons, which
        are only shifted).
    """
    if not base_models:
        raise ValueError("repair needs at least one base model")
    hidden = fused.neuron_levels[:-1]
    for index, model in enumerate(base_models):
        if model.neuron_levels != fused.neuron_levels or any(
            model.level_width(i) != fused.level_width(i) for i in hidden
        ):
            raise ValueError(f"repair: base model {index} does not match the fused model's levels")
    views = affine_levels(fused)
    targets = target_statistics(
        [
            neuron_statistics(m, data, hidden, batch_size=batch_size, device=device)
            for m in base_models
        ],
        alpha,
    )
    compute = resolve_device(device)
    was_training, home = fused.training, next(fused.parameters()).device
    fused.eval().to(compute)
    try:
        x = data.to(compute)
        for index, level in enumerate(fused.levels):
            outputs = _apply(level, x, batch_size)
            if index in targets:
                sums: dict[int, torch.Tensor] = {}
                squares: dict[int, torch.Tensor] = {}
                rows: dict[int, int] = {}
                _accumulate(output_rows(outputs), index, sums, squares, rows)
                mean, std = _moments(sums[index], squares[index], rows[index])
                goal_mean, goal_std = (t.to(compute) for t in targets[index])
                alive = std > DEAD_RATIO * goal_std + torch.finfo(torch.float32).tiny
                scale = torch.where(alive, goal_std / std.clamp_min(1e-300), 1.0)
                shift = goal_mean - scale * mean
                view = views[index]
                if view.layer.bias is None:
                    raise ValueError(f"repair: level {fused.level_name(index)} has no bias")
                w = view.weights().double() * scale[None]
                w[-1] += shift
                view.set_weights(w)
                outputs = _apply(level, x, batch_size)
                log.debug(
                    "repair level %s: mean scale %.3g, %d dead neurons",
                    fused.level_name(index),
                    float(scale.mean()),
                    int((~alive).sum()),
                )
            x = outputs
    finally:
        fused.to(home).train(was_training)
    return fused


def _apply(level: torch.nn.Module, x: torch.Tensor, batch_size: int) -> torch.Tensor:
    return torch.cat([level(x[s : s + batch_size]) for s in range(0, len(x), batch_size)])
