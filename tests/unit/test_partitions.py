"""Tests for fedfuse.partitions: coverage, determinism, regime properties, fusion set, summary."""

from __future__ import annotations

import numpy as np
import pytest

from fedfuse import partitions as fp

DRAW = "fedfuse.partitions.dirichlet._draw_proportions"

NUM_CLASSES = 10
# Real-world-like long tail, including a class (id 7) with no samples at all.
UNEVEN_SIZES = [900, 450, 300, 120, 60, 35, 12, 0, 3, 1]


def balanced_labels() -> np.ndarray:
    """10 classes x 200 samples, shuffled."""
    rng = np.random.default_rng(123)
    return rng.permutation(np.repeat(np.arange(NUM_CLASSES), 200))


def uneven_labels() -> np.ndarray:
    rng = np.random.default_rng(456)
    return rng.permutation(np.repeat(np.arange(NUM_CLASSES), UNEVEN_SIZES))


LABELS = {"balanced": balanced_labels(), "uneven": uneven_labels()}

# (name, num_clients, options) for every partitioner, used in the generic property tests.
CASES = [
    ("iid", 1, {}),
    ("iid", 3, {}),
    ("iid", 7, {}),
    ("dirichlet", 1, {}),
    ("dirichlet", 2, {}),
    ("dirichlet", 4, {"min_max_ratio": 0.1, "min_size": 5}),
    ("sharded", 1, {}),
    ("sharded", 3, {}),
    ("sharded", 10, {}),
]


def assert_exact_cover(parts: list[np.ndarray], n: int) -> None:
    for p in parts:
        assert isinstance(p, np.ndarray)
        assert p.dtype == np.int64
        assert p.ndim == 1
        assert np.all(np.diff(p) > 0), "each partition must be sorted without duplicates"
    allidx = np.concatenate(parts)
    assert allidx.size == n, "partitions must not overlap and must cover every index"
    np.testing.assert_array_equal(np.sort(allidx), np.arange(n))


def mean_tv_to_global(labels: np.ndarray, parts: list[np.ndarray]) -> float:
    """Average total-variation distance between client class distributions and the global one."""
    c = int(labels.max()) + 1
    glob = np.bincount(labels, minlength=c) / labels.size
    tvs = [0.5 * np.abs(np.bincount(labels[p], minlength=c) / p.size - glob).sum() for p in parts]
    return float(np.mean(tvs))


# ---------------------------------------------------------------- generic properties


@pytest.mark.parametrize("kind", sorted(LABELS))
@pytest.mark.parametrize(("name", "k", "opts"), CASES)
def test_disjoint_and_exact_cover(kind, name, k, opts):
    labels = LABELS[kind]
    parts = fp.partition_labels(name, labels, k, seed=0, **opts)
    assert len(parts) == k
    assert_exact_cover(parts, labels.size)


@pytest.mark.parametrize(("name", "k", "opts"), [c for c in CASES if c[1] > 1])
def test_deterministic_by_seed(name, k, opts):
    labels = LABELS["balanced"]
    a = fp.partition_labels(name, labels, k, seed=11, **opts)
    b = fp.partition_labels(name, labels.copy(), k, seed=11, **opts)
    c = fp.partition_labels(name, labels, k, seed=12, **opts)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


@pytest.mark.parametrize("fn", [fp.iid_partition, fp.dirichlet_partition, fp.sharded_partition])
def test_accepts_array_likes(fn):
    labels = balanced_labels()
    a = fn(labels.tolist(), 2, seed=3)
    b = fn(labels.astype(np.uint8), 2, seed=3)
    c = fn(labels, 2, seed=3)
    assert all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))
    assert all(np.array_equal(x, y) for x, y in zip(b, c, strict=True))


@pytest.mark.parametrize("fn", [fp.iid_partition, fp.dirichlet_partition, fp.sharded_partition])
@pytest.mark.parametrize(
    ("bad", "exc", "match"),
    [
        (np.zeros((4, 5), dtype=int), ValueError, "1-D"),
        (np.array([], dtype=int), ValueError, "non-empty"),
        (np.array([0.0, 1.0, 2.0] * 10), TypeError, "integer"),
        (np.array([True, False] * 10), TypeError, "integer"),
        (np.array([0, 1, -1] * 10), ValueError, "non-negative"),
    ],
)
def test_label_validation(fn, bad, exc, match):
    with pytest.raises(exc, match=match):
        fn(bad, 2, seed=0)


