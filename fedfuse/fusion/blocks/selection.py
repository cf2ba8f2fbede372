"""Choosing among candidate fused models on the server's labelled fusion set.

Several methods leave a choice open to an ``"auto"`` option: Fisher merging's damping, CCA
Merge's covariance ridge, OTFusion's ground metric, reference and averaging weights, Git
Re-Basin's matching and averaging weights, FedMA's noise std. Each fuses with every candidate,
in its order of *preference* (first: the value the method takes without a labelled fusion set,
the papers' default), and keeps (:func:`best_on_fusion_set`; never the test set):

1. only the candidates whose fusion-set *accuracy* is not significantly below another's: by a
   paired comparison on the same rows, candidate ``a`` is significantly below ``b`` when
   ``b`` is right on ``n_b`` rows where ``a`` is wrong, ``a`` on ``n_a`` where ``b`` is wrong,
   and ``n_b - n_a > SIGNIFICANCE * sqrt(n_b + n_a)`` (one standard error of the difference,
   McNemar's statistic; Breiman's one-standard-error rule);
2. of those, the first in the order of preference.

The most accurate candidate always qualifies, so a candidate is replaced only on evidence; the
cross-entropy is still measured and reported.

Why accuracy, and why a standard error (issue 52): on LeNets trained with another recipe than
fedfuse's (SGD with momentum, 30 epochs, no label smoothing; ``benchmarks/other_recipe_lenet.py``)
the fusion-set loss picked low-accuracy candidates: confident sites make flat-predicting fused
models (large Fisher damping, uniform averages) score a low cross-entropy while they classify
worse. Accuracy alone, on 500 rows, still swung on differences of a few rows that reversed on
the test set (OTFusion's uniform weights: +0.8 points on the fusion set, -0.8 on test); the
paired standard error keeps the preferred value there and changes it where the evidence is large
(OTFusion's weight cost over activations, +15 points). The candidates these options choose
between are fitted without the fusion set's labels (Fisher uploads, alignments by activations
or weights), so the labelled fusion set is a held-out set for the choice.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from fedfuse.fusion.inputs import FusionInputs
from fedfuse.models import LeveledModel

log = logging.getLogger(__name__)

Key = TypeVar("Key", bound=Hashable)
#: a fused model and its details, as a method's ``_fuse`` returns them
Fused = tuple[LeveledModel, dict[str, Any]]
#: standard errors of the paired difference by which a candidate must be below another to lose
SIGNIFICANCE = 1.0


@dataclass
class Chosen(Generic[Key]):
    """The chosen candidate, and every candidate's fusion-set loss and accuracy in order."""

    key: Key
    model: LeveledModel
    details: dict[str, Any]
    losses: dict[Key, float]
    accuracies: dict[Key, float] = field(default_factory=dict)


@torch.no_grad()
def fusion_set_predictions(
    model: LeveledModel, inputs: FusionInputs, batch_size: int = 256
) -> tuple[torch.Tensor, float]:
    """Per row of the labelled fusion set, whether ``model`` classifies it right (bool), and
    its mean cross-entropy (on the CPU)."""
    if inputs.data is None or inputs.labels is None:
        raise ValueError("the fusion-set scores need FusionInputs.data and FusionInputs.labels")
    model = model.cpu().eval()
    right, total = [], 0.0
    labels = inputs.labels.cpu()
    for x, y in zip(inputs.data.cpu().split(batch_size), labels.split(batch_size), strict=True):
        logits = model(x)
        total += torch.nn.functional.cross_entropy(logits, y, reduction="sum").item()
        right.append(logits.argmax(dim=1) == y)
    return torch.cat(right), total / len(labels)


def fusion_set_scores(
    model: LeveledModel, inputs: FusionInputs, batch_size: int = 256
) -> tuple[float, float]:
    """``(accuracy, mean cross-entropy)`` of ``model`` on the labelled fusion set."""
    right, loss = fusion_set_predictions(model, inputs, batch_size)
    return float(right.double().mean()), loss


def significantly_below(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the per-row right answers ``a`` are significantly fewer than ``b``'s (module
    docstring: ``n_b - n_a > SIGNIFICANCE * sqrt(n_b + n_a)``)."""
    only_b, only_a = int((b & ~a).sum()), int((a & ~b).sum())
    return only_b - only_a > SIGNIFICANCE * math.sqrt(only_a + only_b)


def best_on_fusion_set(
    candidates: Iterable[tuple[Key, Fused]], inputs: FusionInputs, batch_size: int = 256
) -> Chosen[Key]:
    """Of the candidates ``(key, (model, details))``, in order of preference, the first whose
    fusion-set accuracy no other candidate's is significantly above (module docstring).

    ``candidates`` may be a generator: each model is measured when it comes, and a model is
    dropped as soon as one candidate is significantly above it. Raises ValueError when there is
    no candidate.
    """
    kept: list[tuple[Key, torch.Tensor, Fused]] = []
    measured: list[torch.Tensor] = []
    losses: dict[Key, float] = {}
    accuracies: dict[Key, float] = {}
    for key, fused in candidates:
        right, loss = fusion_set_predictions(fused[0], inputs, batch_size)
        losses[key], accuracies[key] = loss, float(right.double().mean())
        measured.append(right)
        kept = [k for k in kept if not significantly_below(k[1], right)]
        if not any(significantly_below(right, other) for other in measured):
            kept.append((key, right, fused))
    if not measured:
        raise ValueError("no candidate fused model to choose from")
    key, _, (model, details) = kept[0]
    return Chosen(key, model, details, losses, accuracies)


#: the former name, when the criterion was the loss alone
lowest_fusion_set_loss = best_on_fusion_set


def preferred_first(grid: Sequence[float], preferred: float) -> list[float]:
    """``grid`` with ``preferred`` moved to the front (added when not in it)."""
    return [preferred] + [v for v in grid if v != preferred]


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
    """``fuse(value)`` for a number; for ``"auto"``, the fusion with the value of ``grid`` that
    :func:`best_on_fusion_set` keeps, ``unlabelled`` preferred (``details["fusion_set_losses"]``
    and ``details["fusion_set_accuracies"]``: each value's, keyed by its ``str``), or with
    ``unlabelled`` when there is no labelled fusion set."""
    if value != "auto":
        return fuse(float(value))
    if inputs.data is None or inputs.labels is None:
        log.info("%s: no labelled fusion set to choose %s by; %s", method, option, unlabelled)
        return fuse(unlabelled)
    values = preferred_first(grid, unlabelled)
    chosen = best_on_fusion_set(((v, fuse(v)) for v in values), inputs)
    chosen.details["fusion_set_losses"] = {str(v): loss for v, loss in chosen.losses.items()}
    chosen.details["fusion_set_accuracies"] = {str(v): a for v, a in chosen.accuracies.items()}
    return chosen.model, chosen.details
