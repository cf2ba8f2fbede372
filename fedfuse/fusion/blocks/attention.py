r"""Attention in closed form: fusing heads' bilinear forms and cutting value products to rank.

A ViT encoder block's attention is fitted as two of its linear pieces
(:mod:`fedfuse.fusion.blocks.pieces`); this module holds their math, shared by the fusion-set fits
and the sites' statistics rounds, and the token helpers the block's pieces read it through.
``ñ`` are the block's normalised tokens with a 1 (the fused LayerNorms are plain normalisations).

1. ``q+k``. Softmax is not affine, but the logits are bilinear: head ``g`` of model ``m`` has
   logits ``ñ^{(m)} B_{mg} ñ^{(m)T}``, ``B = W̃_q^T W̃_k / sqrt(d_h)`` (biases in the last row
   and column). Regressing the model's queries and keys on the fused ``ñ`` (the piece's
   targets; on the fusion set, or each site's translation on its data) gives
   ``ñ^{(m)} W̃^T ≈ ñ Ŵ``, so its logits are ``≈ ñ B̂_{mg} ñ^T``: forms in one coordinate
   system, which can be compared and averaged. With ``H H^T = ñ^T ñ / R`` the design's second
   moment, ``||H^T (B̂ - B̂') H||`` is the logits' distance on the data. Heads are grouped across
   models (Hungarian or k-means, equal weights) by their attention maps where the server holds
   the data (the fusion set, :func:`attention_map_points`), else by that distance, and fused
   head ``c`` takes its group's mean form (the softmax of mean logits: the normalised geometric
   mean of the maps), cut to the head's rank where the data measures it: from the SVD
   ``H^T B_c H = U S V^T``, ``W̃_q^T = d_h^{1/4} H^+ U_r S_r^{1/2}``, ``W̃_k^T`` with ``V_r``
   (:func:`attention_logits`).
2. ``v+out``: given the fused maps ``P_c``, the attention output ``sum_c P_c ñ A_c + b_o`` is
   linear in ``A_c = W_{v,c}^T W_{o,c}^T`` (rank ``d_h``), fitted jointly to the stream's
   groups after attention minus the stream; each ``A_c`` is cut to its rank where its own
   design ``P_c ñ`` measures it, and the left factor is ``W_v`` (:func:`value_weights`).
   ``V``'s bias is 0: each row of ``P_c`` sums to one, so it would only add a constant.

The whitener ``H`` is cut at the fusion's ``whiten_rcond`` (:mod:`fedfuse.fusion.blocks.whitening`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fedfuse.fusion.blocks.whitening import whitener
from fedfuse.models.vit import Attention

#: ``group(points, weights, widths, k)``: the fused neuron (or head) of each base one, points
#: as rows, model by model
GroupFn = Callable[[torch.Tensor, torch.Tensor, list[int], int], torch.Tensor]


def token_rows(tokens: torch.Tensor) -> torch.Tensor:
    """Tokens ``(N, T, d)`` as rows ``(N T, d)``."""
    return tokens.reshape(-1, tokens.shape[-1])


def as_tokens(x: torch.Tensor) -> torch.Tensor:
    """Channels-first level input ``(N, d, T)`` as tokens ``(N, T, d)``."""
    return x.transpose(1, 2)


def plain_norm(tokens: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    """``norm`` without its scale and shift (the fused norms are plain)."""
    return F.layer_norm(tokens, norm.normalized_shape, eps=norm.eps)


def split_heads(attention: Attention, y: torch.Tensor) -> torch.Tensor:
    """Tokens ``(n, T, d)`` as ``(n, heads, T, d / heads)``."""
    n, t, d = y.shape
    return y.view(n, t, attention.heads, d // attention.heads).transpose(1, 2)


def attention_maps(attention: Attention, normed: torch.Tensor) -> torch.Tensor:
    """Attention probabilities ``(n, heads, T, T)`` on normalised tokens."""
    q = split_heads(attention, attention.q(normed))
    k = split_heads(attention, attention.k(normed))
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1)


def attention_logits(
    translations: list[torch.Tensor],
    heads: list[int],
    gram: torch.Tensor,
    fused_heads: int,
    head_size: int,
    group: GroupFn,
    points: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused queries and keys ``[W̃_q^T, W̃_k^T]`` (``(d+1) x 2 * heads * head_size``) of a
    ``q+k`` piece, and the fused head of each base head (module docstring, step 1).

    ``translations[m]`` (``(d+1) x 2 w_m``): model ``m``'s queries then keys regressed on the
    fused design (Gram ``gram``); ``heads[m]`` its head count. The heads are grouped by
    ``points`` (a row per base head) when given, else by their forms."""
    half, inverse = whitener(gram)
    forms = []
    for regressed, count in zip(translations, heads, strict=True):
        width = regressed.shape[1] // 2
        size = width // count
        q, k = regressed[:, :width].double(), regressed[:, width:].double()
        forms += [
            q[:, g * size : (g + 1) * size] @ k[:, g * size : (g + 1) * size].T / math.sqrt(size)
            for g in range(count)
        ]
    if points is None:
        points = torch.stack([(half.T @ form @ half).flatten() for form in forms])
    ones = torch.ones(len(points), dtype=points.dtype, device=points.device)
    labels = group(points, ones, list(heads), fused_heads)
    width = fused_heads * head_size
    weights = gram.new_zeros(len(gram), 2 * width, dtype=torch.float64)
    for c in range(fused_heads):
        members = (labels == c).nonzero().flatten().tolist()
        if not members:
            continue
        mean = sum(forms[i] for i in members) / len(members)
        u, s, vh = torch.linalg.svd(half.T @ mean @ half)
        r = min(head_size, len(s))
        scale = s[:r].sqrt() * head_size**0.25
        weights[:, c * head_size : c * head_size + r] = inverse @ (u[:, :r] * scale)
        weights[:, width + c * head_size : width + c * head_size + r] = inverse @ (vh[:r].T * scale)
    return weights, labels


@torch.no_grad()
def attention_map_points(blocks: list[nn.Module], inputs: list[torch.Tensor]) -> torch.Tensor:
    """Each head's attention maps on its block's inputs (channels first), flattened as a row,
    model by model: points to group heads by where they attend (the fusion set's alternative to
    the logits' forms of :func:`attention_logits`)."""
    rows = []
    for block, x in zip(blocks, inputs, strict=True):
        maps = attention_maps(block.attention, block.ln1(as_tokens(x)))  # (n, heads, T, T)
        rows.append(maps.transpose(0, 1).flatten(1))
    return torch.cat(rows).double()


def value_weights(
    products: torch.Tensor, gram: torch.Tensor, heads: int, head_size: int
) -> torch.Tensor:
    """``W̃_v^T`` (``(d+1) x heads * head_size``, bias row 0) from the joint fit of the
    ``v+out`` piece: each head's product block cut to rank ``head_size`` where its design
    measures it (module docstring, step 2)."""
    d = (len(products) - 1) // heads
    weights = products.new_zeros(d + 1, heads * head_size, dtype=torch.float64)
    for c in range(heads):
        block = slice(c * d, (c + 1) * d)
        half, inverse = whitener(gram[block, block])
        u, _, _ = torch.linalg.svd(half.T @ products[block].double())
        r = min(head_size, u.shape[1])
        weights[:d, c * head_size : c * head_size + r] = inverse @ u[:, :r]
    return weights


__all__ = [
    "GroupFn",
    "as_tokens",
    "attention_logits",
    "attention_map_points",
    "attention_maps",
    "plain_norm",
    "split_heads",
    "token_rows",
    "value_weights",
]
