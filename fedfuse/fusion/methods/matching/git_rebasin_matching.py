"""Git Re-Basin's matching step: the cost between two models' neurons and the permutations
MergeMany finds for one hidden level or feature space, with what the details say of them.

:func:`match_neurons` and :func:`cost_matrix` compare two models' neurons by their
pre-activations (correlation or squared distance); :meth:`MergeMany.permutations` runs MergeMany
(:func:`~fedfuse.fusion.blocks.matching.merge_many`) on one level's or space's pairwise costs,
once per candidate weighting. The options, the averaging and the choice among weightings are
the method's (:mod:`fedfuse.fusion.methods.matching.git_rebasin`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fedfuse.fusion.blocks.matching import (
    correlation,
    linear_assignment,
    merge_many,
    squared_distances,
)

log = logging.getLogger(__name__)

MATCHING_COSTS = ("correlation", "l2")


def check_cost(cost: str) -> None:
    """Raise ValueError, naming the choices, unless ``cost`` is one of :data:`MATCHING_COSTS`."""
    if cost not in MATCHING_COSTS:
        raise ValueError(f"cost must be one of {MATCHING_COSTS}, got {cost!r}")


def match_neurons(
    a: torch.Tensor, b: torch.Tensor, cost: str = "correlation", batch_size: int = 256
) -> tuple[torch.Tensor, float]:
    """The permutation of ``b``'s neurons onto ``a``'s and the mean matched cost.

    Args:
        a, b: level outputs ``(N, n, ...)`` (or ``(R, n)`` matrices, neurons as columns).
        cost: ``"correlation"`` (maximise the summed correlation) or ``"l2"`` (minimise the
            summed squared distance, divided by the rows).
        batch_size: samples per float64 chunk.

    Returns:
        ``permutation`` (``b``'s neuron matched to ``a``'s neuron ``i``; use it with
        :func:`~fedfuse.fusion.blocks.alignment.permute_level`) and the mean matched correlation or
        squared distance.
    """
    matrix = cost_matrix(a, b, cost, batch_size)
    permutation = linear_assignment(matrix)
    matched = matrix[torch.arange(len(permutation)), permutation.to(matrix.device)].mean()
    return permutation, float(-matched if cost == "correlation" else matched)


def cost_matrix(
    a: torch.Tensor, b: torch.Tensor, cost: str = "correlation", batch_size: int = 256
) -> torch.Tensor:
    """``(n, n)`` float64 cost between ``a``'s and ``b``'s neurons: minus the correlation, or the
    squared distance divided by the rows (arguments as :func:`match_neurons`)."""
    check_cost(cost)
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"cannot permute {b.shape[1]} neurons onto {a.shape[1]}")
    if cost == "correlation":
        return -correlation(a, b, batch_size)
    return squared_distances(a, b, batch_size)


@dataclass(frozen=True)
class MergeMany:
    """MergeMany (:func:`~fedfuse.fusion.blocks.matching.merge_many`) with the method's settings:
    the kind of cost (``"correlation"`` costs are minus the correlation), the most rounds and the
    seed of the order of visits (offset per level or space)."""

    cost: str
    rounds: int
    seed: int

    def permutations(
        self,
        costs: dict[tuple[int, int], torch.Tensor],
        weightings: Mapping[str, list[float]],
        *,
        offset: int,
        label: dict[str, Any],
        started: float,
        assign: Callable[[torch.Tensor], torch.Tensor] = linear_assignment,
        probes: int = 1,
    ) -> dict[str, tuple[list[torch.Tensor], dict[str, Any]]]:
        """MergeMany on one level's (or feature space's) pairwise ``costs``, per weighting.

        Args:
            costs: the cost between every pair ``i < j`` of models (:func:`cost_matrix`).
            weightings: the candidate model weights, by name (MergeMany's ``c``).
            offset: added to the seed (the level's index, or the space's position).
            label: what names the level or space in its details (e.g. ``{"level": "fc1"}``).
            started: when the costs began (``time.perf_counter()``), for ``seconds``.
            assign: the assignment solver (per attention head for grouped spaces).
            probes: the probes ``costs`` are summed over (the reported match is per probe).

        Returns:
            Per weighting, every model's permutation (model 0's the identity) and its details:
            ``label``, ``matched`` (the mean matched correlation, or squared distance per row,
            averaged over the pairs of models), the moves and ``seconds``.
        """
        cost_seconds = time.perf_counter() - started
        merged = {}
        for weighting, weights in weightings.items():
            begun = time.perf_counter()
            permutations, rounds = merge_many(
                costs, weights, rounds=self.rounds, seed=self.seed + offset, assign=assign
            )
            matched = _matched(costs, permutations) / probes
            seconds = cost_seconds + time.perf_counter() - begun
            details = {
                **label,
                "matched": -matched if self.cost == "correlation" else matched,
                **_moves(permutations, rounds),
                "seconds": seconds,
            }
            log.debug("merged %s (%s): matched %.4g (%.3f s)", label, weighting, matched, seconds)
            merged[weighting] = (permutations, details)
        return merged


def _matched(costs: dict[tuple[int, int], torch.Tensor], permutations: list[torch.Tensor]) -> float:
    """The mean cost of the aligned neurons, averaged over the pairs of models."""
    means = [float(cost[permutations[i], permutations[j]].mean()) for (i, j), cost in costs.items()]
    return sum(means) / len(means)


def _moves(permutations: list[torch.Tensor], rounds: int) -> dict[str, Any]:
    """What the details say of one level's (or space's) permutations: ``moved`` (neurons
    not matched to their own index, summed over models 1..N-1), MergeMany's ``rounds``, and
    ``permutation`` (model 1's; two models) or ``permutations`` (each model's; more)."""
    identity = torch.arange(len(permutations[0]))
    described: dict[str, Any] = {
        "moved": sum(int((p != identity).sum()) for p in permutations[1:]),
        "rounds": rounds,
    }
    if len(permutations) == 2:
        described["permutation"] = permutations[1].tolist()
    else:
        described["permutations"] = [p.tolist() for p in permutations]
    return described
