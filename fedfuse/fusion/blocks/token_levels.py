r"""The levels of a user's traced Vision Transformer as fedfuse's ViT levels, and their pieces.

:func:`token_levels` finds the parts :mod:`.graph_attention` reads in a run of graph levels
(the patch embedding, each encoder block's attention and MLP halves, the norm and classifier)
and returns levels over the same modules with fedfuse's ViT interface, tokens channels first
``(N, d, T)`` between them:

* :class:`TokenEmbedding`: one piece, the patch projection and one offset per token, affine in
  the row ``[p_t, e_t]`` (``p_0 = 0``, ``e_t`` the one-hot token), held by the projection and
  the position embedding; the projection's bias and the class token are set to 0 (as
  :class:`~fedfuse.models.vit.PatchEmbedding`'s piece in :mod:`.pieces`);
* :class:`TokenEncoder`: the attention half and the MLP half as one residual level, fitted by the
  five pieces of fedfuse's encoder block (:mod:`.pieces`), which read ``ln1``, ``attention``
  (``q``, ``k``, ``v``: views of the packed ``in_proj``; ``out``; ``heads``), ``ln2``, ``fc1``,
  ``gelu`` (the activation, whatever its kind), ``fc2``;
* :class:`TokenHead`: the class token normalised (the norm's scale and shift fold into the
  classifier, so the fused norm is plain) and the classifier fitted onto it, one piece.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx, nn

from fedfuse.fusion.blocks.attention import as_tokens, plain_norm
from fedfuse.fusion.blocks.graph_attention import (
    odd_node,
    read_attention,
    read_embedding,
    read_head,
    read_mlp,
)
from fedfuse.fusion.blocks.linear_piece import LinearPiece
from fedfuse.models.affine import AffineLevel, output_rows
from fedfuse.models.graph_levels import describe, joined


class _Projection:
    """One of a packed attention projection's three parts (``index``: 0 query, 1 key, 2 value)
    as a linear layer: ``weight`` and ``bias`` are views of the packed parameters, so loading
    or scaling them writes the user's module."""

    def __init__(self, attention: nn.MultiheadAttention, index: int) -> None:
        width = attention.embed_dim
        self.module, self.rows = attention, slice(index * width, (index + 1) * width)
        self.in_features = self.out_features = width

    @property
    def weight(self) -> torch.Tensor:
        return self.module.in_proj_weight.detach()[self.rows]

    @property
    def bias(self) -> torch.Tensor | None:
        bias = self.module.in_proj_bias
        return None if bias is None else bias.detach()[self.rows]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class PackedAttention:
    """``nn.MultiheadAttention`` (batch first, self-attention) with the interface of fedfuse's
    :class:`~fedfuse.models.vit.Attention`: ``heads``, ``q``, ``k``, ``v``, ``out``. Called, it is
    the attention branch as the fits read it, in eval mode (the dropout after it is inactive)."""

    def __init__(self, attention: nn.MultiheadAttention) -> None:
        self.module = attention
        self.heads = attention.num_heads
        self.q, self.k, self.v = (_Projection(attention, i) for i in range(3))
        self.out = attention.out_proj

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.module(tokens, tokens, tokens, need_weights=False)[0]


class TokenLevel(nn.Module):
    """A level of a user's ViT read as one of fedfuse's: ``token_width`` neurons (the stream's
    width), tokens channels first between levels."""

    token_width: int

    def linear_pieces(self) -> list[LinearPiece]:
        raise NotImplementedError


class TokenEmbedding(TokenLevel):
    """The graph levels from the image to the first encoder block, joined (``part``)."""

    def __init__(self, part: fx.GraphModule, projection: str, class_token: str, position: str):
        super().__init__()
        self.part = part
        self.paths = (projection, class_token, position)
        self.token_width = self.projection.out_channels
        self.label = projection

    @property
    def projection(self) -> nn.Conv2d:
        return self.part.get_submodule(self.paths[0])

    @property
    def class_token(self) -> nn.Parameter:
        return operator.attrgetter(self.paths[1])(self.part)

    @property
    def position(self) -> nn.Parameter:
        return operator.attrgetter(self.paths[2])(self.part)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.part(x).transpose(1, 2)

    def linear_pieces(self) -> list[LinearPiece]:
        return [_EMBEDDING]


