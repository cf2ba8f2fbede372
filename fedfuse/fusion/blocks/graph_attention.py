r"""A user's traced Vision Transformer read as fedfuse's own ViT levels, so the same pieces fit it.

The graph cut (:mod:`fedfuse.models.graph_levels`) leaves a pre-norm transformer, as
torchvision's ``VisionTransformer`` is written, as a run of graph levels on tokens ``(N, T, d)``:
the patch embedding (a patch ``Conv2d``, its output flattened to ``(N, d, patches)`` and
permuted to tokens, a class token ``cat`` in front, a position embedding added), then per
encoder block two levels, each adding a branch to the stream it reads,

* ``x + drop(attn(LN x, LN x, LN x)[0])``: a ``LayerNorm`` then ``nn.MultiheadAttention``
  self-attention (batch first, packed ``in_proj``), and
* ``x + drop(fc_2(act(fc_1(LN x))))``: a ``LayerNorm`` then ``Linear``, an element-wise
  activation, ``Linear``,

then a ``LayerNorm``, the class token's row and the classifier ``Linear``. Each part is found in
the graph by what its nodes compute (the modules' classes and the functions applied), not by
the names of the user's classes; nodes that compute no value the output reads (shape checks,
``torch._assert``) are ignored, every other node must be one of the part's.

Each reader returns the paths of the part's modules and parameters, or None; what is done with
them (levels with fedfuse's ViT interface, fitted by the same pieces) is
:mod:`.token_levels`'. A run that is not of this shape is left as it is (the methods then refuse
its first level no piece takes, naming it and its op).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx, nn

from fedfuse.models.channel_ops import ACTIVATION_FUNCTIONS
from fedfuse.models.graph_levels import output_shape

_ADDS = (operator.add, operator.iadd, torch.add)
#: parameter-free modules that act on every entry alike (activations, dropout): no pooling
_ELEMENTWISE = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.Softplus,
    nn.Hardtanh, nn.Mish, nn.Dropout, nn.Identity,
)  # fmt: skip
_DROPOUTS = (nn.Dropout, nn.Identity)


# ------------------------------------------------------------------------- graph reading
def live_nodes(level: fx.GraphModule) -> set[fx.Node]:
    """The nodes whose values the level's output reads (placeholders and the output excluded)."""
    result = next(n for n in level.graph.nodes if n.op == "output")
    seen: set[fx.Node] = set()
    stack = list(result.all_input_nodes)
    while stack:
        node = stack.pop()
        if node in seen or node.op == "placeholder":
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return seen


def _module(level: fx.GraphModule, node: fx.Node, kinds: tuple[type, ...]) -> nn.Module | None:
    if node.op != "call_module":
        return None
    module = level.get_submodule(str(node.target))
    return module if isinstance(module, kinds) else None


def _skip(level: fx.GraphModule, node: fx.Node, kinds: tuple[type, ...]) -> tuple[fx.Node, list]:
    """Walk up from ``node`` through single-input modules of ``kinds``: the first other node and
    the nodes passed (bottom-up)."""
    passed = []
    while _module(level, node, kinds) is not None and len(node.all_input_nodes) == 1:
        passed.append(node)
        node = node.all_input_nodes[0]
    return node, passed


def _elementwise(level: fx.GraphModule, node: fx.Node) -> bool:
    if len(node.all_input_nodes) != 1 or not isinstance(node.args[0], fx.Node):
        return False
    if node.op == "call_module":
        return _module(level, node, _ELEMENTWISE) is not None and not node.kwargs
    if node.op in ("call_function", "call_method"):
        return node.target in ACTIVATION_FUNCTIONS or node.target is F.dropout
    return False


def _norm(level: fx.GraphModule, node: fx.Node, source: fx.Node) -> str | None:
    """The path of the affine ``LayerNorm`` over the last dim that ``node`` applies to
    ``source``, else None."""
    norm = _module(level, node, (nn.LayerNorm,))
    if norm is None or node.args != (source,) or node.kwargs:
        return None
    return str(node.target) if norm.elementwise_affine and len(norm.normalized_shape) == 1 else None


