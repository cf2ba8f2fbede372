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
* :func:`pair_labels`: two equal-width sets of weighted neurons paired into clusters of two.

Reference: H. W. Kuhn, "The Hungarian method for the assignment problem", 1955; D. F. Crouse,
"On implementing 2D rectangular assignment algorithms", IEEE TAES 2016 (SciPy's solver).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from scipy.optimize import linear_sum_assignment

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
