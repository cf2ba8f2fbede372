"""A user's own PyTorch model as a leveled model, and the fused result back as the user's class.

:class:`ModelAdapter` traces a plain ``nn.Module`` with ``torch.fx.symbolic_trace`` and cuts its
graph into levels (paper Sec. 3) the way fedfuse's own MLP and VGG are cut: every ``nn.Linear``
or ``nn.Conv2d`` is a neuron level, every parameter-free operation between them (activations,
pooling, dropout) a level of its own, and the flatten before the first ``Linear`` joins that
``Linear``'s level. The leveled model *shares* the user's modules, so adapting copies no weight,
and a two-way map of parameter names (:meth:`ModelAdapter.user_names`) takes a fused model back
into the user's class with the user's names (:meth:`ModelAdapter.export`).

Two kinds of graph, and why:

- a *chain* (each node feeds the next; ``Linear``/``Conv2d`` layers with elementwise
  activations, pooling, dropout and the flatten of ``(C, H, W)`` into ``C*H*W`` features between
  them) is cut as above, so every method that fits affine levels in closed form takes it;
- any other traceable graph (residual adds, ``cat``, BatchNorm, LayerNorm, GroupNorm,
  ``nn.MultiheadAttention``, torchvision's ResNets and ViTs) is cut into levels where a single
  tensor is live (:mod:`fedfuse.models.graph_adapter`), and its feature spaces are derived from
  the graph (:mod:`fedfuse.models.graph_symmetry`): methods that work by parameter name
  (averaging, distillation, Fisher) and those that align feature spaces (Git Re-Basin,
  OTFusion) take it; a graph whose channels cannot be aligned (a custom op mixing them, a
  ``flip``, a grouped convolution) is refused by the aligning methods only, in one line naming
  the node and the op; methods that fit levels of known types refuse it naming the level.

Refused at once, with the node named: an operation after the classifier (``log_softmax``:
fedfuse's methods read logits), a forward pass of several inputs, and forward code that
``torch.fx`` cannot trace (control flow on tensor values).

Tracing is chosen over an explicit list of layers because the forward pass, not the order of
``__init__``, says how layers connect (the Flower PyTorch template reuses one ``MaxPool2d`` twice
and calls ``F.relu`` and ``x.view`` inline); functional activations become one module per use,
as Captum's DeepLIFT needs.
"""

from __future__ import annotations

import copy
import logging
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from fedfuse.models.affine import affine_view
from fedfuse.models.channel_ops import (
    ACTIVATION_FUNCTIONS,
    CHANNELWISE_FUNCTIONS,
    CHANNELWISE_MODULES,
    FLATTENS,
)
from fedfuse.models.graph_adapter import GraphPlan
from fedfuse.models.graph_levels import out_of_place, trace
from fedfuse.models.leveled import LeveledModel
from fedfuse.models.registry import register_architecture
from fedfuse.models.spec import ModelSpec

log = logging.getLogger(__name__)


class _Call(nn.Module):
    """A traced function or method call on the level's input (argument ``position``), as a
    module."""

    def __init__(
        self, kind: str, target: Any, args: tuple, position: int, kwargs: dict[str, Any]
    ) -> None:
        super().__init__()
        self.kind, self.target, self.kwargs = kind, target, kwargs
        self.args, self.position = args, position

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        args = (*self.args[: self.position], x, *self.args[self.position + 1 :])
        if self.kind == "call_method":
            return getattr(args[0], self.target)(*args[1:], **self.kwargs)
        return self.target(*args, **self.kwargs)

    def extra_repr(self) -> str:
        return getattr(self.target, "__name__", str(self.target))


