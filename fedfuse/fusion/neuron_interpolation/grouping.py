"""Grouping one level's base neurons into the fused level's neurons: Hungarian or K-means.

Each base neuron is a point (its outputs over the fusion set, or their coordinates in the fused
design's basis) with an importance weight. Hungarian Fusion (HF) groups equal-width models'
neurons one-to-one, one neuron of each model per group (two models: exact Hungarian matching;
more: block-coordinate descent, :func:`~fedfuse.fusion.blocks.matching.one_to_one_labels`);
K-means Fusion (KF) clusters any number of models' neurons by
importance-weighted k-means into as many groups as the fused level has neurons. A residual
level's groups are then numbered like the fused input channels they add to.
"""

from __future__ import annotations

import torch

from fedfuse.fusion.blocks.costs import cluster_targets
from fedfuse.fusion.blocks.kmeans import weighted_centers, weighted_kmeans
from fedfuse.fusion.blocks.matching import linear_assignment, one_to_one_labels
from fedfuse.fusion.pieces import GroupFn
from fedfuse.models.affine import output_rows

GROUPINGS = ("hungarian", "kmeans")


def group_neurons(
    points: torch.Tensor,
    weights: torch.Tensor,
    widths: list[int],
    k: int,
    *,
    grouping: str,
    n_init: int,
    max_iter: int,
    tol: float,
    seed: int,
    local_search_swaps: int,
    match_rounds: int = 50,
    kmeans_variance: float | str | None = None,
) -> torch.Tensor:
    """Fused neuron of each base neuron; ``points`` are base neurons as rows, model by model
    (``widths``). Hungarian groups (at most ``match_rounds`` rounds of re-matching for more than
    two models) and K-means clusters when ``k`` is its width are numbered like model 0's neurons
    (for base-weight initialisation)."""
    if grouping == "hungarian":
        return one_to_one_labels(points, weights, widths, rounds=match_rounds)
    result = weighted_kmeans(
        points.float(),
        weights,
        k,
        n_init=n_init,
        max_iter=max_iter,
        tol=tol,
        seed=seed,
        local_search_swaps=local_search_swaps,
        variance=kmeans_variance,
    )
    labels = result.labels
    if k == widths[0]:  # order clusters like model 0's neurons (for base-weight initialisation)
        centers, _ = weighted_centers(points, weights, labels, k)
        order = linear_assignment(torch.cdist(centers, points[: widths[0]]).pow(2))
        labels = order.to(labels.device)[labels]
    return labels


@torch.no_grad()
def residual_labels(
    x: torch.Tensor,
    outputs: list[torch.Tensor],
    weights: torch.Tensor,
    widths: list[int],
    k: int,
    group: GroupFn,
) -> torch.Tensor:
    """Group a residual level's neurons with ``group``, then number the groups like the fused
    input's channels they add to: fused neuron ``j`` is ``F(x)_j + x_j``, so its target should be
    the cluster closest to input channel ``j`` (the residual stream stays aligned)."""
    z = torch.cat([output_rows(o) for o in outputs], 1)
    labels = group(z.T.contiguous(), weights.to(z), widths, k)
    stream = output_rows(x)
    if stream.shape != (len(z), k):
        return labels  # a shape change (no identity shortcut after all): nothing to keep
    targets = cluster_targets(z, labels, weights.to(z), k)
    cost = torch.cdist(stream.T.double(), targets.T.double()).pow(2)
    order = linear_assignment(cost)  # input channel j takes cluster order[j]
    rename = torch.empty_like(order)
    rename[order] = torch.arange(k)
    return rename.to(labels.device)[labels]
