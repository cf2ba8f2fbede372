"""The neuron symmetries of any traced model, derived from its ``torch.fx`` graph.

Git Re-Basin writes a *permutation spec* per architecture: which permutation acts on each axis
of each parameter. Here the spec is derived by following every tensor's channel axis through
the graph (:func:`derive_spaces`) and joining, in a union-find, the channels that must be
permuted together:

- ``Linear``/``Conv1d``/``Conv2d`` (groups=1) consume their input's channels (weight dim 1) and
  start a new space on their output (weight and bias dim 0);
- ``add``/``sub``/``mul``/``div`` of tensors with channels join them into one space (a residual
  stream is one space from its first producer to its last consumer); ``cat`` along the channels
  makes a tensor of several *parts*, each consumed by a slice of the next weight
  (:attr:`~fedfuse.models.symmetry.Axis.offset`); ``cat`` along another dim joins the parts;
- BatchNorm, InstanceNorm, LayerNorm over the channels and GroupNorm keep the space and
  normalise it (their weights, biases and running statistics are axes of it; GroupNorm keeps a
  permutation inside its groups);
- activations, pooling, dropout, softmax, ``view``/``reshape``/``flatten`` of channel-major
  tensors (a flattened feature owns a block of entries: ``repeat``), ``permute``/``transpose``/
  ``getitem`` (which move the channel dim) keep it;
- ``nn.MultiheadAttention`` consumes its inputs with ``in_proj_weight``; its query and key rows
  are one space, its value rows and ``out_proj``'s inputs another, both permuted within heads,
  and its output is a new space;
- a parameter read in ``forward`` (a class token, a position embedding) takes the space it is
  added to or concatenated with. A space is probed on the nodes holding its channels;
  :attr:`DerivedSpace.read` marks those a ``Linear``, ``Conv`` or attention reads.

The model's input and the classifier's outputs are *fixed*: a space joined to them is never
permuted. Any other operation on a tensor that carries a permutable space (a custom function, a
``flip``, a grouped convolution) is refused in one line naming the node and the op; the model
can still be fused by the methods that need no alignment.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from fedfuse.models.channel_ops import (
    ACTIVATION_FUNCTIONS,
    CHANNELWISE_FUNCTIONS,
    CHANNELWISE_MODULES,
)
from fedfuse.models.graph_levels import describe, output_shape
from fedfuse.models.symmetry import Axis

FIXED = 0
#: modules through which channels pass unchanged (module class), beyond the chain's
_KEEPING_MODULES: tuple[type[nn.Module], ...] = (
    *CHANNELWISE_MODULES, nn.Softmax, nn.LogSoftmax, nn.AdaptiveAvgPool1d, nn.AdaptiveMaxPool1d,
    nn.Hardswish, nn.Hardsigmoid, nn.PReLU, nn.CELU, nn.SELU, nn.AlphaDropout,
)  # fmt: skip
_KEEPING_FUNCTIONS = frozenset(
    {*ACTIVATION_FUNCTIONS, *CHANNELWISE_FUNCTIONS, F.softmax, F.log_softmax, torch.softmax,
     "softmax", "log_softmax", F.hardswish, F.mish, F.softplus, "contiguous", "clone",
     "detach", "float", "to", "type_as", F.adaptive_avg_pool1d, F.adaptive_max_pool1d,
     "sigmoid_", "relu_", torch.nn.functional.hardtanh, operator.neg, torch.neg, "neg",
     torch.exp, "exp", torch.abs, "abs", torch.sqrt, "sqrt", operator.pos}
)  # fmt: skip
_ELEMENTWISE = frozenset(
    {operator.add, operator.sub, operator.mul, operator.truediv, operator.iadd, operator.imul,
     torch.add, torch.sub, torch.mul, torch.div, "add", "sub", "mul", "div", "add_", "mul_"}
)  # fmt: skip
_RESHAPES = frozenset(
    {torch.flatten, "flatten", "view", "reshape", torch.reshape, "unsqueeze", "squeeze",
     torch.unsqueeze, torch.squeeze, "unflatten"}
)  # fmt: skip
_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.InstanceNorm1d, nn.InstanceNorm2d)


class Refusal(ValueError):
    """A graph whose channels cannot be aligned; the message names the node and the op."""


@dataclass(frozen=True)
class Features:
    """A tensor's permutable channels: ``parts`` ``(space id, size)`` laid end to end along
    dim ``dim``, each feature owning ``repeat`` consecutive entries."""

    parts: tuple[tuple[int, int], ...]
    dim: int
    repeat: int = 1

    @property
    def size(self) -> int:
        return sum(size for _, size in self.parts)


@dataclass
class DerivedSpace:
    """One space in the user's names: axes on the user's state-dict keys, probes on nodes."""

    name: str
    size: int
    axes: list[Axis] = field(default_factory=list)
    probes: list[tuple[str, int]] = field(default_factory=list)
    groups: int = 1
    read: set[str] = field(default_factory=set)  # probes a Linear, Conv or attention reads


class _UnionFind:
    """Spaces as sets of channels that must be permuted alike; set 0 is the fixed one."""

    def __init__(self) -> None:
        self.parent, self.size, self.groups, self.name = [0], [0], [1], ["fixed"]
        self.sourced = [False]

    def new(self, size: int, name: str, *, source: bool = True) -> int:
        self.parent.append(len(self.parent))
        self.size.append(size)
        self.groups.append(1)
        self.name.append(name)
        self.sourced.append(source)
        return len(self.parent) - 1

    def find(self, space: int) -> int:
        while self.parent[space] != space:
            self.parent[space] = self.parent[self.parent[space]]
            space = self.parent[space]
        return space

    def union(self, a: int, b: int, where: str) -> None:
        a, b = sorted((self.find(a), self.find(b)))  # the older set names both; fixed is 0
        if a == b:
            return
        if a != FIXED and self.size[a] != self.size[b]:
            raise Refusal(f"{where} joins {self.size[a]} channels with {self.size[b]}")
        self.parent[b] = a
        self.groups[a] = math.lcm(self.groups[a], self.groups[b])
        self.sourced[a] = self.sourced[a] or self.sourced[b]

    def constrain(self, space: int, groups: int) -> None:
        root = self.find(space)
        self.groups[root] = math.lcm(self.groups[root], groups)


class _Deriver:
    """One pass over the graph in order, each node's output given its :class:`Features`."""

    def __init__(self, graph_module: fx.GraphModule, root: nn.Module) -> None:
        self.graph_module, self.root = graph_module, root
        self.spaces = _UnionFind()
        self.axes: list[tuple[int, Axis]] = []
        self.opaque: list[tuple[fx.Node, list[int]]] = []
        self.projections: list[tuple[int, str, int]] = []  # attention probes (capture.py)
        self.features: dict[fx.Node, Any] = {}
        self.read: set[fx.Node] = set()  # nodes a Linear, Conv or attention reads

    # ----------------------------------------------------------------- helpers
    def where(self, node: fx.Node) -> str:
        return f"node {node.name!r} ({describe(node, self.root)})"

    def fresh(self, node: fx.Node, size: int, dim: int, name: str | None = None) -> Features:
        space = self.spaces.new(size, name or node.name)
        return Features(((space, size),), dim)

    def fixed(self, node: fx.Node) -> Features | None:
        shape = output_shape(node)
        if shape is None or len(shape) < 2:
            return None
        space = self.spaces.new(shape[1], node.name, source=False)
        self.spaces.union(FIXED, space, self.where(node))
        return Features(((space, shape[1]),), 1)

    def produce(self, space: int, key: str, dim: int = 0, offset: int | None = None) -> None:
        self.axes.append((space, Axis(key, dim, True, 1, offset)))

    def consume(self, features: Features | None, key: str, dim: int = 1) -> None:
        if features is None:
            return
        whole = len(features.parts) == 1
        offset = 0
        for space, size in features.parts:
            self.axes.append(
                (space, Axis(key, dim, False, features.repeat, None if whole else offset))
            )
            offset += size * features.repeat

    def join(self, a: Features, b: Features, node: fx.Node) -> None:
        if [s for _, s in a.parts] != [s for _, s in b.parts] or a.repeat != b.repeat:
            raise Refusal(
                f"{self.where(node)} combines channels laid out as "
                f"{[s for _, s in a.parts]} and {[s for _, s in b.parts]}"
            )
        for (x, _), (y, _) in zip(a.parts, b.parts, strict=True):
            self.spaces.union(x, y, self.where(node))

    def mark_opaque(self, node: fx.Node) -> Features | None:
        """An op fedfuse does not see through: its inputs' spaces must end up fixed (checked
        at the end), its output is fixed."""
        spaces = [
            space
            for arg in node.all_input_nodes
            if isinstance(self.features.get(arg), Features)
            for space, _ in self.features[arg].parts
        ]
        self.opaque.append((node, spaces))
        return self.fixed(node)

    # ----------------------------------------------------------------- the pass
    def run(self) -> list[DerivedSpace]:
        for node in self.graph_module.graph.nodes:
            self.features[node] = self.visit(node)
        for node, spaces in self.opaque:
            if any(self.spaces.find(s) != FIXED for s in spaces):
                raise Refusal(
                    f"{self.where(node)} is an operation on channels that fedfuse cannot align "
                    "(known: Linear, Conv, norms, attention, elementwise and shape ops)"
                )
        return self.collect()

    def visit(self, node: fx.Node) -> Any:
        if node.op == "placeholder":
            return self.fixed(node)
        if node.op == "output":
            for arg in node.all_input_nodes:
                feats = self.features.get(arg)
                for space, _ in feats.parts if isinstance(feats, Features) else ():
                    self.spaces.union(FIXED, space, self.where(node))
            return None
        if node.op == "get_attr":
            return self.parameter(node)
        if node.op == "call_module":
            return self.module(node, self.root.get_submodule(str(node.target)))
        return self.function(node)

    def parameter(self, node: fx.Node) -> Features | None:
        shape = output_shape(node)
        if not shape:
            return None
        space = self.spaces.new(shape[-1], node.name, source=False)
        self.produce(space, str(node.target), len(shape) - 1)
        return Features(((space, shape[-1]),), len(shape) - 1)

    def module(self, node: fx.Node, module: nn.Module) -> Any:
        inputs = [self.features.get(arg) for arg in node.args if isinstance(arg, fx.Node)]
        x = inputs[0] if inputs else None
        shape = output_shape(node)
        path = str(node.target)
        if isinstance(module, nn.MultiheadAttention):
            return self.attention(node, module)
        if isinstance(module, nn.Linear) and shape is not None:
            self.expect(node, x, len(shape) - 1)
            return self.affine(node, module, path, x, len(shape) - 1)
        if isinstance(module, nn.Conv1d | nn.Conv2d) and module.groups == 1 and shape:
            self.expect(node, x, 1, repeat=False)
            return self.affine(node, module, path, x, 1)
        if isinstance(module, _NORMS) and isinstance(x, Features):
            self.expect(node, x, 1, repeat=False)
            return self.normalise(node, module, path, x)
        if isinstance(module, nn.LayerNorm) and isinstance(x, Features) and shape is not None:
            if len(module.normalized_shape) != 1 or x.dim != len(shape) - 1 or x.repeat != 1:
                return self.mark_opaque(node)
            return self.normalise(node, module, path, x)
        if isinstance(module, nn.GroupNorm) and isinstance(x, Features):
            self.expect(node, x, 1, repeat=False)
            if module.num_groups != module.num_channels:  # one channel a group: any order
                for space, _ in x.parts:
                    self.spaces.constrain(space, module.num_groups)
            return self.normalise(node, module, path, x)
        if isinstance(module, _KEEPING_MODULES):
            return x
        if isinstance(module, nn.Flatten | nn.Unflatten):
            return self.reshape(node, x)
        return self.mark_opaque(node)

    def expect(self, node: fx.Node, x: Any, dim: int, *, repeat: bool = True) -> None:
        if isinstance(x, Features) and (x.dim != dim or (x.repeat != 1 and not repeat)):
            raise Refusal(
                f"{self.where(node)} reads its channels on dim {dim}, the permutable ones of "
                f"its input are on dim {x.dim}"
                + (f" in blocks of {x.repeat}" if x.repeat > 1 else "")
            )

    def affine(self, node: fx.Node, module: nn.Module, path: str, x: Any, dim: int) -> Features:
        self.consume(x if isinstance(x, Features) else None, f"{path}.weight")
        self.read.update(arg for arg in node.args[:1] if isinstance(arg, fx.Node))
        out = self.fresh(node, module.weight.shape[0], dim)
        space = out.parts[0][0]
        self.produce(space, f"{path}.weight")
        if getattr(module, "bias", None) is not None:
            self.produce(space, f"{path}.bias")
        return out

    def normalise(self, node: fx.Node, module: nn.Module, path: str, x: Features) -> Features:
        names = ("weight", "bias", "running_mean", "running_var")
        state = dict(module.named_parameters(recurse=False)) | dict(
            module.named_buffers(recurse=False)
        )
        offset = 0
        for space, size in x.parts:
            for name in names:
                if state.get(name) is not None:
                    self.produce(space, f"{path}.{name}", 0, None if len(x.parts) == 1 else offset)
            offset += size
        return x

    def attention(self, node: fx.Node, module: nn.MultiheadAttention) -> Any:
        """``nn.MultiheadAttention`` (self- or cross-attention, packed projections)."""
        if not module._qkv_same_embed_dim or module.bias_k is not None:
            return self.mark_opaque(node)
        args = list(node.args) + [None] * 3
        names = ("query", "key", "value")
        qkv = [node.kwargs.get(k, a) for k, a in zip(names, args[:3], strict=True)]
        feats = [self.features.get(a) if isinstance(a, fx.Node) else None for a in qkv]
        shape = output_shape(qkv[0]) if isinstance(qkv[0], fx.Node) else None
        if shape is None or not all(isinstance(f, Features) for f in feats):
            return self.mark_opaque(node)
        for f in feats:
            self.expect(node, f, len(shape) - 1, repeat=False)
            self.join(feats[0], f, node)
        path, width, heads = str(node.target), module.embed_dim, module.num_heads
        self.consume(feats[0], f"{path}.in_proj_weight")
        self.read.update(a for a in qkv if isinstance(a, fx.Node))
        query_key = self.spaces.new(width, f"{node.name}.qk")
        value = self.spaces.new(width, f"{node.name}.v")
        for space, offsets in ((query_key, (0, width)), (value, (2 * width,))):
            self.spaces.constrain(space, heads)
            for offset in offsets:
                position = offset // width
                probe = f"{node.name}#in_proj:{position}:{offset}:{offset + width}"
                self.projections.append((space, probe, len(shape) - 1))
                self.produce(space, f"{path}.in_proj_weight", 0, offset)
                if module.in_proj_bias is not None:
                    self.produce(space, f"{path}.in_proj_bias", 0, offset)
        self.axes.append((value, Axis(f"{path}.out_proj.weight", 1, False)))
        out = self.spaces.new(width, node.name)
        self.produce(out, f"{path}.out_proj.weight")
        if module.out_proj.bias is not None:
            self.produce(out, f"{path}.out_proj.bias")
        return (Features(((out, width),), len(shape) - 1), None)

    def function(self, node: fx.Node) -> Any:
        target = node.target
        shape = output_shape(node)
        args = [self.features.get(a) if isinstance(a, fx.Node) else None for a in node.args]
        x = args[0] if args else None
        if target is operator.getitem:
            return self.getitem(node, x)
        if shape is None or not any(
            isinstance(self.features.get(a), Features) for a in node.all_input_nodes
        ):
            return self.fixed(node) if shape is not None else None
        if target in _ELEMENTWISE:
            return self.elementwise(node, shape)
        if target in (torch.cat, torch.concat, torch.concatenate):
            return self.concatenate(node, shape)
        if target in _KEEPING_FUNCTIONS and isinstance(x, Features):
            return x
        if target in _RESHAPES:
            return self.reshape(node, x)
        if target in ("permute", torch.permute, "transpose", torch.transpose, "expand"):
            return self.move(node, x, shape)
        if target in ("mean", torch.mean, "sum", torch.sum, "amax", torch.amax):
            return self.reduce(node, x, shape)
        return self.mark_opaque(node)

    def getitem(self, node: fx.Node, x: Any) -> Any:
        index = node.args[1]
        if isinstance(x, tuple):
            return x[index] if isinstance(index, int) else None
        if not isinstance(x, Features):
            return self.fixed(node) if output_shape(node) is not None else None
        index = index if isinstance(index, tuple) else (index,)
        source = output_shape(node.args[0])
        assert source is not None
        ellipsis = [i for i, item in enumerate(index) if item is Ellipsis]
        if ellipsis:
            consumed = sum(item is not None for item in index) - 1
            fill = (slice(None),) * (len(source) - consumed)
            index = (*index[: ellipsis[0]], *fill, *index[ellipsis[0] + 1 :])
        dim, out = 0, 0
        for item in index:
            if item is None:
                out += 1
                continue
            if dim == x.dim:
                if item != slice(None):
                    return self.mark_opaque(node)
                return Features(x.parts, out, x.repeat)
            out += 0 if isinstance(item, int) else 1
            dim += 1
        return Features(x.parts, out + x.dim - dim, x.repeat)

    def elementwise(self, node: fx.Node, shape: tuple[int, ...]) -> Features | None:
        ranked: list[tuple[Features, int]] = []
        for arg in node.all_input_nodes:
            feats, in_shape = self.features.get(arg), output_shape(arg)
            if not isinstance(feats, Features) or in_shape is None or feats.size == 1:
                continue
            ranked.append((feats, feats.dim + len(shape) - len(in_shape)))
        if not ranked:
            return self.fixed(node)
        first, dim = ranked[0]
        for feats, position in ranked[1:]:
            if position != dim:
                return self.mark_opaque(node)
            self.join(first, feats, node)
        return Features(first.parts, dim, first.repeat)

    def concatenate(self, node: fx.Node, shape: tuple[int, ...]) -> Features | None:
        tensors = node.args[0] if node.args else node.kwargs.get("tensors")
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
        dim = dim % len(shape)
        feats = [self.features.get(t) for t in tensors]
        if not all(isinstance(f, Features) and f.dim == feats[0].dim for f in feats):
            return self.mark_opaque(node)
        if dim != feats[0].dim:
            for other in feats[1:]:
                self.join(feats[0], other, node)
            return feats[0]
        if len({f.repeat for f in feats}) != 1:
            return self.mark_opaque(node)
        return Features(tuple(p for f in feats for p in f.parts), dim, feats[0].repeat)

    def reshape(self, node: fx.Node, x: Any) -> Features | None:
        """A reshape keeps the channels when the entries before them keep their count and each
        feature's entries stay one block of the new dim (channel-major flatten or unflatten)."""
        source, shape = output_shape(node.all_input_nodes[0]), output_shape(node)
        if not isinstance(x, Features) or source is None or shape is None:
            return self.mark_opaque(node)
        before = math.prod(source[: x.dim])
        entries = x.size * x.repeat * math.prod(source[x.dim + 1 :])
        for dim in range(len(shape)):
            if math.prod(shape[:dim]) != before or (shape[dim] == 1 and x.size > 1):
                continue
            if shape[dim] % x.size == 0 and shape[dim] * math.prod(shape[dim + 1 :]) == entries:
                return Features(x.parts, dim, shape[dim] // x.size)
        return self.mark_opaque(node)

    def move(self, node: fx.Node, x: Any, shape: tuple[int, ...]) -> Features | None:
        source = output_shape(node.all_input_nodes[0])
        if not isinstance(x, Features) or source is None:
            return self.mark_opaque(node)
        if node.target == "expand":
            return Features(x.parts, x.dim + len(shape) - len(source), x.repeat)
        rest = [a for a in node.args[1:]] or list(node.kwargs.values())
        dims = tuple(rest[0]) if len(rest) == 1 and isinstance(rest[0], list | tuple) else rest
        if node.target in ("transpose", torch.transpose):
            a, b = (int(d) % len(source) for d in dims)
            order = list(range(len(source)))
            order[a], order[b] = b, a
        else:
            order = [int(d) % len(source) for d in dims]
        return Features(x.parts, order.index(x.dim), x.repeat)

    def reduce(self, node: fx.Node, x: Any, shape: tuple[int, ...]) -> Features | None:
        source = output_shape(node.all_input_nodes[0])
        dims = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
        if not isinstance(x, Features) or source is None or dims is None or x.repeat != 1:
            return self.mark_opaque(node)
        dims = {int(d) % len(source) for d in (dims if isinstance(dims, list | tuple) else [dims])}
        if x.dim in dims:
            return self.fixed(node)
        kept = len(shape) == len(source)
        return Features(x.parts, x.dim - (0 if kept else sum(d < x.dim for d in dims)))

    # ----------------------------------------------------------------- result
    def collect(self) -> list[DerivedSpace]:
        spaces: dict[int, DerivedSpace] = {}
        for space in range(1, len(self.spaces.parent)):
            root = self.spaces.find(space)
            if root == FIXED or not self.spaces.sourced[root]:
                continue
            if root not in spaces:
                name = self.spaces.name[root]
                spaces[root] = DerivedSpace(
                    name, self.spaces.size[root], groups=self.spaces.groups[root]
                )
        for space, axis in self.axes:
            found = spaces.get(self.spaces.find(space))
            if found is not None and axis not in found.axes:
                found.axes.append(axis)
        for node, feats in self.features.items():
            if isinstance(feats, Features) and len(feats.parts) == 1 and feats.repeat == 1:
                found = spaces.get(self.spaces.find(feats.parts[0][0]))
                if found is not None:
                    found.probes.append((node.name, feats.dim))
                    if node in self.read:
                        found.read.add(node.name)
        for space, probe, dim in self.projections:
            found = spaces.get(self.spaces.find(space))
            if found is not None:
                found.probes.append((probe, dim))
        return list(spaces.values())


def derive_spaces(graph_module: fx.GraphModule, root: nn.Module, name: str) -> list[DerivedSpace]:
    """The feature spaces of the traced ``graph_module`` of ``root`` (module docstring), in the
    user's state-dict keys, probes on the nodes that hold them. Raises :class:`Refusal`, one
    line naming ``name``, the node and the op, for a graph whose channels cannot be aligned."""
    try:
        return _Deriver(graph_module, root).run()
    except Refusal as error:
        raise Refusal(f"{name}: {error}; methods that need no alignment still fuse it") from None