class TokenEncoder(TokenLevel):
    """An attention level then an MLP level (``x + attn(ln1 x)``, ``+ fc2(act(fc1(ln2 x)))``)."""

    #: output dim ``j`` adds input dim ``j`` (see LeveledModel.is_residual)
    residual = True

    def __init__(self, attention: fx.GraphModule, mlp: fx.GraphModule) -> None:
        super().__init__()
        self.attention_part, self.mlp_part = attention, mlp
        read, parts = read_attention(attention), read_mlp(mlp)
        assert read is not None and parts is not None
        self.paths = (read.norm, read.attention, parts.norm, parts.fc1, parts.fc2)
        self.activation = parts.act
        self.token_width = self.fc2.out_features
        self.label = _common(getattr(attention, "label", ""), getattr(mlp, "label", ""))

    @property
    def ln1(self) -> nn.LayerNorm:
        return self.attention_part.get_submodule(self.paths[0])

    @property
    def attention(self) -> PackedAttention:
        return PackedAttention(self.attention_part.get_submodule(self.paths[1]))

    @property
    def ln2(self) -> nn.LayerNorm:
        return self.mlp_part.get_submodule(self.paths[2])

    @property
    def fc1(self) -> nn.Linear:
        return self.mlp_part.get_submodule(self.paths[3])

    @property
    def fc2(self) -> nn.Linear:
        return self.mlp_part.get_submodule(self.paths[4])

    def gelu(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP's activation (the element-wise nodes between ``fc1`` and ``fc2``)."""
        nodes = {n.name: n for n in self.mlp_part.graph.nodes}
        for name in self.activation:
            node = nodes[name]
            args, kwargs = node.args[1:], dict(node.kwargs)
            if node.op == "call_module":
                x = self.mlp_part.get_submodule(str(node.target))(x)
            elif node.op == "call_method":
                x = getattr(x, str(node.target))(*args, **kwargs)
            else:
                x = node.target(x, *args, **kwargs)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp_part(self.attention_part(as_tokens(x))).transpose(1, 2)


class TokenHead(TokenLevel):
    """The graph levels after the last encoder block, joined: norm, class token, classifier."""

    def __init__(self, part: fx.GraphModule, norm: str, classifier: str) -> None:
        super().__init__()
        self.part, self.paths = part, (norm, classifier)
        self.token_width = self.classifier.out_features
        self.label = classifier

    @property
    def norm(self) -> nn.LayerNorm:
        return self.part.get_submodule(self.paths[0])

    @property
    def classifier(self) -> nn.Linear:
        return self.part.get_submodule(self.paths[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.part(as_tokens(x))

    def linear_pieces(self) -> list[LinearPiece]:
        return [_HEAD]


def token_levels(levels: list[nn.Module]) -> tuple[list[nn.Module], dict[int, int]] | None:
    """``levels`` (a traced model's graph levels) as a :class:`TokenEmbedding`, a
    :class:`TokenEncoder` per block and a :class:`TokenHead`, over the same modules, and the new
    level of each old one; None unless the whole model is such a transformer."""
    starts = [i for i, level in enumerate(levels) if read_attention(level) is not None]
    if not starts or not all(isinstance(level, fx.GraphModule) for level in levels):
        return None
    first, last = starts[0], starts[-1] + 2
    if starts != list(range(first, last, 2)) or first == 0 or last >= len(levels):
        return None
    if any(read_mlp(levels[i + 1]) is None for i in starts):
        return None
    embedding, head = _chain(levels[:first], joined), _chain(levels[last:], joined)
    found, classifier = read_embedding(embedding), read_head(head)
    if found is None or classifier is None:
        return None
    result: list[nn.Module] = [
        TokenEmbedding(embedding, found.projection, found.class_token, found.position)
    ]
    result += [TokenEncoder(levels[i], levels[i + 1]) for i in starts]
    result.append(TokenHead(head, *classifier))
    where = {i: 0 for i in range(first)}
    where |= {i + half: 1 + block for block, i in enumerate(starts) for half in (0, 1)}
    where |= {i: len(result) - 1 for i in range(last, len(levels))}
    return result, where


#: what a part of a user's ViT must be, by the part's name in :func:`~.graph_attention.odd_node`
_PARTS = {
    "embedding": "is no ViT patch embedding (a patch Conv2d on the input, flattened and "
    "permuted to tokens, a class token in front, a position embedding added)",
    "mlp": "is no MLP half of an encoder block (LayerNorm, Linear, an element-wise "
    "activation, Linear, added to its input)",
    "head": "is no ViT head (LayerNorm, the class token, one Linear)",
}


def token_refusal(levels: list[nn.Module]) -> tuple[int, str] | None:
    """Where ``levels`` hold an attention half of an encoder block
    (:func:`~.graph_attention.read_attention`) but are not as :func:`token_levels` reads them:
    the first level of the part that is not, and why (naming its first op no piece takes, when
    one is); else None."""
    starts = [i for i, level in enumerate(levels) if read_attention(level) is not None]
    if not starts or token_levels(levels) is not None:
        return None
    if not all(isinstance(level, fx.GraphModule) for level in levels):
        return None
    for i in starts:
        if i + 1 >= len(levels) or read_mlp(levels[i + 1]) is None:
            return i + 1, _why(levels[i + 1] if i + 1 < len(levels) else None, "mlp")
    for before, after in zip(starts, starts[1:], strict=False):
        if after != before + 2:
            return before + 2, "lies between two encoder blocks, where no piece takes a level"
    first, last = starts[0], starts[-1] + 2
    if first == 0 or read_embedding(_chain(levels[:first], joined)) is None:
        return 0, _why(_chain(levels[:first], joined) if first else None, "embedding")
    return last, _why(_chain(levels[last:], joined) if last < len(levels) else None, "head")


def _why(level: fx.GraphModule | None, part: str) -> str:
    node = odd_node(level, part) if level is not None else None
    if node is None:
        return _PARTS[part]
    return f"{_PARTS[part]}: its node {node.name!r}, {describe(node, level)}, is none of these"


def _chain(levels: list[nn.Module], join) -> fx.GraphModule:
    result = levels[0]
    for level in levels[1:]:
        result = join(result, level)
    return result


def _common(first: str, second: str) -> str:
    return first if first == second else f"{first}+{second}"


# ------------------------------------------------------------------------------ pieces
def _with_ones(rows: torch.Tensor) -> torch.Tensor:
    return torch.cat([rows, rows.new_ones(len(rows), 1)], 1)


def _tokens(level: TokenEmbedding) -> int:
    return level.position.numel() // level.token_width


def _embedding_design(level: nn.Module, x: torch.Tensor) -> torch.Tensor:
    projection = AffineLevel([], level.projection, bias=False)
    fan, tokens = projection.fan_in, _tokens(level)
    patches = projection.design(x).reshape(len(x), tokens - 1, fan)
    rows = patches.new_zeros(len(x), tokens, fan + tokens)
    rows[:, 1:, :fan] = patches
    rows[:, :, fan:] = torch.eye(tokens, dtype=rows.dtype, device=rows.device)
    return rows.reshape(-1, fan + tokens)


@torch.no_grad()
def _load_embedding(level: nn.Module, w: torch.Tensor, _gram: torch.Tensor) -> None:
    conv, position = level.projection, level.position
    fan = conv.weight[0].numel()
    conv.weight.copy_(w[:fan].T.reshape(conv.weight.shape).to(conv.weight))
    if conv.bias is not None:
        conv.bias.zero_()
    level.class_token.zero_()
    position.copy_(w[fan:].reshape(position.shape).to(position))


@torch.no_grad()
def _load_head(level: nn.Module, w: torch.Tensor, _gram: torch.Tensor) -> None:
    level.norm.weight.fill_(1.0)
    level.norm.bias.zero_()
    AffineLevel([], level.classifier).set_weights(w)


_EMBEDDING = LinearPiece(
    "projection+position",
    design=_embedding_design,
    target=lambda m, x: output_rows(m(x)),
    fan_in=lambda m: m.projection.weight[0].numel() + _tokens(m),
    width=lambda m: m.token_width,
    load=_load_embedding,
)

_HEAD = LinearPiece(
    "classifier",
    design=lambda m, x: _with_ones(plain_norm(as_tokens(x)[:, 0], m.norm)),
    target=lambda m, x: output_rows(m(x)),
    fan_in=lambda m: m.classifier.in_features + 1,
    width=lambda m: m.classifier.out_features,
    load=_load_head,
)


__all__ = [
    "PackedAttention",
    "TokenEmbedding",
    "TokenEncoder",
    "TokenHead",
    "TokenLevel",
    "token_levels",
    "token_refusal",
]
