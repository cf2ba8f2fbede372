r"""The Foldable SuperNet of FS-Merge on neuron levels (MLPs and CNNs of affine levels).

The level-wise SuperNet keeps the ``K`` base models frozen and puts a learnable merge/unmerge
pair (:class:`~fedfuse.fusion.methods.trained.fs_merge.matrices.FoldableMatrix`) between consecutive
hidden neuron levels: :meth:`FoldableSuperNet.level` is one level of it (the local objective),
:meth:`FoldableSuperNet.chain` the whole network from the first level's pre-activations (the global
objective). Transformers use the feature-space SuperNet of
:mod:`~fedfuse.fusion.methods.trained.fs_merge.spaces` instead.

Between consecutive hidden neuron levels of ``K`` base models of width ``d`` the SuperNet holds a
learnable *merge* matrix :math:`M_l \in \mathbb{R}^{d \times Kd}` and *unmerge* matrix
:math:`U_l \in \mathbb{R}^{Kd \times d}`. The base weights stay frozen. At neuron level ``l`` the
models' pre-activations are concatenated, :math:`z_l = z_l^1 \Vert \dots \Vert z_l^K`, merged to
``d`` channels, passed through the parameter-free levels that follow (the activation
:math:`\sigma`, max-pooling), and unmerged into one reconstruction per model, which is what each
model's next affine level consumes:

.. math::
    \tilde f_l = U_l\,\sigma(M_l z_l),\qquad
    z_{l+1}^k = W_{l+1}^k \tilde f_l^k + b_{l+1}^k \quad (\text{Eq. 2; } U_0 = (I;\dots;I)).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedfuse.fusion.methods.trained.fs_merge.matrices import FoldableMatrix, on_channels


class FoldableSuperNet(nn.Module):
    """The merge/unmerge matrices of every hidden level, and the SuperNet's forward passes."""

    def __init__(
        self,
        merges: Sequence[FoldableMatrix],
        unmerges: Sequence[FoldableMatrix],
        between: Sequence[nn.Module],
    ) -> None:
        super().__init__()
        self.merges = nn.ModuleList(merges)
        self.unmerges = nn.ModuleList(unmerges)
        self.between = nn.ModuleList(between)  # parameter-free levels after each hidden level

    def level(self, position: int, z: torch.Tensor) -> torch.Tensor:
        """``U_l sigma(M_l z)`` of hidden level ``position`` (the local SuperNet, Eq. 2)."""
        return self.after_merge(position, on_channels(self.merges[position], z))

    def after_merge(self, position: int, merged: torch.Tensor) -> torch.Tensor:
        """``U_l sigma(m)`` of hidden level ``position`` from its merged pre-activations."""
        return on_channels(self.unmerges[position], self.between[position](merged))

    def chain(
        self,
        first_z: torch.Tensor,
        base_levels: Sequence[nn.Module],
        first_level: StackedLevel | None = None,
    ) -> torch.Tensor:
        """The global SuperNet (Eq. 4) from the concatenated first-level pre-activations, or,
        with ``first_level`` (the models' first level, :attr:`StackedLevel.folds_a_merge`),
        from the models' shared input ``first_z``.

        ``base_levels[p]`` runs the ``K`` models' (frozen) neuron level ``p + 1`` on the
        concatenated reconstructions (:class:`StackedLevel`).
        """
        if first_level is None:
            reconstruction = self.level(0, first_z)
        else:
            reconstruction = self.after_merge(0, first_level.merged(self.merges[0], first_z))
        for position in range(1, len(self.merges)):
            reconstruction = self.level(position, base_levels[position - 1](reconstruction))
        return reconstruction


def _stacked_affine(layer: nn.Module) -> tuple[str, nn.Module] | None:
    """The kind (``"conv"``, ``"linear"``, ``"flatten-linear"``) of an affine level that
    :class:`StackedLevel` runs for all models in one call, and its affine layer."""
    if isinstance(layer, nn.Conv2d) and layer.padding_mode == "zeros":
        return "conv", layer
    if isinstance(layer, nn.Linear):
        return "linear", layer
    if (
        isinstance(layer, nn.Sequential)
        and len(layer) == 2
        and isinstance(layer[0], nn.Flatten)
        and layer[0].start_dim == 1
        and layer[0].end_dim == -1
        and isinstance(layer[1], nn.Linear)
    ):
        return "flatten-linear", layer[1]
    return None


