r"""The Foldable SuperNet of FS-Merge on neuron levels (MLPs and CNNs of affine levels).

The level-wise SuperNet keeps the ``K`` base models frozen and puts a learnable merge/unmerge
pair (:class:`~fedfuse.fusion.fs_merge.matrices.FoldableMatrix`) between consecutive hidden neuron
levels: :meth:`FoldableSuperNet.level` is one level of it (the local objective),
:meth:`FoldableSuperNet.chain` the whole network from the first level's pre-activations (the
global objective). Transformers use the feature-space SuperNet of
:mod:`~fedfuse.fusion.fs_merge.spaces` instead.

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

import torch
from torch import nn

from fedfuse.fusion.fs_merge.matrices import FoldableMatrix, on_channels


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
        merged = self.between[position](on_channels(self.merges[position], z))
        return on_channels(self.unmerges[position], merged)

    def chain(
        self, first_z: torch.Tensor, base_levels: Sequence[Sequence[nn.Module]]
    ) -> torch.Tensor:
        """The global SuperNet (Eq. 4) from the concatenated first-level pre-activations.

        ``base_levels[p][k]`` is model ``k``'s (frozen) neuron level ``p + 1``.
        """
        reconstruction = self.level(0, first_z)
        for position in range(1, len(self.merges)):
            parts = reconstruction.split(self.unmerges[position - 1].width, dim=1)
            z = torch.cat(
                [layer(part) for layer, part in zip(base_levels[position - 1], parts, strict=True)],
                1,
            )
            reconstruction = self.level(position, z)
        return reconstruction
