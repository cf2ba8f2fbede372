r"""Aligning two models feature space by feature space: the architecture-generic matching step.

:func:`fedfuse.models.symmetry.feature_spaces` lists, for any described architecture (MLP, VGG,
ResNet with its residual streams and BatchNorm buffers, ViT with its residual stream and
attention heads), the sets of interchangeable neurons and every tensor axis they index. This
module compares two models' neurons of one space by their activations on the fusion set, summed
over the space's probes (every module output that holds the space's features: for a residual
stream, the output of every block that writes to it), and turns the comparison into a map:

* :func:`space_cost`: the ``(n, n)`` cost between the reference's and the other model's neurons,
  ``-corr`` (Pearson correlation, Git Re-Basin) or the squared distance per row (OTFusion, Git
  Re-Basin's ``"l2"``), each summed over the probes;
* :func:`pairwise_space_costs`: that cost between every pair of N models;
* :func:`block_assignment`: the permutation minimising the cost (Hungarian), solved per group of
  a grouped space (attention heads: a permutation never leaves its head);
* :func:`block_transport`: the optimal transport map (POT, per group, rows normalised to be
  barycentric; :mod:`fedfuse.fusion.blocks.transport`) of OTFusion;
* :func:`match_spaces`: every space of N models matched onto one order (Git Re-Basin's
  MergeMany on the activation costs), as permutation maps per model;
* :func:`align_model`: a copy of a model with each space's features replaced by ``map @ features``
  (:func:`~fedfuse.models.symmetry.map_state` on every axis of the space, BatchNorm buffers
  included), so a permutation keeps the function exactly.

Costs are measured on the *original* models: permuting one space does not change the features
of another, so for permutations the spaces are independent; for soft transport maps this is the
same activation proxy as level-wise OTFusion.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import torch

from fedfuse.fusion.blocks.matching import (
    correlation,
    linear_assignment,
    merge_many,
    squared_distances,
)
from fedfuse.fusion.blocks.transport import row_stochastic, transport_plan
from fedfuse.models import LeveledModel
from fedfuse.models.capture import capture_modules
from fedfuse.models.symmetry import FeatureSpace, feature_spaces, map_state, permutation_matrix
from fedfuse.runtime import resolve_device

SPACE_COSTS = ("correlation", "l2")


def check_feature_spaces(model: LeveledModel) -> list[FeatureSpace]:
    """The model's feature spaces; a ValueError says the architecture's symmetries are unknown."""
    try:
        return feature_spaces(model)
    except (ValueError, KeyError, AttributeError) as error:
        raise ValueError(f"its feature spaces cannot be described: {error}") from None


def capture_space(
    model: LeveledModel,
    data: torch.Tensor,
    space: FeatureSpace,
    *,
    batch_size: int = 256,
    device: str | torch.device = "auto",
) -> dict[tuple[str, int], torch.Tensor]:
    """The rows ``(R, size)`` of every probe of ``space`` on ``data``; a probe that is an
    activation module (a ResNet block's inner ReLU, a ViT MLP's GELU) is read before the
    nonlinearity, like the level path's pre-activations (dead ReLUs would tie)."""
    return capture_modules(
        model,
        data,
        space.probes,
        batch_size=batch_size,
        device=device,
        store_device=device,
        pre_activation=True,
    )


def space_cost(
    reference: Mapping[tuple[str, int], torch.Tensor],
    other: Mapping[tuple[str, int], torch.Tensor],
    cost: str = "correlation",
    batch_size: int = 256,
) -> torch.Tensor:
    """``(n, n)`` float64 cost between two models' neurons of one space, summed over probes.

    Args:
        reference, other: :func:`capture_space` of the two models (same probes, same data).
        cost: ``"correlation"`` (minus the Pearson correlation) or ``"l2"`` (squared distance
            divided by the rows).
        batch_size: rows per float64 chunk.
    """
    if cost not in SPACE_COSTS:
        raise ValueError(f"cost must be one of {SPACE_COSTS}, got {cost!r}")
    if reference.keys() != other.keys() or not reference:
        raise ValueError("the two captures must have the same, non-empty probes")
    total = None
    for probe, rows in reference.items():
        part = (
            -correlation(rows, other[probe], batch_size)
            if cost == "correlation"
            else squared_distances(rows, other[probe], batch_size)
        )
        total = part if total is None else total + part
    assert total is not None
    return total.cpu()


def _blocks(size: int, groups: int) -> list[slice]:
    if groups < 1 or size % groups:
        raise ValueError(f"{groups} groups do not divide {size} features")
    step = size // groups
    return [slice(g * step, (g + 1) * step) for g in range(groups)]