@pytest.mark.parametrize("fn", [fp.iid_partition, fp.dirichlet_partition, fp.sharded_partition])
@pytest.mark.parametrize("k", [0, -1, 2.0, True])
def test_num_clients_validation(fn, k):
    with pytest.raises((ValueError, TypeError), match="num_clients"):
        fn(balanced_labels(), k, seed=0)


# ---------------------------------------------------------------- iid


def test_iid_sizes_near_equal_and_shuffled():
    labels = LABELS["uneven"]
    parts = fp.iid_partition(labels, 7, seed=0)
    sizes = [p.size for p in parts]
    assert max(sizes) - min(sizes) <= 1
    # Shuffled, not contiguous blocks of the index range.
    assert not np.array_equal(parts[0], np.arange(parts[0].size))
    # Class mix close to global: IID splits are far less skewed than sharded ones.
    assert mean_tv_to_global(labels, parts) < 0.1


# ---------------------------------------------------------------- sharded


@pytest.mark.parametrize("kind", sorted(LABELS))
@pytest.mark.parametrize("k", [2, 3, 4, 10])
def test_sharded_class_exclusive_and_fully_owned(kind, k):
    labels = LABELS[kind]
    parts = fp.sharded_partition(labels, k, seed=5, num_classes=NUM_CLASSES)
    groups = fp.sharded_class_groups(NUM_CLASSES, k, seed=5)
    owners: dict[int, int] = {}
    for client, (p, g) in enumerate(zip(parts, groups, strict=True)):
        present = set(np.unique(labels[p]).tolist())
        assert present <= set(g.tolist())
        for cls in present:
            assert cls not in owners, f"class {cls} shared by clients {owners.get(cls)}, {client}"
            owners[cls] = client
        # every sample of each owned class is with this client
        np.testing.assert_array_equal(p, np.flatnonzero(np.isin(labels, g)))
    assert set(owners) == set(np.unique(labels).tolist())


def test_sharded_groups_uneven_split():
    groups = fp.sharded_class_groups(10, 3, seed=0)
    assert [g.size for g in groups] == [4, 3, 3]
    np.testing.assert_array_equal(np.sort(np.concatenate(groups)), np.arange(10))
    for g in groups:
        assert g.dtype == np.int64
        assert np.all(np.diff(g) > 0)


def test_sharded_groups_depend_on_seed():
    groups = {tuple(map(tuple, fp.sharded_class_groups(10, 2, seed=s))) for s in range(10)}
    assert len(groups) > 1


def test_sharded_more_clients_than_classes_errors():
    with pytest.raises(ValueError, match="num_clients <= num_classes"):
        fp.sharded_class_groups(10, 11, seed=0)
    with pytest.raises(ValueError, match="num_clients <= num_classes"):
        fp.sharded_partition(balanced_labels(), 11, seed=0)


def test_sharded_num_classes_too_small_errors():
    with pytest.raises(ValueError, match="num_classes"):
        fp.sharded_partition(balanced_labels(), 2, seed=0, num_classes=5)


# ---------------------------------------------------------------- dirichlet


def test_dirichlet_concentrations_are_per_model_linspace():
    np.testing.assert_allclose(
        fp.dirichlet_concentrations(5, alpha_min=1.0, min_max_ratio=0.2), [1, 2, 3, 4, 5]
    )
    np.testing.assert_allclose(
        fp.dirichlet_concentrations(3, alpha_min=0.5, min_max_ratio=0.1), [0.5, 2.75, 5.0]
    )
    np.testing.assert_allclose(fp.dirichlet_concentrations(4, min_max_ratio=1.0), [1, 1, 1, 1])
    assert fp.dirichlet_concentrations(1).shape == (1,)


