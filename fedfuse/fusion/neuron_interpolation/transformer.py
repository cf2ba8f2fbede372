r"""The Linear fit inside a ViT level: the patch embedding and each pre-norm encoder block.

Between levels the tokens are channels first; here every token of every fusion sample is a row,
and ``x`` is the fused level's input, ``x^{(m)}`` model ``m``'s own. The stream's neurons are
grouped once per level (a block's are numbered like its input's, so the residual stream stays
aligned) and every sub-layer that writes the stream is fitted to the groups' weighted centres
minus what the stream already carries, from the fused model's own inputs (the errors below are
accounted for, as between levels; each ridge by GCV on the fusion set).

**Patch embedding.** Token ``t >= 1`` is ``W p_t + b + pos_t`` (``p_t`` its patch), the class
token ``cls + pos_0``: affine in the row ``[p_t, e_t]`` (``p_0 = 0``, ``e_t`` the one-hot token).
One fit gives the projection and one offset per token, held by the position embedding (the
projection's bias and the class token are set to 0).

**Encoder block** ``a = x + O(attn(n))`` with ``n = LN_1(x)``, then ``y = a + fc_2(gelu(fc_1(
LN_2(a))))``. A LayerNorm's scale and shift fold into the linears after it, so the fused norms
are plain normalisations and each linear below reads ``ñ``, the normalised tokens with a 1.

1. *Queries and keys.* Softmax is not affine but the logits are bilinear: head ``g`` of model
   ``m`` has logits ``ñ^{(m)} B_{mg} ñ^{(m)T}`` with ``B = W̃_q^T W̃_k / sqrt(d_h)`` (biases in
   the last row and column). Regressing the model's queries and keys on the fused ``ñ`` gives
   ``ñ^{(m)} W̃^T ≈ ñ Ŵ``, so its logits are ``≈ ñ B̂_{mg} ñ^T`` with ``B̂`` built from ``Ŵ``:
   forms in one coordinate system, which can be averaged. Heads are grouped across models by
   their attention maps on the fusion set (Hungarian or k-means, as neurons, equal weights),
   and fused head ``c`` takes its group's mean form ``B_c`` (the softmax of mean logits: the
   normalised geometric mean of the maps). A head has rank ``d_h``: with ``H H^T = ñ^T ñ / R``,
   the rank-``d_h`` form nearest in logits on the fusion set comes from the SVD
   ``H^T B_c H = U S V^T``: ``W̃_q^T = d_h^{1/4} H^+ U_r S_r^{1/2}``, ``W̃_k^T`` with ``V_r``.
2. *Values and output.* Given the fused maps ``P_c``, the attention's output
   ``sum_c P_c ñ A_c + b_o`` is linear in the products ``A_c = W_{v,c}^T W_{o,c}^T`` (rank
   ``d_h``). Their joint fit to ``T_a - x`` (``T_a``: the centres of the models' mid-block
   stream ``a^{(m)}`` under the stream's groups) is truncated per head as above (whitened by
   ``P_c ñ``'s Gram), the left factor is ``W_v``, and ``O`` is refitted given ``V``, which
   recovers what the truncation lost. ``V``'s bias is 0: each row of ``P_c`` sums to one, so it
   only adds a constant, which ``O``'s bias holds.
3. *MLP*, as a ResNet block's inner layer: ``fc_1``'s pre-activations are grouped into the fused
   MLP width (equal weights; the sites score the stream only), ``fc_1`` is fitted from
   ``LN_2(a)`` to their centres, and ``fc_2`` from ``gelu(fc_1)`` to ``T_y - a``.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedfuse.fusion.neuron_interpolation.grouping import GroupFn
from fedfuse.fusion.neuron_interpolation.sublayers import (
    chunks,
    fit_rows,
    group_targets,
    run_chunks,
    whitener,
    with_ones,
)
from fedfuse.models.affine import AffineLevel, output_rows
from fedfuse.models.vit import Attention, EncoderBlock, PatchEmbedding

#: the ViT levels fitted here
TRANSFORMER_LEVELS = (PatchEmbedding, EncoderBlock)

#: fusion samples whose attention maps place heads into groups
HEAD_MATCH_SAMPLES = 64


@torch.no_grad()
def fit_transformer_level(
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
    """Fit the fused ViT ``level`` (a :class:`PatchEmbedding` or :class:`EncoderBlock`, inputs
    ``x``) in closed form (module docstring) to the base ``base_levels`` run on their own
    ``base_inputs``; ``weights`` are the stream neurons' importances and ``labels`` their groups
    when already chosen. Returns the ridge of each sub-layer fit, the heads' groups and the
    stream's ``labels``."""
    parts = chunks(len(x), batch_size)
    base_levels = [copy.deepcopy(b).to(x.device).eval() for b in base_levels]
    if isinstance(level, PatchEmbedding):
        return _fit_embedding(level, x, base_levels, base_inputs, weights, k, labels, group, parts)
    if isinstance(level, EncoderBlock):
        if labels is None:
            outputs = [
                run_chunks(b, i, parts) for b, i in zip(base_levels, base_inputs, strict=True)
            ]
            labels, _ = group_targets(outputs, weights, k, None, group)
            del outputs
        return _fit_encoder(level, x, base_levels, base_inputs, weights, labels, group, parts)
    raise TypeError(f"fit_transformer_level fits a ViT level, not {type(level).__name__}")


