"""The server's fusion set: a small sample of training indices used to fuse the models."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike

from ._validation import as_labels, check_int


def sample_fusion_set(
    labels: ArrayLike,
    partitions: Sequence[ArrayLike],
    n: int,
    *,
    source: int | str = 0,
    seed: int,
) -> np.ndarray:
    """Sample ``n`` distinct training indices for fusion; returns them sorted (int64).

    ``source=k`` draws from client ``k``'s partition, so the fusion set is skewed like that
    client's data (the paper uses 400 points from the first model's data). When client ``k``
    holds fewer than ``n`` samples (many clients share the data), the set takes all of them and
    is topped up from clients ``k+1, k+2, ...`` in turn, staying as skewed as the split allows.
    ``source="all"`` draws uniformly from the whole training set (indices ``0..N-1``,
    ``N = len(labels)``).
    """
    y = as_labels(labels)
    n = check_int(n, "n", minimum=1)
    rng = np.random.default_rng(seed)
    if isinstance(source, str):
        if source != "all":
            raise ValueError(f"source must be a client index or 'all', got {source!r}")
        if n > y.size:
            raise ValueError(
                f"requested n={n} fusion samples but only {y.size} are in the whole training set"
            )
        return np.sort(rng.choice(np.arange(y.size, dtype=np.int64), size=n, replace=False))
    k = check_int(source, "source", minimum=0)
    if k >= len(partitions):
        raise ValueError(f"source={k} is out of range for {len(partitions)} partitions")
    pools = [np.asarray(p, dtype=np.int64) for p in partitions]
    total = sum(p.size for p in pools)
    if n > total:
        raise ValueError(f"requested n={n} fusion samples but the clients hold only {total}")
    chosen: list[np.ndarray] = []
    remaining = n
    for offset in range(len(pools)):
        pool = pools[(k + offset) % len(pools)]
        if pool.size and (pool.min() < 0 or pool.max() >= y.size):
            raise ValueError(
                f"partition {(k + offset) % len(pools)} has indices outside [0, {y.size})"
            )
        if pool.size >= remaining:
            chosen.append(rng.choice(pool, size=remaining, replace=False))
            break
        chosen.append(pool)
        remaining -= pool.size
    return np.sort(np.concatenate(chosen))
