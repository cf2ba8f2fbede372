r"""The linear pieces of a level: what a closed-form fit solves for, one least-squares problem each.

The fusion-set fits (:mod:`fedfuse.fusion.methods.neuron_interpolation.blocks`) and the sites'
statistics rounds (:mod:`fedfuse.fusion.statistics.rounds`) share these definitions. Each piece
builds its design rows from the fused level's input (the pieces before it already fitted), its
targets (what it should reproduce) from any model's level and that level's input, and loads
fitted weights ``W`` (``fan_in x width``, the bias last) given the design's Gram.

* An **affine level** (parameter-free ops then one Linear/Conv2d) is one piece; its design has
  the trailing 1 (and ``W`` the bias row) exactly when the layer has a bias, so a bias-free
  layer is fitted without intercept.
* A **ResNet stem** is one: its conv with the BatchNorm after it folded in (eval mode,
  ``BN(y) = a y + b``). A **BasicBlock** is two: ``conv1`` onto the inner channels, then
  ``conv2`` (jointly with a projection shortcut's conv) onto the output channels; an identity
  shortcut's input is the *stream* the outputs add to, subtracted from the targets. A fitted
  BatchNorm holds the affine map it stands for (conv output plus the fitted bias), with its
  input's mean and variance on the fitted rows (read off the design's Gram) as running
  statistics, so train mode starts from the same function; the targets are pre-activations
  (ReLU is monotone, and the fit stays linear).
* A **graph level** of a user's traced model (a conv with its BatchNorm, torchvision's
  ``BasicBlock`` with its ``downsample``) is read off its graph as the same kinds of pieces
  (:mod:`.graph_pieces`); a user's traced Vision Transformer (torchvision's
  ``VisionTransformer``) as fedfuse's ViT levels (:mod:`.token_levels`), whose encoder blocks
  are fitted by the encoder pieces below.
* A **ViT patch embedding** is one: token ``t >= 1`` is ``W p_t + b + pos_t`` (``p_t`` its
  patch), the class token ``cls + pos_0``, affine in the row ``[p_t, e_t]`` (``p_0 = 0``,
  ``e_t`` the one-hot token): the projection and one offset per token (held by the position
  embedding; bias and class token 0).
* A **ViT encoder block** ``a = x + O(attn(LN_1 x))``, ``y = a + fc_2(gelu(fc_1(LN_2 a)))`` is
  five, on tokens as rows. The LayerNorms' scale and shift fold into the linears after them, so
  the fused norms are plain normalisations and each linear reads normalised tokens with a 1
  (``ñ``).

  1. ``q+k`` (kind ``"logits"``): the heads' queries and keys, fitted through their logits'
     bilinear forms, grouped across models and averaged (:func:`~.attention.attention_logits`).
  2. ``v+out``: the products of values and output, fitted jointly given the fused maps, the
     values cut to each head's rank (:func:`~.attention.value_weights`).
  3. ``out``: ``O`` refitted given ``V``, which recovers what the cut lost.
  4. ``fc1``: the MLP's pre-activations (inner neurons, equal weights) from ``LN_2(a)``.
  5. ``fc2``: the block output's groups minus ``a`` from ``gelu(fc_1)``.

  The fit sets the products ``W_q^T W_k`` and ``W_o W_v``, not how their factors share the
  scale; once a block's attention is fitted, its factors are balanced channel by channel
  (:func:`~fedfuse.models.symmetry.balance_attention`, the same function), so that a fused
  model can be trained further.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from fedfuse.fusion.blocks.attention import (
    as_tokens,
    attention_maps,
    plain_norm,
    split_heads,
    token_rows,
    value_weights,
)
from fedfuse.fusion.blocks.graph_pieces import block_pieces, read_block
from fedfuse.fusion.blocks.linear_piece import LinearPiece, Rows, output_moments, set_batchnorm
from fedfuse.fusion.blocks.token_levels import TokenEncoder, TokenLevel
from fedfuse.models import LeveledModel
from fedfuse.models.affine import AffineLevel, affine_view, fit_intercept, output_rows
from fedfuse.models.resnet import BasicBlock, Stem
from fedfuse.models.symmetry import balance_query_key, balance_value_output
from fedfuse.models.vit import EncoderBlock, PatchEmbedding


def linear_pieces(level: nn.Module) -> list[LinearPiece] | None:
    """The pieces of ``level``, bottom-up; None for a level that is none of the kinds above
    (a graph level of a user's model: :mod:`.graph_pieces`)."""
    block = read_block(level)
    if block is not None:
        return block_pieces(block)
    if isinstance(level, TokenEncoder):  # a user's ViT block: fedfuse's block's pieces
        return list(_ENCODER)
    if isinstance(level, TokenLevel):
        return level.linear_pieces()
    if isinstance(level, Stem):
        return [_conv_piece("conv", ("conv",), "bn", lambda m, x: m.bn(m.conv(x)))]
    if isinstance(level, BasicBlock):
        inner = _conv_piece("conv1", ("conv1",), "bn1", lambda m, x: m.bn1(m.conv1(x)), True)
        if level.identity_shortcut:
            output = _conv_piece("conv2", ("conv2",), "bn2", pre_output, stream=_identity)
        else:
            output = _conv_piece("conv2+shortcut", ("conv2", "shortcut.0"), "bn2", pre_output)
        return [inner, output]
    if isinstance(level, PatchEmbedding):
        return [_EMBEDDING]
    if isinstance(level, EncoderBlock):
        return list(_ENCODER)
    if affine_view(level) is None:
        return None
    return [
        LinearPiece(
            "affine",
            design=lambda m, x: _affine(m).design(x),
            target=lambda m, x: output_rows(m(x)),
            fan_in=lambda m: _affine(m).fan_in,
            width=lambda m: _affine(m).layer.weight.shape[0],
            load=lambda m, w, _gram: _affine(m).set_weights(w),
        )
    ]


def check_affine_intercept(
    model: LeveledModel, index: int, fit_bias: bool | str, name: str
) -> None:
    """Where level ``index`` of ``model`` is affine, raise ValueError (naming ``name`` and the
    level) unless its layer can be fitted as ``fit_bias`` says
    (:func:`~fedfuse.models.affine.fit_intercept`); other levels' pieces always have one."""
    view = affine_view(model.levels[index])
    if view is not None:
        fit_intercept(view.layer, fit_bias, where=f"{name}: level {model.level_name(index)}")


def pre_output(block: BasicBlock, x: torch.Tensor) -> torch.Tensor:
    """A block's pre-activation output ``BN_2(conv_2(h)) + s(x)`` (before its last ReLU)."""
    h = block.relu1(block.bn1(block.conv1(x)))
    return block.bn2(block.conv2(h)) + block.shortcut(x)


# ------------------------------------------------------------------------------ ResNet
def _identity(_level: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An identity shortcut's contribution: the level input itself, as rows."""
    return output_rows(x)


def _affine(level: nn.Module) -> AffineLevel:
    """The level's affine view, with an intercept exactly when its layer has a bias."""
    view = affine_view(level)
    assert view is not None
    return replace(view, bias=view.layer.bias is not None)


def _conv_piece(
    name: str,
    convs: tuple[str, ...],
    norm: str,
    target: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    inner: bool = False,
    stream: Rows | None = None,
) -> LinearPiece:
    """Convs whose outputs add up, then BatchNorm ``norm`` (the bias); ``conv2`` reads the
    block's ``h``, the other convs the level input."""

    def modules(level: nn.Module) -> list[nn.Conv2d]:
        found = dict(level.named_modules())
        return [found[c] for c in convs]

    def design(level: nn.Module, x: torch.Tensor) -> torch.Tensor:
        parts = []
        for conv_name, conv in zip(convs, modules(level), strict=True):
            inputs = level.relu1(level.bn1(level.conv1(x))) if conv_name == "conv2" else x
            parts.append(AffineLevel([], conv, bias=False).design(inputs))
        return _with_ones(torch.cat(parts, 1))

    def load(level: nn.Module, w: torch.Tensor, gram: torch.Tensor) -> None:
        start, columns = 0, []
        with torch.no_grad():
            for conv in modules(level):
                size = conv.weight[0].numel()
                conv.weight.copy_(w[start : start + size].T.reshape(conv.weight.shape))
                columns.append(slice(start, start + size))
                start += size
        set_batchnorm(getattr(level, norm), w[-1], output_moments(w, gram, columns[0]))
        if "shortcut.0" in convs:
            shortcut_norm = level.shortcut[1]
            zero = torch.zeros(shortcut_norm.num_features)
            set_batchnorm(shortcut_norm, zero, output_moments(w, gram, columns[1]))

    return LinearPiece(
        name,
        design=design,
        target=lambda m, x: output_rows(target(m, x)),
        fan_in=lambda m: sum(c.weight[0].numel() for c in modules(m)) + 1,
        width=lambda m: modules(m)[0].out_channels,
        load=load,
        stream=stream,
        inner=inner,
    )


# ------------------------------------------------------------------------------ ViT
def _with_ones(rows: torch.Tensor) -> torch.Tensor:
    return torch.cat([rows, rows.new_ones(len(rows), 1)], 1)


def _mid(block: EncoderBlock, x: torch.Tensor) -> torch.Tensor:
    """The stream after a block's attention, ``x + attn(ln_1 x)``, as tokens (the block's own
    norms: plain on the fused block, the model's on a base one)."""
    tokens = as_tokens(x)
    return tokens + block.attention(block.ln1(tokens))


def _mid_rows(level: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The stream after a block's attention as rows: the attention pieces' targets."""
    return token_rows(_mid(level, x))


def _input_rows(_level: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A block's input tokens as rows: the stream the attention pieces add to."""
    return token_rows(as_tokens(x))


def _embedding_design(level: nn.Module, x: torch.Tensor) -> torch.Tensor:
    images = F.pad(x, level.padding) if any(level.padding) else x
    tokens = level.position.shape[1]
    projection = AffineLevel([], level.projection, bias=False)
    fan = projection.fan_in
    patches = projection.design(images).reshape(len(images), tokens - 1, fan)
    rows = patches.new_zeros(len(images), tokens, fan + tokens)
    rows[:, 1:, :fan] = patches
    rows[:, :, fan:] = torch.eye(tokens, dtype=rows.dtype, device=rows.device)
    return rows.reshape(-1, fan + tokens)


def _load_embedding(level: nn.Module, w: torch.Tensor, _gram: torch.Tensor) -> None:
    fan = level.projection.weight[0].numel()
    with torch.no_grad():
        w = w.to(level.position.dtype)
        level.projection.weight.copy_(w[:fan].T.reshape(level.projection.weight.shape))
        level.projection.bias.zero_()
        level.class_token.zero_()
        level.position.copy_(w[fan:].T)


def _load_logits(level: nn.Module, w: torch.Tensor, _gram: torch.Tensor) -> None:
    width = level.attention.q.out_features
    for norm in (level.ln1, level.ln2):
        with torch.no_grad():
            norm.weight.fill_(1.0)
            norm.bias.zero_()
    AffineLevel([], level.attention.q).set_weights(w[:, :width])
    AffineLevel([], level.attention.k).set_weights(w[:, width:])
    balance_query_key(level.attention)  # the values and output are the next pieces' to fit


def _head_values(level: nn.Module, x: torch.Tensor) -> torch.Tensor:
    normed = plain_norm(as_tokens(x), level.ln1)
    per_head = attention_maps(level.attention, normed) @ normed[:, None]  # (n, heads, T, d)
    return _with_ones(token_rows(per_head.transpose(1, 2).flatten(2)))


def _load_values(level: nn.Module, w: torch.Tensor, gram: torch.Tensor) -> None:
    attention = level.attention
    size = attention.v.out_features // attention.heads
    values = value_weights(w, gram, attention.heads, size)
    AffineLevel([], attention.v).set_weights(values.to(w.dtype))


def _head_outputs(level: nn.Module, x: torch.Tensor) -> torch.Tensor:
    attention = level.attention
    normed = plain_norm(as_tokens(x), level.ln1)
    values = split_heads(attention, attention.v(normed))
    heads = attention_maps(attention, normed) @ values
    return _with_ones(token_rows(heads.transpose(1, 2).flatten(2)))


def _load_output(level: nn.Module, w: torch.Tensor, _gram: torch.Tensor) -> None:
    AffineLevel([], level.attention.out).set_weights(w)
    balance_value_output(level.attention)  # the values were fitted by the piece before


def _hidden(level: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return level.gelu(level.fc1(plain_norm(_mid(level, x), level.ln2)))


def _set(name: str) -> Callable[[nn.Module, torch.Tensor, torch.Tensor], None]:
    def load(level: nn.Module, w: torch.Tensor, _gram: torch.Tensor) -> None:
        AffineLevel([], getattr(level, name)).set_weights(w)

    return load


def _stream_width(level: nn.Module) -> int:
    return level.fc2.out_features


_EMBEDDING = LinearPiece(
    "projection+position",
    design=_embedding_design,
    target=lambda m, x: output_rows(m(x)),
    fan_in=lambda m: m.projection.weight[0].numel() + m.position.shape[1],
    width=lambda m: m.position.shape[0],
    load=_load_embedding,
)

_ENCODER = (
    LinearPiece(
        "q+k",
        design=lambda m, x: _with_ones(token_rows(plain_norm(as_tokens(x), m.ln1))),
        target=lambda m, x: torch.cat(
            [
                token_rows(m.attention.q(m.ln1(as_tokens(x)))),
                token_rows(m.attention.k(m.ln1(as_tokens(x)))),
            ],
            1,
        ),
        fan_in=lambda m: m.attention.q.in_features + 1,
        width=lambda m: 2 * m.attention.q.out_features,
        load=_load_logits,
        kind="logits",
    ),
    LinearPiece(
        "v+out",
        design=_head_values,
        target=_mid_rows,
        fan_in=lambda m: m.attention.heads * m.attention.q.in_features + 1,
        width=_stream_width,
        load=_load_values,
        stream=_input_rows,
    ),
    LinearPiece(
        "out",
        design=_head_outputs,
        target=_mid_rows,
        fan_in=lambda m: m.attention.v.out_features + 1,
        width=_stream_width,
        load=_load_output,
        stream=_input_rows,
    ),
    LinearPiece(
        "fc1",
        design=lambda m, x: _with_ones(token_rows(plain_norm(_mid(m, x), m.ln2))),
        target=lambda m, x: token_rows(m.fc1(m.ln2(_mid(m, x)))),
        fan_in=lambda m: m.fc1.in_features + 1,
        width=lambda m: m.fc1.out_features,
        load=_set("fc1"),
        inner=True,
    ),
    LinearPiece(
        "fc2",
        design=lambda m, x: _with_ones(token_rows(_hidden(m, x))),
        target=lambda m, x: output_rows(m(x)),
        fan_in=lambda m: m.fc2.in_features + 1,
        width=_stream_width,
        load=_set("fc2"),
        stream=_mid_rows,
    ),
)


__all__ = [
    "LinearPiece",
    "check_affine_intercept",
    "linear_pieces",
    "output_moments",
    "pre_output",
    "set_batchnorm",
]
