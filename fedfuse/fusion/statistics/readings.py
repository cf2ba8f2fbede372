r"""How the server reads each site's neurons as fused neurons, and sum-only statistics.

A reading ``P_k`` (``fused width x width_k``) says which of model ``k``'s neurons make each
fused neuron. The per-site fit of :mod:`fedfuse.fusion.methods.neuron_interpolation.sites` finds the
readings from the sites' replies (their translations, :func:`readings_from_groups`). Sum-only
statistics find them first, on the server's own data, so that the fit needs sums over sites alone.

The per-site fit of :mod:`fedfuse.fusion.methods.neuron_interpolation.sites` reads each site's
statistics: its neurons' translations group them, and each site's ``B_k = X_k^T Z_k`` is mapped
through its own reading ``P_k`` before the sum ``sum_k B_k P_k^T``. Everything the server needs is a
sum over sites once the readings are known before the round:

1. **Group on the server's own data.** Each model's neurons are grouped by their outputs on the
   fusion set (under the model's own prefix, as K-means / Hungarian Fusion do), weighted by the
   sites' importance scores; model ``k``'s reading ``P_k`` (``fused width x width_k``) is the
   importance-weighted mean of its neurons in each group (its nearest neuron where a group
   has none of them). The server holds the models and the fusion set, so nothing of a site's
   data enters the grouping.
2. **Send each site its reading** with the round's request. The site returns the statistics of
   its mapped targets ``Z_k P_k^T``: ``G_k = X_k^T X_k``, ``X_k^T Z_k P_k^T``,
   ``P_k Z_k^T Z_k P_k^T`` and its row count.
3. **Fit on the sums**: ``W = (sum G_k + lambda I)^{-1} sum_k X_k^T Z_k P_k^T``, the ridge chosen
   by GCV from the summed target moments: the per-site fit with these readings, exactly.

The sums (:mod:`fedfuse.fusion.statistics.summed_terms`) are what secure aggregation hands the
server instead of each site's reply (``docs/privacy.md``). Without it, each reply still carries the
site's translation of its mapped targets, which the sum-only fit does not read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fedfuse.fusion.blocks.kmeans import weighted_centers
from fedfuse.fusion.blocks.matching import linear_assignment
from fedfuse.fusion.blocks.pieces import linear_pieces
from fedfuse.fusion.statistics.rounds import SiteStatistics
from fedfuse.models import LeveledModel

#: group(points, weights, sizes, k) -> the group of each point (rows model by model)
GroupFn = Callable[[torch.Tensor, torch.Tensor, list[int], int], torch.Tensor]


def readings_from_groups(
    points: torch.Tensor,
    weights: torch.Tensor,
    labels: torch.Tensor,
    sizes: Sequence[int],
    width: int,
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """Each model's reading ``(width, size)`` of the fused neurons from the groups ``labels`` of
    its neurons (``points`` rows, model by model, ``sizes`` each): the importance-weighted mean
    of its neurons in a group, its nearest neuron to the group's centre where it has none."""
    centers, mass = weighted_centers(points, weights, labels, width, dtype=torch.float64)
    owner = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(list(sizes)))
    readings, empty_groups = [], 0
    for position, size in enumerate(sizes):
        mine = owner == position
        reading = torch.zeros(width, size, dtype=torch.float64)
        reading[labels[mine], torch.arange(size)] = weights[mine].double().clamp_min(1e-12)
        missing = reading.sum(1) == 0
        empty_groups += int(missing.sum())
        if bool(missing.any()):
            nearest = torch.cdist(centers[missing], points[mine].double()).argmin(1)
            reading[missing.nonzero().squeeze(1), nearest] = 1.0
        readings.append(reading / reading.sum(1, keepdim=True))
    cost = (weights.double() * (points.double() - centers[labels]).pow(2).sum(1)).sum()
    info = {
        "grouping_cost": float(cost / weights.double().sum().clamp_min(1e-300)),
        "groups_read_by_nearest": empty_groups,
        "empty_clusters": int((mass == 0).sum()),
    }
    return readings, info


@torch.no_grad()
def fusion_set_readings(
    models: Sequence[LeveledModel],
    index: int,
    data: torch.Tensor,
    weights: Sequence[torch.Tensor],
    width: int,
    group: GroupFn,
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """The readings of affine level ``index`` grouped on the fusion set ``data``: each model's
    neurons are points, their outputs on ``data`` under the model's own prefix."""
    points, sizes = [], []
    for model in models:
        level = model.levels[index]
        pieces = linear_pieces(level)
        assert pieces is not None and len(pieces) == 1
        outputs = pieces[0].target(level, model.forward_levels(data, 0, index))
        points.append(outputs.double().T)
        sizes.append(outputs.shape[1])
    stacked = torch.cat(points)
    mass = torch.cat([w.double().cpu() for w in weights])
    labels = group(stacked, mass, sizes, width)
    readings, info = readings_from_groups(stacked, mass, labels, sizes, width)
    info["grouped_on"] = "the fusion set"  # type: ignore[assignment]
    return readings, info


def stream_tensor(statistics: SiteStatistics, name: str) -> torch.Tensor:
    tensor = getattr(statistics, name)
    assert tensor is not None  # checked with the piece's stream width
    return tensor.double()


def number_like_the_stream(
    statistics: dict[int, SiteStatistics], readings: dict[int, torch.Tensor]
) -> dict[int, torch.Tensor]:
    """Renumber the fused neurons so that neuron ``j`` is the group nearest the level input's
    channel ``j`` on all sites' rows (as
    :func:`~fedfuse.fusion.methods.neuron_interpolation.grouping. residual_labels` on the fusion
    set): ``cost[j, c] = sum_k ||s_j - Z_k r_c||^2``."""
    cost = sum(
        stream_tensor(s, "stream_norms")[:, None]
        - 2 * stream_tensor(s, "stream_target").T @ readings[m].T
        + ((readings[m] @ s.target_gram.double()) * readings[m]).sum(1)[None]
        for m, s in statistics.items()
    )
    order = linear_assignment(cost)  # input channel j takes group order[j]
    return {m: reading[order] for m, reading in readings.items()}
