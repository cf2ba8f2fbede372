r"""Importance-weighted k-means: the grouping step of K-means Fusion (paper App. B.1).

Neurons are the points and their (projected) outputs over the fusion set the features. We
minimise the weighted k-means cost

.. math::  \sum_j s_j \, \lVert x_j - \mu_{c(j)} \rVert^2, \qquad
           \mu_k = \frac{\sum_{j: c(j)=k} s_j x_j}{\sum_{j: c(j)=k} s_j},

with Lloyd's algorithm from weighted k-means++ seeds (Arthur & Vassilvitskii, 2007), several
restarts, repair of empty clusters, and early stopping; optionally refined by the single-swap
local search of Kanungo et al. (2002), the algorithm behind the paper's Theorem 2 bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class KMeansResult:
    """Labels (cluster of each point), weighted centres, final cost and per-iteration costs."""

    labels: torch.Tensor
    centers: torch.Tensor
    cost: float
    history: list[float] = field(default_factory=list)
    n_iter: int = 0


#: rows of the point-to-centre distance matrix computed at once (bounds memory: with k = 512
#: float32 centres a block is 128 MB, however many neurons are clustered)
_BLOCK_ROWS = 1 << 16


def _block_rows(points: torch.Tensor, dtype: torch.dtype) -> int:
    """Rows per block: fewer when each block is converted to a wider ``dtype`` (its copies sit
    beside every point of a many-model level)."""
    wider = torch.finfo(dtype).bits > torch.finfo(points.dtype).bits
    return max(_BLOCK_ROWS // 4, 1) if wider else _BLOCK_ROWS


def _squared_distances(points: torch.Tensor, centers: torch.Tensor) -> torch.Tensor:
    """``||p - c||^2`` for all pairs, via the Gram expansion (clamped at 0)."""
    d = (points * points).sum(1, keepdim=True) - 2 * points @ centers.T
    d += (centers * centers).sum(1)[None]
    return d.clamp_min_(0)


def _assign(
    points: torch.Tensor, norms: torch.Tensor, centers: torch.Tensor, labels: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Nearest centre of every point, block by block (a ``points x centres`` block at a time),
    and with ``labels`` the squared distance to each point's current centre. With ``labels``,
    ties stay on the current centre, so reassigning never raises the cost."""
    center_norms = (centers * centers).sum(1)
    nearest = torch.empty(len(points), dtype=torch.long, device=points.device)
    current = None if labels is None else torch.empty_like(norms)
    for start in range(0, len(points), _BLOCK_ROWS):
        rows = slice(start, start + _BLOCK_ROWS)
        # ||p||^2 - 2 p.c + ||c||^2 without ||p||^2, the same for every centre: it is added
        # to the chosen distances only (one pass less over the block)
        d = torch.addmm(center_norms[None], points[rows], centers.T, alpha=-2)
        value, index = d.min(1)
        if labels is not None and current is not None:
            mine = d.gather(1, labels[rows, None])[:, 0]
            index = torch.where(mine <= value, labels[rows], index)
            current[rows] = (mine + norms[rows]).clamp_min_(0)
        nearest[rows] = index
    return nearest, current


