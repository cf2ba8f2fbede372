"""OTFusion's alignment step: every model's neurons transported onto a reference model's.

:class:`Transport` holds the solver's settings. On the level path (affine levels),
:meth:`Transport.levels` aligns level by level, bottom-up, with the ground cost of the
activations or of the realigned incoming weights; on the feature-space path,
:meth:`Transport.spaces` gives each feature space one map. The plans and maps
are :mod:`fedfuse.fusion.blocks.transport`'s; the options, the averaging and the choice among
candidate fusions are the method's (:mod:`fedfuse.fusion.methods.matching.otfusion`).
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from fedfuse.fusion.blocks.alignment import affine_levels, map_incoming, map_outgoing
from fedfuse.fusion.blocks.matching import squared_distances
from fedfuse.fusion.blocks.space_alignment import (
    align_model,
    block_transport,
    capture_space,
    check_feature_spaces,
    is_permutation,
    space_cost,
)
from fedfuse.fusion.blocks.transport import row_stochastic, transport_plan
from fedfuse.models import LeveledModel
from fedfuse.models.capture import LevelIO
from fedfuse.models.importance import Scores

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Transport:
    """OTFusion's alignment by optimal transport, with its settings.

    Args:
        solver, reg, max_iter: :func:`~fedfuse.fusion.blocks.transport.transport_plan`'s.
        batch_size: samples per forward pass, and rows per float64 chunk of the costs.
        device: where activations and costs are computed.
        method: the method's name, for the log.
    """

    solver: str
    reg: float
    max_iter: int
    batch_size: int
    device: torch.device
    method: str = "otfusion"

    def spaces(
        self, models: list[LeveledModel], data: torch.Tensor, ref: int
    ) -> tuple[list[LeveledModel], dict[str, Any]]:
        """Transport every feature space of every model onto the reference's (``models[ref]``):
        the aligned models (the reference itself among them) and the details of the alignment."""
        spaces = check_feature_spaces(models[ref])
        maps: list[dict[str, torch.Tensor]] = [{} for _ in models]
        details: dict[str, Any] = {
            "path": "spaces",
            "reference": ref,
            "ground_metric": "activations",
            "solver": self.solver,
            "spaces": [],
        }
        for space in spaces:
            started = time.perf_counter()
            captured_ref = capture_space(
                models[ref], data, space, batch_size=self.batch_size, device=self.device
            )
            costs: dict[int, float] = {}
            permutation = True
            for k, model in enumerate(models):
                if k == ref:
                    continue
                captured = capture_space(
                    model, data, space, batch_size=self.batch_size, device=self.device
                )
                cost = space_cost(captured_ref, captured, "l2", self.batch_size)
                del captured
                matrix, costs[k] = block_transport(
                    cost, space.groups, solver=self.solver, reg=self.reg, max_iter=self.max_iter
                )
                permutation &= is_permutation(matrix)
                maps[k][space.name] = matrix
            del captured_ref
            seconds = time.perf_counter() - started
            details["spaces"].append(
                {
                    "space": space.name,
                    "transport_cost": [costs[k] for k in sorted(costs)],
                    "permutation": permutation,
                    "seconds": seconds,
                }
            )
            log.debug("%s space %s: costs %s (%.3f s)", self.method, space.name, costs, seconds)
        aligned = [m if k == ref else align_model(m, maps[k], spaces) for k, m in enumerate(models)]
        return aligned, details

    def levels(
        self,
        models: list[LeveledModel],
        levels: list[int],
        metric: str,
        ref: int,
        captured: list[dict[int, LevelIO]] | None,
        scores: list[Scores] | None,
    ) -> tuple[list[LeveledModel], dict[str, Any]]:
        """Transport every model's neurons onto the reference's, level by level, bottom-up.

        Args:
            models: the models (never modified: the aligned ones are CPU copies).
            levels: the neuron levels (:func:`~fedfuse.fusion.inputs.check_levels`); all but the
                classifier are transported.
            metric: the ground cost, ``"activations"`` (of ``captured``: the models' level outputs)
                or ``"weights"`` (the realigned incoming weights and bias).
            ref: the reference model's index.
            scores: the models' importance scores as marginals (None: uniform).

        Returns:
            The aligned models (the reference a copy too) and the details of the alignment.
        """
        hidden = levels[:-1]
        aligned = [copy.deepcopy(m).cpu() for m in models]  # the inputs are never modified
        views = [affine_levels(m) for m in aligned]
        details: dict[str, Any] = {
            "path": "levels",
            "reference": ref,
            "ground_metric": metric,
            "solver": self.solver,
            "levels": [],
        }
        for position, index in enumerate(hidden):
            started = time.perf_counter()
            costs: dict[int, float] = {}
            permutation = True
            for k in range(len(models)):
                if k == ref:
                    continue
                if metric == "activations":
                    assert captured is not None
                    cost = squared_distances(
                        captured[ref][index].outputs, captured[k][index].outputs, self.batch_size
                    )
                else:
                    cost = squared_distances(
                        views[ref][index].weights().to(self.device),
                        views[k][index].weights().to(self.device),
                        self.batch_size,
                    )
                plan = transport_plan(
                    cost,
                    None if scores is None else scores[ref][index],
                    None if scores is None else scores[k][index],
                    solver=self.solver,
                    reg=self.reg,
                    max_iter=self.max_iter,
                )
                cost = cost.cpu()
                costs[k] = float((plan * cost).sum())
                matrix = row_stochastic(plan, cost)
                permutation &= bool(((matrix == 0) | (matrix == 1)).all()) and bool(
                    (matrix.sum(0) == 1).all()
                )
                map_outgoing(views[k][index], matrix.float())
                map_incoming(views[k][levels[position + 1]], matrix.float(), channels=len(cost.T))
            seconds = time.perf_counter() - started
            details["levels"].append(
                {
                    "level": models[ref].level_name(index),
                    "transport_cost": [costs[k] for k in sorted(costs)],
                    "permutation": permutation,
                    "seconds": seconds,
                }
            )
            log.debug("%s level %s: costs %s (%.3f s)", self.method, index, costs, seconds)
        return aligned, details