class _Flatten(nn.Module):
    """The flatten of ``(N, C, ...)`` into ``(N, C*...)`` that a traced ``view``/``reshape`` or
    ``torch.flatten`` stood for (whatever numbers the user's code wrote)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1)


@dataclass(frozen=True)
class _Step:
    """One operation of the traced chain: a user submodule (``path``) or a parameter-free
    module made from a traced call (``module``); ``flattens``: it flattens channels and space."""

    name: str
    path: str | None = None
    module: nn.Module | None = None
    flattens: bool = False
    affine: bool = False


class ModelAdapter:
    """A user's model class, traced once, turned into fedfuse's leveled models and back.

    Args:
        factory: builds a fresh instance of the user's model (e.g. the class ``Net``); fedfuse
            calls it for every model it builds (a fused model, a model of a checkpoint).
        input_shape: one input's shape without the batch, e.g. ``(3, 32, 32)``.
        name: the architecture name in specs and checkpoints (default: the class's
            ``module.QualName``).

    Raises ValueError, naming the node or layer, for a graph it cannot align (module docstring).
    """

    def __init__(
        self,
        factory: Callable[[], nn.Module],
        input_shape: tuple[int, ...] | list[int],
        *,
        name: str | None = None,
    ) -> None:
        check_factory(factory, "factory")
        self.factory = factory
        self.input_shape = tuple(int(d) for d in input_shape)
        template = factory()
        if not isinstance(template, nn.Module):
            raise ValueError(f"the model factory returned a {type(template).__name__}")
        cls = type(template)
        self.name = name or f"{cls.__module__}.{cls.__qualname__}"
        self.model_class = cls
        graph_module = trace(template, self.input_shape, self.name)
        _INPUT_SHAPES[cls] = self.input_shape
        self._graph: GraphPlan | None = None
        try:
            steps = _trace_chain(graph_module, template, self.name)
        except _NotAChain:
            self._graph = GraphPlan(graph_module, template, self.name, self.input_shape)
            self._levels: list[list[_Step]] = []
            self.spec, self._names = self._graph.spec, self._graph.names
            return
        self._levels = _cut_levels(steps)
        widths = [template.get_submodule(s.path).weight.shape[0] for s in steps if s.affine]
        self.spec = ModelSpec(self.name, self.input_shape, int(widths[-1]), tuple(widths[:-1]))
        self._names = self._user_names(template)

    @classmethod
    def of(cls, model: nn.Module, input_shape: tuple[int, ...] | list[int]) -> ModelAdapter:
        """The adapter of ``model``'s class; fresh instances are deep copies of ``model`` with
        their parameters reset (for a class whose constructor needs arguments)."""

        def factory() -> nn.Module:
            fresh = copy.deepcopy(model)
            for module in fresh.modules():
                if hasattr(module, "reset_parameters"):
                    module.reset_parameters()
            return fresh

        return cls(factory, input_shape)

    def adapt(self, model: nn.Module) -> LeveledModel:
        """``model`` (an instance of the adapted class) as a :class:`LeveledModel` that shares
        its modules and parameters."""
        if type(model) is not self.model_class:
            raise ValueError(
                f"{self.name}: got a {type(model).__name__}, the adapter traced a "
                f"{self.model_class.__name__}"
            )
        if self._graph is not None:
            return self._graph.adapt(model).train(model.training)
        levels = []
        for steps in self._levels:
            modules = []
            for s in steps:
                if s.path is not None and s.affine:
                    modules.append(model.get_submodule(s.path))
                else:  # parameter-free: a copy, never run in place (a capture keeps its input)
                    own = model.get_submodule(s.path) if s.path else s.module
                    modules.append(out_of_place(copy.deepcopy(own)))
            levels.append(modules[0] if len(modules) == 1 else nn.Sequential(*modules))
        leveled = LeveledModel(levels, self.spec)
        return leveled.train(model.training)

    def user_names(self) -> dict[str, str]:
        """The leveled model's state-dict keys mapped to the user's (``levels.3.weight`` ->
        ``conv2.weight``): a chain's only state is its affine layers'; a graph level holds the
        user's tensors under their own keys (``levels.5.layer1.0.bn1.running_mean``)."""
        return dict(self._names)

    def _user_names(self, template: nn.Module) -> dict[str, str]:
        names = {}
        for index, steps in enumerate(self._levels):
            for position, step in enumerate(steps):
                if not step.affine:
                    continue
                prefix = f"levels.{index}" if len(steps) == 1 else f"levels.{index}.{position}"
                for key, _ in template.get_submodule(step.path).named_parameters():
                    names[f"{prefix}.{key}"] = f"{step.path}.{key}"
        return names

    def export(self, model: LeveledModel, into: nn.Module | None = None) -> nn.Module:
        """The weights of ``model`` (e.g. a fused model) in an instance of the user's class
        (``into``, or a fresh one), under the user's parameter names."""
        if model.spec != self.spec:
            raise ValueError(
                f"{self.name}: the model's spec {model.spec.to_dict()} is not the adapted "
                f"one {self.spec.to_dict()}"
            )
        target = into if into is not None else self.factory()
        state = model.state_dict()
        extra = sorted(set(state) - set(self._names))
        if extra:
            raise ValueError(f"{self.name}: state entries without a user name: {extra}")
        mapped = {self._names[key]: value for key, value in state.items()}
        if self._graph is not None:  # modules the forward pass never calls keep their values
            mapped = {**target.state_dict(), **mapped}
        target.load_state_dict(mapped)
        return target.train(model.training)

    def register(self) -> ModelAdapter:
        """Make ``build_model(spec)`` of this architecture build the user's model (adapted):
        fused models and checkpoints of it can then be made and loaded. Idempotent."""
        register_architecture(self.name, self._build)
        return self

    def _build(self, spec: ModelSpec) -> LeveledModel:
        if spec != self.spec:
            raise ValueError(
                f"{self.name}: an adapted model has the widths its class defines "
                f"{list(self.spec.widths)} (input {list(self.spec.input_shape)}, "
                f"{self.spec.num_classes} classes); asked for {spec.to_dict()}"
            )
        return self.adapt(self.factory())


