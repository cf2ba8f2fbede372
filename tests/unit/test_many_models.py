"""The pairwise methods fuse N models: Hungarian Fusion (hf-linear, hf-gradient, hf-sites) by
iterative one-to-one grouping, Git Re-Basin by MergeMany. Identical models and permuted copies
give the model's function back for N = 3 and 5, and two models fuse exactly as before."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from fedfuse.fusion import FUSION_METHODS, FusionInputs, LocalSites, make_fusion_method
from fedfuse.fusion.blocks.alignment import permute_level
from fedfuse.fusion.blocks.matching import (
    linear_assignment,
    merge_many,
    one_to_one_labels,
    pair_labels,
)
from fedfuse.fusion.methods.averaging.fedavg import average_state_dicts
from fedfuse.fusion.methods.matching.git_rebasin_matching import match_neurons
from fedfuse.models import build_model, make_spec, mlp_spec, vgg11_spec
from fedfuse.models.affine import affine_view
from fedfuse.models.capture import capture_levels
from fedfuse.models.symmetry import permute_model, random_permutations
from tests.helpers import permuted_copy, randn

MLP = mlp_spec((1, 4, 4), 3, (8, 6))
VGG = vgg11_spec((1, 8, 8), 3, width_multiplier=1 / 16)
PAIRWISE = ("hf-linear", "hf-gradient", "hf-sites", "git-rebasin")
#: hf-gradient from the closed-form fit, polished briefly: the grouping decides the targets
OPTIONS = {
    "hf-linear": {"device": "cpu"},
    "hf-gradient": {"device": "cpu", "start": "closed-form", "preset": "refine", "epochs": 2},
    "hf-sites": {"use_scores": False, "statistics_dtype": "float64"},
    "git-rebasin": {"device": "cpu"},
}

pytestmark = pytest.mark.usefixtures("one_thread")


def _fuse(name: str, models: list, spec=MLP, **extra):
    """Fuse ``models`` with ``name``: a fusion set, or (hf-sites) each site's own data."""
    n = 120 if spec is MLP else 24
    options = {**OPTIONS[name], **extra}
    if name == "hf-sites":
        data = [randn(10 + k, n, *spec.input_shape) for k in range(len(models))]
        inputs = FusionInputs(sites=LocalSites(models, data, device="cpu"))
    else:
        inputs = FusionInputs(data=randn(1, n, *spec.input_shape))
    return make_fusion_method(name, **options).fuse(models, inputs)


def _assert_same_function(fused, model, spec=MLP) -> None:
    test = randn(99, 40, *spec.input_shape)
    with torch.no_grad():
        expected, got = model(test), fused.eval()(test)
    assert (got - expected).abs().max() <= 1e-3 * expected.abs().max()


# ---------------------------------------------------------------------------- the methods
def test_no_registered_method_refuses_more_than_two_models():
    assert all(cls.max_models is None for cls in FUSION_METHODS.values())
    for name in PAIRWISE:
        make_fusion_method(name).check_run(10, MLP)


@pytest.mark.parametrize("count", [3, 5])
@pytest.mark.parametrize("name", PAIRWISE)
def test_identical_models_give_the_model_back(name, count):
    model = build_model(MLP, seed=0).eval()
    result = _fuse(name, [copy.deepcopy(model) for _ in range(count)])
    _assert_same_function(result.model, model)


@pytest.mark.parametrize("name", PAIRWISE)
def test_three_permuted_copies_fuse_to_the_same_function(name):
    model = build_model(MLP, seed=0).eval()
    models = [model] + [permuted_copy(model, seed=s) for s in (1, 2)]
    result = _fuse(name, models)
    _assert_same_function(result.model, model)


@pytest.mark.parametrize("name", ["hf-linear", "git-rebasin"])
def test_five_permuted_vggs_fuse_to_the_same_function(name):
    model = build_model(VGG, seed=0).eval()
    models = [model] + [permuted_copy(model, seed=s) for s in range(1, 5)]
    result = _fuse(name, models, VGG)
    _assert_same_function(result.model, model, VGG)


