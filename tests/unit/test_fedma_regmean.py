"""FedMA-style one-shot matching (BBP-MAP) and RegMean."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedfuse.fusion import FUSION_METHODS, FusionInputs, make_fusion_method
from fedfuse.fusion.blocks.selection import best_on_fusion_set
from fedfuse.fusion.methods.matching.fedma import FedMAMatching
from fedfuse.fusion.methods.matching.fedma_bbp import _client_gains
from fedfuse.fusion.methods.regression.regmean import RegMean, level_grams
from fedfuse.io.grams import full_gram
from fedfuse.io.validation import ContributionError, validate_grams
from fedfuse.models import LeveledModel, build_model, mlp_spec
from fedfuse.models.affine import affine_view
from tests.helpers import permuted_copy


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture
def x():
    return torch.randn(32, 1, 4, 4, generator=torch.Generator().manual_seed(1))


def test_both_methods_are_registered():
    assert FUSION_METHODS["fedma"] is FedMAMatching
    assert FUSION_METHODS["regmean"] is RegMean
    assert make_fusion_method("fedma", sigma=0.2, max_width=12).max_width == 12
    assert make_fusion_method("regmean", alpha=0.5).alpha == 0.5


# ---------------------------------------------------------------------------------------- FedMA


@torch.no_grad()
def test_fedma_of_identical_models_opens_nothing_and_keeps_the_function(tiny_mlp, x):
    result = FedMAMatching().fuse([tiny_mlp, tiny_mlp, tiny_mlp])
    assert result.model.spec == tiny_mlp.spec
    assert result.details["new_neurons"] == [0, 0]
    assert _relative_error(result.model(x), tiny_mlp(x)) < 1e-3


@torch.no_grad()
def test_fedma_of_a_permuted_copy_recovers_the_function(tiny_mlp, x):
    permuted = permuted_copy(tiny_mlp)
    assert torch.allclose(permuted(x), tiny_mlp(x), atol=1e-5)
    result = FedMAMatching().fuse([tiny_mlp, permuted])
    assert result.details["widths"] == list(tiny_mlp.spec.widths)
    assert result.details["new_neurons"] == [0, 0]
    assert _relative_error(result.model(x), tiny_mlp(x)) < 1e-3


@torch.no_grad()
def test_fedma_matches_conv_levels_of_a_permuted_vgg(tiny_vgg):
    permuted = permuted_copy(tiny_vgg, seed=3)
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    result = FedMAMatching().fuse([tiny_vgg, permuted])
    assert result.model.spec == tiny_vgg.spec
    assert _relative_error(result.model(images), tiny_vgg(images)) < 1e-3


@torch.no_grad()
def test_fedma_opens_new_neurons_for_disjoint_models_within_the_cap(x):
    spec = mlp_spec((1, 4, 4), 3, (8, 6))
    a, b = build_model(spec, seed=0), build_model(spec, seed=1)
    # unrelated neurons stay apart: with room for all of them the fused model is the
    # concatenation of both networks, i.e. it averages their logits (uniform head weights)
    wide = FedMAMatching(sigma=0.05, width_factor=2.0).fuse([a, b])
    assert wide.details["widths"] == [16, 12]
    assert wide.details["new_neurons"] == [8, 6]
    assert torch.allclose(wide.model(x), (a(x) + b(x)) / 2, atol=1e-5)
    capped = FedMAMatching(sigma=0.05, max_width=10).fuse([a, b])
    assert capped.details["widths"] == [10, 10]
    assert capped.model.spec.widths == (10, 10)
    default = FedMAMatching().fuse([a, b])
    assert all(w > c for w, c in zip(default.details["widths"], spec.widths, strict=True))
    assert all(
        w <= int(1.5 * c) for w, c in zip(default.details["widths"], spec.widths, strict=True)
    )
    with pytest.raises(ValueError, match="below the widest client"):
        FedMAMatching(max_width=7).fuse([a, b])
    # an explicit target with other widths caps each level at its widths
    targeted = FedMAMatching(sigma=0.05).fuse([a, b], target=spec.with_widths((9, 11)))
    assert targeted.details["widths"] == [9, 11]


@torch.no_grad()
def test_fedma_head_rows_follow_the_class_counts(x):
    spec = mlp_spec((1, 4, 4), 3, (8, 6))
    a, b = build_model(spec, seed=0), build_model(spec, seed=1)
    # class 0 only at client 0, class 2 only at client 1, class 1 split 1:3
    counts = [[10, 5, 0], [0, 15, 7]]
    fused = FedMAMatching(sigma=0.05, width_factor=2.0).fuse(
        [a, b], FusionInputs(class_counts=counts)
    )
    out, za, zb = fused.model(x), a(x), b(x)
    assert torch.allclose(out[:, 0], za[:, 0], atol=1e-5)
    assert torch.allclose(out[:, 2], zb[:, 2], atol=1e-5)
    assert torch.allclose(out[:, 1], 0.25 * za[:, 1] + 0.75 * zb[:, 1], atol=1e-5)
    assert fused.details["head_weights"][0] == pytest.approx([1.0, 0.25, 0.0])


@torch.no_grad()
def test_fedma_fuses_clients_of_different_widths(x):
    a = build_model(mlp_spec((1, 4, 4), 3, (8, 6)), seed=0)
    b = build_model(mlp_spec((1, 4, 4), 3, (5, 4)), seed=1)
    result = FedMAMatching().fuse([a, b])
    assert all(w >= c for w, c in zip(result.details["widths"], (8, 6), strict=True))
    assert result.model(x).shape == (len(x), 3)
    other = build_model(mlp_spec((1, 4, 4), 4, (8, 6)), seed=0)
    with pytest.raises(ValueError, match="more than the widths"):
        FedMAMatching().fuse([a, other])


def _labelled(x: torch.Tensor, classes: int = 3) -> FusionInputs:
    labels = torch.arange(len(x)) % classes
    return FusionInputs(data=x, labels=labels)


def test_fedma_popularity_code_is_fedmas_clipped_log():
    # one client neuron against two global neurons used by 1 and 12 of J = 20 clients: only the
    # popularity term differs, 2 log(m/(J-m)) (paper) against log(min(m,10)/(J-min(m,10)))
    v = torch.randn(1, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    sums = torch.randn(2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    precisions = torch.tensor([2.0, 13.0], dtype=torch.float64)
    counts = torch.tensor([1.0, 12.0], dtype=torch.float64)
    common = dict(new_columns=1, clients=20, sigma=1.0, sigma0=1.0, gamma=1.0)
    paper = _client_gains(v, sums, precisions, counts, **common)
    code = _client_gains(v, sums, precisions, counts, popularity="code", **common)
    expected = torch.tensor([[-math.log(1 / 19), math.log(10 / 10) - 2 * math.log(12 / 8), 0]])
    assert torch.allclose(code - paper, expected.double(), atol=1e-12)
    with pytest.raises(ValueError, match="popularity"):
        FedMAMatching(popularity="fedma")


@torch.no_grad()
def test_fedma_chooses_sigma_on_the_fusion_set(x):
    spec = mlp_spec((1, 4, 4), 3, (8, 6))
    models = [build_model(spec, seed=s) for s in range(3)]
    inputs = _labelled(x)
    method = FedMAMatching(sigma=0.4, grid=5, max_width=0)  # the sigma alone (cap: 1.5x)
    assert method.needs() == {"class_counts", "data", "labels"}
    result = method.fuse(models, inputs)
    selection = result.details["selection"]
    assert selection["sigmas"] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6])
    losses, accuracies = selection["fusion_loss"], selection["fusion_accuracy"]
    chosen = selection["chosen"]
    # the configured sigma preferred, then the nearest: kept unless significantly less accurate
    candidates = [
        (
            i,
            (
                FedMAMatching(sigma=selection["sigmas"][i], select=False, max_width=0)
                .fuse(models, inputs)
                .model,
                {},
            ),
        )
        for i in (2, 1, 3, 0, 4)
    ]
    assert chosen == best_on_fusion_set(candidates, inputs).key
    assert accuracies[chosen] >= max(accuracies) - 1 / len(x) ** 0.5
    assert result.details["sigma"] == pytest.approx(selection["sigmas"][chosen])
    # the chosen model is the one the fixed sigma gives, and its loss is the one reported
    fixed = FedMAMatching(sigma=selection["sigmas"][chosen], select=False).fuse(models, inputs)
    assert torch.allclose(result.model(x), fixed.model(x))
    assert "width_cap_chosen" not in result.details and len(selection["caps"]) == 1
    loss = F.cross_entropy(result.model(x), inputs.labels).item()
    assert loss == pytest.approx(losses[chosen], rel=1e-6)
    # different sigmas give different fused models here, so the choice matters
    assert len({round(v, 6) for v in losses}) > 1


@torch.no_grad()
def test_fedma_chooses_fedmas_wider_cap_only_when_the_fusion_set_says_it_is_better(x):
    spec = mlp_spec((1, 4, 4), 3, (8, 6))
    models = [build_model(spec, seed=s) for s in range(3)]
    inputs = _labelled(x)
    result = FedMAMatching(sigma=0.05, grid=1).fuse(models, inputs)
    selection = result.details["selection"]
    # two caps tried: 1.5x the widest client, and FedMA's 700 (here: every neuron, 24 and 18)
    assert [t["caps"] for t in selection["caps"]] == [[12, 9], [700, 700]]
    compact = FedMAMatching(sigma=0.05, grid=1, max_width=0).fuse(models, inputs)
    wide = FedMAMatching(sigma=0.05, grid=1, max_width=700).fuse(models, inputs)
    assert wide.details["widths"] == [24, 18] and compact.details["widths"] == [12, 9]
    keep = best_on_fusion_set(
        [(0, (compact.model, {})), (1, (wide.model, {}))], inputs
    ).key  # width_factor's cap preferred unless FedMA's is significantly better
    assert selection["chosen_caps"] == keep
    assert result.details["width_cap_chosen"] == ("width_factor" if keep == 0 else "700")
    expected = compact if keep == 0 else wide
    assert torch.allclose(result.model(x), expected.model(x))
    # without labels, or with select=False, the compact cap alone
    assert FedMAMatching(sigma=0.05, grid=1).fuse(models).details["widths"] == [12, 9]
    assert FedMAMatching(grid=1, select=False).needs() == {"class_counts"}
    assert FedMAMatching(grid=1).needs() == {"class_counts", "data", "labels"}
    with pytest.raises(ValueError, match="max_width"):
        FedMAMatching(max_width="wide")


@torch.no_grad()
def test_fedma_without_a_labelled_fusion_set_keeps_the_configured_sigma(tiny_mlp, x):
    b = build_model(tiny_mlp.spec, seed=1)
    plain = FedMAMatching(sigma=0.3).fuse([tiny_mlp, b])
    assert plain.details["sigma"] == 0.3 and "selection" not in plain.details
    fixed = FedMAMatching(sigma=0.3, select=False).fuse([tiny_mlp, b], _labelled(x))
    assert "selection" not in fixed.details
    assert torch.allclose(plain.model(x), fixed.model(x))
    single = FedMAMatching(grid=1, max_width=0)
    assert single.needs() == {"class_counts"}
    with pytest.raises(ValueError, match="grid"):
        FedMAMatching(grid=0)


@torch.no_grad()
def test_fedma_selection_keeps_identical_and_permuted_models(tiny_mlp, x):
    inputs = _labelled(x)
    same = FedMAMatching().fuse([tiny_mlp] * 4, inputs)
    assert same.details["new_neurons"] == [0, 0]
    assert _relative_error(same.model(x), tiny_mlp(x)) < 1e-3
    permuted = FedMAMatching().fuse([tiny_mlp, permuted_copy(tiny_mlp)], inputs)
    assert permuted.details["widths"] == list(tiny_mlp.spec.widths)
    # (the largest sigma of the grid shrinks the matched neurons toward 0 by ~1e-3 per level)
    assert _relative_error(permuted.model(x), tiny_mlp(x)) < 5e-3


# -------------------------------------------------------------------------------------- RegMean


def _linear_clients(seed: int = 0):
    """Two single-level (linear) models on 2x3 inputs and their own inputs."""
    spec = mlp_spec((1, 2, 3), 4, ())
    generator = torch.Generator().manual_seed(seed)
    models = [build_model(spec, seed=seed + i) for i in range(2)]
    data = [
        torch.randn(40, 1, 2, 3, generator=generator) * torch.tensor([1.0, 3.0, 0.5]) + 0.3,
        torch.randn(25, 1, 2, 3, generator=generator) - 0.5,
    ]
    return models, data


def _design(inputs: torch.Tensor) -> torch.Tensor:
    rows = inputs.reshape(len(inputs), -1).double()
    return torch.cat([rows, torch.ones(len(rows), 1, dtype=rows.dtype)], 1)


def _weights(model: LeveledModel, level: int) -> torch.Tensor:
    view = affine_view(model.levels[level])
    assert view is not None
    return view.weights().double()


def test_regmean_of_identical_models_returns_the_model(tiny_mlp):
    data = torch.randn(50, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    grams = [level_grams(tiny_mlp, data[:20]), level_grams(tiny_mlp, data[20:])]
    fused = RegMean().fuse([tiny_mlp, tiny_mlp], FusionInputs(grams=grams)).model
    for name, value in tiny_mlp.state_dict().items():
        assert torch.allclose(fused.state_dict()[name], value, atol=1e-5), name


def test_regmean_with_alpha_one_is_the_least_squares_fit_of_all_clients():
    models, data = _linear_clients()
    grams = [level_grams(m, d) for m, d in zip(models, data, strict=True)]
    fused = RegMean(alpha=1.0).fuse(models, FusionInputs(grams=grams)).model
    designs = [_design(d) for d in data]
    targets = [x @ _weights(m, 0) for x, m in zip(designs, models, strict=True)]
    expected = torch.linalg.lstsq(torch.cat(designs), torch.cat(targets)).solution
    assert torch.allclose(_weights(fused, 0), expected, atol=1e-5)


def test_regmean_with_alpha_zero_averages_each_input_coordinate():
    models, data = _linear_clients()
    grams = [level_grams(m, d) for m, d in zip(models, data, strict=True)]
    fused = _weights(RegMean(alpha=0.0).fuse(models, FusionInputs(grams=grams)).model, 0)
    exact = _weights(RegMean(alpha=1.0).fuse(models, FusionInputs(grams=grams)).model, 0)
    assert not torch.allclose(fused, exact, atol=1e-3)
    # diagonal Grams: each input row of W is the diag(G)-weighted average of the clients' rows
    diagonals = torch.stack([g[0].diagonal() for g in grams])  # (clients, fan_in + 1)
    rows = torch.stack([_weights(m, 0) for m in models])  # (clients, fan_in + 1, out)
    expected = (diagonals[..., None] * rows).sum(0) / diagonals.sum(0)[:, None]
    assert torch.allclose(fused, expected, atol=1e-5)


def test_regmean_without_grams_names_the_missing_field(tiny_mlp):
    with pytest.raises(ValueError, match=r"FusionInputs\.grams"):
        RegMean().fuse([tiny_mlp, tiny_mlp])
    data = torch.randn(10, 1, 4, 4)
    grams = level_grams(tiny_mlp, data)
    partial = {k: v for k, v in grams.items() if k != tiny_mlp.neuron_levels[-1]}
    with pytest.raises(ValueError, match=r"FusionInputs\.grams\[1\] has no Gram for level"):
        RegMean().fuse([tiny_mlp, tiny_mlp], FusionInputs(grams=[grams, partial]))


def test_regmean_survives_dead_inputs(tiny_mlp):
    """A hidden neuron that is zero on every client's data leaves a singular Gram."""
    model = copy.deepcopy(tiny_mlp)
    with torch.no_grad():
        model.levels[0][1].weight[0] = 0.0
        model.levels[0][1].bias[0] = -1.0  # ReLU(-1) = 0 on all inputs
    data = torch.randn(30, 1, 4, 4)
    grams = [level_grams(model, data), level_grams(model, data + 0.1)]
    fused = RegMean(alpha=1.0).fuse([model, model], FusionInputs(grams=grams)).model
    for name, value in model.state_dict().items():
        assert torch.allclose(fused.state_dict()[name], value, atol=1e-4), name


