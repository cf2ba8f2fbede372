"""A traced model with branches cut into levels: each level a piece of the user's graph.

A level must have a single output (:mod:`fedfuse.models.leveled`), so the graph is cut only
after a node whose tensor is the only value still needed by what follows: a residual block, an
attention block with its skip connection, or a ``cat`` of two branches stays inside one level.
Each level is an ``fx.GraphModule`` over the nodes between two cuts that holds the user's own
submodules and parameters under their own paths, so an adapted model shares the user's weights
and a level's state-dict keys are the user's keys behind ``levels.<index>.``. An activation the
user runs in place (``nn.ReLU(inplace=True)``, as torchvision's models do) runs out of place in a
level, so a level's output or a probed module's output is still what was captured after the next
level or module has run.
"""

from __future__ import annotations

import contextlib
import copy
import io
import operator
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp


def trace(template: nn.Module, input_shape: tuple[int, ...], name: str) -> fx.GraphModule:
    """``template`` traced by ``torch.fx``, each node's output shape recorded (``tensor_meta``)
    from a batch of two zero inputs; a ValueError in one line where either fails."""
    try:
        graph_module = fx.symbolic_trace(template)
    except Exception as error:  # torch.fx raises many kinds for untraceable code
        first = str(error).splitlines()[0] if str(error) else ""
        raise ValueError(
            f"{name}: torch.fx cannot trace the forward pass ({type(error).__name__}: {first}); "
            "fedfuse adapts models whose forward has no control flow on tensor values"
        ) from None
    training = template.training
    propagation = _ShapeProp(graph_module.eval())
    try:  # ShapeProp prints the traceback of a failing node to stderr before it re-raises
        with contextlib.redirect_stderr(io.StringIO()):
            propagation.propagate(torch.zeros(2, *input_shape))
    except Exception as error:  # any error of the user's forward pass
        raise ValueError(_shape_mismatch(name, input_shape, propagation.node, error)) from None
    finally:
        graph_module.train(training)
    return graph_module


class _ShapeProp(ShapeProp):
    """ShapeProp that remembers the node it ran last (the one that failed, when one does)."""

    node: fx.Node | None = None

    def run_node(self, n: fx.Node) -> object:
        self.node = n
        return super().run_node(n)


def _shape_mismatch(
    name: str, given: tuple[int, ...], node: fx.Node | None, error: Exception
) -> str:
    """One line for a forward pass that fails on ``given``: the failing layer, the input it
    expects against the one it got, and the knob to fix (``input_shape=``). ShapeProp wraps the
    error with a traceback in its message, so only the root error's first line is kept."""
    root: BaseException = error
    while root.__cause__ is not None:
        root = root.__cause__
    reason = (str(root).splitlines() or [type(root).__name__])[0]
    where = f"node {node.name!r}" if node is not None else "the forward pass"
    expected = ""
    if node is not None and node.op == "call_module":
        module = node.graph.owning_module.get_submodule(str(node.target))
        where = f"{node.target!r} ({type(module).__name__})"
        arg = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        got = output_shape(arg) if arg is not None and arg.op != "placeholder" else None
        got = got if got is not None else (2, *given)
        if isinstance(module, nn.Linear):
            expected = f"expects {module.in_features} features, got {got[-1]}"
        elif isinstance(module, nn.Conv1d | nn.Conv2d | nn.Conv3d):
            expected = f"expects {module.in_channels} channels, got shape {list(got[1:])}"
    detail = expected or f"fails ({reason})"
    return (
        f"{name}: input_shape {list(given)} does not fit the model: {where} {detail}; give "
        "input_shape= as one input's shape without the batch (e.g. (3, 32, 32))"
    )


def output_shape(node: fx.Node) -> tuple[int, ...] | None:
    """The shape of ``node``'s tensor output (None: not a tensor, e.g. a size or a tuple)."""
    meta = node.meta.get("tensor_meta")
    shape = getattr(meta, "shape", None)
    return tuple(int(d) for d in shape) if shape is not None else None


