"""Choosing among candidate fused models by their loss on the server's labelled fusion set.

Several methods leave a choice open to an ``"auto"`` option: Fisher merging's damping, CCA
Merge's covariance ridge, OTFusion's ground metric, reference and averaging weights, Git
Re-Basin's averaging weights. Each fuses with every candidate and keeps the fused model with the
lowest cross-entropy on the labelled fusion set (:func:`~fedfuse.fusion.inputs.fusion_set_loss`;
never the test set). The rule lives here once: candidates are measured as they come, only the
best so far is kept, and of equal losses the first wins.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from fedfuse.fusion.inputs import FusionInputs, fusion_set_loss
from fedfuse.models import LeveledModel

log = logging.getLogger(__name__)

Key = TypeVar("Key", bound=Hashable)
#: a fused model and its details, as a method's ``_fuse`` returns them
Fused = tuple[LeveledModel, dict[str, Any]]


@dataclass
class Chosen(Generic[Key]):
    """The candidate with the lowest fusion-set loss, and every candidate's loss in order."""

    key: Key
    model: LeveledModel
    details: dict[str, Any]
    losses: dict[Key, float]


def lowest_fusion_set_loss(
    candidates: Iterable[tuple[Key, Fused]], inputs: FusionInputs, batch_size: int = 256
) -> Chosen[Key]:
    """The candidate ``(key, (model, details))`` whose model has the lowest fusion-set loss.

    ``candidates`` may be a generator: each model is measured when it comes, and only the best
    one so far is held. Raises ValueError when there is no candidate.
    """
    best: tuple[float, Key, Fused] | None = None
    losses: dict[Key, float] = {}
    for key, fused in candidates:
        loss = fusion_set_loss(fused[0], inputs, batch_size)
        losses[key] = loss
        if best is None or loss < best[0]:
            best = (loss, key, fused)
    if best is None:
        raise ValueError("no candidate fused model to choose from")
    _, key, (model, details) = best
    return Chosen(key, model, details, losses)


def fuse_with_option(
    method: str,
    option: str,
    value: float | str,
    fuse: Callable[[float], Fused],
    *,
    grid: Sequence[float],
    unlabelled: float,
    inputs: FusionInputs,
) -> Fused:
    """``fuse(value)`` for a number; for ``"auto"``, the fusion with the value of ``grid`` of
    lowest fusion-set loss (``details["fusion_set_losses"]``: each value's, keyed by its
    ``str``), or with ``unlabelled`` when there is no labelled fusion set."""
    if value != "auto":
        return fuse(float(value))
    if inputs.data is None or inputs.labels is None:
        log.info("%s: no labelled fusion set to choose %s by; %s", method, option, unlabelled)
        return fuse(unlabelled)
    chosen = lowest_fusion_set_loss(((v, fuse(v)) for v in grid), inputs)
    chosen.details["fusion_set_losses"] = {str(v): loss for v, loss in chosen.losses.items()}
    return chosen.model, chosen.details
