"""Sharded partitioning: each client owns a disjoint group of classes (paper, App. D.2)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike

from ._validation import as_labels, check_int, check_num_clients, finalize, resolve_num_classes


def sharded_class_groups(num_classes: int, num_clients: int, *, seed: int) -> list[np.ndarray]:
    """Permute the class ids ``0..C-1`` and cut them into ``K`` disjoint groups.

    Uses ``np.array_split`` semantics: the first ``C mod K`` groups get ``ceil(C/K)`` classes,
    the rest ``floor(C/K)``. Each group is returned sorted (int64). ``K > C`` is an error since
    some client would own no class.
    """
    c = check_int(num_classes, "num_classes", minimum=1)
    k = check_int(num_clients, "num_clients", minimum=1)
    if k > c:
        raise ValueError(f"sharded split needs num_clients <= num_classes, got {k} > {c}")
    perm = np.random.default_rng(seed).permutation(c)
    return [np.sort(g).astype(np.int64) for g in np.array_split(perm, k)]


def check_class_groups(
    class_groups: Sequence[Sequence[int]], num_classes: int, num_clients: int
) -> list[np.ndarray]:
    """Chosen class groups as sorted int64 arrays: one non-empty group per client, disjoint,
    covering every class ``0..C-1`` exactly once (so every sample has one owner)."""
    groups = [np.asarray(list(g), dtype=np.int64) for g in class_groups]
    if len(groups) != num_clients:
        raise ValueError(
            f"class_groups has {len(groups)} groups for {num_clients} clients; give one per client"
        )
    seen: dict[int, int] = {}
    for index, group in enumerate(groups):
        if group.size == 0:
            raise ValueError(f"class_groups: group {index} is empty")
        for c in group.tolist():
            if not 0 <= c < num_classes:
                raise ValueError(
                    f"class_groups: class {c} in group {index} is not in 0..{num_classes - 1}"
                )
            if c in seen:
                raise ValueError(f"class_groups: class {c} is in groups {seen[c]} and {index}")
            seen[c] = index
    missing = sorted(set(range(num_classes)) - set(seen))
    if missing:
        raise ValueError(f"class_groups: class(es) {missing} belong to no group")
    return [np.sort(g) for g in groups]


def sharded_partition(
    labels: ArrayLike,
    num_clients: int,
    *,
    seed: int,
    num_classes: int | None = None,
    class_groups: Sequence[Sequence[int]] | None = None,
) -> list[np.ndarray]:
    """Give each client every sample of its class group.

    The groups are ``class_groups`` when given (e.g. the paper's BloodMNIST hospitals:
    white blood cells vs the rest; see :func:`check_class_groups`), else drawn at random by
    :func:`sharded_class_groups`. ``num_classes`` defaults to ``max(labels) + 1``; classes
    without samples still count when forming groups (so a client can end up empty if all its
    classes are absent). Clients share no classes: ``C_i & C_j = {}`` and ``U_k C_k = C``.
    Returns sorted int64 index arrays.
    """
    y = as_labels(labels)
    k = check_num_clients(num_clients, y.size)
    c = resolve_num_classes(y, num_classes)
    if class_groups is None:
        groups = sharded_class_groups(c, k, seed=seed)
    else:
        groups = check_class_groups(class_groups, c, k)
    return finalize([np.flatnonzero(np.isin(y, g)) for g in groups])