def test_dirichlet_one_shuffled_draw_per_class(monkeypatch):
    """Each class gets exactly one Dirichlet draw whose concentrations are a shuffle of alphas."""
    seen: list[np.ndarray] = []
    real_dirichlet = np.random.Generator.dirichlet

    def spy(rng, alphas):
        conc = rng.permutation(alphas)
        seen.append(conc)
        return real_dirichlet(rng, conc)

    monkeypatch.setattr(DRAW, spy)
    labels = LABELS["uneven"]
    k = 4
    fp.dirichlet_partition(labels, k, min_max_ratio=0.25, min_size=0, seed=0)
    expected = np.linspace(1.0, 4.0, k)
    assert len(seen) == np.unique(labels).size  # one draw per (non-empty) class
    for conc in seen:
        np.testing.assert_allclose(np.sort(conc), expected)
    # the concentration order is reshuffled per class, not fixed
    assert len({tuple(c) for c in seen}) > 1


def test_dirichlet_cuts_follow_drawn_proportions(monkeypatch):
    """Each class is cut exactly by its drawn proportions: floor(cumsum(p) * N_c)."""
    fixed = np.array([0.5, 0.3, 0.2])
    monkeypatch.setattr(DRAW, lambda rng, alphas: fixed)
    labels = balanced_labels()  # 200 per class
    parts = fp.dirichlet_partition(labels, 3, min_size=0, seed=0)
    table = fp.class_counts(labels, parts)
    np.testing.assert_array_equal(table, np.tile([[100], [60], [40]], (1, NUM_CLASSES)))
    # the class's sample indices are shuffled before cutting, not cut as contiguous runs
    members = np.flatnonzero(labels == 0)
    assert not np.array_equal(parts[0][labels[parts[0]] == 0], members[:100])


def test_dirichlet_visits_classes_in_shuffled_order(monkeypatch):
    """Route the i-th visited class wholly to client i to observe the visiting order."""
    calls = []

    def one_hot(rng, alphas):
        calls.append(None)
        return np.eye(alphas.size)[len(calls) - 1]

    labels = balanced_labels()
    orders = []
    for seed in range(3):
        calls.clear()
        monkeypatch.setattr(DRAW, one_hot)
        parts = fp.dirichlet_partition(labels, NUM_CLASSES, min_size=0, seed=seed)
        order = [int(np.unique(labels[p]).item()) for p in parts]
        assert sorted(order) == list(range(NUM_CLASSES))
        orders.append(tuple(order))
    assert orders[0] != tuple(range(NUM_CLASSES))
    assert len(set(orders)) > 1


def test_dirichlet_skew_grows_as_min_max_ratio_falls():
    # Heterogeneity = mean over seeds of the average TV distance between client and global
    # class distributions. Two clients, where the regime is monotone in min_max_ratio;
    # 30 seeds make the gap (~0.15) many standard errors (~0.01) wide.
    labels = balanced_labels()

    def skew(ratio: float) -> float:
        splits = [fp.dirichlet_partition(labels, 2, min_max_ratio=ratio, seed=s) for s in range(30)]
        return float(np.mean([mean_tv_to_global(labels, parts) for parts in splits]))

    flat, mid, steep = skew(1.0), skew(0.2), skew(0.1)
    assert steep > mid > flat
    assert steep - flat > 0.08


def test_dirichlet_min_size_guard_redraws():
    labels = np.repeat(np.arange(NUM_CLASSES), 30)  # 300 samples
    kwargs = {"min_max_ratio": 0.1, "alpha_min": 0.2}
    # Seeds whose first draw leaves some client below 15 samples ...
    unguarded = {
        s: fp.dirichlet_partition(labels, 8, min_size=0, seed=s, **kwargs) for s in range(40)
    }
    bad_seeds = [s for s, parts in unguarded.items() if min(p.size for p in parts) < 15]
    assert len(bad_seeds) >= 3
    # ... are redrawn until every client has at least 15.
    for s in bad_seeds:
        parts = fp.dirichlet_partition(labels, 8, min_size=15, seed=s, **kwargs)
        assert min(p.size for p in parts) >= 15
        assert_exact_cover(parts, labels.size)


def test_dirichlet_min_size_impossible_errors():
    labels = balanced_labels()  # 2000 samples
    with pytest.raises(ValueError, match="min_size=501 is impossible"):
        fp.dirichlet_partition(labels, 4, min_size=501, seed=0)
    # Feasible in principle, but (practically) never drawn: error names the client and fixes.
    with pytest.raises(ValueError, match=r"client \d+ .*min_max_ratio.*min_size") as info:
        fp.dirichlet_partition(labels, 4, min_size=495, seed=0, max_attempts=5)
    assert "5 attempts" in str(info.value)


