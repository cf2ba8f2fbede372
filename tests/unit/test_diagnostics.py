"""Diagnostics of fused models: the plane through three models, its landscape, weight statistics
and first-layer templates, each pinned by a property."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from fedfuse.experiments.diagnostics import (
    first_layer_templates,
    landscape_on_plane,
    layer_weight_stats,
    load_weight_vector,
    plane_basis,
    weight_vector,
)
from fedfuse.models import build_model, make_spec
from fedfuse.models.capture import predict

SPEC = make_spec("mlp", (1, 8, 8), 4, widths=(16, 12))


def _models(*seeds: int):
    return [build_model(SPEC, seed=s) for s in seeds]


def _batch(n: int = 64):
    generator = torch.Generator().manual_seed(0)
    return torch.randn(n, 1, 8, 8, generator=generator), torch.randint(
        0, 4, (n,), generator=generator
    )


def test_weight_vector_round_trips_through_a_model():
    a, b = _models(0, 1)
    load_weight_vector(b, weight_vector(a))
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    with pytest.raises(ValueError, match="parameters"):
        load_weight_vector(b, torch.zeros(3))


def test_plane_basis_is_orthonormal_and_reproduces_the_three_models():
    vectors = [weight_vector(m) for m in _models(0, 1, 2)]
    basis = plane_basis(*vectors)
    assert basis.u.norm().item() == pytest.approx(1.0)
    assert basis.v.norm().item() == pytest.approx(1.0)
    assert basis.u.dot(basis.v).item() == pytest.approx(0.0, abs=1e-12)
    assert basis.anchors[0].tolist() == [0.0, 0.0] and basis.anchors[1, 1].item() == 0.0
    for (x, y), vector in zip(basis.anchors.tolist(), vectors, strict=True):
        torch.testing.assert_close(basis.point(x, y), vector, atol=1e-10, rtol=0)
        torch.testing.assert_close(basis.coordinates(vector), torch.tensor([x, y]).double())
    # plane distances are weight-space distances
    assert basis.anchors[1, 0].item() == pytest.approx((vectors[1] - vectors[0]).norm().item())


def test_plane_basis_refuses_degenerate_triples():
    a, b = (weight_vector(m) for m in _models(0, 1))
    with pytest.raises(ValueError, match="same weights"):
        plane_basis(a, a, b)
    with pytest.raises(ValueError, match="collinear"):
        plane_basis(a, b, (a + b) / 2)
    with pytest.raises(ValueError, match="one shape"):
        plane_basis(a, b, a[:-1])


def test_landscape_at_the_anchors_equals_the_models_own_loss_and_accuracy():
    models = _models(0, 1, 2)
    inputs, labels = _batch()
    landscape = landscape_on_plane(models, inputs, labels, grid=(4, 3), margin=0.1, device="cpu")
    assert landscape.loss.shape == (3, 4) and landscape.accuracy.shape == (3, 4)
    assert landscape.xs.shape == (4,) and landscape.ys.shape == (3,)
    assert landscape.samples == len(inputs)
    for k, model in enumerate(models):
        logits = predict(model, inputs, device="cpu").double()
        loss = F.cross_entropy(logits, labels).item()
        accuracy = (logits.argmax(1) == labels).double().mean().item()
        assert landscape.anchor_loss[k].item() == pytest.approx(loss, abs=1e-5)
        assert landscape.anchor_accuracy[k].item() == pytest.approx(accuracy)
    # the grid covers the anchors with the margin on each side
    low, high = landscape.anchors.min(0).values, landscape.anchors.max(0).values
    assert landscape.xs[0].item() == pytest.approx((low[0] - 0.1 * (high[0] - low[0])).item())
    assert landscape.ys[-1].item() == pytest.approx((high[1] + 0.1 * (high[1] - low[1])).item())
    assert torch.isfinite(landscape.loss).all()
    assert ((landscape.accuracy >= 0) & (landscape.accuracy <= 1)).all()
    # the template models are untouched
    assert torch.equal(weight_vector(models[0]), weight_vector(build_model(SPEC, seed=0)))


def test_landscape_refuses_models_of_different_widths():
    other = build_model(SPEC.with_widths((8, 12)), seed=3)
    inputs, labels = _batch(8)
    with pytest.raises(ValueError, match="shapes differ"):
        landscape_on_plane([*_models(0, 1), other], inputs, labels, device="cpu")
    with pytest.raises(ValueError, match="exactly 3"):
        landscape_on_plane(_models(0, 1), inputs, labels, device="cpu")


def test_layer_weight_stats_equal_the_statistics_computed_by_hand():
    model = _models(5)[0]
    stats = layer_weight_stats(model)
    assert [s.level for s in stats] == model.neuron_levels == [0, 2, 4]
    linears = [model.levels[0][1], model.levels[2], model.levels[4]]
    for s, layer in zip(stats, linears, strict=True):
        w = layer.weight.detach().double().flatten()
        n = w.numel()
        mean = w.sum().item() / n
        assert s.numel == n
        assert s.norm == pytest.approx(sum(v * v for v in w.tolist()) ** 0.5)
        assert s.mean == pytest.approx(mean)
        assert s.std == pytest.approx((sum((v - mean) ** 2 for v in w.tolist()) / n) ** 0.5)
        assert s.max_abs == pytest.approx(max(abs(v) for v in w.tolist()))
        assert s.bias_norm == pytest.approx(layer.bias.detach().double().norm().item())
    assert stats[0].name == "0:Linear"


def test_averaging_shrinks_the_largest_weight_and_the_spread():
    """Wang et al. Eqs. 5-9: the average's max |w| and std are at most the larger of the two."""
    a, b = _models(0, 1)
    average = copy.deepcopy(a)
    load_weight_vector(average, (weight_vector(a) + weight_vector(b)) / 2)
    for sa, sb, sm in zip(*(layer_weight_stats(m) for m in (a, b, average)), strict=True):
        assert sm.max_abs <= max(sa.max_abs, sb.max_abs) + 1e-12
        assert sm.std <= max(sa.std, sb.std) + 1e-12
        assert sm.norm <= max(sa.norm, sb.norm) + 1e-12


def test_mlp_templates_have_the_input_image_shape():
    model = _models(0)[0]
    templates = first_layer_templates(model)
    assert templates.shape == (16, 1, 8, 8)
    torch.testing.assert_close(templates[3].flatten(), model.levels[0][1].weight[3].detach())
    strongest = first_layer_templates(model, count=5, order="norm")
    norms = templates.flatten(1).norm(dim=1)
    assert strongest.shape == (5, 1, 8, 8)
    torch.testing.assert_close(strongest.flatten(1).norm(dim=1), norms.sort(descending=True)[0][:5])
    with pytest.raises(ValueError, match="order"):
        first_layer_templates(model, order="random")


def test_conv_templates_are_the_first_filters(tiny_vgg):
    templates = first_layer_templates(tiny_vgg, count=3)
    conv = tiny_vgg.levels[0]
    assert templates.shape == (3, 3, 3, 3)
    torch.testing.assert_close(templates, conv.weight.detach()[:3])
