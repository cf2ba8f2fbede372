r"""The linear pieces of a level of a user's traced model, read off the level's graph.

A user's model with branches or normalisation is cut into graph levels
(:mod:`fedfuse.models.graph_levels`). A closed-form fit reaches such a level when its graph is
made of *units* joined by channel-wise parameter-free operations: a unit is one ``Conv2d``
(no groups, zero padding) or ``Linear``, optionally with the ``BatchNorm1d``/``BatchNorm2d``
that reads it alone (folded: eval mode, ``BN(y) = a y + b``). The level's output must be

* one unit's output (a ``Linear``/``Conv2d`` level, a conv with its BatchNorm), or
* an ``add`` of two such outputs, or of one and the level input (an identity shortcut: the
  residual stream, subtracted from the targets), as torchvision's ``BasicBlock`` and
  ``Bottleneck`` and a ``downsample`` of conv and BatchNorm are written.

Units whose outputs feed other units (through activations, pooling, a flatten) are *inner*:
fitted onto their own pre-activation outputs with equal weights, bottom-up. The units that
make the output are fitted jointly, one piece. This is :mod:`.pieces`' derivation for
fedfuse's own ``Stem`` and ``BasicBlock``, found in the graph instead of in a class: a fitted
BatchNorm holds the affine map it stands for, with its input's moments on the fitted rows as
running statistics (:func:`~.linear_piece.set_batchnorm`); a second BatchNorm in a joint piece gets
zero shift.

The graph cut leaves a BatchNorm after a level's last conv as a level of its own (torchvision's
``conv1``, ``bn1``); :func:`fold_norm_levels` gives the view of a leveled model in which each
such pair is one level, fitted as one unit.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import fx, nn

from fedfuse.fusion.blocks.linear_piece import LinearPiece, output_moments, set_batchnorm
from fedfuse.fusion.blocks.token_levels import token_levels
from fedfuse.models.affine import AffineLevel, affine_view, output_rows
from fedfuse.models.channel_ops import (
    ACTIVATION_FUNCTIONS,
    CHANNELWISE_FUNCTIONS,
    CHANNELWISE_MODULES,
    FLATTENS,
)
from fedfuse.models.graph_levels import joined
from fedfuse.models.leveled import LeveledModel

_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d)
_ADDS = (operator.add, operator.iadd, torch.add)


@dataclass(frozen=True)
class Unit:
    """One ``Linear``/``Conv2d`` of a graph level (``layer``: its module path), the BatchNorm
    folded after it (``norm``, or None), the node its input is (``source``) and the node its
    output is (``output``: the norm's, else the layer's)."""

    layer: str
    norm: str | None
    source: str
    output: str

    def holds_bias(self, level: nn.Module) -> bool:
        """Whether the unit can hold a fitted bias: in its BatchNorm, or its layer's bias."""
        return self.norm is not None or level.get_submodule(self.layer).bias is not None


@dataclass(frozen=True)
class GraphBlock:
    """A graph level's units: ``inner`` (bottom-up) and ``outputs`` (summed into the level's
    output, node ``output``), and whether the level input is added too (``identity``)."""

    inner: tuple[Unit, ...]
    outputs: tuple[Unit, ...]
    identity: bool
    output: str