@pytest.mark.parametrize(
    ("opts", "name"),
    [
        ({"min_max_ratio": 0.0}, "min_max_ratio"),
        ({"min_max_ratio": 1.5}, "min_max_ratio"),
        ({"min_max_ratio": -0.2}, "min_max_ratio"),
        ({"alpha_min": 0.0}, "alpha_min"),
        ({"alpha_min": -1.0}, "alpha_min"),
        ({"min_size": -1}, "min_size"),
        ({"max_attempts": 0}, "max_attempts"),
    ],
)
def test_dirichlet_argument_validation(opts, name):
    with pytest.raises(ValueError, match=name):
        fp.dirichlet_partition(balanced_labels(), 3, seed=0, **opts)


# ---------------------------------------------------------------- fusion set


def test_fusion_set_skewed_stays_in_source_partition():
    labels = LABELS["uneven"]
    parts = fp.sharded_partition(labels, 3, seed=1)
    for src in range(3):
        n = min(400, parts[src].size)
        fs = fp.sample_fusion_set(labels, parts, n, source=src, seed=0)
        assert fs.size == n
        assert fs.dtype == np.int64
        assert np.unique(fs).size == n  # without replacement
        assert np.isin(fs, parts[src]).all()
    fs0 = fp.sample_fusion_set(labels, parts, 50, seed=0)  # default source is client 0
    assert np.isin(fs0, parts[0]).all()
    assert np.array_equal(fs0, fp.sample_fusion_set(labels, parts, 50, seed=0))
    assert not np.array_equal(fs0, fp.sample_fusion_set(labels, parts, 50, seed=1))


def test_fusion_set_tops_up_from_the_next_clients_when_the_source_is_small():
    labels = balanced_labels()
    parts = fp.iid_partition(labels, 4, seed=0)  # 500 each
    fs = fp.sample_fusion_set(labels, parts, 1100, source=2, seed=0)
    assert fs.size == 1100 and np.unique(fs).size == 1100
    # all of client 2, all of client 3, then 100 of client 0 (wrapping around), none of client 1
    assert np.isin(parts[2], fs).all() and np.isin(parts[3], fs).all()
    assert np.isin(fs, parts[0]).sum() == 100 and not np.isin(fs, parts[1]).any()
    # enough data at the source: exactly the draw from the source alone
    small = fp.sample_fusion_set(labels, parts, 300, source=2, seed=0)
    assert np.isin(small, parts[2]).all()


def test_fusion_set_all_samples_everywhere():
    labels = balanced_labels()
    parts = fp.sharded_partition(labels, 2, seed=0)
    fs = fp.sample_fusion_set(labels, parts, 400, source="all", seed=0)
    assert fs.size == 400
    assert np.unique(fs).size == 400
    assert all(np.isin(fs, p).any() for p in parts)
    assert np.unique(labels[fs]).size == NUM_CLASSES
    full = fp.sample_fusion_set(labels, parts, labels.size, source="all", seed=0)
    np.testing.assert_array_equal(full, np.arange(labels.size))


def test_fusion_set_errors():
    labels = balanced_labels()
    parts = fp.iid_partition(labels, 4, seed=0)  # 500 each
    with pytest.raises(ValueError, match=r"n=2001.*only 2000"):
        fp.sample_fusion_set(labels, parts, 2001, source=0, seed=0)
    with pytest.raises(ValueError, match=r"n=2001.*2000"):
        fp.sample_fusion_set(labels, parts, 2001, source="all", seed=0)
    with pytest.raises(ValueError, match="source"):
        fp.sample_fusion_set(labels, parts, 10, source=4, seed=0)
    with pytest.raises(ValueError, match="source"):
        fp.sample_fusion_set(labels, parts, 10, source="everything", seed=0)
    with pytest.raises(ValueError, match="n must be"):
        fp.sample_fusion_set(labels, parts, 0, seed=0)


# ---------------------------------------------------------------- summary


