r"""The Linear fit inside a ResNet level: the stem and each BasicBlock, sub-layer by sub-layer.

A ResNet level is not one affine map, but each convolution in it is, once the BatchNorm after it
is read in eval mode (``BN(y) = a * y + b`` per channel, folded into the conv's weights and one
bias). Writing the fused level's input ``x`` and the base models' own inputs ``x^{(m)}``:

* **Stem** ``pool(relu(u))`` with ``u = BN(conv(x))``: the base pre-activations ``u^{(m)}`` are
  grouped into the fused width, and the fused conv (with the BN as its bias) is the ridge
  least-squares fit of the groups' weighted centres ``T_u`` from the patches of ``x``.
* **BasicBlock** ``relu(z)`` with ``u = BN_1(conv_1(x))``, ``h = relu(u)`` and
  ``z = BN_2(conv_2(h)) + s(x)``:

  1. the inner neurons: ``u^{(m)}`` grouped into the fused inner width; ``conv_1`` fitted to the
     centres from ``x``'s patches, exactly as the stem; then the fused ``h = relu(u)``;
  2. the output neurons: ``z^{(m)}`` grouped (for an identity shortcut, numbered like the fused
     input's channels they add to, so the residual stream stays aligned); with an identity
     shortcut ``conv_2`` is fitted to ``T_z - x`` from ``h``'s patches; with a projection
     shortcut ``s(x) = BN_s(conv_s(x))``, ``conv_2`` and ``conv_s`` are one least-squares problem
     on the joint design ``[patches(h), x strided, 1]``.

Each fit is from the fused model's own inputs, so the errors of the sub-layers below are
accounted for, as between levels (paper Sec. 4); each ridge is chosen by generalised
cross-validation on the fusion set (:func:`~fedfuse.fusion.blocks.least_squares.ridge_fit`), as
for the affine levels. The targets are pre-activations: ReLU is monotone, and fitting ``u``
keeps the fit linear (the grouping of output neurons reads the same pre-activations). A fitted
BatchNorm holds the affine map it stands for (mean 0, variance ``1 - eps``, scale 1, the fitted
bias), and :func:`~fedfuse.fusion.blocks.batchnorm.refold_batchnorm_statistics` later gives it
the fusion set's statistics without changing the function. Inner neurons have no importance
scores (the sites score level outputs), so they are grouped with equal weights.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fedfuse.fusion.neuron_interpolation.grouping import GroupFn
from fedfuse.fusion.neuron_interpolation.sublayers import (
    chunks,
    fit_rows,
    group_targets,
    run_chunks,
)
from fedfuse.fusion.neuron_interpolation.transformer import (
    TRANSFORMER_LEVELS,
    fit_transformer_level,
)
from fedfuse.models.leveled import LeveledModel
from fedfuse.models.pieces import LinearPiece, linear_pieces
from fedfuse.models.resnet import BasicBlock, Stem

#: the levels fitted here besides affine ones
BLOCK_LEVELS = (Stem, BasicBlock, *TRANSFORMER_LEVELS)


def is_block_level(level: nn.Module) -> bool:
    """Whether ``level`` is a ResNet stem or BasicBlock, or a ViT patch embedding or encoder
    block (fitted by :func:`fit_block_linear`)."""
    return isinstance(level, BLOCK_LEVELS)


def check_block_levels(model: LeveledModel, affine: Callable[[nn.Module], Any]) -> None:
    """Raise ValueError naming the first neuron level that is neither affine (``affine(level)``
    not None) nor a ResNet or ViT block."""
    for index in model.neuron_levels:
        level = model.levels[index]
        if affine(level) is None and not is_block_level(level):
            raise ValueError(
                f"level {model.level_name(index)} is neither affine (parameter-free ops then one "
                "Linear/Conv2d) nor a ResNet stem, BasicBlock or ViT patch embedding or "
                "encoder block, the levels a Linear variant fits in closed form; use a gradient "
                "variant for it"
            )


@torch.no_grad()
def fit_block_linear(
    level: nn.Module,
    x: torch.Tensor,
    base_levels: list[nn.Module],
    base_inputs: list[torch.Tensor],
    weights: torch.Tensor,
    k: int,
    labels: torch.Tensor | None,
    *,
    group: GroupFn,
    batch_size: int,
) -> dict[str, Any]:
    """Fit the fused block ``level`` (inputs ``x``) in closed form, sub-layer by sub-layer: a
    ResNet :class:`Stem` or :class:`BasicBlock` (module docstring) or a ViT level
    (:mod:`.transformer`), to the base ``base_levels`` run on
    their own ``base_inputs``; ``weights`` are the base output neurons' importances and
    ``labels`` their groups when already chosen (residual levels). Returns the fit's details:
    the ridge of each sub-layer fit and the output neurons' ``labels``."""
    if isinstance(level, TRANSFORMER_LEVELS):
        return fit_transformer_level(
            level,
            x,
            base_levels,
            base_inputs,
            weights,
            k,
            labels,
            group=group,
            batch_size=batch_size,
        )
    parts = chunks(len(x), batch_size)
    # the base models stay where they are, unchanged: their level runs as a copy beside x
    base_levels = [copy.deepcopy(b).to(x.device).eval() for b in base_levels]
    pieces = linear_pieces(level)
    if pieces is None or not isinstance(level, (Stem, BasicBlock)):
        raise TypeError(f"fit_block_linear fits ResNet and ViT blocks, not {type(level).__name__}")
    details: dict[str, Any] = {}
    for piece in pieces:
        ridge, fitted = _fit_piece(
            piece, level, x, base_levels, base_inputs, weights, k, labels, group, parts
        )
        labels = labels if piece.inner else fitted
        details[piece.name] = ridge
    return {"sublayers": details, "labels": labels}


def _fit_piece(
    piece: LinearPiece,
    level: nn.Module,
    x: torch.Tensor,
    base_levels: list[nn.Module],
    base_inputs: list[torch.Tensor],
    weights: torch.Tensor,
    k: int,
    labels: torch.Tensor | None,
    group: GroupFn,
    parts: list[slice],
) -> tuple[float, torch.Tensor]:
    """Fit one piece of the fused ``level`` to its groups' centres (inner neurons with equal
    weights, output neurons by ``weights`` and ``labels``); returns the ridge and the labels."""
    base_targets = [
        run_chunks(lambda t, b=b: piece.target(b, t), i, parts)
        for b, i in zip(base_levels, base_inputs, strict=True)
    ]
    if piece.inner:
        weights = torch.ones(sum(t.shape[1] for t in base_targets), device=weights.device)
        k, labels = piece.width(level), None
    labels, targets = group_targets(base_targets, weights, k, labels, group)
    del base_targets
    if piece.stream is not None:
        stream = piece.stream
        targets = targets - run_chunks(lambda t: stream(level, t), x, parts)
    positions = len(targets) // len(x)
    fit, _, _ = fit_rows(
        lambda c: piece.design(level, x[c]),
        lambda c: targets[c.start * positions : c.stop * positions],
        parts,
    )
    piece.load(level, fit.weights.float())
    return fit.ridge, labels