def read_block(level: nn.Module) -> GraphBlock | None:
    """The units of ``level`` when it is a graph level of the kinds above, else None."""
    if not isinstance(level, fx.GraphModule):
        return None
    nodes = list(level.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    result = next((n for n in nodes if n.op == "output"), None)
    if len(placeholders) != 1 or result is None or not isinstance(result.args[0], fx.Node):
        return None
    source, out = placeholders[0], result.args[0]
    units: dict[str, Unit] = {}  # by output node
    layers: set[str] = set()
    for node in nodes:
        if node.op in ("placeholder", "output"):
            continue
        kind = op_kind(level, node)
        if kind is None or (kind == "add" and node is not out):
            return None
        inputs = node.all_input_nodes
        if kind != "add" and len(inputs) != 1:
            return None
        if kind == "layer":
            if str(node.target) in layers:
                return None  # one module called twice: its fits would overwrite each other
            layers.add(str(node.target))
            units[node.name] = Unit(str(node.target), None, inputs[0].name, node.name)
        elif kind == "norm":
            unit = units.pop(inputs[0].name, None)
            if unit is None or unit.norm is not None or len(inputs[0].users) != 1:
                return None  # a BatchNorm that does not read one layer alone
            units[node.name] = replace(unit, norm=str(node.target), output=node.name)
    if out.op == "call_function" and out.target in _ADDS:
        operands = [a for a in out.args if isinstance(a, fx.Node)]
        if len(operands) != 2 or len(out.args) != 2 or out.kwargs:
            return None
        identity = any(a is source for a in operands)
        names = [a.name for a in operands if a is not source]
    else:
        identity, names = False, [out.name]
    if not names or any(name not in units for name in names):
        return None
    outputs = tuple(units[name] for name in names)
    inner = tuple(u for name, u in units.items() if name not in names)
    return GraphBlock(inner, outputs, identity, out.name)


def op_kind(level: nn.Module, node: fx.Node) -> str | None:
    """``"layer"``, ``"norm"``, ``"add"``, ``"free"`` (channel-wise, parameter-free), or None."""
    if node.op == "call_module":
        module = level.get_submodule(str(node.target))
        if isinstance(module, nn.Linear | nn.Conv2d):
            return "layer" if affine_view(module) is not None else None
        if isinstance(module, _NORMS):
            usable = module.affine and module.track_running_stats and not node.kwargs
            return "norm" if usable else None
        if isinstance(module, (*CHANNELWISE_MODULES, nn.Flatten)):
            return "free"
        return None
    if node.op in ("call_function", "call_method"):
        target = node.target
        if target in _ADDS:
            return "add"
        if target in ACTIVATION_FUNCTIONS or target in CHANNELWISE_FUNCTIONS or target in FLATTENS:
            return "free"
    return None


@torch.no_grad()
def node_values(level: fx.GraphModule, x: torch.Tensor, names: set[str]) -> dict[str, torch.Tensor]:
    """The values of the nodes ``names`` when ``level`` runs on ``x`` (it stops once they are
    all computed)."""
    env: dict[fx.Node, object] = {}
    found: dict[str, torch.Tensor] = {}
    for node in level.graph.nodes:
        if node.op == "output" or len(found) == len(names):
            break
        if node.op == "placeholder":
            value: object = x
        else:
            args = fx.node.map_arg(node.args, lambda n: env[n])
            kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
            if node.op == "call_module":
                value = level.get_submodule(str(node.target))(*args, **kwargs)
            elif node.op == "call_method":
                value = getattr(args[0], str(node.target))(*args[1:], **kwargs)
            else:
                value = node.target(*args, **kwargs)
        env[node] = value
        if node.name in names:
            found[node.name] = value  # type: ignore[assignment]
    return found


def block_pieces(block: GraphBlock) -> list[LinearPiece]:
    """The :class:`~.linear_piece.LinearPiece` s of a recognised graph level, bottom-up."""
    pieces = [
        LinearPiece(
            unit.layer,
            design=_design((unit,)),
            target=_values_of(unit.output),
            fan_in=_fan_in((unit,)),
            width=_width(unit),
            load=_load((unit,)),
            inner=True,
        )
        for unit in block.inner
    ]
    pieces.append(
        LinearPiece(
            "+".join(u.layer for u in block.outputs) + ("+identity" if block.identity else ""),
            design=_design(block.outputs),
            target=_values_of(block.output),
            fan_in=_fan_in(block.outputs),
            width=_width(block.outputs[0]),
            load=_load(block.outputs),
            stream=(lambda _m, x: output_rows(x)) if block.identity else None,
        )
    )
    return pieces


def _intercept(units: tuple[Unit, ...], level: nn.Module) -> bool:
    return any(u.holds_bias(level) for u in units)


def _design(units: tuple[Unit, ...]) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    def design(level: nn.Module, x: torch.Tensor) -> torch.Tensor:
        values = node_values(level, x, {u.source for u in units})
        parts = [
            AffineLevel([], level.get_submodule(u.layer), bias=False).design(values[u.source])
            for u in units
        ]
        rows = torch.cat(parts, 1)
        if _intercept(units, level):
            rows = torch.cat([rows, rows.new_ones(len(rows), 1)], 1)
        return rows

    return design


def _values_of(name: str) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    def target(level: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return output_rows(node_values(level, x, {name})[name])

    return target


def _fan_in(units: tuple[Unit, ...]) -> Callable[[nn.Module], int]:
    def fan_in(level: nn.Module) -> int:
        sizes = sum(level.get_submodule(u.layer).weight[0].numel() for u in units)
        return sizes + int(_intercept(units, level))

    return fan_in


def _width(unit: Unit) -> Callable[[nn.Module], int]:
    return lambda level: level.get_submodule(unit.layer).weight.shape[0]


def _load(units: tuple[Unit, ...]) -> Callable[[nn.Module, torch.Tensor, torch.Tensor], None]:
    """Write ``W`` (the units' weights stacked, the bias last when there is one) into the
    layers; the bias goes to the first unit that holds one, every BatchNorm gets its input's
    moments on the fitted rows (:func:`~.linear_piece.output_moments`), every other bias 0."""

    def load(level: nn.Module, w: torch.Tensor, gram: torch.Tensor) -> None:
        intercept = _intercept(units, level)
        holder = next((u for u in units if u.holds_bias(level)), None)
        start = 0
        for unit in units:
            layer = level.get_submodule(unit.layer)
            size = layer.weight[0].numel()
            columns = slice(start, start + size)
            start += size
            with torch.no_grad():
                layer.weight.copy_(w[columns].T.reshape(layer.weight.shape).to(layer.weight))
                if layer.bias is not None:
                    layer.bias.zero_()
            bias = w[-1] if intercept and unit is holder else torch.zeros_like(w[-1])
            if unit.norm is not None:
                moments = output_moments(w, gram, columns) if intercept else None
                set_batchnorm(level.get_submodule(unit.norm), bias, moments)
            elif unit is holder:
                with torch.no_grad():
                    layer.bias.copy_(bias.to(layer.bias))

    return load


# ------------------------------------------------------------------ BatchNorm levels, folded
def _norm_only(level: nn.Module) -> bool:
    """Whether ``level`` is one usable BatchNorm applied to the level input, nothing else."""
    if not isinstance(level, fx.GraphModule):
        return False
    body = [n for n in level.graph.nodes if n.op not in ("placeholder", "output")]
    return len(body) == 1 and op_kind(level, body[0]) == "norm"


def _ends_in_layer(level: nn.Module) -> bool:
    """Whether ``level`` is a graph level whose output is a ``Linear``/``Conv2d`` unit's."""
    block = read_block(level)
    return (
        block is not None
        and not block.identity
        and len(block.outputs) == 1
        and block.outputs[0].norm is None
    )


def fold_norm_levels(model: LeveledModel) -> tuple[LeveledModel, dict[int, int]]:
    """The view of ``model`` where each graph level ending in a ``Linear``/``Conv2d`` and the
    BatchNorm level right after it are one level (sharing the modules), a traced Vision
    Transformer's levels are fedfuse's ViT levels (:func:`~.token_levels.token_levels`), and
    the view's level of each of ``model``'s levels. ``model`` itself (identity map) when nothing
    folds. Levels with an identity shortcut are marked residual
    (:meth:`LeveledModel.is_residual`)."""
    tokens = token_levels(list(model.levels))
    source, first = tokens if tokens is not None else (list(model.levels), None)
    levels: list[nn.Module] = []
    at: dict[int, int] = {}
    index = 0
    while index < len(source):
        level = source[index]
        following = source[index + 1] if index + 1 < len(source) else None
        if following is not None and _norm_only(following) and _ends_in_layer(level):
            at[index] = at[index + 1] = len(levels)
            levels.append(joined(level, following))
            index += 2
            continue
        at[index] = len(levels)
        levels.append(level)
        index += 1
    for level in levels:
        block = read_block(level)
        if block is not None and block.identity:
            level.residual = True
    where = {i: at[first[i] if first is not None else i] for i in range(model.num_levels)}
    if len(levels) == model.num_levels and first is None:
        return model, where
    view = LeveledModel(levels, model.spec)
    by_view = {where[i]: model.level_width(i) for i in model.neuron_levels}
    widths = tuple(
        getattr(view.levels[i], "token_width", None) or by_view[i] for i in view.neuron_levels
    )
    view.spec = replace(model.spec, widths=widths[:-1])
    return view, where


__all__ = [
    "GraphBlock",
    "Unit",
    "block_pieces",
    "fold_norm_levels",
    "joined",
    "node_values",
    "op_kind",
    "read_block",
]