@pytest.mark.parametrize(
    "spec",
    [
        make_spec("resnet", (1, 12, 12), 4, depth=10, width_multiplier=1 / 16),
        make_spec("vit", (1, 12, 12), 4, patch=4, depth=1, heads=2, hidden=16, mlp=24),
    ],
    ids=["resnet", "vit"],
)
def test_git_rebasin_aligns_three_permuted_residual_models_space_by_space(spec):
    generator = torch.Generator().manual_seed(0)
    model = build_model(spec, seed=0).eval()
    models = [model] + [
        permute_model(model, random_permutations(model, generator)) for _ in range(2)
    ]
    data = randn(1, 24, *spec.input_shape)
    options = {"device": "cpu", "reset_batchnorm": False}
    result = make_fusion_method("git-rebasin", **options).fuse(models, FusionInputs(data=data))
    assert result.details["path"] == "spaces"
    assert all(len(s["permutations"]) == 3 for s in result.details["spaces"])
    _assert_same_function(result.model, model, spec)


def test_git_rebasin_reports_each_models_permutation_for_many_models():
    model = build_model(MLP, seed=0).eval()
    models = [model] + [permuted_copy(model, seed=s) for s in (1, 2, 3)]
    levels = _fuse("git-rebasin", models).details["levels"]
    hidden = model.neuron_levels[:-1]
    for index, info in zip(hidden, levels, strict=True):
        assert info["permutations"][0] == list(range(model.level_width(index)))
        assert info["matched"] == pytest.approx(1.0)  # every pair aligned: correlation 1
        assert 1 <= info["rounds"] <= 100
    for number, copy_ in enumerate(models[1:], 1):  # each copy unshuffled is the model
        unshuffled = copy.deepcopy(copy_)
        for index, info in zip(hidden, levels, strict=True):
            permute_level(unshuffled, index, torch.tensor(info["permutations"][number]))
        expected = model.state_dict()
        assert all(torch.equal(v, expected[k]) for k, v in unshuffled.state_dict().items())


def test_hf_gradient_numbers_the_groups_like_model_0():
    """Started from model 0's level (epsilon 0), targets numbered like model 0's neurons give
    zero loss at the start: the fused model is model 0."""
    model = build_model(MLP, seed=0).eval()
    models = [model] + [permuted_copy(model, seed=s) for s in (1, 2, 3, 4)]
    result = _fuse("hf-gradient", models, start="base", preset="setting2", epsilon=0.0)
    for index in model.neuron_levels[:-1]:
        torch.testing.assert_close(
            affine_view(result.model.levels[index]).weights(),
            affine_view(model.levels[index]).weights(),
            atol=1e-4,
            rtol=0,
        )


# ---------------------------------------------------------------------------- two models
def test_two_models_rebasin_is_one_match_of_model_1_onto_model_0():
    a, b = build_model(MLP, seed=0).eval(), build_model(MLP, seed=1).eval()
    data = randn(1, 120, *MLP.input_shape)
    fused = make_fusion_method("git-rebasin", device="cpu").fuse([a, b], FusionInputs(data=data))
    hidden = a.neuron_levels[:-1]
    captured = [capture_levels(m, data, hidden, keep_inputs=False) for m in (a, b)]
    permuted = copy.deepcopy(b)
    for index in hidden:  # today's pairwise path, written out
        permutation, _ = match_neurons(captured[0][index].outputs, captured[1][index].outputs)
        permute_level(permuted, index, permutation)
    expected = average_state_dicts([a, permuted], [0.5, 0.5])
    state = fused.model.state_dict()
    assert all(
        torch.allclose(state[k], v.to(state[k].dtype), atol=1e-7) for k, v in expected.items()
    )


@pytest.mark.parametrize("name", ["hf-linear", "hf-sites"])
def test_two_models_ignore_the_rounds(name):
    models = [build_model(MLP, seed=s).eval() for s in (0, 1)]
    first = _fuse(name, models, match_rounds=0).model.state_dict()
    second = _fuse(name, models, match_rounds=7).model.state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_two_sets_are_paired_exactly_as_before():
    points, weights = randn(0, 20, 5), randn(1, 20).abs()
    expected = pair_labels(points[:10], points[10:], weights[:10], weights[10:])
    assert torch.equal(one_to_one_labels(points, weights, [10, 10]), expected)
    costs = {(0, 1): randn(2, 7, 7)}
    permutations, _ = merge_many(costs, [0.5, 0.5])
    assert torch.equal(permutations[0], torch.arange(7))
    assert torch.equal(permutations[1], linear_assignment(costs[(0, 1)]))


