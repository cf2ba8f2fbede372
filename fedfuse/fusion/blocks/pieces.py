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
* A **ViT patch embedding** is one: token ``t >= 1`` is ``W p_t + b + pos_t`` (``p_t`` its
  patch), the class token ``cls + pos_0``, affine in the row ``[p_t, e_t]`` (``p_0 = 0``,
  ``e_t`` the one-hot token): the projection and one offset per token (held by the position
  embedding; bias and class token 0).
* A **ViT encoder block** ``a = x + O(attn(LN_1 x))``, ``y = a + fc_2(gelu(fc_1(LN_2 a)))`` is
  five, on tokens as rows. The LayerNorms' scale and shift fold into the linears after them, so
  the fused norms are plain normalisations and each linear reads normalised tokens with a 1
  (``ñ``).

  1. ``q+k`` (kind ``"logits"``). Softmax is not affine, but the logits are bilinear: head ``g``
     of model ``m`` has logits ``ñ^{(m)} B_{mg} ñ^{(m)T}``, ``B = W̃_q^T W̃_k / sqrt(d_h)``
     (biases in the last row and column). Regressing the model's queries and keys on the fused
     ``ñ`` (the piece's targets; on the fusion set, or each site's translation on its data)
     gives ``ñ^{(m)} W̃^T ≈ ñ Ŵ``, so its logits are ``≈ ñ B̂_{mg} ñ^T``: forms in one
     coordinate system, which can be compared and averaged. With ``H H^T = ñ^T ñ / R`` the
     design's second moment, ``||H^T (B̂ - B̂') H||`` is the logits' distance on the data.
     Heads are grouped across models (Hungarian or k-means, equal weights) by their attention
     maps where the server holds the data (the fusion set), else by that distance, and fused head
     ``c`` takes its group's mean form (the softmax of mean logits: the normalised geometric
     mean of the maps), cut to the head's rank where the data measures it: from the SVD
     ``H^T B_c H = U S V^T``, ``W̃_q^T = d_h^{1/4} H^+ U_r S_r^{1/2}``, ``W̃_k^T`` with ``V_r``
     (:func:`attention_logits`).
  2. ``v+out``: given the fused maps ``P_c``, the attention output ``sum_c P_c ñ A_c + b_o`` is
     linear in ``A_c = W_{v,c}^T W_{o,c}^T`` (rank ``d_h``), fitted jointly to the stream's
     groups after attention minus the stream; each ``A_c`` is cut to its rank where its own
     design ``P_c ñ`` measures it, and the left factor is ``W_v`` (:func:`value_weights`).
     ``V``'s bias is 0: each row of ``P_c`` sums to one, so it would only add a constant.
  3. ``out``: ``O`` refitted given ``V``, which recovers what the cut lost.
  4. ``fc1``: the MLP's pre-activations (inner neurons, equal weights) from ``LN_2(a)``.
  5. ``fc2``: the block output's groups minus ``a`` from ``gelu(fc_1)``.

  The fit sets the products ``W_q^T W_k`` and ``W_o W_v``, not how their factors share the
  scale; once a block's attention is fitted, its factors are balanced channel by channel
  (:func:`~fedfuse.models.symmetry.balance_attention`, the same function), so that a fused
  model can be trained further.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from fedfuse.fusion.blocks.least_squares import gram_spectrum
from fedfuse.models.affine import AffineLevel, affine_view, output_rows
from fedfuse.models.resnet import BasicBlock, Stem
from fedfuse.models.symmetry import balance_query_key, balance_value_output
from fedfuse.models.vit import Attention, EncoderBlock, PatchEmbedding

Rows = Callable[[nn.Module, torch.Tensor], torch.Tensor]
#: ``group(points, weights, widths, k)``: the fused neuron (or head) of each base one, points
#: as rows, model by model
GroupFn = Callable[[torch.Tensor, torch.Tensor, list[int], int], torch.Tensor]
_Fused = TypeVar("_Fused")


@dataclass(frozen=True)
class LinearPiece:
    """One linear map of a level, fitted in closed form.

    Attributes:
        name: the piece's name in fit details (``"conv1"``, ``"conv2+shortcut"``, ``"q+k"``).
        design: ``(level, level input) -> rows``: the piece's inputs with a trailing 1 (an
            affine level's: only when its layer has a bias).
        target: ``(level, level input) -> rows``: the piece's outputs on that level.
        fan_in, width: the design's columns and the outputs' count on a level.
        load: ``(level, W, gram)``: write fitted weights, ``gram`` the design's ``X^T X``.
        stream: ``(level, level input) -> rows`` added to the piece's outputs (a residual
            stream), so the fit's targets are the centres minus it; None when nothing is.
        inner: its neurons are hidden inside the level (no importance scores: equal weights).
        kind: ``"neurons"`` (group the outputs, fit their centres) or ``"logits"`` (attention
            queries and keys, fitted by :func:`attention_logits`).
    """

    name: str
    design: Rows
    target: Rows
    fan_in: Callable[[nn.Module], int]
    width: Callable[[nn.Module], int]
    load: Callable[[nn.Module, torch.Tensor, torch.Tensor], None]
    stream: Rows | None = None
    inner: bool = False
    kind: str = "neurons"