def _by_hand_grams(model: LeveledModel, data: torch.Tensor) -> dict[int, torch.Tensor]:
    grams = {}
    x = data
    with torch.no_grad():
        for index, level in enumerate(model.levels):
            if model.has_neurons(index):
                layer = level if not isinstance(level, nn.Sequential) else level[-1]
                inputs = x.flatten(1) if isinstance(layer, nn.Linear) else x
                if isinstance(layer, nn.Conv2d):
                    patches = F.unfold(inputs, layer.kernel_size, padding=layer.padding)
                    inputs = patches.transpose(1, 2).reshape(-1, patches.shape[1])
                design = torch.cat([inputs, torch.ones(len(inputs), 1)], 1).double()
                grams[index] = design.T @ design
            x = level(x)
    return grams


def test_level_grams_are_the_design_grams_by_hand(tiny_mlp, tiny_vgg):
    data = torch.randn(7, 1, 4, 4)
    for batch_size in (256, 3):
        got = level_grams(tiny_mlp, data, batch_size=batch_size)
        expected = _by_hand_grams(tiny_mlp, data)
        assert sorted(got) == tiny_mlp.neuron_levels
        for index in expected:
            assert got[index].dtype == torch.float64
            assert torch.allclose(got[index], expected[index], rtol=1e-6, atol=1e-6)
    images = torch.randn(3, 3, 32, 32)
    got = level_grams(tiny_vgg, images, batch_size=2)
    expected = _by_hand_grams(tiny_vgg, images)
    assert sorted(got) == tiny_vgg.neuron_levels
    for index in expected:
        assert torch.allclose(got[index], expected[index], rtol=1e-5, atol=1e-4), index
    assert got[0].shape == (3 * 9 + 1, 3 * 9 + 1)
    assert tiny_vgg.training  # restored


