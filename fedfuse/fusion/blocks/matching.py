r"""Matching neurons: the costs between them and the one-to-one assignment (Hungarian).

* Costs between the neurons of two levels, from their outputs over the same rows:
  :func:`squared_distances` (OTFusion, Git Re-Basin's ``"l2"``) and :func:`correlation` (Git
  Re-Basin; FS-Merge's ZipIt matching), accumulated in float64 chunks (:func:`neuron_rows`);
  :func:`pairing_cost` weighs a squared distance by the two neurons' importance (Hungarian
  Fusion).
* :func:`linear_assignment`: the linear assignment problem, solved exactly by SciPy's
  ``linear_sum_assignment`` (a Hungarian-type algorithm). For a cost matrix :math:`C \in
  \mathbb{R}^{n \times m}`, :math:`n \le m`, it returns the injective :math:`\pi` with

  .. math::
      \pi^\ast = \operatorname*{arg\,min}_{\pi} \sum_{i=1}^n C_{i\,\pi(i)}
      \quad(\text{or } \operatorname*{arg\,max} \text{ of a gain with } ``maximize``),

  as used by Hungarian Fusion (pairing two models' neurons; ordering K-means clusters like model
  0's neurons), Git Re-Basin (the permutation of model 1's neurons) and FedMA (each client's
  neurons to global neurons, maximising the posterior gain).
* :func:`pair_labels`: two equal-width sets of weighted neurons paired into clusters of two;
  :func:`one_to_one_labels`: any number of them, one neuron of each per cluster (Hungarian
  Fusion of N models, block-coordinate descent over the models).
* :func:`merge_many`: Git Re-Basin's MergeMany from the models' pairwise costs (each model's
  permutation matched, in random order, to the others' already aligned units until none moves).

Reference: H. W. Kuhn, "The Hungarian method for the assignment problem", 1955; D. F. Crouse,
"On implementing 2D rectangular assignment algorithms", IEEE TAES 2016 (SciPy's solver).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

from fedfuse.models.affine import output_rows


def linear_assignment(cost: torch.Tensor, *, maximize: bool = False) -> torch.Tensor:
    """The column assigned to each row by a minimum-cost (``maximize``: maximum-gain) matching.

    Args:
        cost: ``(n, m)`` costs (or gains), ``n <= m``; any device and float dtype.
        maximize: maximise the summed entries instead of minimising them.

    Returns:
        ``(n,)`` int64 CPU tensor ``pi``: row ``i`` is matched to column ``pi[i]`` (distinct).
    """
    if cost.dim() != 2 or cost.shape[0] > cost.shape[1]:
        raise ValueError(
            f"linear_assignment needs an (n, m) matrix with n <= m, got {tuple(cost.shape)}"
        )
    # imported here: scipy.optimize costs half a second at the start of every process that never
    # matches (each Flower ClientApp, every CLI command)
    from scipy.optimize import linear_sum_assignment

    rows, cols = linear_sum_assignment(cost.detach().cpu().numpy(), maximize=maximize)
    assigned = torch.empty(cost.shape[0], dtype=torch.long)
    assigned[torch.as_tensor(rows, dtype=torch.long)] = torch.as_tensor(cols, dtype=torch.long)
    return assigned


def pairing_cost(
    a: torch.Tensor, b: torch.Tensor, weight_a: torch.Tensor, weight_b: torch.Tensor
) -> torch.Tensor:
    r"""``(n, m)`` cost of merging point ``a_i`` (weight ``s_i``) with ``b_j`` (``t_j``).

    The weighted k-means cost of the cluster :math:`\{a_i, b_j\}` around its weighted mean,
    :math:`\frac{s_i t_j}{s_i + t_j} \lVert a_i - b_j \rVert^2` (0 when both weights are 0).
    """
    pair = (weight_a[:, None] * weight_b[None]) / (weight_a[:, None] + weight_b[None]).clamp_min(
        1e-30
    )
    return pair * torch.cdist(a, b).pow(2)


def pair_labels(
    a: torch.Tensor, b: torch.Tensor, weight_a: torch.Tensor, weight_b: torch.Tensor
) -> torch.Tensor:
    """Cluster labels of ``n`` points ``a`` then ``n`` points ``b``, paired one-to-one.

    Point ``a_i`` is cluster ``i``; each ``b_j`` joins the ``a_i`` it is matched to by the
    minimum total :func:`pairing_cost` (Hungarian Fusion's grouping of two models' neurons).
    Returns ``(2n,)`` int64 labels on ``a``'s device.
    """
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"pair_labels needs two sets of equal size, got {len(a)} and {len(b)}")
    n = len(a)
    match = linear_assignment(pairing_cost(a, b, weight_a, weight_b)).to(a.device)
    labels = torch.empty(2 * n, dtype=torch.long, device=a.device)
    labels[:n] = torch.arange(n, device=a.device)
    labels[n + match] = torch.arange(n, device=a.device)
    return labels


def one_to_one_labels(
    points: torch.Tensor, weights: torch.Tensor, widths: Sequence[int], *, rounds: int = 50
) -> torch.Tensor:
    r"""Cluster labels of ``N`` equal-width sets of weighted points, one point of each per cluster.

    Hungarian Fusion's grouping for any number of models. The objective is the weighted k-means
    cost :math:`J = \sum_c \sum_{j \in c} s_j \lVert p_j - T_c \rVert^2` (``T_c`` the cluster's
    weighted mean), each cluster holding exactly one point of every set: for two sets a linear
    assignment solved exactly (:func:`pair_labels`), for more an ``N``-dimensional assignment
    (NP-hard), minimised here by block-coordinate descent over the sets. With set ``m``'s points
    taken out, cluster ``c`` has weighted mean :math:`T_c^{-m}` and mass :math:`S_c^{-m}`, and
    adding a point ``p`` of weight ``t`` raises its cost by exactly
    :math:`\frac{S t}{S + t} \lVert T^{-m}_c - p \rVert^2` (:func:`pairing_cost`), so the
    Hungarian solution of that matrix is set ``m``'s best assignment given the others, and
    :math:`J` never increases.

    Start: set 0 is the pivot; sets ``1 .. N-1`` are matched in turn to the clusters formed so
    far. Then each round re-matches every set, in order ``0 .. N-1``, to the others; it stops
    after a round that moves nothing, or after ``rounds`` rounds (0: the start only).

    Args:
        points: ``(sum(widths), d)`` points, set by set.
        weights: ``(sum(widths),)`` non-negative weights.
        widths: the sets' sizes, all equal.
        rounds: most rounds of re-matching after the start (``N > 2``).

    Returns:
        ``(sum(widths),)`` int64 labels on ``points``' device; cluster ``i`` holds set 0's
        point ``i``. Two sets: exactly :func:`pair_labels`.
    """
    n = widths[0]
    if any(w != n for w in widths) or sum(widths) != len(points):
        raise ValueError(
            f"one-to-one grouping needs sets of equal size covering the {len(points)} points, "
            f"got sizes {list(widths)}"
        )
    if len(widths) == 1:
        return torch.arange(n, device=points.device)
    sets, masses = points.split(list(widths)), weights.split(list(widths))
    if len(widths) == 2:
        return pair_labels(sets[0], sets[1], masses[0], masses[1])
    masses = weights.to(points.dtype).split(list(widths))
    # slots[m][c]: set m's point in cluster c; parts[m]: its weighted points in cluster order
    slots = [torch.arange(n, device=points.device)]
    parts = [(masses[0][:, None] * sets[0], masses[0])]

    def best(m: int, others: list[int]) -> torch.Tensor:
        total = sum(parts[j][0] for j in others)
        mass = sum(parts[j][1] for j in others)
        assert isinstance(total, torch.Tensor) and isinstance(mass, torch.Tensor)
        centres = total / mass.clamp_min(torch.finfo(mass.dtype).tiny)[:, None]
        return linear_assignment(pairing_cost(centres, sets[m], mass, masses[m])).to(points.device)

    for m in range(1, len(widths)):
        slots.append(best(m, list(range(m))))
        parts.append((masses[m][slots[m], None] * sets[m][slots[m]], masses[m][slots[m]]))
    for _ in range(rounds):
        moved = False
        for m in range(len(widths)):
            slot = best(m, [j for j in range(len(widths)) if j != m])
            if not torch.equal(slot, slots[m]):
                moved = True
                slots[m] = slot
                parts[m] = (masses[m][slot, None] * sets[m][slot], masses[m][slot])
        if not moved:
            break
    labels = torch.empty(len(points), dtype=torch.long, device=points.device)
    for m, slot in enumerate(slots):  # cluster c takes the number of set 0's point in it
        labels[m * n + slot] = slots[0]
    return labels


def merge_many(
    costs: Mapping[tuple[int, int], torch.Tensor],
    weights: Sequence[float],
    *,
    rounds: int = 100,
    seed: int = 0,
    assign: Callable[[torch.Tensor], torch.Tensor] = linear_assignment,
) -> tuple[list[torch.Tensor], int]:
    r"""Git Re-Basin's MergeMany (Ainsworth et al., 2023, Alg. 3) on pairwise unit costs.

    Every model ``i`` carries a permutation :math:`\pi_i` (start: the identity); unit slot
    ``s`` of the merged model is unit :math:`\pi_i(s)` of model ``i``. A round visits the models
    in a random order and re-matches each to the others as already aligned,

    .. math::
        \pi_i \leftarrow \operatorname*{arg\,min}_{\pi} \sum_s \sum_{j \ne i}
            c_j\, C_{ji}\bigl(\pi_j(s), \pi(s)\bigr),

    a linear assignment; rounds repeat until one moves nothing, or ``rounds`` of them. For an
    inner-product similarity (weight matching; minus the correlation) and for squared distances
    this is matching model ``i`` to the ``c``-weighted mean of the others (the squared distance
    up to a constant); for correlations it sums the correlations with each aligned model.

    Args:
        costs: for every pair ``i < j``, the ``(n, n)`` cost ``C_ij[a, b]`` between unit ``a``
            of model ``i`` and unit ``b`` of model ``j`` (a symmetric measure: ``C_ji =
            C_ij^T``).
        weights: the models' weights ``c`` (the mean of the others is ``c``-weighted).
        rounds: most rounds.
        seed: seeds the order of the visits.
        assign: the assignment solver (``assign(M)[s]``: the unit placed in slot ``s``), e.g.
            one matching attention heads block by block.

    Returns:
        Each model's permutation, expressed so that model 0's is the identity (the merged units
        numbered like model 0's; a relabelling that changes no function), and the rounds run.
        Two models: model 1 matched once onto model 0 (what MergeMany converges to from either
        first visit, as the optimal assignment of one onto the other is its own best reply).
    """
    count = len(weights)
    n = costs[(0, 1)].shape[0]
    identity = torch.arange(n)
    if count == 2:
        return [identity, assign(costs[(0, 1)])], 1

    def pair(j: int, i: int) -> torch.Tensor:
        return costs[(j, i)] if j < i else costs[(i, j)].T

    permutations = [identity.clone() for _ in range(count)]
    generator = torch.Generator().manual_seed(seed)
    done = 0
    while done < rounds:
        done += 1
        moved = False
        for i in torch.randperm(count, generator=generator).tolist():
            total = sum(weights[j] * pair(j, i)[permutations[j]] for j in range(count) if j != i)
            assert isinstance(total, torch.Tensor)
            permutation = assign(total)
            if not torch.equal(permutation, permutations[i]):
                moved, permutations[i] = True, permutation
        if not moved:
            break
    inverse = torch.argsort(permutations[0])
    return [p[inverse] for p in permutations], done


def neuron_rows(outputs: torch.Tensor, batch_size: int = 256) -> Iterator[torch.Tensor]:
    """Float64 chunks of ``output_rows(outputs)`` (neurons as columns), ``batch_size`` samples
    each, so that wide convolutional levels never exist in float64 all at once."""
    for start in range(0, len(outputs), batch_size):
        yield output_rows(outputs[start : start + batch_size]).double()


def squared_distances(a: torch.Tensor, b: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
    """``D_ij = ||a_i - b_j||^2 / R`` between the neurons (channels, dim 1) of ``a`` and ``b``.

    Args:
        a, b: level outputs ``(N, n, ...)`` and ``(N, m, ...)`` (or any ``(R, n)`` matrices with
            neurons as columns, e.g. weights as ``(fan_in + 1, out)``); a neuron's vector is its
            column of :func:`~fedfuse.models.affine.output_rows`, of ``R`` rows (samples x
            positions).
        batch_size: samples per float64 chunk.

    Returns:
        ``(n, m)`` float64. Each row of features is centred by its mean over all ``n + m``
        neurons first (the distances do not change; ``|a|^2 + |b|^2 - 2 a.b`` then loses less
        to cancellation).
    """
    if len(a) != len(b):
        raise ValueError(f"{len(a)} and {len(b)} rows: neurons must be seen on the same inputs")
    n, m = a.shape[1], b.shape[1]
    cross = a.new_zeros(n, m, dtype=torch.float64)
    norms_a = a.new_zeros(n, dtype=torch.float64)
    norms_b = a.new_zeros(m, dtype=torch.float64)
    rows = 0
    for za, zb in zip(neuron_rows(a, batch_size), neuron_rows(b, batch_size), strict=True):
        centre = (za.sum(1, keepdim=True) + zb.sum(1, keepdim=True)) / (n + m)
        za, zb = za - centre, zb - centre
        cross += za.T @ zb
        norms_a += (za * za).sum(0)
        norms_b += (zb * zb).sum(0)
        rows += len(za)
    return (norms_a[:, None] + norms_b[None] - 2 * cross).clamp_min(0) / max(rows, 1)


def correlation(
    a: torch.Tensor,
    b: torch.Tensor | None = None,
    batch_size: int = 256,
    eps: float = 1e-12,
    *,
    one_pass: bool = False,
) -> torch.Tensor:
    r"""Pearson correlation ``(n, m)`` between the neurons of ``a`` and ``b``.

    The correlation of neurons :math:`i` and :math:`j` over the rows :math:`r = 1..R` (samples x
    positions) is :math:`\rho_{ij} = \operatorname{cov}(a_i, b_j) / (\sigma(a_i)\,\sigma(b_j))`,
    accumulated in float64 chunks of ``batch_size`` samples (:func:`neuron_rows`).

    Args:
        a, b: level outputs ``(N, n, ...)`` and ``(N, m, ...)`` (or ``(R, n)`` matrices); a
            neuron's values are its column of :func:`~fedfuse.models.affine.output_rows`.
            ``b`` None: the ``(n, n)`` correlation of ``a``'s neurons among themselves.
        batch_size: samples per float64 chunk.
        eps: when a neuron counts as constant (dead); a constant neuron has correlation 0 with
            all. Two passes: the floor of a neuron's centred norm. ``one_pass``: the share of
            the largest standard deviation a neuron's must exceed.
        one_pass: how the moments are taken. False (Git Re-Basin, feature-space matching): two
            passes, the means first, then the centred products. True (FS-Merge's ZipIt
            matching): one pass over raw moments, :math:`\operatorname{cov} = E[ab] -
            E[a]E[b]`, the variances taken from the same products (the diagonal when ``b`` is
            None), the result clipped to ``[-1, 1]``.
    """
    other = a if b is None else b
    if len(a) != len(other):
        raise ValueError(f"{len(a)} and {len(other)} rows: neurons must be seen on the same inputs")
    n, m = a.shape[1], other.shape[1]
    if one_pass:
        joint = n if b is None else n + m
        total = a.new_zeros(joint, dtype=torch.float64)
        gram = a.new_zeros(joint, joint, dtype=torch.float64)
        chunks = (
            neuron_rows(a, batch_size)
            if b is None
            else (
                torch.cat(pair, 1)
                for pair in zip(neuron_rows(a, batch_size), neuron_rows(b, batch_size), strict=True)
            )
        )
        rows = 0
        for block in chunks:
            total += block.sum(0)
            gram += block.T @ block
            rows += len(block)
        mean = total / rows
        cov = gram / rows - torch.outer(mean, mean)
        std = cov.diagonal().clamp_min(0).sqrt()
        alive = std > eps * std.max().clamp_min(1e-300)
        scale = torch.where(alive, std, torch.ones_like(std))
        corr = cov / torch.outer(scale, scale)
        corr[~alive] = 0
        corr[:, ~alive] = 0
        return corr.clamp(-1, 1) if b is None else corr[:n, n:].clamp(-1, 1)
    means = []
    for z in (a, other):
        total, rows = z.new_zeros(z.shape[1], dtype=torch.float64), 0
        for chunk in neuron_rows(z, batch_size):
            total += chunk.sum(0)
            rows += len(chunk)
        means.append(total / max(rows, 1))
    cross = a.new_zeros(n, m, dtype=torch.float64)
    norms_a = a.new_zeros(n, dtype=torch.float64)
    norms_b = a.new_zeros(m, dtype=torch.float64)
    for za, zb in zip(neuron_rows(a, batch_size), neuron_rows(other, batch_size), strict=True):
        za, zb = za - means[0], zb - means[1]
        cross += za.T @ zb
        norms_a += (za * za).sum(0)
        norms_b += (zb * zb).sum(0)
    scale = norms_a.sqrt().clamp_min(eps)[:, None] * norms_b.sqrt().clamp_min(eps)[None]
    return cross / scale
