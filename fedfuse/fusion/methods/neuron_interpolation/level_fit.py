"""What fitting one fused level reads, shared by the level-by-level fit
(:class:`~.methods.NeuronInterpolation`) and the fits it calls (:mod:`.linear`, :mod:`.gradient`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class LevelFit:
    """What fitting one fused level reads: its index and module, its input ``x`` on the
    fusion set, the base models' outputs there (``widths`` neurons each), its width ``k``,
    and the captures and level mappings of the base models."""

    index: int
    level: nn.Module
    x: torch.Tensor
    outputs: list[torch.Tensor]
    widths: list[int]
    k: int
    captured: list[dict[int, Any]]
    mappings: list[dict[int, int]]
    #: every model's outputs side by side (``samples x sum(widths)``; ``outputs`` are its
    #: column blocks) when the level is a linear one of many models, else None
    columns: torch.Tensor | None = None
    #: the groups' centres of the base weights on the level's inputs (:mod:`.prior`), on demand
    prior_weights: Callable[..., torch.Tensor | None] | None = None


__all__ = ["LevelFit"]
