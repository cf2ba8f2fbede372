r"""The Linear fit inside a block level, piece by piece: a ResNet stem or BasicBlock, a ViT
patch embedding or encoder block (the pieces and their derivation:
:mod:`fedfuse.fusion.blocks.pieces`).

Each piece is fitted from the fused model's own inputs, so the errors of the pieces below are
accounted for, as between levels (paper Sec. 4), each ridge chosen by generalised
cross-validation on the fusion set (:func:`~fedfuse.fusion.blocks.least_squares.ridge_fit`), as
for the affine levels. A piece's output neurons are grouped with the level's importances (for a
residual level, numbered like the stream's channels); inner neurons have no importance scores
(the sites score level outputs), so they are grouped with equal weights. A fitted BatchNorm holds
the affine map it stands for; :func:`~fedfuse.fusion.blocks.batchnorm.refold_batchnorm_statistics`
later gives it the fusion set's statistics without changing the function.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from fedfuse.fusion.blocks.attention import attention_logits, attention_map_points
from fedfuse.fusion.blocks.graph_attention import live_nodes
from fedfuse.fusion.blocks.graph_pieces import fold_norm_levels, op_kind, read_block
from fedfuse.fusion.blocks.pieces import LinearPiece, linear_pieces
from fedfuse.fusion.blocks.token_levels import TokenLevel, token_refusal
from fedfuse.fusion.methods.neuron_interpolation.grouping import GroupFn
from fedfuse.fusion.methods.neuron_interpolation.sublayers import (
    chunks,
    fit_rows,
    group_targets,
    run_chunks,
)
from fedfuse.models.graph_levels import describe
from fedfuse.models.leveled import LeveledModel
from fedfuse.models.resnet import BasicBlock, Stem
from fedfuse.models.vit import EncoderBlock, PatchEmbedding

#: fusion samples whose attention maps place the base heads into the fused heads
HEAD_MATCH_SAMPLES = 64

#: the levels fitted here besides affine ones
BLOCK_LEVELS = (Stem, BasicBlock, PatchEmbedding, EncoderBlock)


def is_block_level(level: nn.Module) -> bool:
    """Whether ``level`` is a ResNet stem or BasicBlock, a ViT patch embedding or encoder
    block, or a graph level of a user's model read as pieces
    (:func:`~fedfuse.fusion.blocks.graph_pieces.read_block`), all fitted by
    :func:`fit_block_linear`."""
    return isinstance(level, (*BLOCK_LEVELS, TokenLevel)) or read_block(level) is not None


def check_block_levels(model: LeveledModel, affine: Callable[[nn.Module], Any]) -> None:
    """Raise ValueError naming the first neuron level that is neither affine (``affine(level)``
    not None) nor a block, after each BatchNorm level is folded into the layer before it
    (:func:`~fedfuse.fusion.blocks.graph_pieces.fold_norm_levels`)."""
    refusal = token_refusal(list(model.levels))
    if refusal is not None:  # a transformer whose levels are not all read as fedfuse's ViT's
        index, reason = refusal
        raise ValueError(
            f"level {model.level_name(index)} {reason}; a Linear variant fits a Vision "
            "Transformer in closed form only from such parts, use a gradient variant for it"
        )
    model, _ = fold_norm_levels(model)
    for index in model.neuron_levels:
        level = model.levels[index]
        if affine(level) is None and not is_block_level(level):
            raise ValueError(
                f"level {model.level_name(index)} is neither affine (parameter-free ops then one "
                "Linear/Conv2d) nor a block: a ResNet stem, BasicBlock or ViT patch embedding or "
                "encoder block, or in a model of yours a Linear/Conv2d with its BatchNorm, or a "
                "residual block of such layers added to the block's input or to a "
                "Linear/Conv2d shortcut (as torchvision's ResNets), or a pre-norm ViT's levels (as "
                "torchvision's VisionTransformer), the levels a Linear variant fits in closed "
                f"form{unfit_op(level)}; use a gradient variant for it"
            )


def unfit_op(level: nn.Module) -> str:
    """``" (its op 'x' is ...)"``: the first op of a graph level that no piece takes."""
    if not isinstance(level, fx.GraphModule):
        return ""
    read = live_nodes(level)  # shape checks and asserts compute nothing the output reads
    for node in level.graph.nodes:
        if node not in read or node.op == "get_attr" or "tensor_meta" not in node.meta:
            continue  # sizes (a shape, its entries) are no ops on channels either
        if op_kind(level, node) is None:
            return f" (its node {node.name!r}, {describe(node, level)}, is none of these)"
    return ""


@dataclass(frozen=True)
class _BlockFit:
    """What every piece's fit in one block reads: the fused ``level`` and its inputs ``x``, the
    base ``base_levels`` run on their own ``base_inputs``, the grouping and the sample chunks."""

    level: nn.Module
    x: torch.Tensor
    base_levels: list[nn.Module]
    base_inputs: list[torch.Tensor]
    group: GroupFn
    parts: list[slice]

    def base_targets(self, piece: LinearPiece) -> list[torch.Tensor]:
        """Each base model's ``piece`` targets on every sample, chunk by chunk."""
        return [
            run_chunks(lambda t, b=b: piece.target(b, t.to(self.x.device)), i, self.parts)
            for b, i in zip(self.base_levels, self.base_inputs, strict=True)
        ]

    def base_targets_on(self, piece: LinearPiece, c: slice) -> list[torch.Tensor]:
        """Each base model's ``piece`` targets on the samples ``c``."""
        return [
            piece.target(b, i[c].to(self.x.device))
            for b, i in zip(self.base_levels, self.base_inputs, strict=True)
        ]

    def design(self, piece: LinearPiece, c: slice) -> torch.Tensor:
        """The fused ``piece``'s design rows on samples ``c``."""
        return piece.design(self.level, self.x[c])


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
    """Fit the fused block ``level`` (inputs ``x``) in closed form, piece by piece
    (:func:`~fedfuse.fusion.blocks.pieces.linear_pieces`), to the base ``base_levels`` run on their
    own ``base_inputs``; ``weights`` are the base output neurons' importances and ``labels`` their
    groups when already chosen (residual levels). Returns the ridge of each piece's fit, the heads'
    groups (ViT blocks) and the output neurons' ``labels``."""
    # the base models stay where they are, unchanged: their level runs as a copy beside x
    base_levels = [copy.deepcopy(b).to(x.device).eval() for b in base_levels]
    block = _BlockFit(level, x, base_levels, base_inputs, group, chunks(len(x), batch_size))
    pieces = linear_pieces(level)
    if pieces is None or not is_block_level(level):
        raise TypeError(f"fit_block_linear fits ResNet and ViT blocks, not {type(level).__name__}")
    details: dict[str, Any] = {"sublayers": {}}
    for piece in pieces:
        if piece.kind == "logits":
            ridge, heads = _fit_logits(block, piece)
            details["heads"] = heads.tolist()
        else:
            ridge, fitted = _fit_piece(block, piece, weights, k, labels)
            labels = labels if piece.inner else fitted
        details["sublayers"][piece.name] = ridge
    return {**details, "labels": labels}