@pytest.mark.parametrize("name", sorted(fp.PARTITIONERS))
def test_class_counts_consistent(name):
    labels = LABELS["uneven"]
    parts = fp.partition_labels(name, labels, 3, seed=0)
    table = fp.class_counts(labels, parts)
    assert table.shape == (3, NUM_CLASSES)
    assert np.issubdtype(table.dtype, np.integer)
    np.testing.assert_array_equal(table.sum(axis=1), [p.size for p in parts])
    np.testing.assert_array_equal(table.sum(axis=0), UNEVEN_SIZES)
    wide = fp.class_counts(labels, parts, num_classes=12)
    assert wide.shape == (3, 12)
    assert wide[:, 10:].sum() == 0


def test_class_counts_exact_values():
    labels = np.array([0, 0, 1, 2, 2, 2])
    table = fp.class_counts(labels, [np.array([0, 3]), np.array([1, 2, 4, 5])])
    np.testing.assert_array_equal(table, [[1, 0, 1], [1, 1, 2]])


def test_format_class_counts():
    text = fp.format_class_counts(np.array([[1, 0, 1], [1, 1, 20]]))
    lines = text.splitlines()
    assert lines[0].split() == ["client", "0", "1", "2", "total"]
    rows = [ln.split() for ln in lines if ln and not ln.startswith("-")]
    assert rows[1] == ["0", "1", "0", "1", "2"]
    assert rows[2] == ["1", "1", "1", "20", "22"]
    assert rows[3] == ["total", "2", "1", "21", "24"]


def test_plot_class_counts_writes_png(tmp_path):
    labels = LABELS["uneven"]
    table = fp.class_counts(labels, fp.dirichlet_partition(labels, 3, min_size=0, seed=0))
    out = fp.plot_class_counts(table, tmp_path / "counts.png")
    data = (tmp_path / "counts.png").read_bytes()
    assert out == tmp_path / "counts.png"
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(data) > 1000


# ---------------------------------------------------------------- registry


def test_registry_contents_and_dispatch():
    assert set(fp.PARTITIONERS) == {"iid", "dirichlet", "sharded"}
    labels = balanced_labels()
    direct = fp.dirichlet_partition(labels, 3, min_max_ratio=0.5, seed=4)
    via = fp.partition_labels("dirichlet", labels, 3, seed=4, min_max_ratio=0.5)
    assert all(np.array_equal(a, b) for a, b in zip(direct, via, strict=True))
    assert fp.partitioner_options("iid") == ()
    assert fp.partitioner_options("sharded") == ("num_classes", "class_groups")
    assert set(fp.partitioner_options("dirichlet")) == {
        "alpha_min",
        "min_max_ratio",
        "min_size",
        "max_attempts",
    }


def test_registry_rejects_unknown_name():
    with pytest.raises(ValueError, match=r"'pathological'.*dirichlet, iid, sharded"):
        fp.partition_labels("pathological", balanced_labels(), 2, seed=0)


def test_registry_rejects_unknown_option():
    with pytest.raises(ValueError, match=r"'alpha'.*'dirichlet'.*alpha_min.*min_max_ratio"):
        fp.partition_labels("dirichlet", balanced_labels(), 2, seed=0, alpha=0.5)
    with pytest.raises(ValueError, match=r"'min_size'.*'iid'.*\(none\)"):
        fp.partition_labels("iid", balanced_labels(), 2, seed=0, min_size=3)


def test_sharded_with_chosen_class_groups_gives_each_site_its_classes():
    labels = np.repeat(np.arange(8), 5)
    groups = [[0, 1, 3, 4, 5, 6], [2, 7]]  # the paper's BloodMNIST hospitals (Table 3)
    parts = fp.sharded_partition(labels, 2, seed=0, class_groups=groups)
    for part, group in zip(parts, groups, strict=True):
        assert sorted(set(labels[part].tolist())) == group
    assert sum(len(p) for p in parts) == labels.size


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ([[0, 1, 2, 3]], "1 groups for 2 clients"),
        ([[0, 1], [1, 2, 3]], "class 1 is in groups 0 and 1"),
        ([[0, 1], [2]], r"class\(es\) \[3\] belong to no group"),
        ([[0, 1], [2, 9]], "class 9 in group 1"),
        ([[0, 1, 2, 3], []], "group 1 is empty"),
    ],
)
def test_bad_class_groups_are_named(groups, message):
    with pytest.raises(ValueError, match=message):
        fp.sharded_partition(np.repeat(np.arange(4), 3), 2, seed=0, class_groups=groups)
