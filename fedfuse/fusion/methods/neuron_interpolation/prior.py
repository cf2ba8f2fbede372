r"""The base models' weights on the fused level's inputs: what the Linear fit shrinks towards.

On a level with more inputs than fusion rows (an MLP's 784 pixels or 512 neurons against 400
rows: the kernel route of :func:`~.linear.fit_linear`) the rows span only part of the inputs. A
least-squares fit shrunk towards zero puts no weight outside that span, so the fused neurons
ignore every input direction the fusion set does not show; on a skewed fusion set that includes
what sets apart the classes it lacks. The base models do weigh those directions, and their
weights can be written in the fused level's inputs: base neuron ``j``'s weight on fused input
``i`` is

    ``P_ji = sum over its model's inputs p grouped into i one level down of W_jp``

(a model's neuron ``p`` stands in for the fused neuron of its group; on the model's raw input,
which every model and the fused one read alike, ``P_j = W_j``). The group's importance-weighted
centre ``W0`` of the ``P_j`` of its members is then a fit of the group's target by the base
models' own weights; on the first level it *is* the target, on every input. The Linear fit
``argmin ||X W - T||^2 + lambda ||W - W0||^2`` shrinks towards it instead:
``W = W0 + X^T (X X^T + lambda I)^{-1} (T - X W0)``. It reaches the rows' targets as the fit
towards zero does (as ``lambda -> 0`` both interpolate them) and is ``W0`` outside the rows'
span. ``ridge_prior="auto"`` keeps it on a level only where its leave-one-out error on the
fusion set is the lower (a left-out row is partly outside the other rows' span, so the error
sees what each prior does there).

Only plain stacks (each level reading the one below it, through parameter-free ops that keep
channels, such as activations, pooling and flattening) have such a ``P``; residual streams and
blocks mix several levels' neurons, and their levels are fitted towards zero.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from fedfuse.fusion.blocks.kmeans import weighted_centers
from fedfuse.fusion.methods.neuron_interpolation.blocks import is_block_level
from fedfuse.models.affine import affine_view

#: the choices of ``ridge_prior``
RIDGE_PRIORS = ("auto", "aligned", "zero")


def check_ridge_prior(ridge_prior: str) -> str:
    """``ridge_prior`` if it is one of :data:`RIDGE_PRIORS`, else a ValueError naming them."""
    if ridge_prior not in RIDGE_PRIORS:
        raise ValueError(f"ridge_prior must be one of {RIDGE_PRIORS}, got {ridge_prior!r}")
    return ridge_prior


def aligned_weight_centres(
    base_levels: Sequence[nn.Module],
    below: tuple[torch.Tensor, list[int], int] | None,
    fused_level: nn.Module,
    intercept: bool,
    weights: torch.Tensor,
    labels: torch.Tensor,
    k: int,
) -> torch.Tensor | None:
    """``W0``: each of the ``k`` groups' ``weights``-weighted centre of its members' weights on
    ``fused_level``'s inputs, ``(k, fan_in [+ 1])`` float64 (the bias, 0 where a layer has
    none, last where the fused design has an ``intercept``). The base neurons are the models'
    in order (``labels`` and ``weights`` per neuron); ``below``: the level below's groups (every
    base neuron's group, the models' widths, the fused width), None on the raw input. One
    model's weights at a time, so a thousand models cost one group-sized sum. None where a level
    is not affine or its inputs do not split into the groups' channels."""
    fused = affine_view(fused_level)
    if fused is None:
        return None
    fan_in = fused.layer.weight[0].numel()
    device = weights.device
    sums = torch.zeros(k, fan_in + int(intercept), dtype=torch.float64, device=device)
    mass = torch.zeros(k, dtype=torch.float64, device=device)
    neuron = channel = 0
    for number, level in enumerate(base_levels):
        view = affine_view(level)
        if view is None:
            return None
        weight = view.layer.weight.detach().to(device, torch.float64).flatten(1)
        if below is not None:
            grouped, widths, groups = below
            channels = widths[number]
            positions, spare = divmod(weight.shape[1], channels)
            if spare or positions * groups != fan_in:
                return None
            mine = grouped[channel : channel + channels].to(device)
            channel += channels
            summed = weight.new_zeros(len(weight), groups, positions)
            summed.index_add_(1, mine, weight.reshape(len(weight), channels, positions))
            weight = summed.reshape(len(weight), fan_in)
        elif weight.shape[1] != fan_in:
            return None
        if intercept:
            bias = view.layer.bias
            column = weight.new_zeros(len(weight)) if bias is None else bias.detach().to(weight)
            weight = torch.cat([weight, column[:, None]], 1)
        rows = slice(neuron, neuron + len(weight))
        neuron += len(weight)
        centre, share = weighted_centers(weight, weights[rows], labels[rows], k)
        sums += centre * share[:, None]
        mass += share
    return sums / mass.clamp_min(torch.finfo(torch.float64).tiny)[:, None]


def has_plain_levels(model: nn.Module) -> bool:
    """Whether ``model`` (a :class:`~fedfuse.models.LeveledModel`) is a plain stack: no
    residual level and no block, so each neuron level reads the one below it."""
    return not any(is_block_level(level) for level in model.levels) and not any(
        model.is_residual(index) for index in model.neuron_levels
    )
