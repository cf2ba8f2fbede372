r"""The foldable merge and unmerge matrices of FS-Merge: a diagonal part plus a low-rank part.

A :class:`FoldableMatrix` is one learnable merge ``M`` (``d x Kd``: the ``K`` models' neurons of a
level or feature space onto ``d`` merged channels) or unmerge ``U`` (``Kd x d``: back to one
reconstruction per model), applied to feature rows without forming the matrix; both SuperNets
(:mod:`~fedfuse.fusion.methods.trained.fs_merge.supernet` for levels,
:mod:`~fedfuse.fusion.methods.trained.fs_merge.spaces` for transformers) are built from them, and
folding reads them back as dense matrices.

**Parameterisation** (Eq. 7): :math:`M = M^{\text{diag}} + M^1 M^2` with rank ``r`` and
:math:`M^{\text{diag}}` a concatenation of ``K`` diagonal matrices (one learnable scalar per base
neuron); likewise ``U``. ``rank=-1`` learns dense matrices (the MLP theory of App. H). Low-rank
factors start as in the authors' code: the factor on one side at zero, the other small random, so
the product is 0. For the ZipIt initialisation the "diagonal" is taken in the matched basis
(base neuron ``j`` of model ``k`` sits at its ZipIt cluster instead of at row ``j``), which is a
concatenation of diagonals after re-indexing each model's neurons.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

#: the authors' scale of the random low-rank factor (``LOW_RANK_FACTOR`` in their code)
LOW_RANK_FACTOR = 0.1


class FoldableMatrix(nn.Module):
    r"""A merge ``M`` (``width x n``) or unmerge ``U`` (``n x width``) matrix, ``n = K * width``.

    ``M = D + A B``: ``D`` has one learnable entry per base neuron ``j``, at merged channel
    ``assign[j]`` (a concatenation of diagonal matrices when ``assign`` is the identity in each
    model), and ``A B`` has rank ``rank`` (0: none). ``rank=-1`` makes the whole matrix a dense
    parameter. Applied to rows ``(R, in)`` it returns ``(R, out)`` without forming the matrix.
    """

    def __init__(
        self,
        kind: str,
        assign: torch.Tensor,
        diagonal: torch.Tensor,
        width: int,
        rank: int,
        generator: torch.Generator,
    ) -> None:
        super().__init__()
        if kind not in ("merge", "unmerge"):
            raise ValueError(f"kind must be 'merge' or 'unmerge', got {kind!r}")
        self.kind = kind
        self.width = width
        self.n = len(assign)
        self.rank = rank
        self.register_buffer("assign", assign.long().clone())
        models = self.n // width
        sizes = torch.bincount(self.assign, minlength=width)
        #: how the sparse part is applied: "identity" (neuron i of every model -> channel i: a
        #: reshape), "regular" (every merged channel has exactly K base neurons: a gather and a
        #: reshape) or "general" (index_add)
        self.layout = "general"
        if self.n == models * width and bool((sizes == models).all()):
            identity = torch.arange(width).repeat(models)
            self.layout = "identity" if torch.equal(self.assign, identity) else "regular"
        # members of each channel, slot-major: position s * width + c holds channel c's s-th one
        order = torch.argsort(self.assign * self.n + torch.arange(self.n), stable=True)
        slots = order.view(width, models).T.reshape(-1) if self.layout == "regular" else order
        self.register_buffer("slots", slots)
        self.diagonal: nn.Parameter | None = None
        self.left: nn.Parameter | None = None
        self.right: nn.Parameter | None = None
        self.full: nn.Parameter | None = None
        sparse = self._sparse(diagonal.float())
        if rank < 0:
            self.full = nn.Parameter(sparse)
            return
        self.diagonal = nn.Parameter(diagonal.float().clone())
        if rank > 0:
            scale = LOW_RANK_FACTOR * width**-0.5 / rank
            if kind == "merge":  # M = left (width x r, random) @ right (r x n, zero)
                self.left = nn.Parameter(scale * torch.randn(width, rank, generator=generator))
                self.right = nn.Parameter(torch.zeros(rank, self.n))
            else:  # U = left (n x r, random) @ right (r x width, zero)
                self.left = nn.Parameter(scale * torch.randn(self.n, rank, generator=generator))
                self.right = nn.Parameter(torch.zeros(rank, width))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.width, self.n) if self.kind == "merge" else (self.n, self.width)

    def _sparse(self, values: torch.Tensor) -> torch.Tensor:
        matrix = torch.zeros(self.shape, dtype=values.dtype, device=values.device)
        columns = torch.arange(self.n, device=values.device)
        assign = self.assign.to(values.device)
        if self.kind == "merge":
            matrix[assign, columns] = values
        else:
            matrix[columns, assign] = values
        return matrix

    def dense(self) -> torch.Tensor:
        """The matrix itself, ``(out, in)``."""
        if self.full is not None:
            return self.full
        assert self.diagonal is not None
        matrix = self._sparse(self.diagonal)
        if self.left is not None and self.right is not None:
            matrix = matrix + self.left @ self.right
        return matrix

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows @ matrix.T`` for rows ``(R, in)``."""
        if self.full is not None:
            return rows @ self.full.T
        assert self.diagonal is not None
        if self.kind == "merge":
            scaled = rows * self.diagonal
            if self.layout == "identity":
                out = scaled.view(len(rows), -1, self.width).sum(1)
            elif self.layout == "regular":
                out = scaled.index_select(1, self.slots).view(len(rows), -1, self.width).sum(1)
            else:
                out = rows.new_zeros(len(rows), self.width).index_add(1, self.assign, scaled)
        elif self.layout == "identity":
            out = rows.repeat(1, self.n // self.width) * self.diagonal
        else:
            out = rows.index_select(1, self.assign) * self.diagonal
        if self.left is not None and self.right is not None:
            out = out + (rows @ self.right.T) @ self.left.T
        return out


def on_channels(function: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Apply a map of rows ``(R, C) -> (R, C')`` to the channel axis (dim 1) of ``x``.

    A :class:`FoldableMatrix` on feature maps ``(N, C, H, W)`` is applied as the 1x1 convolution
    with its dense matrix: the same product as its row-wise :meth:`~FoldableMatrix.forward` on
    every pixel, without moving the channels last (a copy of the whole map, forward and
    backward) and with one optimised kernel where the row-wise form takes several passes.
    """
    if x.dim() == 2:
        return function(x)
    if x.dim() == 4 and isinstance(function, FoldableMatrix):
        return F.conv2d(x, function.dense()[:, :, None, None])
    moved = x.movedim(1, -1)
    out = function(moved.reshape(-1, moved.shape[-1]))
    return out.reshape(*moved.shape[:-1], out.shape[-1]).movedim(-1, 1)