def _fit_embedding(
    level: PatchEmbedding,
    x: torch.Tensor,
    base_levels: list[nn.Module],
    base_inputs: list[torch.Tensor],
    weights: torch.Tensor,
    k: int,
    labels: torch.Tensor | None,
    group: GroupFn,
    parts: list[slice],
) -> dict[str, Any]:
    outputs = [run_chunks(b, i, parts) for b, i in zip(base_levels, base_inputs, strict=True)]
    labels, targets = group_targets(outputs, weights, k, labels, group)
    del outputs
    tokens = level.position.shape[1]
    projection = AffineLevel([], level.projection)
    fan = projection.fan_in - 1

    def design(c: slice) -> torch.Tensor:
        images = F.pad(x[c], level.padding) if any(level.padding) else x[c]
        patches = projection.design(images)[:, :-1].reshape(len(images), tokens - 1, fan)
        rows = patches.new_zeros(len(images), tokens, fan + tokens)
        rows[:, 1:, :fan] = patches
        rows[:, :, fan:] = torch.eye(tokens, dtype=rows.dtype, device=rows.device)
        return rows.reshape(-1, fan + tokens)

    fit, _, _ = fit_rows(design, lambda c: targets[c.start * tokens : c.stop * tokens], parts)
    w = fit.weights.to(level.position.dtype)
    level.projection.weight.copy_(w[:fan].T.reshape(level.projection.weight.shape))
    level.projection.bias.zero_()
    level.class_token.zero_()
    level.position.copy_(w[fan:].T)
    return {"sublayers": {"projection+position": fit.ridge}, "labels": labels}