class _NotAChain(ValueError):
    """The graph is no chain of levels the chain adapter keeps (the graph adapter takes it)."""


def _trace_chain(graph_module: fx.GraphModule, template: nn.Module, name: str) -> list[_Step]:
    """The traced graph of ``template`` as a chain of steps; refuses a model fedfuse cannot
    fuse at all, and raises :class:`_NotAChain` for any other graph than a chain."""
    nodes = list(graph_module.graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    if len(inputs) != 1:
        raise ValueError(f"{name}: the forward pass takes {len(inputs)} inputs, fedfuse needs 1")
    affine_nodes = [
        n
        for n in nodes
        if n.op == "call_module"
        and isinstance(template.get_submodule(n.target), nn.Linear | nn.Conv2d)
    ]
    if not affine_nodes:
        raise ValueError(f"{name}: the model has no Linear or Conv2d layer to fuse")
    after = nodes[nodes.index(affine_nodes[-1]) + 1 : -1]
    if after:
        raise ValueError(
            f"{name}: {after[0].name!r} comes after the classifier {affine_nodes[-1].target!r}; "
            "fedfuse's methods read the logits, so return them (apply softmax outside the model)"
        )
    steps: list[_Step] = []
    previous = inputs[0]
    for node in nodes:
        if node.op == "placeholder":
            continue
        where = f"{name}: node {node.name!r} ({_describe(node)})"
        if len(previous.users) != 1:
            users = ", ".join(sorted(u.name for u in previous.users))
            raise _NotAChain(
                f"{name}: the output of {previous.name!r} feeds {len(previous.users)} "
                f"operations ({users}): a branch (e.g. a residual connection); fedfuse adapts "
                "chains of layers (use its 'resnet' or 'vit' architectures for residual models)"
            )
        tensor_inputs = node.all_input_nodes
        if tensor_inputs != [previous]:
            raise _NotAChain(f"{where} combines several tensors (a branch); fedfuse adapts chains")
        if node.op == "output":
            break
        steps.append(_step(template, node, previous, where))
        previous = node
    return steps


def _is_affine(template: nn.Module, node: fx.Node) -> bool:
    return isinstance(template.get_submodule(str(node.target)), nn.Linear | nn.Conv2d)


def _step(template: nn.Module, node: fx.Node, previous: fx.Node, where: str) -> _Step:
    if node.op == "call_module":
        module = template.get_submodule(node.target)
        if isinstance(module, nn.Linear | nn.Conv2d):
            if affine_view(module) is None:
                raise _NotAChain(
                    f"{where}: a {type(module).__name__} with groups or non-zero padding mode "
                    "is not an affine level fedfuse can fit"
                )
            return _Step(node.name, path=str(node.target), affine=True)
        if any(True for _ in module.parameters()):
            raise _NotAChain(
                f"{where}: {type(module).__name__} layers have parameters fedfuse cannot align in "
                "a plain model (only Linear and Conv2d); fold normalisation into the preceding "
                "layer, or use fedfuse's own architectures"
            )
        if isinstance(module, nn.Flatten):
            return _Step(node.name, module=_Flatten(), flattens=_is_flatten(node, previous, where))
        if isinstance(module, CHANNELWISE_MODULES):
            return _Step(node.name, path=str(node.target))
        raise _NotAChain(f"{where}: {type(module).__name__} is not known to preserve channels")
    if node.op in ("call_function", "call_method"):
        target = node.target
        plain = set(node.kwargs) <= {"inplace"} and len(node.args) == 1
        if target in ACTIVATION_FUNCTIONS and plain:
            return _Step(node.name, module=ACTIVATION_FUNCTIONS[target]())
        if target in FLATTENS:
            return _Step(node.name, module=_Flatten(), flattens=_is_flatten(node, previous, where))
        if target in CHANNELWISE_FUNCTIONS or target in ACTIVATION_FUNCTIONS:
            position = list(node.args).index(previous)
            args = tuple(None if i == position else arg for i, arg in enumerate(node.args))
            kwargs = dict(node.kwargs)
            if kwargs.get("inplace") is True:  # F.relu(x, inplace=True): out of place in a level
                kwargs["inplace"] = False
            call = _Call(node.op, target, args, position, kwargs)
            return _Step(node.name, module=call)
    if node.op == "get_attr":
        raise _NotAChain(f"{where}: reads a tensor attribute directly; fedfuse adapts layers")
    raise _NotAChain(
        f"{where}: not an operation fedfuse can align neurons through (known: Linear, Conv2d, "
        "elementwise activations, pooling, dropout, and a flatten before a Linear)"
    )


def _is_flatten(node: fx.Node, previous: fx.Node, where: str) -> bool:
    before = previous.meta.get("tensor_meta")
    after = node.meta.get("tensor_meta")
    shape_in = tuple(before.shape) if before is not None else ()
    shape_out = tuple(after.shape) if after is not None else ()
    if (
        len(shape_out) != 2
        or shape_out[0] != shape_in[:1][0]
        or shape_out[1] != math.prod(shape_in[1:])
    ):
        raise _NotAChain(
            f"{where}: reshapes {list(shape_in)} into {list(shape_out)}; fedfuse aligns through "
            "a flatten of every feature of a sample only"
        )
    return True


def _cut_levels(steps: list[_Step]) -> list[list[_Step]]:
    """Levels: each affine layer, each parameter-free step; a flatten and what follows it join
    the next affine layer's level (as in fedfuse's MLP and VGG), which must be a Linear."""
    levels: list[list[_Step]] = []
    pending: list[_Step] = []
    for step in steps:
        if step.flattens or pending:
            pending.append(step)
            if step.affine:
                levels.append(pending)
                pending = []
            continue
        levels.append([step])
    return levels


def _describe(node: fx.Node) -> str:
    target = node.target
    text = getattr(target, "__name__", None) or str(target)
    return text if node.op != "call_function" or target is not operator.add else "add"


#: the input shape each class was last adapted on (a fusion without a fusion set reuses it)
_INPUT_SHAPES: dict[type, tuple[int, ...]] = {}


def known_input_shape(model_class: type) -> tuple[int, ...] | None:
    """The input shape ``model_class`` was last adapted on in this process (by a
    :class:`ModelAdapter`, ``LocalSites`` or ``compute_site_extras``), None if never."""
    return _INPUT_SHAPES.get(model_class)


#: square image sides tried for a model whose first layer is a convolution (ImageNet's last)
_IMAGE_SIDES = (28, 32, 64, 96, 16, 224)


def infer_input_shape(model: nn.Module) -> tuple[int, ...] | None:
    """An input shape ``model`` runs on, read off its first layer (a ``Linear``: its features;
    a ``Conv1d``/``Conv2d``: its channels, with the model's ``image_size`` or a common side),
    each guess checked by tracing; None when none runs. For methods without a fusion set, which
    need a shape only to trace the model (any shape it runs on cuts the same levels)."""
    first = next(
        (m for m in model.modules() if isinstance(m, nn.Linear | nn.Conv1d | nn.Conv2d)), None
    )
    if first is None:
        return None
    if isinstance(first, nn.Linear):
        guesses = [(first.in_features,)]
    else:
        side = getattr(model, "image_size", None)
        sides = ([side] if isinstance(side, int) else []) + list(_IMAGE_SIDES)
        spatial = 1 if isinstance(first, nn.Conv1d) else 2
        guesses = [(first.in_channels, *(s,) * spatial) for s in dict.fromkeys(sides)]
    for shape in guesses:
        try:
            trace(model, shape, type(model).__name__)
        except ValueError:
            continue
        return shape
    return None


def check_factory(factory: object, what: str) -> None:
    """Refuse a model instance where a factory is expected: calling an instance runs its forward
    pass without input, which fails far from the cause (``forward() missing ... 'x'``).

    Raises:
        TypeError: naming what to pass instead.
    """
    if isinstance(factory, nn.Module):
        cls = type(factory).__name__
        raise TypeError(
            f"{what} is a {cls} instance; pass the class ({what}={cls}) or a zero-argument "
            f"function returning a new model ({what}=lambda: {cls}(...)): fedfuse builds a fresh "
            "model for every fused result"
        )
    if not callable(factory):
        raise TypeError(
            f"{what} is a {type(factory).__name__}; pass the model class or a zero-argument "
            "function returning a new model"
        )


def is_adaptable(model: nn.Module) -> bool:
    """Whether ``model`` is a plain module that :class:`ModelAdapter` must adapt (not already a
    :class:`LeveledModel`)."""
    return isinstance(model, nn.Module) and not isinstance(model, LeveledModel)


__all__ = [
    "ModelAdapter",
    "check_factory",
    "infer_input_shape",
    "is_adaptable",
    "known_input_shape",
]
