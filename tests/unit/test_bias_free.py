"""Layers without a bias are fitted without intercept (issue 25, part 5), by the closed-form
fits (kf-linear, hf-linear, kf-sites, hf-sites) and RegMean, and ``fit_bias`` chooses."""

from __future__ import annotations

import copy

import pytest
import torch

from fedfuse.fusion import FusionInputs, LocalSites, make_fusion_method
from fedfuse.fusion.blocks.alignment import permute_level
from fedfuse.fusion.methods.regression.regmean import level_grams
from fedfuse.models import build_model, lenet5_spec, mlp_spec
from fedfuse.models.affine import affine_view, fit_intercept

CLOSED_FORM = ("kf-linear", "hf-linear", "kf-sites", "hf-sites")


def _permuted_copy(model, seed: int = 1):
    """``model`` with every hidden neuron level's neurons shuffled (the same function)."""
    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    for index in other.neuron_levels[:-1]:
        width = other.level_width(index)
        permute_level(other, index, torch.randperm(width, generator=generator))
    return other


def _inputs(method: str, models, data: torch.Tensor) -> FusionInputs:
    if method.endswith("sites"):
        return FusionInputs(sites=LocalSites(models, [data] * len(models), device="cpu"))
    if method == "regmean":
        return FusionInputs(grams=[level_grams(m, data) for m in models])
    return FusionInputs(data=data)


def _options(method: str) -> dict:
    if method == "regmean":
        return {"alpha": 1.0}
    options = {"use_scores": False, "ridge": 0.0}
    return options | ({"device": "cpu"} if not method.endswith("sites") else {})