def test_regmean_merges_a_vgg_from_its_grams(tiny_vgg):
    images = torch.randn(4, 3, 32, 32)
    other = copy.deepcopy(tiny_vgg)
    grams = [level_grams(tiny_vgg, images[:2]), level_grams(other, images[2:])]
    fused = RegMean().fuse([tiny_vgg, other], FusionInputs(grams=grams)).model
    with torch.no_grad():
        assert torch.allclose(fused(images), tiny_vgg(images), atol=1e-3)


def test_a_site_with_fewer_rows_than_columns_sends_an_exact_gram_factor(tiny_mlp):
    data = torch.randn(7, 1, 4, 4, generator=torch.Generator().manual_seed(3))
    full = level_grams(tiny_mlp, data)
    compact = level_grams(tiny_mlp, data, factor=True, batch_size=3)
    for index, gram in full.items():
        stored = compact[index]
        if gram.shape[0] > len(data):  # 7 rows under 17 columns: R (7 x 17) with R^T R = G
            assert stored.shape == (len(data), gram.shape[0])
            assert torch.allclose(full_gram(stored), gram, rtol=1e-6, atol=1e-6)
        else:
            assert torch.allclose(stored, gram, rtol=1e-6, atol=1e-6)
    # the fit from factors is the fit from the matrices
    other = level_grams(tiny_mlp, data + 0.5)
    fused = RegMean().fuse([tiny_mlp, tiny_mlp], FusionInputs(grams=[full, other])).model
    compact_other = level_grams(tiny_mlp, data + 0.5, factor=True)
    from_factors = (
        RegMean().fuse([tiny_mlp, tiny_mlp], FusionInputs(grams=[compact, compact_other])).model
    )
    for name, value in fused.state_dict().items():
        assert torch.allclose(from_factors.state_dict()[name], value, atol=1e-5), name


def test_gram_factors_are_validated_by_shape_and_values(tiny_mlp):
    data = torch.randn(5, 1, 4, 4)
    compact = level_grams(tiny_mlp, data, factor=True)
    first = tiny_mlp.neuron_levels[0]
    assert validate_grams(tiny_mlp, compact, source="site-3")[first].shape == (5, 17)
    bad = {**compact, first: compact[first][:, :-1]}
    with pytest.raises(ContributionError, match=r"site-3: Gram matrix of level 0 has shape"):
        validate_grams(tiny_mlp, bad, source="site-3")
    poisoned = {**compact, first: compact[first].clone()}
    poisoned[first][0, 0] = float("nan")
    with pytest.raises(ContributionError, match="NaN/Inf"):
        validate_grams(tiny_mlp, poisoned, source="site-3")