# ---------------------------------------------------------------------------- the blocks
def _grouping_cost(points, weights, labels, k) -> float:
    total = 0.0
    for c in range(k):
        p, w = points[labels == c], weights[labels == c]
        centre = (w[:, None] * p).sum(0) / w.sum()
        total += float((w * (p - centre).pow(2).sum(1)).sum())
    return total


def test_one_to_one_groups_take_one_point_of_each_set_and_recover_shuffled_copies():
    base, sets, orders = randn(3, 12, 6), [], []
    for m in range(4):
        order = torch.randperm(12, generator=torch.Generator().manual_seed(m))
        sets.append(base[order] + 0.01 * randn(10 + m, 12, 6))
        orders.append(order)
    points, weights = (
        torch.cat(sets),
        torch.rand(48, generator=torch.Generator().manual_seed(0)) + 0.5,
    )
    labels = one_to_one_labels(points, weights, [12] * 4)
    for m, order in enumerate(orders):
        own = labels[12 * m : 12 * (m + 1)]
        assert sorted(own.tolist()) == list(range(12))  # one point of each set per group
        # the copies of base point order[i] share the group of set 0's copy of it
        assert torch.equal(own, labels[:12][torch.argsort(orders[0])][order])


def test_the_rounds_lower_the_grouping_cost_to_the_brute_force_optimum_here():
    points, weights = randn(5, 9, 2), randn(6, 9).abs() + 0.1
    start = one_to_one_labels(points, weights, [3, 3, 3], rounds=0)
    labels = one_to_one_labels(points, weights, [3, 3, 3])
    best = min(
        _grouping_cost(points, weights, torch.cat([torch.arange(3), p1, p2]), 3)
        for p1 in map(torch.tensor, itertools.permutations(range(3)))
        for p2 in map(torch.tensor, itertools.permutations(range(3)))
    )
    cost = _grouping_cost(points, weights, labels, 3)
    assert cost <= _grouping_cost(points, weights, start, 3) + 1e-12
    assert cost == pytest.approx(best)


def test_merge_many_aligns_permuted_copies_of_noisy_units():
    units, count = randn(7, 10, 30), 5
    perms = [torch.arange(10)] + [
        torch.randperm(10, generator=torch.Generator().manual_seed(s)) for s in range(1, count)
    ]
    copies = [units[p] + 0.05 * randn(20 + i, 10, 30) for i, p in enumerate(perms)]
    costs = {
        (i, j): torch.cdist(copies[i], copies[j]).pow(2)
        for i in range(count)
        for j in range(i + 1, count)
    }
    found, rounds = merge_many(costs, [1 / count] * count, seed=3)
    assert torch.equal(found[0], torch.arange(10)) and rounds >= 2
    for p, q in zip(perms, found, strict=True):  # slot s holds base unit s in every model
        assert torch.equal(p[q], torch.arange(10))


@pytest.mark.parametrize(
    ("samples", "route", "hidden"),
    [(12, "kernel", (16, 12)), (40, "gram", (16, 12)), (12, "kernel", (16, 16, 16))],
)
def test_many_models_levels_side_by_side_fit_as_the_levels_one_by_one(
    monkeypatch, samples, route, hidden
):
    """When K-means clusters on principal coordinates, a linear level of every model is kept
    as one tensor whose transpose is the points (equal widths: the last level's tensor,
    overwritten); the fit is the one from separate tensors."""
    from fedfuse.fusion.methods.neuron_interpolation.methods import NeuronInterpolation

    spec = mlp_spec((1, 4, 4), 3, hidden)
    models = [build_model(spec, seed=seed) for seed in range(6)]
    inputs = FusionInputs(data=randn(1, samples, 1, 4, 4))
    options = {"kmeans_variance": 0.999, "ridge": 0.01}
    shared = make_fusion_method("kf-linear", **options).fuse(models, inputs)
    assert shared.details["levels"][0]["route"] == route
    original = NeuronInterpolation._stream_level

    def separate(self, streams, captured, mappings, index, fused, previous=None):
        assert previous is None
        assert original(self, streams, captured, mappings, index, fused) is not None or (
            index == fused.neuron_levels[-1]
        )
        return None  # the levels stay in the captures, the fit concatenates them itself

    monkeypatch.setattr(NeuronInterpolation, "_stream_level", separate)
    alone = make_fusion_method("kf-linear", **options).fuse(models, inputs)
    for name, value in shared.model.state_dict().items():
        assert torch.allclose(alone.model.state_dict()[name], value, atol=1e-6), name
