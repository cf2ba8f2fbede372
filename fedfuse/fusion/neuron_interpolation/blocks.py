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

from fedfuse.fusion.blocks.least_squares import accumulate_normal_equations, ridge_fit
from fedfuse.fusion.neuron_interpolation.grouping import GroupFn
from fedfuse.fusion.neuron_interpolation.sublayers import chunks, group_targets, run_chunks
from fedfuse.fusion.neuron_interpolation.transformer import (
    TRANSFORMER_LEVELS,
    fit_transformer_level,
)
from fedfuse.models.affine import AffineLevel, output_rows
from fedfuse.models.leveled import LeveledModel
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
    if isinstance(level, Stem):
        base_u = [
            run_chunks(lambda t, s=s: s.bn(s.conv(t)), i, parts)
            for s, i in zip(base_levels, base_inputs, strict=True)
        ]
        labels, targets = group_targets(base_u, weights, k, labels, group)
        ridge = _fit_convs([level.conv], [x], targets, level.bn, parts)
        return {"sublayers": {"conv": ridge}, "labels": labels}
    if not isinstance(level, BasicBlock):
        raise TypeError(f"fit_block_linear fits a ResNet Stem or BasicBlock, not {type(level)}")
    details: dict[str, Any] = {}
    base_u = [
        run_chunks(lambda t, b=b: b.bn1(b.conv1(t)), i, parts)
        for b, i in zip(base_levels, base_inputs, strict=True)
    ]
    inner = level.conv1.out_channels
    _, inner_targets = group_targets(
        base_u,
        torch.ones(sum(u.shape[1] for u in base_u), device=weights.device),
        inner,
        None,
        group,
    )
    del base_u
    details["conv1"] = _fit_convs([level.conv1], [x], inner_targets, level.bn1, parts)
    del inner_targets
    h = run_chunks(lambda t: level.relu1(level.bn1(level.conv1(t))), x, parts)
    base_z = [
        run_chunks(lambda t, b=b: _pre_output(b, t), i, parts)
        for b, i in zip(base_levels, base_inputs, strict=True)
    ]
    labels, targets = group_targets(base_z, weights, k, labels, group)
    del base_z
    if level.identity_shortcut:
        targets = targets - output_rows(x).to(targets.dtype)
        details["conv2"] = _fit_convs([level.conv2], [h], targets, level.bn2, parts)
    else:
        conv, norm = level.shortcut[0], level.shortcut[1]
        details["conv2+shortcut"] = _fit_convs(
            [level.conv2, conv], [h, x], targets, level.bn2, parts
        )
        _set_batchnorm(norm, torch.zeros(norm.num_features, device=norm.weight.device))
    return {"sublayers": details, "labels": labels}


def _pre_output(block: BasicBlock, x: torch.Tensor) -> torch.Tensor:
    """A block's pre-activation output ``BN_2(conv_2(h)) + s(x)`` (before its last ReLU)."""
    h = block.relu1(block.bn1(block.conv1(x)))
    return block.bn2(block.conv2(h)) + block.shortcut(x)


def _design(convs: list[nn.Conv2d], inputs: list[torch.Tensor], chunk: slice) -> torch.Tensor:
    """Joint design rows of ``convs`` on their ``inputs`` for one chunk, one trailing 1."""
    parts = [
        AffineLevel([], conv).design(x[chunk])[:, :-1]
        for conv, x in zip(convs, inputs, strict=True)
    ]
    rows = torch.cat(parts, 1)
    return torch.cat([rows, rows.new_ones(len(rows), 1)], 1)


def _fit_convs(
    convs: list[nn.Conv2d],
    inputs: list[torch.Tensor],
    targets: torch.Tensor,
    norm: nn.BatchNorm2d,
    chunks: list[slice],
) -> float:
    """Fit ``convs`` jointly (their outputs summed, one bias held by ``norm``) to the target
    rows; the ridge is chosen by GCV. Returns the ridge."""
    positions = len(targets) // len(inputs[0])
    row_chunks = [slice(c.start * positions, (c.stop or 0) * positions) for c in chunks]
    gram, cross, norms = accumulate_normal_equations(
        (_design(convs, inputs, c) for c in chunks),
        (targets[r] for r in row_chunks),
        dtype=torch.float32,
    )
    fit = ridge_fit(gram, cross, norms, len(targets))
    w = fit.weights.float()
    start = 0
    for conv in convs:
        size = conv.weight[0].numel()
        conv.weight.copy_(w[start : start + size].T.reshape(conv.weight.shape))
        start += size
    _set_batchnorm(norm, w[-1])
    return fit.ridge


def _set_batchnorm(norm: nn.BatchNorm2d, bias: torch.Tensor) -> None:
    """``norm`` as the map ``y + bias`` in eval mode (mean 0, variance ``1 - eps``, scale 1)."""
    norm.running_mean.zero_()
    norm.running_var.fill_(1.0 - norm.eps)
    norm.weight.fill_(1.0)
    norm.bias.copy_(bias.to(norm.bias.dtype))