def _fit_piece(
    block: _BlockFit,
    piece: LinearPiece,
    weights: torch.Tensor,
    k: int,
    labels: torch.Tensor | None,
) -> tuple[float, torch.Tensor]:
    """Fit one piece of the fused block to its groups' centres (inner neurons with equal
    weights, output neurons by ``weights`` and ``labels``); returns the ridge and the labels."""
    level, x, parts = block.level, block.x, block.parts
    base_targets = block.base_targets(piece)
    if piece.inner:
        weights = torch.ones(sum(t.shape[1] for t in base_targets), device=weights.device)
        k, labels = piece.width(level), None
    labels, targets = group_targets(base_targets, weights, k, labels, block.group)
    del base_targets
    if piece.stream is not None:
        stream = piece.stream
        targets = targets - run_chunks(lambda t: stream(level, t), x, parts)
    positions = len(targets) // len(x)
    fit, gram, _ = fit_rows(
        lambda c: block.design(piece, c),
        lambda c: targets[c.start * positions : c.stop * positions],
        parts,
    )
    piece.load(level, fit.weights, gram)
    return fit.ridge, labels


def _fit_logits(block: _BlockFit, piece: LinearPiece) -> tuple[float, torch.Tensor]:
    """Fit an attention's queries and keys
    (:func:`~fedfuse.fusion.blocks.attention.attention_logits`): every model's regressed on the
    fused design in one ridge fit, the heads grouped by their attention maps on the first
    :data:`HEAD_MATCH_SAMPLES` fusion samples (on a validation split of two ViT site sets this
    beat grouping by the logits' forms by 1 point, lower loss in all four fusions); returns the
    ridge and the fused head of each base head."""
    level, base_levels = block.level, block.base_levels
    fit, gram, _ = fit_rows(
        lambda c: block.design(piece, c),
        lambda c: torch.cat(block.base_targets_on(piece, c), 1),
        block.parts,
    )
    widths = [piece.width(b) for b in base_levels]
    translations = list(fit.weights.split(widths, 1))
    heads = [b.attention.heads for b in base_levels]
    fused_heads = level.attention.heads
    size = level.attention.q.out_features // fused_heads
    samples = [inp[:HEAD_MATCH_SAMPLES].to(block.x.device) for inp in block.base_inputs]
    points = attention_map_points(base_levels, samples)
    weights, labels = attention_logits(
        translations, heads, gram, fused_heads, size, block.group, points
    )
    piece.load(level, weights, gram)
    return fit.ridge, labels
