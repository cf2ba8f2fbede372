import numpy as np
import pytest
import torch

from fedfuse.fusion.blocks.costs import cluster_targets, representation_cost
from fedfuse.fusion.blocks.least_squares import gram_basis, kernel_basis, weighted_least_squares


@pytest.mark.parametrize("rows", [40, 7], ids=["tall-gram", "wide-kernel"])
def test_basis_projects_and_fits_exactly(rows):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 12, generator=g, dtype=torch.float64)
    z = torch.randn(rows, 5, generator=g, dtype=torch.float64)
    basis = gram_basis(x.T @ x) if rows >= 12 else kernel_basis(x)
    coords = basis.coordinates(xtz=x.T @ z, z=z)
    projector = x.numpy() @ np.linalg.pinv(x.numpy())
    projected = projector @ z.numpy()
    # distances between coordinates equal distances between projected columns
    assert np.allclose(
        np.linalg.norm(coords.numpy()[:, 0] - coords.numpy()[:, 1]),
        np.linalg.norm(projected[:, 0] - projected[:, 1]),
    )
    # the weights fitted to the coordinates reproduce the projected outputs
    w = basis.weights(coords)
    assert np.allclose((x @ w).numpy(), projected, atol=1e-8)


def test_ridge_matches_the_textbook_formula():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(30, 6, generator=g, dtype=torch.float64)
    z = torch.randn(30, 2, generator=g, dtype=torch.float64)
    basis = gram_basis(x.T @ x, ridge=0.5)
    penalty = 0.5 * torch.linalg.eigvalsh(x.T @ x).mean()
    expected = torch.linalg.solve(x.T @ x + penalty * torch.eye(6, dtype=x.dtype), x.T @ z)
    w = basis.weights(basis.coordinates(xtz=x.T @ z))
    # ridge on the projected targets equals ridge on the raw ones (X^T P z = X^T z)
    assert torch.allclose(w, expected, atol=1e-10)
    kernel = kernel_basis(x[:5], ridge=0.5)
    k_penalty = 0.5 * torch.linalg.eigvalsh(x[:5] @ x[:5].T).sum() / 6
    k_expected = x[:5].T @ torch.linalg.solve(
        x[:5] @ x[:5].T + k_penalty * torch.eye(5, dtype=x.dtype), z[:5]
    )
    assert torch.allclose(kernel.weights(kernel.coordinates(z=z[:5])), k_expected, atol=1e-10)


def test_weighted_least_squares_equals_numpy():
    rng = np.random.default_rng(0)
    x, y, a = rng.normal(size=(50, 4)), rng.normal(size=(50, 3)), rng.uniform(0.1, 2, size=50)
    ours = weighted_least_squares(torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(a))
    root = np.sqrt(a)[:, None]
    reference = np.linalg.lstsq(x * root, y * root, rcond=None)[0]
    assert np.allclose(ours.numpy(), reference)
    # and it is the weighted normal-equation solution
    normal = np.linalg.solve(x.T @ (a[:, None] * x), x.T @ (a[:, None] * y))
    assert np.allclose(ours.numpy(), normal)


def test_theorem_1_decomposition_holds_for_any_fused_output():
    g = torch.Generator().manual_seed(3)
    base = torch.randn(64, 10, generator=g, dtype=torch.float64)
    weights = torch.rand(10, generator=g, dtype=torch.float64)
    labels = torch.tensor([0, 0, 1, 2, 2, 2, 3, 1, 0, 3])
    for fused in (
        torch.randn(64, 4, generator=g, dtype=torch.float64),
        cluster_targets(base, labels, weights, 4),
    ):
        cost = representation_cost(fused, base, labels, weights)
        assert cost.total == pytest.approx(cost.approximation + cost.grouping, rel=1e-12)
    # with the fused outputs equal to the targets, only the grouping error remains
    assert cost.approximation == pytest.approx(0, abs=1e-12)
    assert cost.grouping > 0


def test_level_costs_from_cluster_sums_match_the_sums_over_every_base_neuron():
    g = torch.Generator().manual_seed(5)
    base = torch.randn(50, 40, generator=g)  # float32, as captured
    weights = torch.rand(40, generator=g)
    weights[3] = 0.0
    labels = torch.randint(0, 6, (40,), generator=g)
    labels[:6] = torch.arange(6)  # every cluster has a member
    fused = torch.randn(50, 6, generator=g)
    z, w, f = base.double(), weights.double(), fused.double()
    targets = cluster_targets(z, labels, w, 6)
    direct = [
        float((w * ((f[:, labels] - z) ** 2).sum(0)).sum()) / 50,
        float((w * ((f[:, labels] - targets[:, labels]) ** 2).sum(0)).sum()) / 50,
        float((w * ((targets[:, labels] - z) ** 2).sum(0)).sum()) / 50,
    ]
    chunked = representation_cost(fused.split(7), base.split(7), labels, weights)
    for ours, expected in zip(
        (chunked.total, chunked.approximation, chunked.grouping), direct, strict=True
    ):
        assert ours == pytest.approx(expected, rel=1e-9)
