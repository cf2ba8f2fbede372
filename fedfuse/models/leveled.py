"""Models as sequences of levels (paper Sec. 3): the one place that defines what a level is.

A *level* is a sub-network with a single output; the model is the composition of its levels.
Levels that own parameters have *neurons*: the channels (dim 1) of their output. Parameter-free
levels (activations, pooling) are applied as they are and have nothing to align. Anything with
branches (a residual block, an attention block) fits inside one level, so ResNets and ViTs are
written the same way: a list of blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from fedfuse.models.spec import ModelSpec


class LeveledModel(nn.Module):
    """A network whose forward pass is the composition of ``levels``, rebuilt from ``spec``."""

    def __init__(self, levels: Sequence[nn.Module], spec: ModelSpec) -> None:
        super().__init__()
        self.levels = nn.ModuleList(levels)
        self.spec = spec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_levels(x)

    def forward_levels(
        self, x: torch.Tensor, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        """Apply levels ``start .. stop-1`` to ``x`` (the input of level ``start``)."""
        for level in self.levels[start:stop]:
            x = level(x)
        return x

    @property
    def num_levels(self) -> int:
        return len(self.levels)

    def has_neurons(self, index: int) -> bool:
        """Whether level ``index`` owns parameters (and so neurons to align or fuse)."""
        return any(True for _ in self.levels[index].parameters())

    @property
    def neuron_levels(self) -> list[int]:
        """Indices of the levels that own neurons, bottom-up; the last one is the classifier."""
        return [i for i in range(self.num_levels) if self.has_neurons(i)]

    def is_residual(self, index: int) -> bool:
        """Whether level ``index`` adds its input to its output channel by channel (an identity
        shortcut): its neurons then share the order of its input's neurons."""
        return bool(getattr(self.levels[index], "residual", False))

    def level_stages(self) -> list[int]:
        """A stage per neuron level, non-decreasing; levels of one stage are interchangeable in
        depth (a ResNet's blocks of one resolution). Default: every level its own stage."""
        stages = self.spec.options.get("blocks")  # blocks per stage, after a stem
        if stages is None:
            return list(range(len(self.neuron_levels)))
        return [-1, *(s for s, n in enumerate(stages) for _ in range(int(n))), len(stages)]

    def level_width(self, index: int) -> int:
        """Number of neurons (output channels) of level ``index``."""
        if not self.has_neurons(index):
            raise ValueError(f"level {index} ({type(self.levels[index]).__name__}) has no neurons")
        widths = dict(
            zip(self.neuron_levels, (*self.spec.widths, self.spec.num_classes), strict=True)
        )
        return widths[index]

    def level_name(self, index: int) -> str:
        """A short readable name for level ``index``, e.g. ``"2:Linear"``."""
        level = self.levels[index]
        label = getattr(level, "label", None)  # a graph level: the user's module path
        if label is not None:
            return f"{index}:{label}"
        inner = [m for m in level.modules() if not isinstance(m, nn.Sequential)]
        kinds = [type(m).__name__ for m in inner if type(m).__name__ != "Flatten"]
        return f"{index}:{'+'.join(kinds) or type(level).__name__}"


def corresponding_levels(model: LeveledModel, target: LeveledModel) -> dict[int, int]:
    """For each neuron level of ``target``, the neuron level of ``model`` at the same depth.

    Models of one depth correspond level by level. Models of different depths (a ResNet-34
    fused into a ResNet-18) correspond stage by stage: the ``j``-th of ``n`` target levels of a
    stage takes the ``m``-th of ``n'`` model levels with ``m = ceil((j + 1) n' / n) - 1``, so
    each stage's last level (its output) maps onto the other's last.
    """
    ours, theirs = model.neuron_levels, target.neuron_levels
    if len(ours) == len(theirs) and model.num_levels == target.num_levels:
        return dict(zip(theirs, ours, strict=True))
    our_stages, their_stages = model.level_stages(), target.level_stages()
    if sorted(set(our_stages)) != sorted(set(their_stages)):
        raise ValueError(
            f"a {model.spec.arch} model with {len(ours)} neuron levels has no level-by-level or "
            f"stage-by-stage correspondence with one of {len(theirs)} ({target.spec.arch})"
        )
    mapping = {}
    for stage in sorted(set(their_stages)):
        mine = [lvl for lvl, s in zip(ours, our_stages, strict=True) if s == stage]
        wanted = [lvl for lvl, s in zip(theirs, their_stages, strict=True) if s == stage]
        for j, level in enumerate(wanted):
            mapping[level] = mine[-(-(j + 1) * len(mine) // len(wanted)) - 1]
    return mapping
