import pytest
import torch

from fedfuse.fusion.blocks.kmeans import (
    AUTO_POINTS_PER_CLUSTER,
    AUTO_VARIANCE,
    kmeans_plusplus,
    principal_coordinates,
    resolve_variance,
    scatter_around_means,
    weighted_centers,
    weighted_kmeans,
    weighted_kmeans_cost,
)


def _blobs(n_per=30, k=4, dim=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(k, dim, generator=g, dtype=torch.float64) * 10
    points = centers.repeat_interleave(n_per, 0) + torch.randn(
        k * n_per, dim, generator=g, dtype=torch.float64
    )
    return points, centers


def test_cost_never_rises_across_iterations():
    g = torch.Generator().manual_seed(1)
    for seed in range(5):
        points = torch.randn(300, 8, generator=g, dtype=torch.float64)
        weights = torch.rand(300, generator=g, dtype=torch.float64)
        result = weighted_kmeans(points, weights, 20, seed=seed, tol=0)
        history = result.history
        assert all(b <= a * (1 + 1e-12) for a, b in zip(history, history[1:], strict=False))
        assert result.cost == pytest.approx(
            weighted_kmeans_cost(points, weights, result.labels, result.centers)
        )


def test_recovers_well_separated_blobs_and_is_deterministic():
    points, _ = _blobs()
    a = weighted_kmeans(points, None, 4, seed=3)
    b = weighted_kmeans(points, None, 4, seed=3)
    assert torch.equal(a.labels, b.labels)
    # every blob is one cluster
    groups = a.labels.view(4, 30)
    assert all(len(set(row.tolist())) == 1 for row in groups)
    assert len(set(groups[:, 0].tolist())) == 4


def test_a_dominant_weight_pulls_its_centroid_onto_itself():
    points, _ = _blobs(n_per=10, k=2)
    weights = torch.ones(20, dtype=torch.float64)
    weights[3] = 1e9
    result = weighted_kmeans(points, weights, 2, seed=0)
    centre = result.centers[result.labels[3]]
    assert torch.allclose(centre, points[3], atol=1e-6)


def test_no_cluster_is_empty_even_with_duplicates_and_zero_weights():
    points = torch.cat([torch.zeros(10, 3), torch.ones(2, 3)]).double()
    weights = torch.tensor([0.0] * 10 + [1.0, 1.0], dtype=torch.float64)
    result = weighted_kmeans(points, weights, 5, seed=0)
    assert torch.bincount(result.labels, minlength=5).min() >= 1


def test_local_search_never_worsens_lloyd():
    g = torch.Generator().manual_seed(2)
    points = torch.randn(200, 4, generator=g, dtype=torch.float64)
    plain = weighted_kmeans(points, None, 12, seed=0)
    refined = weighted_kmeans(points, None, 12, seed=0, local_search_swaps=10)
    assert refined.cost <= plain.cost + 1e-9


def test_kmeans_plusplus_picks_distinct_points_and_centres_are_weighted_means():
    points, _ = _blobs(n_per=5, k=3)
    seeds = kmeans_plusplus(
        points, torch.ones(15, dtype=torch.float64), 3, torch.Generator().manual_seed(0)
    )
    assert len(set(seeds.tolist())) == 3
    labels = torch.tensor([0] * 10 + [1] * 5)
    weights = torch.arange(1, 16, dtype=torch.float64)
    centers, mass = weighted_centers(points, weights, labels, 2)
    expected = (points[:10] * weights[:10, None]).sum(0) / weights[:10].sum()
    assert torch.allclose(centers[0], expected) and mass[1] == weights[10:].sum()


def test_bad_arguments_are_named():
    points = torch.randn(5, 2)
    with pytest.raises(ValueError, match="k must be between 1"):
        weighted_kmeans(points, None, 6)
    with pytest.raises(ValueError, match="weights must be 5"):
        weighted_kmeans(points, -torch.ones(5), 2)
    with pytest.raises(ValueError, match=r"points must be \(n, d\)"):
        weighted_kmeans(torch.randn(5), None, 2)


def test_many_points_blocks_and_sampled_seeding_find_the_clusters(monkeypatch):
    """Past 16 k points the seeds come from a weighted sample, and distances, centres and costs
    are computed in row blocks; force both on a small problem and check the exact answers."""
    import fedfuse.fusion.blocks.kmeans as kmeans

    monkeypatch.setattr(kmeans, "_BLOCK_ROWS", 7)  # many uneven blocks
    monkeypatch.setattr(kmeans, "SEEDING_POINTS_PER_CLUSTER", 5)  # 20 of the 160 points
    points, centers = _blobs(n_per=40, k=4, dim=3, seed=4)
    weights = torch.rand(len(points), generator=torch.Generator().manual_seed(0)).double()
    result = weighted_kmeans(points, weights, 4, seed=1)
    truth = torch.arange(4).repeat_interleave(40)
    # the same partition as the generating blobs, up to the cluster names
    assert len({(int(a), int(b)) for a, b in zip(result.labels, truth, strict=True)}) == 4
    expected, mass = weighted_centers(points, weights, result.labels, 4)
    direct = (
        torch.stack(
            [
                (points[result.labels == c] * weights[result.labels == c, None]).sum(0)
                for c in range(4)
            ]
        )
        / mass[:, None]
    )
    assert torch.allclose(expected, direct)
    assert result.cost == pytest.approx(
        float((weights * ((points - expected[result.labels]) ** 2).sum(1)).sum())
    )
    again = weighted_kmeans(points, weights, 4, seed=1)
    assert torch.equal(again.labels, result.labels)  # deterministic by seed


def _low_rank_blobs(seed=0):
    """Blobs in a 3-dimensional affine subspace of 12 dimensions, with weights."""
    g = torch.Generator().manual_seed(seed)
    flat, _ = _blobs(n_per=25, k=4, dim=3, seed=seed)
    basis, _ = torch.linalg.qr(torch.randn(12, 3, generator=g, dtype=torch.float64))
    points = (flat @ basis.T + torch.randn(12, generator=g, dtype=torch.float64)).float()
    return points, torch.rand(len(points), generator=g).float() + 0.1


def test_principal_coordinates_keep_every_distance_of_points_on_a_subspace():
    points, weights = _low_rank_blobs()
    coordinates = principal_coordinates(points, weights, 0.999999)
    assert coordinates.shape == (100, 3)  # the subspace's dimension, found from the spectrum
    exact = "donot_use_mm_for_euclid_dist"
    assert torch.allclose(
        torch.cdist(coordinates, coordinates, compute_mode=exact),
        torch.cdist(points, points, compute_mode=exact),
        atol=1e-3,
    )


def test_clustering_on_principal_coordinates_is_scored_on_the_points():
    points, weights = _low_rank_blobs(seed=2)
    full = weighted_kmeans(points, weights, 4, seed=0)
    projected = weighted_kmeans(points, weights, 4, seed=0, variance=0.999999)
    assert torch.equal(projected.labels, full.labels)  # the same distances: the same clusters
    centers, _ = weighted_centers(points, weights, projected.labels, 4)
    assert projected.centers.shape == (4, 12) and torch.allclose(projected.centers, centers)
    assert projected.cost == pytest.approx(full.cost, rel=1e-4)


def test_auto_variance_projects_only_many_points_per_cluster():
    k = 512
    assert resolve_variance("auto", AUTO_POINTS_PER_CLUSTER * k - 1, k) is None
    assert resolve_variance("auto", AUTO_POINTS_PER_CLUSTER * k, k) == AUTO_VARIANCE
    assert resolve_variance(1.0, 10**6, k) is None and resolve_variance(None, 10**6, k) is None
    assert resolve_variance(0.9, 10, k) == 0.9
    for bad in (0.0, -1.0, 1.5, "half"):
        with pytest.raises(ValueError, match="variance must be in"):
            resolve_variance(bad, 10, k)


def test_the_scatter_around_the_weighted_means_is_the_k_means_cost():
    points, weights = _low_rank_blobs(seed=4)
    labels = weighted_kmeans(points, weights, 4, seed=0).labels
    centers, mass = weighted_centers(points, weights.double(), labels, 4, dtype=torch.float64)
    assert scatter_around_means(points, weights.double(), centers, mass) == pytest.approx(
        weighted_kmeans_cost(points.double(), weights.double(), labels, centers), rel=1e-6
    )