def _residual_branch(level: fx.GraphModule) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """``(input, add, branch)`` when the level's output adds a branch to its input."""
    nodes = list(level.graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    out = next(n for n in nodes if n.op == "output").args[0]
    if len(inputs) != 1 or not isinstance(out, fx.Node) or out.target not in _ADDS:
        return None
    operands = [a for a in out.args if isinstance(a, fx.Node)]
    if len(out.args) != 2 or len(operands) != 2 or out.kwargs or inputs[0] not in operands:
        return None
    branch = operands[1] if operands[0] is inputs[0] else operands[0]
    return (inputs[0], out, branch) if branch is not inputs[0] else None


@dataclass(frozen=True)
class _Attention:
    norm: str
    attention: str


@dataclass(frozen=True)
class _Mlp:
    norm: str
    fc1: str
    act: tuple[str, ...]  # the activation's nodes, in order
    fc2: str


def read_attention(level: nn.Module) -> _Attention | None:
    """``x + drop(MHA(LN x, LN x, LN x)[0])``, the attention half of a pre-norm block."""
    if not isinstance(level, fx.GraphModule) or (found := _residual_branch(level)) is None:
        return None
    source, add, branch = found
    getitem, dropouts = _skip(level, branch, _DROPOUTS)
    if getitem.op != "call_function" or getitem.target is not operator.getitem:
        return None
    call = getitem.args[0]
    if getitem.args[1:] != (0,) or not isinstance(call, fx.Node):
        return None
    attention = _module(level, call, (nn.MultiheadAttention,))
    if attention is None or not _self_attention(attention, call):
        return None
    norm = _norm(level, call.args[0], source) if isinstance(call.args[0], fx.Node) else None
    if norm is None:
        return None
    extra = {n for n in call.users if n is not getitem and n.users}
    if extra or live_nodes(level) != {add, getitem, call, call.args[0], *dropouts}:
        return None
    return _Attention(norm, str(call.target))


def _self_attention(attention: nn.MultiheadAttention, call: fx.Node) -> bool:
    """Batch-first self-attention with one packed projection, no masks, no extra keys."""
    usable = (
        attention.batch_first
        and attention._qkv_same_embed_dim
        and attention.bias_k is None
        and not attention.add_zero_attn
        and attention.in_proj_weight is not None
    )
    quiet = {"need_weights", "average_attn_weights"}
    masks_off = all(key in quiet or value in (None, False) for key, value in call.kwargs.items())
    same = len(call.args) == 3 and call.args[0] is call.args[1] is call.args[2]
    return bool(usable and masks_off and same)


def read_mlp(level: nn.Module) -> _Mlp | None:
    """``x + drop(fc_2(act(fc_1(LN x))))``, the MLP half of a pre-norm block."""
    if not isinstance(level, fx.GraphModule) or (found := _residual_branch(level)) is None:
        return None
    source, add, branch = found
    fc2, dropouts = _skip(level, branch, _DROPOUTS)
    if _module(level, fc2, (nn.Linear,)) is None:
        return None
    node, act = fc2.all_input_nodes[0], []
    while _elementwise(level, node):
        act.append(node)
        node = node.all_input_nodes[0]
    fc1 = node
    if _module(level, fc1, (nn.Linear,)) is None or not act:
        return None
    norm = _norm(level, fc1.args[0], source) if isinstance(fc1.args[0], fx.Node) else None
    chain = [add, *dropouts, fc2, *act, fc1, fc1.args[0]]
    if norm is None or live_nodes(level) != set(chain) or any(len(n.users) != 1 for n in chain[1:]):
        return None
    names = tuple(n.name for n in reversed(act))
    return _Mlp(norm, str(fc1.target), names, str(fc2.target))


@dataclass(frozen=True)
class _Embedding:
    projection: str
    class_token: str
    position: str


def read_embedding(level: fx.GraphModule) -> _Embedding | None:
    """Patch ``Conv2d`` (stride its kernel, no padding) on the input, flattened to
    ``(N, d, patches)``, permuted to tokens, a class token ``cat`` in front, a position
    embedding added, dropout."""
    nodes = list(level.graph.nodes)
    source = next(n for n in nodes if n.op == "placeholder")
    out = next(n for n in nodes if n.op == "output").args[0]
    if not isinstance(out, fx.Node):
        return None
    add, dropouts = _skip(level, out, _DROPOUTS)
    if add.target not in _ADDS or len(add.args) != 2 or add.kwargs:
        return None
    position = next((a for a in add.args if isinstance(a, fx.Node) and a.op == "get_attr"), None)
    cat = next((a for a in add.args if isinstance(a, fx.Node) and a is not position), None)
    if position is None or cat is None or cat.target is not torch.cat:
        return None
    parts = cat.args[0] if cat.args else None
    dim = cat.kwargs.get("dim", cat.args[1] if len(cat.args) > 1 else 0)
    if not isinstance(parts, list | tuple) or len(parts) != 2 or dim not in (1, -2):
        return None
    expand, tokens = parts
    token = expand.args[0] if getattr(expand, "target", None) == "expand" else None
    if not isinstance(token, fx.Node) or token.op != "get_attr":
        return None
    flat = _to_tokens(tokens)
    conv = flat.args[0] if flat is not None and isinstance(flat.args[0], fx.Node) else None
    projection = _module(level, conv, (nn.Conv2d,)) if conv is not None else None
    if projection is None or not _patchwise(projection) or conv.args != (source,):
        return None
    shapes = [output_shape(n) for n in (conv, flat, tokens, out)]
    if None in shapes or not _shapes_fit(shapes, level, token, position):
        return None
    tensors = {add, *dropouts, cat, expand, tokens, flat, conv, token, position}
    if any(output_shape(n) is not None for n in live_nodes(level) - tensors):
        return None  # another tensor op than these (sizes for reshape and expand are fine)
    return _Embedding(str(conv.target), str(token.target), str(position.target))


def _to_tokens(node: object) -> fx.Node | None:
    """The flatten before ``node`` when ``node`` permutes ``(N, d, P)`` to ``(N, P, d)``."""
    if not isinstance(node, fx.Node) or not isinstance(node.args[0], fx.Node):
        return None
    swap = (node.target == "permute" and tuple(node.args[1:]) == (0, 2, 1)) or (
        node.target in ("transpose", torch.transpose) and set(node.args[1:]) in ({1, 2}, {-1, 1})
    )
    flat = node.args[0]
    if not swap or flat.target not in ("reshape", "view", "flatten", torch.flatten):
        return None
    return flat


def _patchwise(conv: nn.Conv2d) -> bool:
    return (
        conv.groups == 1
        and conv.kernel_size == conv.stride
        and conv.padding in ((0, 0), "valid")
        and conv.dilation == (1, 1)
    )


def _shapes_fit(shapes: list, level: fx.GraphModule, token: fx.Node, position: fx.Node) -> bool:
    conv, flat, tokens, out = shapes
    n, d, h, w = conv
    cls = operator.attrgetter(str(token.target))(level)
    pos = operator.attrgetter(str(position.target))(level)
    return (
        flat == (n, d, h * w)
        and tokens == (n, h * w, d)
        and out == (n, 1 + h * w, d)
        and isinstance(cls, nn.Parameter)
        and isinstance(pos, nn.Parameter)
        and tuple(cls.shape) == (1, 1, d)
        and tuple(pos.shape) in ((1, 1 + h * w, d), (1 + h * w, d))
    )


def read_head(level: fx.GraphModule) -> tuple[str, str] | None:
    """``Linear(LN(x)[:, 0])`` (or the token taken before the norm): ``(norm, classifier)``."""
    nodes = list(level.graph.nodes)
    source = next(n for n in nodes if n.op == "placeholder")
    out = next(n for n in nodes if n.op == "output").args[0]
    if not isinstance(out, fx.Node) or _module(level, out, (nn.Linear,)) is None:
        return None
    chain, node = [out], out.args[0]
    while isinstance(node, fx.Node) and node is not source and len(chain) < 3:
        chain.append(node)
        node = node.args[0]
    if node is not source or len(chain) != 3 or live_nodes(level) != set(chain):
        return None
    first, second = chain[2], chain[1]  # applied first, then second
    select = next((n for n in (first, second) if n.target is operator.getitem), None)
    norm_node = first if select is second else second
    if select is None or select.args[1] != (slice(None), 0):
        return None
    norm = _norm(level, norm_node, norm_node.args[0])
    return (norm, str(out.target)) if norm is not None else None


# ------------------------------------------------------------------------------ refusals
_PART_MODULES: dict[str, tuple[type, ...]] = {
    "embedding": (nn.Conv2d, *_DROPOUTS),
    "mlp": (nn.LayerNorm, nn.Linear, *_ELEMENTWISE),
    "head": (nn.LayerNorm, nn.Linear),
}
_PART_FUNCTIONS: dict[str, frozenset] = {
    "embedding": frozenset(
        {"reshape", "view", "flatten", "permute", "transpose", "expand", torch.cat, *_ADDS}
        | {torch.flatten, torch.transpose}
    ),
    "mlp": frozenset({*ACTIVATION_FUNCTIONS, F.dropout, *_ADDS}),
    "head": frozenset({operator.getitem}),
}


def odd_node(level: fx.GraphModule, part: str) -> fx.Node | None:
    """The first node computing a tensor the output reads whose op the ``part``
    (``"embedding"``, ``"mlp"``, ``"head"``) has no place for, else None (the ops are the
    part's, their arrangement is not)."""
    live = live_nodes(level)
    for node in level.graph.nodes:
        if node not in live or node.op == "get_attr" or output_shape(node) is None:
            continue
        if node.op == "call_module":
            if _module(level, node, _PART_MODULES[part]) is None:
                return node
        elif node.target not in _PART_FUNCTIONS[part]:
            return node
    return None


__all__ = ["live_nodes", "odd_node", "read_attention", "read_embedding", "read_head", "read_mlp"]