def _stackable(levels: Sequence[nn.Module]) -> tuple[str, list[nn.Module]] | None:
    """The common kind and the affine layers of ``levels`` when one call can run them all:
    the same kind, weight shape, bias presence and (convolutions) geometry; else None."""
    found = [_stacked_affine(level) for level in levels]
    if any(f is None for f in found):
        return None
    kinds = {f[0] for f in found if f is not None}
    layers = [f[1] for f in found if f is not None]
    first = layers[0]

    def geometry(layer: nn.Module) -> tuple[Any, ...]:
        shape = (layer.weight.shape, layer.bias is None)
        if not isinstance(layer, nn.Conv2d):
            return shape
        return (*shape, layer.stride, layer.padding, layer.dilation, layer.groups)

    if len(kinds) != 1 or any(geometry(layer) != geometry(first) for layer in layers):
        return None
    return kinds.pop(), layers


class StackedLevel(nn.Module):
    """One neuron level of ``K`` frozen models, run on their concatenated inputs at once.

    The input holds the ``K`` models' inputs side by side on dim 1 (``(N, K c, ...)``) and the
    output their outputs the same way. Convolutions become one grouped convolution, linear
    layers one batched product: a single kernel where a loop over models takes ``K`` (the
    level's cost is most of an FS-Merge epoch on CNNs). Other levels run model by model.
    """

    def __init__(self, levels: Sequence[nn.Module]) -> None:
        super().__init__()
        self.count = len(levels)
        self.levels = nn.ModuleList(levels)
        stackable = _stackable(levels)
        self.kind = "loop" if stackable is None else stackable[0]
        if stackable is not None:
            layers = stackable[1]
            self.layer = layers[0]
            self.register_buffer("weight", torch.stack([a.weight.detach() for a in layers]))
            biases = [a.bias.detach() for a in layers if a.bias is not None]
            self.register_buffer("bias", torch.stack(biases) if biases else None)

    @property
    def folds_a_merge(self) -> bool:
        """Whether :meth:`merged` can fold a merge matrix into this level (convolutions
        without groups, linear layers)."""
        if self.kind == "conv":
            return self.layer.groups == 1
        return self.kind in ("linear", "flatten-linear")

    def merged(self, matrix: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``matrix`` (a merge, ``d x K c``) on the channels of the ``K`` models' outputs of
        this level, all computed from the one input ``x`` they share (the first level).

        ``M (W x + b) = (M W) x + M b``: one level with ``d`` output channels on ``x``, in place
        of ``K`` levels and a merge on their ``K``-fold output (for a CNN's first level, a 1x1
        convolution over the largest feature maps of the network).
        """
        if not self.folds_a_merge:
            raise ValueError(f"a {self.kind} level cannot fold a merge matrix")
        dense = matrix.dense()  # type: ignore[operator]
        weight = self.weight.flatten(0, 1)  # (K c, ...)
        folded = (dense @ weight.flatten(1)).view(len(dense), *weight.shape[1:])
        bias = None if self.bias is None else dense @ self.bias.flatten()
        if self.kind == "conv":
            conv = self.layer
            return F.conv2d(x, folded, bias, conv.stride, conv.padding, conv.dilation)
        return F.linear(x.flatten(1) if self.kind == "flatten-linear" else x, folded, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        count = self.count
        if self.kind == "conv":
            conv = self.layer
            weight = self.weight.flatten(0, 1)
            bias = None if self.bias is None else self.bias.flatten()
            return F.conv2d(
                x, weight, bias, conv.stride, conv.padding, conv.dilation, conv.groups * count
            )
        if self.kind == "flatten-linear" or (self.kind == "linear" and x.dim() == 2):
            rows = x.reshape(len(x), count, -1).transpose(0, 1)  # (K, N, in)
            out = torch.bmm(rows, self.weight.transpose(1, 2))
            if self.bias is not None:
                out = out + self.bias[:, None, :]
            return out.transpose(0, 1).reshape(len(x), -1)
        parts = x.split(x.shape[1] // count, dim=1)
        return torch.cat([level(part) for level, part in zip(self.levels, parts, strict=True)], 1)
