"""Site-statistics fusion from uploaded Grams (``kf-grams``, ``hf-grams``): the design map is
exact where the readings are, the first level's statistics are the sites', the statistics are
linear in the Gram, permuted and identical sites give the model back, and a missing or wrong
Gram is named."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from fedfuse.federation.uploads import needs_grams
from fedfuse.fusion import HFGrams, KFGrams, KFSites, LocalSites, StatisticsRequest, site_statistics
from fedfuse.fusion.inputs import FusionInputs
from fedfuse.fusion.methods.neuron_interpolation.grams import design_map, gram_statistics
from fedfuse.fusion.statistics.grams import level_grams
from fedfuse.models import build_model, lenet5_spec, mlp_spec, resnet_spec, vgg11_spec
from fedfuse.models.affine import affine_view
from fedfuse.models.symmetry import permute_model, random_permutations
from tests.helpers import randn

MLP = mlp_spec((1, 3, 3), 3, (7, 6))
VGG = vgg11_spec((1, 8, 8), 3, width_multiplier=1 / 16)


def _sites(spec, seed: int = 0) -> tuple[list, list[torch.Tensor]]:
    model = build_model(spec, seed=seed).eval()
    permuted = permute_model(model, random_permutations(model, torch.Generator().manual_seed(1)))
    data = [randn(10, 40, *spec.input_shape), randn(11, 30, *spec.input_shape)]
    return [model, permuted], data


@pytest.mark.parametrize("method", [KFGrams, HFGrams])
@pytest.mark.parametrize("spec", [MLP, VGG], ids=["mlp", "vgg"])
def test_a_model_fused_with_its_permuted_copy_keeps_its_function(method, spec):
    models, data = _sites(spec)
    grams = [level_grams(m, d) for m, d in zip(models, data, strict=True)]
    fused = method().fuse(models, FusionInputs(grams=grams)).model
    x = randn(12, 16, *spec.input_shape)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), models[0](x), rtol=1e-4, atol=1e-4)


def test_sites_that_all_hold_the_same_model_get_it_back():
    model = build_model(MLP, seed=3).eval()
    data = [randn(k, 25, 1, 3, 3) for k in range(3)]
    grams = [level_grams(model, d) for d in data]
    copies = [copy.deepcopy(model) for _ in data]
    fused = KFGrams().fuse(copies, FusionInputs(grams=grams)).model
    for name, value in model.state_dict().items():
        torch.testing.assert_close(fused.state_dict()[name], value, rtol=1e-5, atol=1e-5)


def test_the_first_levels_statistics_are_those_the_site_computes_under_the_fused_prefix():
    model, fused = build_model(MLP, seed=0), build_model(MLP, seed=1)
    data = randn(4, 50, 1, 3, 3)
    request = StatisticsRequest(0, fused, dtype="float64")
    from_gram = gram_statistics(model, level_grams(model, data)[0], request, None)
    on_site = site_statistics(model, data, request, device="cpu")
    assert from_gram.rows == on_site.rows == 50
    for name in ("gram", "cross", "target_gram", "translation"):
        torch.testing.assert_close(
            getattr(from_gram, name), getattr(on_site, name), rtol=1e-6, atol=1e-6
        )


def test_statistics_are_linear_in_the_gram_so_they_add_up_over_pooled_data():
    model, fused = build_model(MLP, seed=0), build_model(MLP, seed=1)
    a, b = randn(5, 20, 1, 3, 3), randn(6, 13, 1, 3, 3)
    reading = torch.rand(7, 7, generator=torch.Generator().manual_seed(2)).double()
    request = StatisticsRequest(2, fused, dtype="float64")
    parts = [gram_statistics(model, level_grams(model, d)[2], request, reading) for d in (a, b)]
    pooled = gram_statistics(model, level_grams(model, torch.cat([a, b]))[2], request, reading)
    assert pooled.rows == 33
    for name in ("gram", "cross", "target_gram"):
        total = getattr(parts[0], name) + getattr(parts[1], name)
        torch.testing.assert_close(getattr(pooled, name), total, rtol=1e-9, atol=1e-9)


def test_the_design_map_mixes_a_convolutions_patches_like_its_input_channels():
    conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    site_channels, fused_channels = 5, 3
    reading = torch.rand(fused_channels, site_channels, generator=torch.Generator().manual_seed(0))
    site_inputs = randn(1, 2, site_channels, 6, 6).double()
    fused_inputs = torch.einsum("cs,bshw->bchw", reading.double(), site_inputs)
    site_conv = torch.nn.Conv2d(site_channels, 4, 3, padding=1).double()
    site_design = affine_view(site_conv).design(site_inputs)
    fused_design = affine_view(conv.double()).design(fused_inputs)
    mapped = design_map(reading, site_design.shape[1], fused_design.shape[1], where="test")
    torch.testing.assert_close(site_design @ mapped, fused_design)


def test_the_design_map_mixes_flattened_feature_maps_channel_by_channel():
    reading = torch.rand(2, 4, generator=torch.Generator().manual_seed(1)).double()
    site = randn(2, 3, 4, 2, 2).double()
    fused = torch.einsum("cs,bshw->bchw", reading, site)
    site_design = torch.cat([site.flatten(1), torch.ones(3, 1, dtype=torch.float64)], 1)
    mapped = design_map(reading, 17, 8, where="test")  # a fused layer without a bias
    torch.testing.assert_close(site_design @ mapped, fused.flatten(1))
    with pytest.raises(ValueError, match="does not map onto"):
        design_map(reading, 17, 11, where="test")


def test_grams_fusion_is_close_to_the_statistics_rounds_on_trained_sites():
    """On two sites trained on disjoint halves of a task, one upload gets what the rounds get
    to within a small loss on the sites' data (the readings' ReLU approximation)."""
    torch.manual_seed(0)
    spec = mlp_spec((1, 4, 4), 3, (12, 10))
    x = randn(20, 400, 1, 4, 4)
    teacher = build_model(spec, seed=9).eval()
    with torch.no_grad():
        y = teacher(x).argmax(1)
    halves = [x[:200], x[200:]]
    models = []
    for seed, part in enumerate(halves):
        model = build_model(spec, seed=seed)
        optimiser = torch.optim.Adam(model.parameters(), lr=0.02)
        labels = y[:200] if seed == 0 else y[200:]
        for _ in range(150):
            optimiser.zero_grad()
            F.cross_entropy(model(part), labels).backward()
            optimiser.step()
        models.append(model.eval())
    grams = [level_grams(m, d) for m, d in zip(models, halves, strict=True)]
    inputs = FusionInputs(grams=grams, sites=LocalSites(models, halves, device="cpu"))
    with torch.no_grad():
        one_upload = KFGrams().fuse(models, inputs).model(x).argmax(1)
        rounds = KFSites().fuse(models, inputs).model(x).argmax(1)
    accuracy = float((one_upload == y).float().mean())
    assert accuracy >= float((rounds == y).float().mean()) - 0.1
    assert accuracy > 0.6


def test_a_missing_or_misshapen_gram_is_named_with_its_site():
    models, data = _sites(MLP)
    grams = [level_grams(m, d) for m, d in zip(models, data, strict=True)]
    missing = [grams[0], {k: v for k, v in grams[1].items() if k != 2}]
    with pytest.raises(ValueError, match="site 1 uploaded no Gram"):
        KFGrams().fuse(models, FusionInputs(grams=missing))
    wrong = [grams[0], {**grams[1], 2: torch.eye(5, dtype=torch.float64)}]
    with pytest.raises(ValueError, match="site 1: the Gram of level .* has side 5"):
        KFGrams().fuse(models, FusionInputs(grams=wrong))


def test_it_reads_grams_only_and_refuses_blocks_before_any_site_trains():
    method = KFGrams()
    assert method.requirements() == {"grams"}
    assert needs_grams([method])
    method.check_run(5, lenet5_spec((1, 28, 28), 10), available={"grams"})
    with pytest.raises(ValueError, match="kf-grams: needs the sites' Gram matrices"):
        method.check_run(2, MLP, available={"data", "scores"})
    with pytest.raises(ValueError, match="kf-grams: cannot fuse resnet models: .*not affine"):
        method.check_run(2, resnet_spec((3, 8, 8), 3, depth=10, width_multiplier=0.25))