def linear_pieces(level: nn.Module) -> list[LinearPiece] | None:
    """The pieces of ``level``, bottom-up; None for a level that is none of the kinds above."""
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


def pre_output(block: BasicBlock, x: torch.Tensor) -> torch.Tensor:
    """A block's pre-activation output ``BN_2(conv_2(h)) + s(x)`` (before its last ReLU)."""
    h = block.relu1(block.bn1(block.conv1(x)))
    return block.bn2(block.conv2(h)) + block.shortcut(x)


def set_batchnorm(
    norm: nn.BatchNorm2d,
    bias: torch.Tensor,
    moments: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """``norm`` as the map ``y + bias`` in eval mode.

    With ``moments``, the mean and variance of its input ``y`` on the fitted rows, they become
    its running statistics and its scale and shift absorb them (``sqrt(var + eps)``, ``bias +
    mean``): the same eval-mode map, and in train mode a batch like those rows is normalised as
    in eval mode, so the fused model can be trained further. Without them: mean 0, variance
    ``1 - eps``, scale 1."""
    with torch.no_grad():
        if moments is None:
            norm.running_mean.zero_()
            norm.running_var.fill_(1.0 - norm.eps)
            norm.weight.fill_(1.0)
            norm.bias.copy_(bias.to(norm.bias.dtype))
            return
        mean, var = (m.to(norm.running_mean.device, torch.float64) for m in moments)
        norm.running_mean.copy_(mean)
        norm.running_var.copy_(var)
        norm.weight.copy_((var + norm.eps).sqrt())
        norm.bias.copy_(bias.to(norm.bias.device, torch.float64) + mean)


def output_moments(
    w: torch.Tensor, gram: torch.Tensor, columns: slice
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per-output mean and variance over the design's rows of ``X[:, columns] @ w[columns]``
    (one conv's output before its BatchNorm), from the Gram ``X^T X`` of a design whose last
    column is the ones (its corner is the row count). None when the Gram has no such column."""
    if gram.shape != (len(w), len(w)) or not gram[-1, -1] > 0:
        return None
    gram, part = gram.double(), w[columns].double().to(gram.device)
    count = gram[-1, -1]
    mean = gram[-1, columns] @ part / count
    second = ((gram[columns, columns] @ part) * part).sum(0) / count
    return mean, (second - mean * mean).clamp_min(0)


#: :func:`whitener`'s default cut: eigenvalues below it times the Gram's mean eigenvalue are
#: dropped (the zero-shot fit; ``whiten_rcond`` of the closed-form methods)
WHITEN_RCOND = 1e-8
_whiten_rcond: ContextVar[float] = ContextVar("whiten_rcond", default=WHITEN_RCOND)


@contextmanager
def whitening_cutoff(rcond: float) -> Iterator[None]:
    """Within the block, :func:`whitener` drops eigen-directions below ``rcond`` times the
    mean eigenvalue. Whitening gives every kept direction of a design equal weight, so the
    factors fitted through it (attention's queries, keys and values) grow large along
    directions the data barely excites; they leave the function on the data alone but turn a
    training step into a large change. A cut near ``1e-3`` keeps them small at a small cost in
    the zero-shot fit (``docs/results.md``)."""
    token = _whiten_rcond.set(rcond)
    try:
        yield
    finally:
        _whiten_rcond.reset(token)


def uses_whitening_cutoff(fuse: Callable[..., _Fused]) -> Callable[..., _Fused]:
    """Decorate a fusion method's ``_fuse``: the pieces it fits whiten with the method's own
    ``whiten_rcond`` (:func:`whitening_cutoff`)."""

    @functools.wraps(fuse)
    def fuse_with_cutoff(self: Any, *args: Any, **kwargs: Any) -> _Fused:
        with whitening_cutoff(self.whiten_rcond):
            return fuse(self, *args, **kwargs)

    return fuse_with_cutoff


def whitener(gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(H, H^+)``: ``H H^T = gram`` on its range and ``H^+`` its pseudo-inverse transposed; a
    map ``M`` cut as ``H^T M`` is cut where the data measures its error (``||X M||``). The
    range is cut at :func:`whitening_cutoff`'s ``rcond``."""
    spectrum = gram_spectrum(gram, rows=1, rcond=_whiten_rcond.get())
    root = spectrum.values.sqrt()
    return spectrum.vectors * root, spectrum.vectors / root


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
        maps = _maps(block.attention, block.ln1(_tokens(x)))  # (n, heads, T, T)
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


def _rows(tokens: torch.Tensor) -> torch.Tensor:
    return tokens.reshape(-1, tokens.shape[-1])


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """Channels-first level input ``(N, d, T)`` as tokens ``(N, T, d)``."""
    return x.transpose(1, 2)


def _normalised(tokens: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    """``norm`` without its scale and shift (the fused norms are plain)."""
    return F.layer_norm(tokens, norm.normalized_shape, eps=norm.eps)


def _split(attention: Attention, y: torch.Tensor) -> torch.Tensor:
    n, t, d = y.shape
    return y.view(n, t, attention.heads, d // attention.heads).transpose(1, 2)


def _maps(attention: Attention, normed: torch.Tensor) -> torch.Tensor:
    """Attention probabilities ``(n, heads, T, T)`` on normalised tokens."""
    q, k = _split(attention, attention.q(normed)), _split(attention, attention.k(normed))
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1)


def _mid(block: EncoderBlock, x: torch.Tensor) -> torch.Tensor:
    """The stream after a block's attention, ``x + attn(ln_1 x)``, as tokens (the block's own
    norms: plain on the fused block, the model's on a base one)."""
    tokens = _tokens(x)
    return tokens + block.attention(block.ln1(tokens))


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
    normed = _normalised(_tokens(x), level.ln1)
    per_head = _maps(level.attention, normed) @ normed[:, None]  # (n, heads, T, d)
    return _with_ones(_rows(per_head.transpose(1, 2).flatten(2)))


def _load_values(level: nn.Module, w: torch.Tensor, gram: torch.Tensor) -> None:
    attention = level.attention
    size = attention.v.out_features // attention.heads
    values = value_weights(w, gram, attention.heads, size)
    AffineLevel([], attention.v).set_weights(values.to(w.dtype))


def _head_outputs(level: nn.Module, x: torch.Tensor) -> torch.Tensor:
    attention = level.attention
    normed = _normalised(_tokens(x), level.ln1)
    values = _split(attention, attention.v(normed))
    return _with_ones(_rows((_maps(attention, normed) @ values).transpose(1, 2).flatten(2)))


def _load_output(level: nn.Module, w: torch.Tensor, _gram: torch.Tensor) -> None:
    AffineLevel([], level.attention.out).set_weights(w)
    balance_value_output(level.attention)  # the values were fitted by the piece before


def _hidden(level: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return level.gelu(level.fc1(_normalised(_mid(level, x), level.ln2)))


def _set(name: str) -> Callable[[nn.Module, torch.Tensor, torch.Tensor], None]:
    def load(level: nn.Module, w: torch.Tensor, _gram: torch.Tensor) -> None:
        AffineLevel([], dict(level.named_modules())[name]).set_weights(w)

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
        design=lambda m, x: _with_ones(_rows(_normalised(_tokens(x), m.ln1))),
        target=lambda m, x: torch.cat(
            [
                _rows(m.attention.q(m.ln1(_tokens(x)))),
                _rows(m.attention.k(m.ln1(_tokens(x)))),
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
        target=lambda m, x: _rows(_mid(m, x)),
        fan_in=lambda m: m.attention.heads * m.attention.q.in_features + 1,
        width=_stream_width,
        load=_load_values,
        stream=lambda m, x: _rows(_tokens(x)),
    ),
    LinearPiece(
        "out",
        design=_head_outputs,
        target=lambda m, x: _rows(_mid(m, x)),
        fan_in=lambda m: m.attention.v.out_features + 1,
        width=_stream_width,
        load=_load_output,
        stream=lambda m, x: _rows(_tokens(x)),
    ),
    LinearPiece(
        "fc1",
        design=lambda m, x: _with_ones(_rows(_normalised(_mid(m, x), m.ln2))),
        target=lambda m, x: _rows(m.fc1(m.ln2(_mid(m, x)))),
        fan_in=lambda m: m.fc1.in_features + 1,
        width=lambda m: m.fc1.out_features,
        load=_set("fc1"),
        inner=True,
    ),
    LinearPiece(
        "fc2",
        design=lambda m, x: _with_ones(_rows(_hidden(m, x))),
        target=lambda m, x: output_rows(m(x)),
        fan_in=lambda m: m.fc2.in_features + 1,
        width=_stream_width,
        load=_set("fc2"),
        stream=lambda m, x: _rows(_mid(m, x)),
    ),
)


__all__ = [
    "GroupFn",
    "LinearPiece",
    "attention_logits",
    "attention_map_points",
    "linear_pieces",
    "output_moments",
    "pre_output",
    "set_batchnorm",
    "value_weights",
    "whitener",
    "uses_whitening_cutoff",
    "whitening_cutoff",
]
