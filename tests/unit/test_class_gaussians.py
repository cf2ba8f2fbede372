"""Class-conditional Gaussians: what a site uploads, what the server draws from it."""

from __future__ import annotations

import pytest
import torch

from fedfuse.fusion import make_fusion_method
from fedfuse.fusion.inputs import FusionInputs
from fedfuse.fusion.statistics.class_gaussians import (
    ClassGaussians,
    GaussianFusionSet,
    allocate,
    fit_class_gaussians,
    top_principal_components,
)
from fedfuse.models import ModelSpec, build_model


def _site(rows: int = 60, classes: int = 3, shape=(2, 3, 3), seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(rows) % classes
    data = torch.randn(rows, *shape, generator=generator) + labels.view(-1, *[1] * len(shape))
    return data, labels


def _sample_covariance(x: torch.Tensor) -> torch.Tensor:
    flat = x.flatten(1).double()
    return torch.cov(flat.T)


def test_full_rank_model_is_the_sample_mean_and_covariance():
    data, labels = _site()
    site = fit_class_gaussians(data, labels, 3, rank=18)  # d = 18
    for c in range(3):
        rows = data[labels == c]
        assert torch.allclose(site.means[c].double(), rows.flatten(1).double().mean(0), atol=1e-6)
        assert torch.allclose(site.covariance(c), _sample_covariance(rows), atol=1e-5)
    assert site.noise.abs().max() < 1e-9
    assert site.counts.tolist() == [20, 20, 20]


def test_low_rank_model_keeps_the_top_directions_and_the_total_variance():
    data, labels = _site(rows=90)
    site = fit_class_gaussians(data, labels, 3, rank=4)
    for c in range(3):
        exact = _sample_covariance(data[labels == c])
        values, vectors = torch.linalg.eigh(exact)
        model = site.covariance(c)
        assert torch.allclose(torch.trace(model), torch.trace(exact), rtol=1e-5)
        top = vectors[:, -4:]  # the kept directions keep their variance exactly
        assert torch.allclose(top.T @ model @ top, torch.diag(values[-4:]), atol=1e-4)
        rest = vectors[:, :-4]  # the others share the rest evenly (PPCA)
        sigma2 = values[:-4].mean()
        assert torch.allclose(
            rest.T @ model @ rest, sigma2 * torch.eye(14, dtype=model.dtype), atol=1e-4
        )


def test_fewer_samples_than_inputs_use_the_gram_route():
    generator = torch.Generator().manual_seed(1)
    centred = torch.randn(7, 40, generator=generator, dtype=torch.float64)
    centred -= centred.mean(0)
    values, vectors = top_principal_components(centred, 5)
    exact_values, exact_vectors = torch.linalg.eigh(centred.T @ centred / 6)
    assert torch.allclose(values, exact_values.flip(0)[:5], atol=1e-9)
    overlap = (vectors.T @ exact_vectors.flip(1)[:, :5]).abs()  # the same directions, up to sign
    assert torch.allclose(overlap, torch.eye(5, dtype=overlap.dtype), atol=1e-6)


def test_classes_a_site_lacks_or_holds_once():
    data, labels = _site(rows=5, classes=1)
    labels = torch.tensor([0, 0, 0, 0, 2])
    site = fit_class_gaussians(data, labels, 4, rank=3)
    assert site.counts.tolist() == [4, 0, 1, 0]
    assert site.means[1].abs().sum() == 0 and site.factors[1].abs().sum() == 0
    assert torch.equal(site.means[2], data[4].flatten())
    assert site.factors[2].abs().sum() == 0 and site.noise[2] == 0
    rows, drawn = site.sample(50, generator=torch.Generator().manual_seed(0))
    assert set(drawn.tolist()) == {0, 2}
    assert torch.allclose(rows[drawn == 2], data[4].expand(int((drawn == 2).sum()), -1, -1, -1))


@pytest.mark.parametrize(
    ("rows", "counts", "expected"),
    [
        (10, [1, 1, 0], [5, 5, 0]),
        (7, [3, 1, 0], [5, 2, 0]),
        (5, [1, 1, 1], [2, 2, 1]),
        (0, [1], [0]),
    ],
)
def test_rows_are_spread_by_class_counts(rows, counts, expected):
    assert allocate(rows, torch.tensor(counts)).tolist() == expected


def test_draws_follow_the_model_and_the_seed():
    data, labels = _site(rows=300, shape=(4,))
    site = fit_class_gaussians(data.view(300, 1, 2, 2), labels, 3, rank=2)
    first, first_labels = site.sample(30000, generator=torch.Generator().manual_seed(5))
    again, _ = site.sample(30000, generator=torch.Generator().manual_seed(5))
    assert torch.equal(first, again)
    for c in range(3):
        drawn = first[first_labels == c].flatten(1).double()
        assert torch.allclose(drawn.mean(0), site.means[c].double(), atol=0.05)
        assert torch.allclose(torch.cov(drawn.T), site.covariance(c), atol=0.08)


def test_the_upload_round_trips_and_hostile_uploads_are_named():
    data, labels = _site()
    site = fit_class_gaussians(data, labels, 3, rank=2)
    back = ClassGaussians.from_tensors(site.to_tensors(), (2, 3, 3), num_classes=3, source="site 4")
    assert all(
        torch.equal(a, b)
        for a, b in zip(site.to_tensors().values(), back.to_tensors().values(), strict=True)
    )
    assert site.nbytes == 3 * 8 + 3 * 18 * 4 + 3 * 18 * 2 * 4 + 3 * 4

    def broken(**change):
        tensors = {**site.to_tensors(), **change}
        return ClassGaussians.from_tensors(tensors, (2, 3, 3), num_classes=3, source="site 4")

    nan_means = site.means.clone()
    nan_means[1, 2] = float("nan")
    with pytest.raises(ValueError, match="site 4.*'means'.*NaN"):
        broken(means=nan_means)
    with pytest.raises(ValueError, match="site 4.*'factors'.*shape"):
        broken(factors=torch.zeros(3, 17, 2))
    with pytest.raises(ValueError, match="site 4.*negative"):
        broken(noise=-site.noise - 1)
    with pytest.raises(ValueError, match="site 4.*'counts' must be integers"):
        broken(counts=site.counts.float())
    with pytest.raises(ValueError, match="site 4.*lack.*noise"):
        ClassGaussians.from_tensors(
            {k: v for k, v in site.to_tensors().items() if k != "noise"}, (2, 3, 3), source="site 4"
        )
    with pytest.raises(ValueError, match="site 4.*every count is 0"):
        broken(counts=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="need 5"):
        ClassGaussians.from_tensors(site.to_tensors(), (2, 3, 3), num_classes=5, source="site 4")


def test_the_fusion_set_is_completed_site_by_site_behind_the_real_rows():
    real, real_labels = _site(rows=6)
    sites = [fit_class_gaussians(*_site(rows=40, seed=k), 3, rank=2) for k in range(2)]
    completion = GaussianFusionSet(samples=9, seed=3)
    data, labels = completion.complete(real, real_labels, sites)
    assert data.shape == (6 + 18, 2, 3, 3)
    assert torch.equal(data[:6], real) and torch.equal(labels[:6], real_labels)
    assert labels[6:].bincount(minlength=3).tolist() == [6, 6, 6]
    unlabelled, none = completion.complete(real, None, sites)
    assert none is None and torch.equal(unlabelled, data)
    inputs = completion.complete_inputs(FusionInputs(data=real, labels=real_labels), sites)
    assert torch.equal(inputs.data, data)
    assert GaussianFusionSet(samples=0).complete(real, real_labels, sites)[0] is real
    with pytest.raises(ValueError, match="site 1: class Gaussians of inputs"):
        completion.complete(
            real, real_labels, [sites[0], fit_class_gaussians(*_site(shape=(18,)), 3)]
        )


def test_rows_of_the_class_a_fusion_set_lacks_let_trust_fusion_route_to_its_model():
    """Two sites of disjoint classes; the fusion set shows only site 0's. With the Gaussians of
    site 1's class the fused model follows site 1's model there (it cannot without them)."""
    torch.manual_seed(0)
    spec = ModelSpec("mlp", input_shape=(1, 2, 2), num_classes=4, widths=(16,))
    generator = torch.Generator().manual_seed(0)
    centres = torch.tensor([[3.0, 0, 0, 0], [0, 3.0, 0, 0], [0, 0, 3.0, 0], [0, 0, 0, 3.0]])

    def draw(classes, n):
        labels = torch.tensor(classes)[torch.arange(n) % len(classes)]
        return (centres[labels] + 0.3 * torch.randn(n, 4, generator=generator)).view(
            n, 1, 2, 2
        ), labels

    models = []
    for k, classes in enumerate(([0, 1], [2, 3])):
        model = build_model(spec, seed=k)
        x, y = draw(classes, 200)
        optimiser = torch.optim.Adam(model.parameters(), lr=0.05)
        for _ in range(150):
            optimiser.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimiser.step()
        models.append(model.eval())
    site_rows = [draw([0, 1], 200), draw([2, 3], 200)]
    gaussians = [fit_class_gaussians(x, y, 4, rank=4) for x, y in site_rows]
    fusion_x, fusion_y = draw([0, 1], 40)
    test_x, test_y = draw([2, 3], 200)
    method = make_fusion_method("kf-trust", use_scores=False)

    def accuracy(inputs):
        fused = method.fuse(models, inputs, target=spec).model
        with torch.no_grad():
            return float((fused(test_x).argmax(1) == test_y).float().mean())

    plain = FusionInputs(data=fusion_x, labels=fusion_y)
    completed = GaussianFusionSet(samples=60).complete_inputs(plain, gaussians)
    assert accuracy(completed) > 0.9
    assert accuracy(completed) > accuracy(plain) + 0.3