def _normalised(tokens: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    """``norm`` without its scale and shift (they fold into the linears that read it)."""
    return F.layer_norm(tokens, norm.normalized_shape, eps=norm.eps)


def _plain(norm: nn.LayerNorm) -> None:
    norm.weight.fill_(1.0)
    norm.bias.zero_()


def _split(attention: Attention, y: torch.Tensor) -> torch.Tensor:
    """``(n, T, d)`` projections as heads ``(n, heads, T, d_h)``."""
    n, t, d = y.shape
    return y.view(n, t, attention.heads, d // attention.heads).transpose(1, 2)


def _maps(attention: Attention, normed: torch.Tensor) -> torch.Tensor:
    """The attention probabilities ``(n, heads, T, T)`` on already normalised tokens."""
    q, k = _split(attention, attention.q(normed)), _split(attention, attention.k(normed))
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1)


def _mid_stream(block: EncoderBlock, tokens: torch.Tensor) -> torch.Tensor:
    """A block's stream after its attention, ``x + attn(ln_1(x))``, tokens as rows."""
    return tokens + block.attention(block.ln1(tokens))


def _fit_encoder(
    level: EncoderBlock,
    x: torch.Tensor,
    base_levels: list[nn.Module],
    base_inputs: list[torch.Tensor],
    weights: torch.Tensor,
    labels: torch.Tensor,
    group: GroupFn,
    parts: list[slice],
) -> dict[str, Any]:
    attention = level.attention
    heads = attention.heads
    tokens_in = x.transpose(1, 2)  # (N, T, d)
    base_tokens = [i.transpose(1, 2) for i in base_inputs]
    bases: list[EncoderBlock] = base_levels  # type: ignore[assignment]
    k = level.fc2.out_features
    _plain(level.ln1)
    _plain(level.ln2)

    def normed(c: slice) -> torch.Tensor:
        return _normalised(tokens_in[c], level.ln1)

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1, t.shape[-1])

    details: dict[str, Any] = {}
    # 1. queries and keys: each model's regressed on the fused normalised tokens
    widths = [b.attention.q.out_features for b in bases]

    def queries_keys(c: slice) -> torch.Tensor:
        columns = []
        for b, t in zip(bases, base_tokens, strict=True):
            n = b.ln1(t[c])
            columns += [rows(b.attention.q(n)), rows(b.attention.k(n))]
        return torch.cat(columns, 1)

    fit, gram, count = fit_rows(lambda c: with_ones(rows(normed(c))), queries_keys, parts)
    details["q+k"] = fit.ridge
    regressed = fit.weights  # (d + 1, sum of 2 * width): per model its q then its k columns
    forms = []
    start = 0
    for b, width in zip(bases, widths, strict=True):
        q, kk = regressed[:, start : start + width], regressed[:, start + width : start + 2 * width]
        start += 2 * width
        size = width // b.attention.heads
        forms += [
            q[:, g * size : (g + 1) * size] @ kk[:, g * size : (g + 1) * size].T / math.sqrt(size)
            for g in range(b.attention.heads)
        ]
    head_labels = _group_heads(bases, base_tokens, heads, group)
    half, inverse = whitener(gram, count)
    size = attention.q.out_features // heads
    wq = torch.zeros_like(gram[:, : attention.q.out_features])
    wk = torch.zeros_like(wq)
    for c in range(heads):
        members = [forms[i] for i in (head_labels == c).nonzero().flatten().tolist()]
        if not members:
            continue
        u, s, vh = torch.linalg.svd(half.T @ (sum(members) / len(members)) @ half)
        r = min(size, len(s))
        scale = s[:r].sqrt() * size**0.25
        wq[:, c * size : c * size + r] = inverse @ (u[:, :r] * scale)
        wk[:, c * size : c * size + r] = inverse @ (vh[:r].T * scale)
    AffineLevel([], attention.q).set_weights(wq.float())
    AffineLevel([], attention.k).set_weights(wk.float())

    # 2. values and output, given the fused maps
    def mid_targets(c: slice) -> torch.Tensor:
        mids = [rows(_mid_stream(b, t[c])) for b, t in zip(bases, base_tokens, strict=True)]
        _, centres = group_targets(mids, weights, k, labels, group)
        return centres - rows(tokens_in[c]).to(centres.dtype)

    def head_values(c: slice) -> torch.Tensor:
        n = normed(c)
        per_head = _maps(attention, n) @ n[:, None]  # (n, heads, T, d)
        return with_ones(rows(per_head.transpose(1, 2).flatten(2)))

    fit, gram, count = fit_rows(head_values, mid_targets, parts)
    d = tokens_in.shape[2]
    wv = torch.zeros(d + 1, attention.v.out_features, dtype=torch.float64, device=x.device)
    for c in range(heads):
        block = slice(c * d, (c + 1) * d)
        half, inverse = whitener(gram[block, block], count)
        u, _, _ = torch.linalg.svd(half.T @ fit.weights[block])
        r = min(size, u.shape[1])
        wv[:d, c * size : c * size + r] = inverse @ u[:, :r]
    AffineLevel([], attention.v).set_weights(wv.float())

    def head_outputs(c: slice) -> torch.Tensor:
        n = normed(c)
        values = _split(attention, attention.v(n))
        return with_ones(rows((_maps(attention, n) @ values).transpose(1, 2).flatten(2)))

    fit, _, _ = fit_rows(head_outputs, mid_targets, parts)
    AffineLevel([], attention.out).set_weights(fit.weights.float())
    details["v+out"] = fit.ridge
    mid = run_chunks(lambda t: t + attention(_normalised(t, level.ln1)), tokens_in, parts)

    # 3. the MLP: inner neurons grouped (equal weights) and fitted, then fc2 onto the stream
    def inner_rows(c: slice) -> list[torch.Tensor]:
        return [
            rows(b.fc1(b.ln2(_mid_stream(b, t[c]))))
            for b, t in zip(bases, base_tokens, strict=True)
        ]

    sample = [torch.cat(z) for z in zip(*(inner_rows(c) for c in parts), strict=True)]
    inner_labels, _ = group_targets(
        sample,
        torch.ones(sum(z.shape[1] for z in sample), device=x.device),
        level.fc1.out_features,
        None,
        group,
    )
    del sample
    ones = torch.ones(len(inner_labels), device=x.device)

    def inner_targets(c: slice) -> torch.Tensor:
        return group_targets(inner_rows(c), ones, level.fc1.out_features, inner_labels, group)[1]

    fit, _, _ = fit_rows(
        lambda c: with_ones(rows(_normalised(mid[c], level.ln2))), inner_targets, parts
    )
    AffineLevel([], level.fc1).set_weights(fit.weights.float())
    details["fc1"] = fit.ridge

    def out_targets(c: slice) -> torch.Tensor:
        outs = [output_rows(b(i[c])) for b, i in zip(bases, base_inputs, strict=True)]
        _, centres = group_targets(outs, weights, k, labels, group)
        return centres - rows(mid[c]).to(centres.dtype)

    fit, _, _ = fit_rows(
        lambda c: with_ones(rows(level.gelu(level.fc1(_normalised(mid[c], level.ln2))))),
        out_targets,
        parts,
    )
    AffineLevel([], level.fc2).set_weights(fit.weights.float())
    details["fc2"] = fit.ridge
    return {"sublayers": details, "heads": head_labels.tolist(), "labels": labels}


def _group_heads(
    bases: list[EncoderBlock], base_tokens: list[torch.Tensor], heads: int, group: GroupFn
) -> torch.Tensor:
    """The fused head of each base head (model-major), grouped by their attention maps on the
    first :data:`HEAD_MATCH_SAMPLES` fusion samples (equal weights)."""
    points = []
    for b, t in zip(bases, base_tokens, strict=True):
        maps = _maps(b.attention, b.ln1(t[:HEAD_MATCH_SAMPLES]))  # (n, heads, T, T)
        points.append(maps.transpose(0, 1).flatten(1))
    rows = torch.cat(points).double()
    counts = [b.attention.heads for b in bases]
    return group(rows, torch.ones(len(rows), dtype=rows.dtype, device=rows.device), counts, heads)
