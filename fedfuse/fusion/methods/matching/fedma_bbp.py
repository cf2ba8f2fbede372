"""PFNM's BBP-MAP for one level: match the clients' neurons into global neurons.

The model, the gains and the algorithm are described in
:mod:`fedfuse.fusion.methods.matching.fedma`, which matches a network level by level with
:func:`bbp_map_match`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from fedfuse.fusion.blocks.matching import linear_assignment

#: FedMA's reference code clips the popularity count ``m`` at this value in the matching cost
_CODE_POPULARITY_CLIP = 10.0
#: how the popularity of an existing global neuron enters the matching gain
POPULARITY = ("paper", "code")


@dataclass
class MatchResult:
    """BBP-MAP outcome for one level.

    Attributes:
        assignments: per client, the global neuron of each of its neurons (injective).
        neurons: the global neurons (posterior means), ``(L, D)``.
        counts: per global neuron, how many clients use it (``m_i``).
        passes: full passes over the clients done after the initial sequential pass.
        history: the likelihood part of the objective, ``sum_i ||s_i||^2 / p_i``, after the
            initial pass and after each later pass (it may fall while ``log P(B)`` rises).
    """

    assignments: list[list[int]]
    neurons: torch.Tensor
    counts: list[int]
    passes: int = 0
    history: list[float] = field(default_factory=list)


def _client_gains(
    v: torch.Tensor,
    sums: torch.Tensor,
    precisions: torch.Tensor,
    counts: torch.Tensor,
    *,
    new_columns: int,
    clients: int,
    sigma: float,
    sigma0: float,
    gamma: float,
    popularity: str = "paper",
) -> torch.Tensor:
    """PFNM gains (negated costs) of client neurons ``v`` ``(Lj, D)`` against ``L`` global
    neurons (natural parameters ``sums`` ``(L, D)``, ``precisions`` ``(L,)``, popularity
    ``counts`` ``(L,)``, all without this client) and ``new_columns`` new neurons; ``mu0 = 0``.
    ``popularity="code"`` scores an existing neuron's popularity as FedMA's reference code does,
    ``log(m / (J - m))`` with ``m`` clipped at 10, instead of the paper's ``2 log(m / (J - m))``.

    Returns ``(Lj, L + new_columns)``.
    """
    b = 1.0 / sigma**2
    a = 1.0 / sigma0**2
    v_sq = (v * v).sum(1)  # (Lj,)
    s_sq = (sums * sums).sum(1)  # (L,)
    cross = v @ sums.T  # (Lj, L)
    match = (s_sq[None] + 2 * b * cross + b * b * v_sq[:, None]) / (precisions + b)[None]
    match = match - (s_sq / precisions)[None]
    if popularity == "code":
        clipped = counts.clamp(max=_CODE_POPULARITY_CLIP)
        match = match + torch.log(clipped / (clients - clipped))[None]
    else:
        match = match + 2 * torch.log(counts / (clients - counts))[None]
    k = torch.arange(1, new_columns + 1, dtype=v.dtype, device=v.device)
    new = (b * b * v_sq / (a + b))[:, None] + 2 * math.log(gamma / clients) - 2 * torch.log(k)
    return torch.cat([match, new], 1)


def bbp_map_match(
    vectors: list[torch.Tensor],
    *,
    sigma: float,
    sigma0: float,
    gamma: float,
    max_width: int,
    iterations: int,
    seed: int = 0,
    popularity: str = "paper",
) -> MatchResult:
    """Match the clients' neurons of one level into global neurons by BBP-MAP (PFNM).

    Args:
        vectors: per client ``j``, its neurons as rows ``(L_j, D)`` (float64), all in the same
            coordinates (the previous level already mapped to the global one).
        sigma: client noise std per coordinate (same units as ``vectors``).
        sigma0: prior std per coordinate around ``mu0 = 0``.
        gamma: IBP mass; larger opens new global neurons more readily.
        max_width: at most this many global neurons (``>= max_j L_j``).
        iterations: passes over the clients in random order after the initial sequential one
            (stops early once a pass changes no assignment).
        seed: seeds the client order of the passes.
        popularity: ``"paper"`` (``2 log(m/(J-m))``) or ``"code"`` (FedMA's code: ``log``, with
            ``m`` clipped at 10); see :func:`_client_gains`.

    Returns:
        :class:`MatchResult` with the assignments and the posterior-mean global neurons.
    """
    clients = len(vectors)
    widest = max(len(v) for v in vectors)
    if max_width < widest:
        raise ValueError(f"max_width={max_width} is below the widest client's {widest} neurons")
    b = 1.0 / sigma**2
    a = 1.0 / sigma0**2
    dtype, device = vectors[0].dtype, vectors[0].device
    dim = vectors[0].shape[1]
    # natural parameters of the global neurons: sums = mu0 a + sum b v (mu0 = 0), prec = a + m b
    sums = torch.zeros(0, dim, dtype=dtype, device=device)
    precisions = torch.zeros(0, dtype=dtype, device=device)
    counts = torch.zeros(0, dtype=dtype, device=device)
    assignments: list[list[int]] = [[] for _ in range(clients)]

    def remove(j: int) -> None:
        nonlocal sums, precisions, counts
        index = torch.tensor(assignments[j], dtype=torch.long, device=device)
        if len(index) == 0:
            return
        # a client's neurons go to distinct global neurons, so plain indexing accumulates
        sums[index] -= b * vectors[j]
        precisions[index] -= b
        counts[index] -= 1
        keep = counts > 0.5
        if bool(keep.all()):
            assignments[j] = []
            return
        new_index = (torch.cumsum(keep.long(), 0) - 1).tolist()
        for other in range(clients):
            if other != j:
                assignments[other] = [new_index[i] for i in assignments[other]]
        sums, precisions, counts = sums[keep], precisions[keep], counts[keep]
        assignments[j] = []

    def add(j: int) -> None:
        nonlocal sums, precisions, counts
        v = vectors[j]
        existing = len(sums)
        new_columns = min(len(v), max_width - existing)
        if existing == 0:  # the first client opens one global neuron per neuron
            sums = b * v.clone()
            precisions = torch.full((len(v),), a + b, dtype=dtype, device=device)
            counts = torch.ones(len(v), dtype=dtype, device=device)
            assignments[j] = list(range(len(v)))
            return
        gains = _client_gains(
            v,
            sums,
            precisions,
            counts,
            new_columns=new_columns,
            clients=clients,
            sigma=sigma,
            sigma0=sigma0,
            gamma=gamma,
            popularity=popularity,
        )
        target = linear_assignment(gains, maximize=True).numpy()
        opened = sorted(int(c) for c in target if c >= existing)
        # new columns are numbered after the existing neurons, in column order
        renumber = {c: existing + n for n, c in enumerate(opened)}
        target = np.array([renumber.get(int(c), int(c)) for c in target], dtype=np.int64)
        grow = len(opened)
        if grow:
            sums = torch.cat([sums, sums.new_zeros(grow, dim)])
            precisions = torch.cat([precisions, precisions.new_full((grow,), a)])
            counts = torch.cat([counts, counts.new_zeros(grow)])
        index = torch.as_tensor(target, device=device)
        sums[index] += b * v
        precisions[index] += b
        counts[index] += 1
        assignments[j] = target.tolist()

    def partition() -> frozenset[frozenset[tuple[int, int]]]:
        groups: dict[int, set[tuple[int, int]]] = {}
        for j, assigned in enumerate(assignments):
            for neuron, i in enumerate(assigned):
                groups.setdefault(i, set()).add((j, neuron))
        return frozenset(frozenset(g) for g in groups.values())

    order = sorted(range(clients), key=lambda j: -len(vectors[j]))  # widest first, as FedMA
    for j in order:
        add(j)
    rng = np.random.default_rng(seed)
    passes = 0
    history = [_objective(sums, precisions)]
    previous = partition()
    for _ in range(iterations):
        passes += 1
        for j in rng.permutation(clients).tolist():
            remove(j)
            add(j)
        history.append(_objective(sums, precisions))
        current = partition()
        if current == previous:
            break
        previous = current
    return MatchResult(
        assignments=assignments,
        neurons=sums / precisions[:, None],
        counts=[int(round(c)) for c in counts.tolist()],
        passes=passes,
        history=history,
    )


def _objective(sums: torch.Tensor, precisions: torch.Tensor) -> float:
    """The likelihood part of the BBP-MAP objective, ``sum_i ||s_i||^2 / p_i``."""
    return float(((sums * sums).sum(1) / precisions).sum())