@dataclass(frozen=True)
class Segment:
    """The nodes of one level (in graph order) and the node whose tensor is its input."""

    source: str
    nodes: tuple[str, ...]
    graph: fx.Graph
    targets: tuple[str, ...]
    #: modules whose input is read again after them: never swapped for an out-of-place copy
    in_place: frozenset[str] = frozenset()

    def build(self, model: nn.Module, constants: fx.GraphModule) -> fx.GraphModule:
        """The level over ``model``'s own submodules and parameters (shared, not copied);
        tensor constants that tracing made live on the traced ``constants``."""
        root: dict[str, object] = {}
        for target in self.targets:
            try:
                module = operator.attrgetter(target)(model)
                root[target] = module if target in self.in_place else out_of_place(module)
            except AttributeError:
                root[target] = operator.attrgetter(target)(constants)
        return fx.GraphModule(root, self.graph, class_name="GraphLevel")


def out_of_place(module: object) -> object:
    """``module``, or for a parameterless module set to work in place (an activation, a
    dropout) a copy that does not: nothing of the user's model changes, and no tensor a level
    handed on or a hook kept is overwritten by the module that reads it next."""
    if (
        isinstance(module, nn.Module)
        and getattr(module, "inplace", False) is True
        and not any(True for _ in module.parameters())
    ):
        module = copy.deepcopy(module)
        module.inplace = False
    return module


def cut_segments(graph_module: fx.GraphModule) -> list[Segment]:
    """The graph's levels: cut after every node whose tensor is then the only live value."""
    nodes = list(graph_module.graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    body = [n for n in nodes if n.op not in ("placeholder", "output")]
    position = {node: index for index, node in enumerate(body)}
    end = len(body)
    last_use = {
        node: max((position.get(user, end) for user in node.users), default=-1)
        for node in (*inputs, *body)
    }
    segments: list[Segment] = []
    source, members = inputs[0], []
    for index, node in enumerate(body):
        members.append(node)
        live = [n for n in (*inputs, *body[: index + 1]) if last_use[n] > index]
        if live == [node] and output_shape(node) is not None:
            segments.append(_segment(source, members))
            source, members = node, []
    if any(node.users for node in members):
        raise ValueError(f"the graph's last values {[n.name for n in members]} are not one tensor")
    return segments


def _segment(source: fx.Node, members: list[fx.Node]) -> Segment:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {source: graph.placeholder("x")}
    in_place = set()
    for node in members:
        env[node] = graph.node_copy(node, lambda n: env[n])
        # an in-place op whose input nothing else reads runs out of place (F.relu(x,
        # inplace=True) here, modules in build); one whose input is read again keeps its effect
        read_again = any(len(arg.users) > 1 for arg in node.all_input_nodes)
        if read_again and node.op == "call_module":
            in_place.add(str(node.target))
        elif env[node].kwargs.get("inplace") is True and not read_again:
            env[node].kwargs = {**env[node].kwargs, "inplace": False}
    graph.output(env[members[-1]])
    targets = tuple(
        dict.fromkeys(str(n.target) for n in members if n.op in ("call_module", "get_attr"))
    )
    nodes = tuple(n.name for n in members)
    return Segment(source.name, nodes, graph, targets, frozenset(in_place))


def describe(node: fx.Node, root: nn.Module | None = None) -> str:
    """The operation of ``node`` in a few words: a module's class, a function's name."""
    if node.op == "call_module" and root is not None:
        return type(root.get_submodule(str(node.target))).__name__
    target = node.target
    if target is operator.add:
        return "add"
    return getattr(target, "__name__", None) or str(target)


def joined(first: fx.GraphModule, second: fx.GraphModule) -> fx.GraphModule:
    """One graph level running ``first`` then ``second``, over the same modules."""
    graph = fx.Graph()
    value: fx.Node | None = None
    root: dict[str, object] = {}
    for part in (first, second):
        env: dict[fx.Node, fx.Node] = {}
        for node in part.graph.nodes:
            if node.op == "placeholder":
                env[node] = value if value is not None else graph.placeholder("x")
            elif node.op == "output":
                value = env[node.args[0]]
            else:
                env[node] = graph.node_copy(node, lambda n, e=env: e[n])
                if node.op in ("call_module", "get_attr"):
                    root[str(node.target)] = operator.attrgetter(str(node.target))(part)
    assert value is not None
    graph.output(value)
    result = fx.GraphModule(root, graph, class_name="GraphLevel")
    labels = [getattr(p, "label", None) for p in (first, second)]
    if all(labels):
        result.label = "+".join(str(label) for label in labels)
    return result
