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

from collections.abc import Sequence

import torch

from fedfuse.fusion.blocks.attention import GroupFn
from fedfuse.fusion.blocks.kmeans import weighted_centers, weighted_kmeans
from fedfuse.fusion.blocks.matching import linear_assignment, one_to_one_labels
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


#: the options of :func:`group_neurons` a fusion method holds as attributes of the same names
GROUPING_OPTIONS = ("grouping", "n_init", "max_iter", "tol", "match_rounds", "kmeans_variance")


def group_with_options(
    method: object,
    points: torch.Tensor,
    weights: torch.Tensor,
    widths: list[int],
    k: int,
    *,
    seed: int,
    local_search_swaps: int,
) -> torch.Tensor:
    """:func:`group_neurons` with the :data:`GROUPING_OPTIONS` that ``method`` holds."""
    options = {name: getattr(method, name) for name in GROUPING_OPTIONS}
    return group_neurons(
        points, weights, widths, k, seed=seed, local_search_swaps=local_search_swaps, **options
    )


#: samples whose output rows are multiplied at once when summing a Gram of neuron columns
GRAM_CHUNK = 256


@torch.no_grad()
def column_gram(blocks: Sequence[torch.Tensor], chunk: int = GRAM_CHUNK) -> torch.Tensor:
    """``Z^T Z`` (float64) of the neuron columns ``Z``: every block's :func:`output_rows`
    side by side, built ``chunk`` samples at a time (no ``rows x columns`` matrix of every
    block at once). The blocks share their first (sample) dimension."""
    size = sum(output_rows(b[:1]).shape[1] for b in blocks)
    gram = torch.zeros(size, size, dtype=torch.float64, device=blocks[0].device)
    for start in range(0, len(blocks[0]), chunk):
        rows = torch.cat([output_rows(b[start : start + chunk]).to(gram.device) for b in blocks], 1)
        gram += (rows.T @ rows).double()
    return gram


def gram_points(gram: torch.Tensor) -> torch.Tensor:
    """Points ``P`` (one row per column of ``Z``) with ``P P^T = gram = Z^T Z``: the same
    distances, inner products and weighted centres as ``Z``'s columns, in at most as many
    coordinates as there are columns, where ``Z`` has one per row (every position of every
    fusion sample of a convolution). Grouping on them is grouping on the columns, at a cost
    that does not grow with the fusion set."""
    values, vectors = torch.linalg.eigh(gram)
    kept = values > values[-1].clamp_min(0) * torch.finfo(gram.dtype).eps * len(gram)
    if not bool(kept.any()):  # every column zero
        return gram.new_zeros(len(gram), 1)
    return vectors[:, kept] * values[kept].sqrt()


def neuron_points(outputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """The base neurons of ``outputs`` (each model's level outputs, or their rows) as points
    for :func:`group_neurons`, model by model: their output columns themselves where there
    are no more rows than neurons, else :func:`gram_points` of their :func:`column_gram`."""
    rows = [output_rows(o) for o in outputs]
    if len(rows[0]) <= sum(r.shape[1] for r in rows):
        return torch.cat(rows, 1).T.contiguous()
    del rows
    return gram_points(column_gram(outputs)).float()


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
    the cluster closest to input channel ``j`` (the residual stream stays aligned). Everything
    is read off one Gram of the stream's and the neurons' columns (:func:`column_gram`)."""
    channels = x.shape[1]
    same_rows = len(x) == len(outputs[0]) and x.shape[2:] == outputs[0].shape[2:]
    if channels != k or not same_rows:  # a shape change (no identity shortcut after all)
        points = neuron_points(outputs).to(weights.device)
        return group(points, weights.to(points), widths, k)
    gram = column_gram([x, *outputs])
    neurons = gram[channels:, channels:]
    points = gram_points(neurons).float().to(weights.device)
    labels = group(points, weights.to(points), widths, k)
    # the groups' weighted centres T = Z M; ||s_j - T_c||^2 from the Gram alone
    mixing = centre_weights(labels.cpu(), weights.double().cpu(), k).to(gram)
    cost = (
        gram.diagonal()[:channels, None]
        + ((mixing.T @ neurons @ mixing).diagonal())[None]
        - 2 * gram[:channels, channels:] @ mixing
    ).clamp_min(0)
    order = linear_assignment(cost)  # input channel j takes cluster order[j]
    rename = torch.empty_like(order)
    rename[order] = torch.arange(k)
    return rename.to(labels.device)[labels]


def centre_weights(labels: torch.Tensor, weights: torch.Tensor, k: int) -> torch.Tensor:
    """``M`` (``points x k``): column ``c`` holds the weights of the points in group ``c``
    over their sum, so ``Z M`` are the groups' weighted centres (as :func:`cluster_targets`)."""
    mixing = torch.zeros(len(labels), k, dtype=weights.dtype)
    mixing[torch.arange(len(labels)), labels] = weights
    mass = mixing.sum(0)
    return mixing / mass.clamp_min(torch.finfo(weights.dtype).tiny)[None]