def block_assignment(cost: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """The permutation ``pi`` (other's neuron ``pi[i]`` onto reference neuron ``i``) of least
    summed cost, each contiguous group of neurons matched within itself."""
    n = cost.shape[0]
    if cost.shape != (n, n):
        raise ValueError(f"a permutation needs a square cost, got {tuple(cost.shape)}")
    permutation = torch.empty(n, dtype=torch.long)
    for block in _blocks(n, groups):
        permutation[block] = linear_assignment(cost[block, block]) + block.start
    return permutation


def pairwise_space_costs(
    models: Sequence[LeveledModel],
    data: torch.Tensor,
    space: FeatureSpace,
    cost: str = "correlation",
    *,
    batch_size: int = 256,
    device: str | torch.device = "auto",
) -> dict[tuple[int, int], torch.Tensor]:
    """:func:`space_cost` of ``space`` between every pair ``i < j`` of ``models`` on ``data``
    (each model's activations captured once), as MergeMany takes them."""
    captured = [capture_space(m, data, space, batch_size=batch_size, device=device) for m in models]
    return {
        (i, j): space_cost(captured[i], captured[j], cost, batch_size)
        for i in range(len(models))
        for j in range(i + 1, len(models))
    }


def block_transport(
    cost: torch.Tensor,
    groups: int = 1,
    *,
    solver: str = "emd",
    reg: float = 0.01,
    max_iter: int = 1000,
) -> tuple[torch.Tensor, float]:
    """OTFusion's barycentric map ``T`` (``(n, m)``, rows summing to 1) and the plan's cost.

    Uniform marginals; a grouped space is transported group by group (``T`` block-diagonal),
    each group's plan normalised by its rows. With equal group sizes, exact OT gives a
    permutation matrix.
    """
    n, m = cost.shape
    matrix = torch.zeros(n, m, dtype=torch.float64)
    total = 0.0
    for rows, cols in zip(_blocks(n, groups), _blocks(m, groups), strict=True):
        block = cost[rows, cols]
        plan = transport_plan(block, solver=solver, reg=reg, max_iter=max_iter)
        total += float((plan * block.double()).sum()) / groups
        matrix[rows, cols] = row_stochastic(plan, block)
    return matrix, total


def is_permutation(matrix: torch.Tensor) -> bool:
    """Whether ``matrix`` is a square 0/1 matrix with one 1 per row and per column."""
    return (
        matrix.shape[0] == matrix.shape[1]
        and bool(((matrix == 0) | (matrix == 1)).all())
        and bool((matrix.sum(0) == 1).all())
        and bool((matrix.sum(1) == 1).all())
    )


@torch.no_grad()
def align_model(
    model: LeveledModel, maps: Mapping[str, torch.Tensor], spaces: list[FeatureSpace]
) -> LeveledModel:
    """A CPU copy of ``model`` whose space ``name`` has features ``maps[name] @ features``."""
    by_name = {space.name: space for space in spaces}
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    for name, matrix in maps.items():
        state = map_state(state, by_name[name], matrix)
    aligned = copy.deepcopy(model).cpu()
    aligned.load_state_dict(state)
    return aligned


def match_spaces(
    models: Sequence[LeveledModel],
    data: torch.Tensor,
    *,
    cost: str = "correlation",
    weights: Sequence[float] | None = None,
    rounds: int = 100,
    seed: int = 0,
    batch_size: int = 256,
    device: str | torch.device = "auto",
) -> tuple[list[FeatureSpace], list[dict[str, torch.Tensor]]]:
    """Every feature space of ``models`` matched onto one order by their activations on
    ``data``: :func:`space_cost` between each pair, then Git Re-Basin's MergeMany (two models:
    one assignment of model 1 onto model 0), each permutation kept inside its groups.

    Returns the spaces and, per model, ``{space name: permutation matrix}`` for
    :func:`align_model` (model 0's are the identity when MergeMany leaves it in place).
    ``weights`` are MergeMany's model weights (None: uniform).
    """
    spaces = check_feature_spaces(models[0])
    device = resolve_device(device)
    weights = list(weights) if weights is not None else [1.0 / len(models)] * len(models)
    maps: list[dict[str, torch.Tensor]] = [{} for _ in models]
    for position, space in enumerate(spaces):
        permutations, _ = merge_many(
            pairwise_space_costs(models, data, space, cost, batch_size=batch_size, device=device),
            weights,
            rounds=rounds,
            seed=seed + position,
            assign=lambda matrix, groups=space.groups: block_assignment(matrix, groups),
        )
        for model_maps, permutation in zip(maps, permutations, strict=True):
            model_maps[space.name] = permutation_matrix(permutation)
    return spaces, maps
