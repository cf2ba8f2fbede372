r"""The representation cost of a fused level and its Theorem 1 decomposition.

With base-model neurons ``j`` (columns ``z_j`` of the concatenated level outputs over a batch),
importance ``s_j``, an assignment ``j -> c(j)`` to fused neurons and fused outputs ``f_k``:

.. math::
    J = \sum_j s_j \lVert f_{c(j)} - z_j \rVert^2
      = \underbrace{\sum_j s_j \lVert f_{c(j)} - T_{c(j)} \rVert^2}_{\text{approximation}}
      + \underbrace{\sum_j s_j \lVert T_{c(j)} - z_j \rVert^2}_{\text{grouping}},
    \qquad T_k = \frac{\sum_{c(j)=k} s_j z_j}{\sum_{c(j)=k} s_j}.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RepresentationCost:
    """Total cost and its two terms (sums over the batch, divided by the number of rows)."""

    total: float
    approximation: float
    grouping: float


def cluster_targets(
    base: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, k: int
) -> torch.Tensor:
    """``T`` (``rows x k``): the importance-weighted mean of each cluster's base columns."""
    weights = weights.to(base.dtype)
    sums = torch.zeros(base.shape[0], k, dtype=base.dtype, device=base.device)
    sums.index_add_(1, labels, base * weights[None])
    mass = torch.zeros(k, dtype=base.dtype, device=base.device).index_add_(0, labels, weights)
    return sums / mass.clamp_min(torch.finfo(base.dtype).tiny)[None]


def _cost_sums(
    fused: torch.Tensor, base: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Unnormalised ``(total, approximation, grouping)`` over the given rows.

    From the clusters' weighted sums ``S_k = sum_{c(j)=k} s_j z_j`` and masses ``m_k`` alone
    (one pass over the base columns, no ``rows x base`` temporaries):
    ``grouping = sum_j s_j |z_j|^2 - sum_k |S_k|^2 / m_k``,
    ``approximation = sum_k m_k |f_k - T_k|^2`` and
    ``total = sum_k (m_k |f_k|^2 - 2 f_k . S_k) + sum_j s_j |z_j|^2``.
    """
    f, w = fused.double(), weights.to(base.dtype)
    k = f.shape[1]
    sums = torch.zeros(base.shape[0], k, dtype=torch.float64, device=base.device)
    sums.index_add_(1, labels, (base * w[None]).double())
    mass = torch.zeros(k, dtype=torch.float64, device=base.device)
    mass.index_add_(0, labels, weights.double())
    base_norm = (w.double() * (base.double() ** 2).sum(0)).sum()
    targets = sums / mass.clamp_min(torch.finfo(torch.float64).tiny)[None]
    grouping = (base_norm - (sums * targets).sum()).clamp_min(0)
    approximation = (mass * ((f - targets) ** 2).sum(0)).sum()
    total = ((mass * (f**2).sum(0)).sum() - 2 * (f * sums).sum() + base_norm).clamp_min(0)
    return torch.stack([total, approximation, grouping])


def representation_cost(
    fused: torch.Tensor | Iterable[torch.Tensor],
    base: torch.Tensor | Iterable[torch.Tensor],
    labels: torch.Tensor,
    weights: torch.Tensor,
) -> RepresentationCost:
    """Eq. (1) for the given assignment, and its approximation/grouping split (Eq. 2).

    Args:
        fused: fused level outputs as rows ``(N, k)``, or an iterable of row chunks.
        base: concatenated base outputs as rows ``(N, d)``, or matching row chunks.
        labels: fused neuron of each base neuron, ``(d,)``.
        weights: importance of each base neuron, ``(d,)``.

    Returns:
        The three sums divided by the number of rows ``N``.
    """
    fused_chunks = [fused] if isinstance(fused, torch.Tensor) else fused
    base_chunks = [base] if isinstance(base, torch.Tensor) else base
    sums = torch.zeros(3, dtype=torch.float64)
    rows = 0
    for f, z in zip(fused_chunks, base_chunks, strict=True):
        sums += _cost_sums(f, z, labels, weights).cpu()
        rows += f.shape[0]
    total, approximation, grouping = (sums / max(rows, 1)).tolist()
    return RepresentationCost(total, approximation, grouping)