@pytest.mark.parametrize(
    "spec",
    [
        mlp_spec((1, 5, 5), 4, (12, 9), bias=False),
        lenet5_spec((1, 28, 28), 4, (3, 4, 10, 8), False),
    ],
    ids=["mlp", "lenet5"],
)
@pytest.mark.parametrize("method", [*CLOSED_FORM, "regmean"])
def test_fusing_a_model_with_its_permuted_copy_keeps_its_function(method, spec):
    model = build_model(spec, seed=0).eval()
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())
    # RegMean does not align neurons: it merges a model with an identical copy
    other = copy.deepcopy(model) if method == "regmean" else _permuted_copy(model)
    data = torch.randn(400, *spec.input_shape, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.allclose(other(data), model(data), atol=1e-5)
        result = make_fusion_method(method, **_options(method)).fuse(
            [model, other], _inputs(method, [model, other], data)
        )
        fused = result.model.eval()
        assert not any(name.endswith("bias") for name, _ in fused.named_parameters())
        reference = model(data)
        error = (fused(data) - reference).norm() / reference.norm()
    assert error < 1e-3, f"{method}: relative error {error:.2e}"


def _one_level_toy(bias: bool):
    """Two different 1-level models (a linear classifier on 6 inputs) and their data, shifted
    off the origin so an intercept matters."""
    spec = mlp_spec((6,), 3, (), bias=bias)
    models = [build_model(spec, seed=s).eval() for s in (0, 1)]
    if bias:  # offsets a fit without intercept must approximate from the inputs
        with torch.no_grad():
            for shift, model in zip((3.0, -1.0), models, strict=True):
                model.levels[0][1].bias.add_(shift)
    generator = torch.Generator().manual_seed(3)
    data = torch.randn(200, 6, generator=generator) + 2.0
    return spec, models, data


def test_kf_linear_fits_a_bias_free_target_without_intercept():
    spec, models, data = _one_level_toy(bias=True)
    target = mlp_spec((6,), 3, (), bias=False)
    method = make_fusion_method("kf-linear", ridge=0.0, use_scores=False, device="cpu")
    result = method.fuse(models, FusionInputs(data=data), target=target)
    fused = result.model.levels[0][1]
    assert fused.bias is None
    with torch.no_grad():
        centres = sum(m(data) for m in models) / 2  # the head's groups: each class's mean logit
    expected = torch.linalg.lstsq(data.double(), centres.double()).solution  # no ones column
    assert torch.allclose(fused.weight.T.double(), expected, atol=1e-4)
    # the with-intercept fit whose bias is dropped (the former behaviour) is much worse
    ones = torch.cat([data, torch.ones(len(data), 1)], 1).double()
    dropped = torch.linalg.lstsq(ones, centres.double()).solution[:-1]
    residual = (data.double() @ dropped - centres).norm() / (
        data.double() @ expected - centres
    ).norm()
    assert residual > 2
    assert result.details["levels"][0]["intercept"] is False


def test_fit_bias_false_fits_a_layer_with_a_bias_without_intercept_and_zeroes_it():
    spec, models, data = _one_level_toy(bias=True)
    with torch.no_grad():
        centres = (sum(m(data) for m in models) / 2).double()
    expected = torch.linalg.lstsq(data.double(), centres).solution
    sites = LocalSites(models, [data, data], device="cpu")
    for name, inputs in (("kf-linear", FusionInputs(data=data)), ("kf-sites", None)):
        options = {"ridge": 0.0, "use_scores": False, "fit_bias": False}
        method = make_fusion_method(name, **options)
        fused = method.fuse(models, inputs or FusionInputs(sites=sites)).model.levels[0][1]
        assert torch.equal(fused.bias, torch.zeros(3)), name
        assert torch.allclose(fused.weight.T.double(), expected, atol=1e-4), name


def test_kf_sites_fits_the_pooled_data_without_intercept():
    spec, models, data = _one_level_toy(bias=False)
    halves = [data[:100], data[100:] - 4.0]
    result = make_fusion_method("kf-sites", ridge=0.0, use_scores=False).fuse(
        models, FusionInputs(sites=LocalSites(models, halves, device="cpu"))
    )
    with torch.no_grad():
        targets = torch.cat([m(x) for m, x in zip(models, halves, strict=True)]).double()
    expected = torch.linalg.lstsq(torch.cat(halves).double(), targets).solution
    weight = result.model.levels[0][1].weight
    assert torch.allclose(weight.T.double(), expected, atol=1e-4)


def test_regmean_merges_bias_free_layers_without_intercept():
    spec, models, data = _one_level_toy(bias=False)
    halves = [data[:100], data[100:] - 4.0]
    grams = [level_grams(m, x) for m, x in zip(models, halves, strict=True)]
    assert grams[0][0].shape == (7, 7)  # the upload format keeps the constant 1
    fused = make_fusion_method("regmean", alpha=1.0).fuse(models, FusionInputs(grams=grams))
    with torch.no_grad():
        targets = torch.cat([m(x) for m, x in zip(models, halves, strict=True)]).double()
    expected = torch.linalg.lstsq(torch.cat(halves).double(), targets).solution
    weight = fused.model.levels[0][1].weight
    assert torch.allclose(weight.T.double(), expected, atol=1e-5)


@pytest.mark.parametrize("method", [*CLOSED_FORM, "regmean"])
def test_forcing_a_bias_on_a_bias_free_layer_is_an_error_naming_the_level(method):
    spec = mlp_spec((6,), 3, (4,), bias=False)
    models = [build_model(spec, seed=s) for s in (0, 1)]
    instance = make_fusion_method(method, fit_bias=True)
    with pytest.raises(ValueError, match=r"level 0:Linear.*fit_bias=True.*no bias"):
        instance.check_architecture(models[0])


def test_fit_bias_values_are_checked_and_resolved():
    with pytest.raises(ValueError, match="fit_bias must be 'auto', true or false"):
        make_fusion_method("kf-linear", fit_bias="yes")
    biased, free = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, bias=False)
    assert fit_intercept(biased, "auto", where="x") and not fit_intercept(free, "auto", where="x")
    assert not fit_intercept(biased, False, where="x")
    view = affine_view(free)
    assert view is not None and view.fan_in == 3  # the default view keeps the bias row
    assert affine_view(free, bias=False).design(torch.ones(5, 2)).shape == (5, 2)
