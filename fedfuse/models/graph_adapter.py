"""The plan that turns a user's model with branches or normalisation into levels, and back.

:class:`~fedfuse.models.adapter.ModelAdapter` keeps a plain chain of ``Linear``/``Conv2d``
layers as fedfuse's MLP and VGG are cut; any other traceable model takes this plan: its graph
cut into levels where one tensor is live (:mod:`fedfuse.models.graph_levels`), each level over
the user's own modules, and its feature spaces derived from the graph
(:mod:`fedfuse.models.graph_symmetry`) and written on the leveled model's keys. Methods that
need no alignment fuse it by parameter name; those that align use the derived spaces, or are
refused with the one-line reason the derivation gave.
"""

from __future__ import annotations

from torch import fx, nn

from fedfuse.models.graph_levels import Segment, cut_segments, output_shape
from fedfuse.models.graph_symmetry import DerivedSpace, Refusal, derive_spaces
from fedfuse.models.leveled import LeveledModel
from fedfuse.models.spec import ModelSpec
from fedfuse.models.symmetry import Axis, FeatureSpace


class GraphPlan:
    """How instances of one traced class become leveled models (``levels``), their spec, the
    leveled-to-user name map (``names``) and the derived spaces (or the refusal)."""

    def __init__(
        self,
        graph_module: fx.GraphModule,
        template: nn.Module,
        name: str,
        input_shape: tuple[int, ...],
    ) -> None:
        self.graph_module = graph_module
        self.segments = cut_segments(graph_module)
        levels = self.levels(template)
        nodes = {node.name: node for node in graph_module.graph.nodes}
        outputs = [output_shape(nodes[s.nodes[-1]]) for s in self.segments]
        logits = outputs[-1]
        if logits is None or len(logits) != 2:
            raise ValueError(f"{name}: the model returns {logits}, fedfuse reads (batch, classes)")
        owning = [i for i, level in enumerate(levels) if any(True for _ in level.parameters())]
        if not owning or owning[-1] != len(levels) - 1:
            raise ValueError(f"{name}: the model's last operation is no layer with parameters")
        widths = tuple(_channels(outputs[i]) for i in owning[:-1])
        self.spec = ModelSpec(name, input_shape, int(logits[1]), widths)
        self.names = {
            f"levels.{index}.{key}": key
            for index, level in enumerate(levels)
            for key in level.state_dict()
        }
        self.spaces: tuple[FeatureSpace, ...] | Refusal
        try:
            derived = derive_spaces(graph_module, template, name)
        except Refusal as error:
            self.spaces = error
        else:
            self.spaces = tuple(self._on_levels(space, nodes) for space in derived)

    def levels(self, model: nn.Module) -> list[nn.Module]:
        """The levels of ``model`` (an instance of the traced class), sharing its modules."""
        levels = [segment.build(model, self.graph_module) for segment in self.segments]
        for segment, level in zip(self.segments, levels, strict=True):
            level.label = _label(segment)
        return levels

    def adapt(self, model: nn.Module) -> LeveledModel:
        leveled = LeveledModel(self.levels(model), self.spec)
        leveled.derived_spaces = self.spaces
        return leveled

    def _on_levels(self, space: DerivedSpace, nodes: dict[str, fx.Node]) -> FeatureSpace:
        """``space`` on the leveled keys (every level's copy of a shared tensor) and probes."""
        copies: dict[str, list[str]] = {}
        for leveled, user in self.names.items():
            copies.setdefault(user, []).append(leveled)
        axes = tuple(
            Axis(key, axis.dim, axis.produces, axis.repeat, axis.offset)
            for axis in space.axes
            for key in copies[axis.key]
        )
        calls: dict[str, int] = {}
        for node in nodes.values():
            if node.op == "call_module":
                calls[str(node.target)] = calls.get(str(node.target), 0) + 1
        where = {name: (i, s) for i, s in enumerate(self.segments) for name in s.nodes}
        root = self.graph_module

        def captured(name: str, projection: str = "") -> str | None:
            """The leveled module whose output is node ``name``'s, if one is."""
            index, segment = where.get(name, (None, None))
            if segment is None:
                return None
            node = nodes[name]
            if segment.nodes[-1] == name and not projection:
                return f"levels.{index}"
            if (
                node.op == "call_module"
                and calls[str(node.target)] == 1
                and any(True for _ in root.get_submodule(str(node.target)).parameters())
            ):
                return f"levels.{index}.{node.target}" + (f"#{projection}" if projection else "")
            return None

        probes, read = [], []
        dims = dict(space.probes)
        for probe, dim in space.probes:
            name, _, projection = probe.partition("#")  # a packed attention projection
            found = captured(name, projection)
            if found is None:
                continue
            probes.append((found, dim))
            if projection:
                read.append((found, dim))
        for name in space.read:  # or, not capturable (a shared ReLU), the node it activates
            node = nodes[name]
            found = captured(name)
            while found is None and len(node.all_input_nodes) == 1:
                node = node.all_input_nodes[0]
                if node.name not in dims:
                    break
                found = captured(node.name)
            if found is not None and (found, dims[name]) not in read:
                read.append((found, dims[name]))
        # what the next learned maps read (a stream after its block's activation), where that
        # can be captured; else every node that holds the space
        chosen = [p for p in probes if p in read] + [p for p in read if p not in probes] or probes
        return FeatureSpace(space.name, space.size, axes, tuple(chosen), space.groups)


def _channels(shape: tuple[int, ...] | None) -> int:
    """A level's width: its output's channels (the last dim of a token sequence)."""
    if shape is None or len(shape) < 2:
        return 1
    return int(shape[-1] if len(shape) == 3 else shape[1])


def _label(segment: Segment) -> str:
    """A level's name: the user's module path its modules share (``layer1.0``), else its
    first and last node."""
    targets = [t for t in segment.targets if "." in t] or list(segment.targets)
    if targets:
        prefix = targets[0].split(".")
        for target in targets[1:]:
            parts = target.split(".")
            common = 0
            while common < min(len(prefix), len(parts)) and prefix[common] == parts[common]:
                common += 1
            prefix = prefix[:common]
        if prefix and len(targets) > 1:
            return ".".join(prefix)
    first, last = segment.nodes[0], segment.nodes[-1]
    return first if first == last else f"{first}..{last}"