def weighted_centers(
    points: torch.Tensor,
    weights: torch.Tensor,
    labels: torch.Tensor,
    k: int,
    *,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance-weighted mean of each cluster, and each cluster's total weight.

    Summed block by block (no ``points``-sized temporary) in ``dtype`` (default: the points').
    """
    dtype = dtype or points.dtype
    w = weights.to(dtype)
    mass = torch.zeros(k, dtype=dtype, device=points.device).index_add_(0, labels, w)
    sums = torch.zeros(k, points.shape[1], dtype=dtype, device=points.device)
    step = _block_rows(points, dtype)
    for start in range(0, len(points), step):
        rows = slice(start, start + step)
        sums.index_add_(0, labels[rows], points[rows].to(dtype) * w[rows, None])
    return sums / mass.clamp_min(torch.finfo(dtype).tiny)[:, None], mass


def point_costs(
    points: torch.Tensor,
    weights: torch.Tensor,
    labels: torch.Tensor,
    centers: torch.Tensor,
    *,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``w_j ||x_j - centers[labels_j]||^2`` of every point, block by block, in ``dtype``."""
    dtype = dtype or points.dtype
    costs = torch.empty(len(points), dtype=dtype, device=points.device)
    centers = centers.to(dtype)
    step = _block_rows(points, dtype)
    for start in range(0, len(points), step):
        rows = slice(start, start + step)
        diff = points[rows].to(dtype) - centers[labels[rows]]
        costs[rows] = weights[rows].to(dtype) * (diff * diff).sum(1)
    return costs


def scatter_around_means(
    points: torch.Tensor, weights: torch.Tensor, centers: torch.Tensor, mass: torch.Tensor
) -> float:
    """``sum_j w_j ||x_j - centers[c(j)]||^2`` when ``centers`` are the clusters' weighted means
    and ``mass`` their weights (:func:`weighted_centers`): ``sum_j w_j ||x_j||^2 - sum_k m_k
    ||c_k||^2`` in float64, one pass over the points and no labels needed."""
    w = weights.to(points.dtype)
    norms = sum(
        (w[s : s + _BLOCK_ROWS] * (points[s : s + _BLOCK_ROWS] ** 2).sum(1)).sum(
            dtype=torch.float64
        )
        for s in range(0, len(points), _BLOCK_ROWS)
    )
    spread = (mass.double() * (centers.double() ** 2).sum(1)).sum()
    return max(float(norms - spread), 0.0)


def weighted_kmeans_cost(
    points: torch.Tensor, weights: torch.Tensor, labels: torch.Tensor, centers: torch.Tensor
) -> float:
    """``sum_j w_j ||x_j - centers[labels_j]||^2``."""
    return float(point_costs(points, weights, labels, centers).sum())


def kmeans_plusplus(
    points: torch.Tensor, weights: torch.Tensor, k: int, generator: torch.Generator
) -> torch.Tensor:
    """Indices of ``k`` seeds drawn by weighted D^2 sampling (the true k-means++ rule).

    The first seed is drawn with probability proportional to the weights, each next one with
    probability proportional to ``w_j * D(x_j)^2``, D being the distance to the nearest seed.
    """
    norms = (points * points).sum(1)
    uniforms = torch.rand(k, generator=generator, dtype=torch.float64)

    def draw(mass: torch.Tensor, u: torch.Tensor) -> int:
        cumulative = mass.double().cumsum(0)
        index = int(torch.searchsorted(cumulative, (u * cumulative[-1]).reshape(1)))
        return min(index, len(mass) - 1)

    def distances_to(index: int) -> torch.Tensor:
        return (norms - 2 * (points @ points[index]) + norms[index]).clamp_min_(0)

    chosen = [draw(weights, uniforms[0])]
    nearest = distances_to(chosen[0])
    for step in range(1, k):
        mass = weights * nearest
        if mass.sum() <= 0:  # every remaining point coincides with a seed: take an unused one
            taken = torch.zeros(len(points), dtype=torch.bool, device=points.device)
            taken[chosen] = True
            mass = (~taken).to(points.dtype)
        chosen.append(draw(mass, uniforms[step]))
        nearest = torch.minimum(nearest, distances_to(chosen[-1]))
    return torch.tensor(chosen, device=points.device)


#: k-means++ seeds are drawn from at most this many points per cluster: D^2 sampling is
#: sequential (k passes over the candidates), so with many models it runs on a sample
SEEDING_POINTS_PER_CLUSTER = 16


def _initial_centers(
    points: torch.Tensor, weights: torch.Tensor, k: int, generator: torch.Generator
) -> torch.Tensor:
    """Weighted k-means++ seeds; from a weighted sample of ``16 k`` points when there are more.

    Up to ``16 k`` points (eight 512-wide models) this is exact weighted k-means++. Beyond,
    candidates are drawn without replacement with probability proportional to the weights and
    seeded by plain D^2 sampling among them (each candidate then counts once, so a neuron's
    chance to seed stays proportional to ``w * D^2``); Lloyd then runs on every point.
    """
    limit = SEEDING_POINTS_PER_CLUSTER * k
    if len(points) <= limit:
        return points[kmeans_plusplus(points, weights, k, generator)].clone()
    sample = torch.multinomial(
        weights.double().cpu(), limit, replacement=False, generator=generator
    )
    sample = sample.sort().values.to(points.device)
    uniform = torch.ones(limit, dtype=points.dtype, device=points.device)
    return points[sample[kmeans_plusplus(points[sample], uniform, k, generator)]].clone()


def _repair_empty(
    points: torch.Tensor, weights: torch.Tensor, labels: torch.Tensor, centers: torch.Tensor
) -> None:
    """Give each empty cluster one of the costliest points (in place), never emptying another.

    Points are taken in decreasing order of their current cost; a point moves only while its
    cluster keeps at least one other member.
    """
    k = len(centers)
    counts = torch.bincount(labels, minlength=k).tolist()
    empty = [c for c in range(k) if counts[c] == 0]
    if not empty:
        return
    cost = point_costs(points, weights, labels, centers)
    order = torch.argsort(cost, descending=True, stable=True).tolist()
    current = labels.tolist()
    for point in order:
        if not empty:
            break
        if counts[current[point]] > 1:
            cluster = empty.pop()
            counts[current[point]] -= 1
            counts[cluster] = 1
            labels[point] = cluster
            centers[cluster] = points[point]


def _lloyd(
    points: torch.Tensor,
    weights: torch.Tensor,
    centers: torch.Tensor,
    max_iter: int,
    tol: float,
) -> KMeansResult:
    k = len(centers)
    history: list[float] = []
    norms = (points * points).sum(1)
    labels, _ = _assign(points, norms, centers, None)
    iterations = 0
    while iterations < max_iter:
        iterations += 1
        _repair_empty(points, weights, labels, centers)
        centers, _ = weighted_centers(points, weights, labels, k)
        new_labels, current = _assign(points, norms, centers, labels)
        assert current is not None
        # the cost of (labels, centers), from the distances just computed
        history.append(float((weights * current).sum()))
        converged = torch.equal(new_labels, labels)
        labels = new_labels
        if converged or (len(history) > 1 and history[-2] - history[-1] <= tol * history[-2]):
            break
    _repair_empty(points, weights, labels, centers)
    centers, _ = weighted_centers(points, weights, labels, k)
    cost = weighted_kmeans_cost(points, weights, labels, centers)
    history.append(cost)
    return KMeansResult(labels, centers, cost, history, iterations)


def local_search(
    points: torch.Tensor,
    weights: torch.Tensor,
    result: KMeansResult,
    *,
    max_swaps: int = 50,
    candidates: int = 16,
    generator: torch.Generator,
    max_iter: int = 100,
    tol: float = 1e-6,
) -> KMeansResult:
    """Single-swap local search (Kanungo et al., 2002) seeded by a Lloyd solution.

    Repeatedly swap one centre for a random data point, re-run Lloyd, and keep the swap when the
    cost drops; stops after ``max_swaps`` accepted swaps or a round of ``candidates`` failures.
    """
    best = result
    swaps = 0
    while swaps < max_swaps:
        improved = False
        for _ in range(candidates):
            centers = best.centers.clone()
            out = int(torch.randint(len(centers), (1,), generator=generator))
            inp = int(torch.randint(len(points), (1,), generator=generator))
            centers[out] = points[inp]
            trial = _lloyd(points, weights, centers, max_iter, tol)
            if trial.cost < best.cost * (1 - 1e-9):
                trial.history = best.history + trial.history
                best, improved = trial, True
                swaps += 1
                break
        if not improved:
            break
    return best


#: ``variance="auto"`` projects once the points outnumber the clusters this many times
AUTO_POINTS_PER_CLUSTER = 64
#: the share of the weighted variance ``variance="auto"`` keeps
AUTO_VARIANCE = 0.99


def resolve_variance(variance: float | str | None, n: int, k: int) -> float | None:
    """The share of the variance to cluster on (None: every feature) for ``n`` points in ``k``
    clusters: ``"auto"`` keeps :data:`AUTO_VARIANCE` once there are
    :data:`AUTO_POINTS_PER_CLUSTER` points per cluster (a thousand 512-wide models), where the
    Lloyd iterations dominate a fusion, and every feature below that."""
    if variance == "auto":
        return AUTO_VARIANCE if n >= AUTO_POINTS_PER_CLUSTER * k else None
    if variance is None:
        return None
    if isinstance(variance, str) or not 0.0 < float(variance) <= 1.0:
        raise ValueError(f"variance must be in (0, 1] or 'auto', got {variance!r}")
    return None if float(variance) == 1.0 else float(variance)


def principal_coordinates(
    points: torch.Tensor, weights: torch.Tensor, variance: float
) -> torch.Tensor:
    """The points' coordinates on their leading principal directions (of the weighted
    covariance around the weighted mean), as many as keep ``variance`` of its trace.

    Squared distances between points split into these coordinates' part and the rest's, so
    a clustering that is good on them is good on the points up to the discarded share of the
    variance (Ding & He, 2004), at a fraction of the cost of every Lloyd iteration.
    """
    w = weights.to(points.dtype)
    # blocks of a quarter of the usual rows: their temporaries sit beside every point
    step = max(_BLOCK_ROWS // 4, 1)
    blocks = [slice(s, s + step) for s in range(0, len(points), step)]
    mean = sum((w[rows, None] * points[rows]).sum(0, dtype=torch.float64) for rows in blocks)
    mean = mean / weights.double().sum().clamp_min(1e-300)
    covariance = torch.zeros(points.shape[1], points.shape[1], dtype=torch.float64)
    covariance = covariance.to(points.device)
    for rows in blocks:  # products in the points' precision, sums in float64
        centred = points[rows] - mean.to(points.dtype)
        covariance += ((centred * w[rows, None]).T @ centred).double()
    del centred
    eigenvalues, eigenvectors = torch.linalg.eigh(covariance)
    eigenvalues = eigenvalues.flip(0).clamp_min(0)
    kept = eigenvalues.cumsum(0) / eigenvalues.sum().clamp_min(1e-300)
    dims = min(int((kept < variance).sum()) + 1, points.shape[1])
    basis = eigenvectors.flip(1)[:, :dims].to(points.dtype)
    shift = mean.to(points.dtype) @ basis
    coordinates = points.new_empty(len(points), dims)
    for rows in blocks:  # written in place: no list of blocks to concatenate
        torch.matmul(points[rows], basis, out=coordinates[rows]).sub_(shift)
    return coordinates


def weighted_kmeans(
    points: torch.Tensor,
    weights: torch.Tensor | None,
    k: int,
    *,
    n_init: int = 1,
    max_iter: int = 100,
    tol: float = 1e-4,
    seed: int = 0,
    local_search_swaps: int = 0,
    variance: float | str | None = None,
) -> KMeansResult:
    """Cluster the rows of ``points`` into ``k`` groups minimising the weighted k-means cost.

    Args:
        points: ``(n, d)`` features, one row per point (neuron).
        weights: ``(n,)`` non-negative importance (None: uniform). Zero-weight points are
            clustered but do not pull centres.
        k: number of clusters, ``1 <= k <= n``.
        n_init: restarts from independent k-means++ seeds; the cheapest result is returned.
        max_iter: Lloyd iterations per restart.
        tol: stop when the relative cost decrease falls below ``tol``.
        seed: makes the result deterministic.
        local_search_swaps: if > 0, refine the best restart with up to this many accepted
            single swaps (Kanungo et al.).
        variance: cluster on the :func:`principal_coordinates` that keep this share of the
            weighted variance (None or 1: on every feature; ``"auto"``:
            :func:`resolve_variance`). The labels are then scored on the points themselves:
            ``centers`` and ``cost`` are the points', ``history`` the coordinates'.

    Returns:
        :class:`KMeansResult` with labels in ``0..k-1`` (every cluster non-empty).
    """
    if points.dim() != 2:
        raise ValueError(f"points must be (n, d), got shape {tuple(points.shape)}")
    n = len(points)
    if not 1 <= k <= n:
        raise ValueError(f"k must be between 1 and the number of points ({n}), got {k}")
    if n_init < 1 or max_iter < 1:
        raise ValueError(f"n_init and max_iter must be >= 1, got {n_init} and {max_iter}")
    w = torch.ones(n, dtype=points.dtype, device=points.device) if weights is None else weights
    w = w.to(points.dtype)
    if w.shape != (n,) or (w < 0).any() or not torch.isfinite(w).all():
        raise ValueError(f"weights must be {n} finite non-negative numbers")
    if w.sum() <= 0:
        w = torch.ones_like(w)
    # zero-weight points still need a cluster: give them a tiny weight for seeding only
    seed_weights = w + w.max() * 1e-9
    share = resolve_variance(variance, n, k)
    features = points if share is None else principal_coordinates(points, w, share)
    generator = torch.Generator().manual_seed(seed)
    best: KMeansResult | None = None
    for _ in range(n_init):
        centers = _initial_centers(features, seed_weights, k, generator)
        result = _lloyd(features, w, centers, max_iter, tol)
        if best is None or result.cost < best.cost:
            best = result
    assert best is not None
    if local_search_swaps > 0:
        best = local_search(
            features,
            w,
            best,
            max_swaps=local_search_swaps,
            generator=generator,
            max_iter=max_iter,
            tol=tol,
        )
    if features is not points:
        del features  # the coordinates are as large as a fifth of the points, or more
        best.centers, _ = weighted_centers(points, w, best.labels, k)
        best.cost = weighted_kmeans_cost(points, w, best.labels, best.centers)
    return best
