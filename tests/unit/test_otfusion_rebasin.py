import copy

import pytest
import torch
from scipy.optimize import linear_sum_assignment

from fedfuse.fusion.base import FusionInputs
from fedfuse.fusion.blocks.alignment import affine_levels, permute_level
from fedfuse.fusion.blocks.matching import correlation, squared_distances
from fedfuse.fusion.blocks.repair import neuron_statistics, repair, target_statistics
from fedfuse.fusion.blocks.selection import best_on_fusion_set
from fedfuse.fusion.blocks.transport import transport_plan
from fedfuse.fusion.methods.averaging.fedavg import average_state_dicts
from fedfuse.fusion.methods.matching.git_rebasin import GitReBasin
from fedfuse.fusion.methods.matching.git_rebasin_matching import match_neurons
from fedfuse.fusion.methods.matching.otfusion import OTFusion
from fedfuse.fusion.registry import make_fusion_method
from fedfuse.models import build_model, mlp_spec, vgg11_spec
from fedfuse.models.affine import output_rows
from tests.helpers import permuted_copy

MLP = mlp_spec((1, 6, 6), 4, (12, 10))
VGG = vgg11_spec((1, 28, 28), 10, width_multiplier=1 / 16)


pytestmark = pytest.mark.usefixtures("one_thread")


def data_for(spec, n=32, seed=0):
    return torch.randn(n, *spec.input_shape, generator=torch.Generator().manual_seed(seed))


def random_scores(model, seed):
    generator = torch.Generator().manual_seed(seed)
    return {i: torch.rand(model.level_width(i), generator=generator) for i in model.neuron_levels}


def params(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def same_params(model, state, atol=1e-6):
    return all(torch.allclose(v, state[k], atol=atol) for k, v in model.state_dict().items())


CASES = [
    (spec, method, f"{name}-{spec.arch}")
    for name, method in [
        ("ot-activations", OTFusion()),
        ("ot-weights", OTFusion(ground_metric="weights")),
        ("rebasin-correlation", GitReBasin()),
        ("rebasin-l2", GitReBasin(cost="l2")),
    ]
    for spec in (MLP, VGG)
    if not (spec is VGG and name == "rebasin-l2")
]


@pytest.mark.parametrize(("spec", "method"), [c[:2] for c in CASES], ids=[c[2] for c in CASES])
def test_fusing_a_model_with_its_permuted_copy_gives_it_back(spec, method):
    model = build_model(spec, seed=0).eval()
    shuffled = permuted_copy(model, seed=1)
    x = data_for(spec, n=32 if spec is MLP else 8)
    before, shuffled_before = params(model), params(shuffled)
    result = method.fuse([model, shuffled], FusionInputs(data=x))
    assert torch.allclose(result.model(x), model(x), atol=1e-4)
    assert same_params(result.model, before, atol=1e-5)
    assert same_params(model, before, atol=0) and same_params(shuffled, shuffled_before, atol=0)
    levels = result.details["levels"]
    assert len(levels) == len(model.neuron_levels) - 1
    assert all(level["seconds"] >= 0 for level in levels)
    if isinstance(method, OTFusion):
        assert all(level["permutation"] for level in levels)
        assert all(c == pytest.approx(0, abs=1e-6) for lv in levels for c in lv["transport_cost"])
    else:
        assert all(level["moved"] > 0 for level in levels)


def test_exact_emd_with_uniform_marginals_is_the_hungarian_matching():
    cost = torch.rand(9, 9, generator=torch.Generator().manual_seed(0))
    plan = transport_plan(cost)
    rows, cols = linear_sum_assignment(cost.numpy())
    permutation = torch.zeros(9, 9, dtype=torch.float64)
    permutation[rows, cols] = 1
    assert torch.allclose(plan * 9, permutation, atol=1e-12)
    # the same on a level's activation cost, through Git Re-Basin's L2 matching
    a, b = torch.randn(50, 8), torch.randn(50, 8)
    perm, _ = match_neurons(a, b, "l2")
    plan = transport_plan(squared_distances(a, b))
    assert torch.equal(plan.argmax(1), perm)


def test_sinkhorn_with_small_regularisation_approaches_emd():
    generator = torch.Generator().manual_seed(0)
    cost = torch.rand(7, 9, generator=generator)
    a, b = torch.rand(7, generator=generator), torch.rand(9, generator=generator)
    exact = transport_plan(cost, a, b)
    gaps = [
        float(
            (transport_plan(cost, a, b, solver="sinkhorn", reg=reg, max_iter=5000) - exact)
            .abs()
            .sum()
        )
        for reg in (0.1, 0.01, 0.001)
    ]
    assert gaps[0] > gaps[1] > gaps[2] and gaps[2] < 1e-2
    # and the fused model: a permuted copy is recovered nearly exactly
    model = build_model(MLP, seed=0).eval()
    x = data_for(MLP)
    fused = OTFusion(solver="sinkhorn", reg=0.001).fuse(
        [model, permuted_copy(model)], FusionInputs(data=x)
    )
    assert torch.allclose(fused.model(x), model(x), atol=1e-3)


def test_scores_change_otfusion_but_a_model_fused_with_itself_is_unchanged():
    a, b = build_model(MLP, seed=0), build_model(MLP, seed=1)
    x = data_for(MLP)
    scores = [random_scores(a, 0), random_scores(b, 1)]
    plain = OTFusion().fuse([a, b], FusionInputs(data=x)).model
    weighted = OTFusion(use_scores=True).fuse([a, b], FusionInputs(data=x, scores=scores)).model
    assert not torch.allclose(plain(x), weighted(x), atol=1e-4)
    before = params(a)
    for method in (OTFusion(), OTFusion(use_scores=True), OTFusion(solver="sinkhorn", reg=1e-3)):
        inputs = FusionInputs(data=x, scores=[scores[0], scores[0]])
        fused = method.fuse([a, copy.deepcopy(a)], inputs).model
        assert same_params(fused, before, atol=1e-4)


def test_otfusion_scores_are_the_marginals():
    a, b = build_model(MLP, seed=0), build_model(MLP, seed=1)
    x = data_for(MLP)
    scores = [random_scores(a, 0), random_scores(b, 1)]
    result = OTFusion(use_scores=True).fuse([a, b], FusionInputs(data=x, scores=scores))
    # unequal marginals: the plans split neurons, so they are not permutations
    assert not all(level["permutation"] for level in result.details["levels"])
    # zero scores are allowed (a neuron with no mass takes its nearest partner)
    scores[0][0][:3] = 0
    OTFusion(use_scores=True).fuse([a, b], FusionInputs(data=x, scores=scores))


def test_otfusion_of_three_models_and_a_reference():
    model = build_model(MLP, seed=0).eval()
    x = data_for(MLP)
    models = [permuted_copy(model, 1), model, permuted_copy(model, 2)]
    for reference in (0, 1, 2):
        result = make_fusion_method("otfusion", reference=reference).fuse(
            models, FusionInputs(data=x)
        )
        assert torch.allclose(result.model(x), model(x), atol=1e-4)
        assert same_params(result.model, params(models[reference]), atol=1e-5)
        assert all(len(level["transport_cost"]) == 2 for level in result.details["levels"])
    others = [build_model(MLP, seed=s) for s in range(3)]
    inputs = FusionInputs(data=x, sample_counts=[1, 2, 3])
    result = OTFusion(weighted_average=True, repair=True).fuse(others, inputs)
    assert result.details["weights"] == pytest.approx([1 / 6, 2 / 6, 3 / 6])
    assert result.details["weighting"] == "samples"
    assert torch.isfinite(result.model(x)).all()
    with pytest.raises(ValueError, match="reference"):
        OTFusion(reference=3).fuse(others, inputs)


def test_weights_ground_metric_needs_no_data_but_activations_do():
    a, b = build_model(MLP, seed=0), build_model(MLP, seed=1)
    OTFusion(ground_metric="weights").fuse([a, b])
    with pytest.raises(ValueError, match="FusionInputs.data"):
        OTFusion(ground_metric="activations").fuse([a, b])
    with pytest.raises(ValueError, match="FusionInputs.data"):
        GitReBasin().fuse([a, b])


def _kept(method, option, values, models, inputs, **options):
    """The value of ``option`` that :func:`best_on_fusion_set` keeps of the explicit fusions
    (``values`` in their order of preference)."""
    candidates = [
        (v, (method(**{option: v}, **options).fuse(models, inputs).model, {})) for v in values
    ]
    return best_on_fusion_set(candidates, inputs).key


def test_auto_ground_metric_keeps_the_fusion_with_the_higher_fusion_set_accuracy():
    models = [build_model(MLP, seed=s) for s in range(3)]
    x = data_for(MLP)
    y = torch.randint(0, MLP.num_classes, (len(x),), generator=torch.Generator().manual_seed(0))
    auto = OTFusion().fuse(models, FusionInputs(data=x, labels=y))
    losses = {c["ground_metric"]: c["loss"] for c in auto.details["fusion_set_losses"]}
    chosen = auto.details["ground_metric_chosen"]
    inputs = FusionInputs(data=x, labels=y)
    kept = _kept(OTFusion, "ground_metric", ["activations", "weights"], models, inputs)
    assert set(losses) == {"activations", "weights"} and chosen == kept
    accuracies = {c["ground_metric"]: c["accuracy"] for c in auto.details["fusion_set_losses"]}
    accuracy = (auto.model(x).argmax(1) == y).double().mean().item()
    assert accuracies[chosen] == pytest.approx(accuracy)
    assert "weighting_chosen" not in auto.details  # no sample counts: uniform only
    explicit = OTFusion(ground_metric=chosen).fuse(models, FusionInputs(data=x))
    for key, value in explicit.model.state_dict().items():
        assert torch.equal(auto.model.state_dict()[key], value), key
    loss = torch.nn.functional.cross_entropy(explicit.model(x), y).item()
    assert losses[chosen] == pytest.approx(loss, rel=1e-5)
    # without labels the cost cannot be chosen: activations; without data: weights
    assert OTFusion().fuse(models, FusionInputs(data=x)).details["ground_metric"] == "activations"
    assert OTFusion().fuse(models).details["ground_metric"] == "weights"


def skewed_sites(seed=0):
    """Three permuted copies of one model and a fusion set it classifies, in which one site
    (a model made to predict class 0 everywhere) has the most or the fewest samples."""
    good = build_model(MLP, seed=seed).eval()
    x = data_for(MLP, n=64, seed=seed)
    y = good(x).argmax(1)
    bad = copy.deepcopy(good)
    head = affine_levels(bad)[good.neuron_levels[-1]]
    rows = head.weights().clone()
    rows.zero_()
    rows[0, -1] = 100.0  # the class-0 logit's bias: always class 0
    head.set_weights(rows)
    return [permuted_copy(good, seed=1), permuted_copy(bad, seed=2), good], x, y


@pytest.mark.parametrize("method", [OTFusion, GitReBasin])
def test_auto_weighting_keeps_the_average_with_the_higher_fusion_set_accuracy(method):
    models, x, y = skewed_sites()
    for counts, expected in (([10, 1, 10], "samples"), ([1, 10, 1], "uniform")):
        inputs = FusionInputs(data=x, labels=y, sample_counts=counts)
        auto = method().fuse(models, inputs)
        losses = {c["weighting"]: c["loss"] for c in auto.details["fusion_set_losses"]}
        assert set(losses) == {"uniform", "samples"}
        assert auto.details["weighting_chosen"] == expected == auto.details["weighting"]
        assert losses[expected] < losses[{"uniform": "samples", "samples": "uniform"}[expected]]
        # the choice is the fusion with that weighting, exactly
        explicit = method(weighted_average=expected == "samples").fuse(models, inputs)
        assert auto.details["weights"] == explicit.details["weights"]
        for key, value in explicit.model.state_dict().items():
            assert torch.equal(auto.model.state_dict()[key], value), key
        loss = torch.nn.functional.cross_entropy(explicit.model(x), y).item()
        assert losses[expected] == pytest.approx(loss, rel=1e-5)


@pytest.mark.parametrize("method", [OTFusion, GitReBasin])
def test_auto_weighting_falls_back_to_what_the_inputs_allow(method):
    models, x, y = skewed_sites()
    counts = [10, 1, 10]
    cases = [  # (inputs, the one weighting fused with)
        (FusionInputs(data=x, sample_counts=counts), "samples"),  # no labels
        (FusionInputs(data=x, labels=y), "uniform"),  # no sample counts
        (FusionInputs(data=x, labels=y, sample_counts=[5, 5, 5]), "uniform"),  # the same two
    ]
    for inputs, weighting in cases:
        result = method().fuse(models, inputs)
        assert result.details["weighting"] == weighting
        assert "weighting_chosen" not in result.details
        assert "sample_counts" not in method().requirements()
    with pytest.raises(ValueError, match="weighted_average"):
        method(weighted_average="samples")


def test_otfusion_reference_rules():
    model = build_model(MLP, seed=0).eval()
    x = data_for(MLP)
    models = [permuted_copy(model, 1), permuted_copy(model, 2), model]
    # largest: the model with the most samples is the reference (its parameters come back)
    for counts, largest in (([1, 2, 3], 2), ([5, 9, 1], 1)):
        inputs = FusionInputs(data=x, sample_counts=counts)
        result = OTFusion(reference="largest", weighted_average=False).fuse(models, inputs)
        assert result.details["reference"] == largest
        assert same_params(result.model, params(models[largest]), atol=1e-5)
    assert "sample_counts" in OTFusion(reference="largest").requirements()
    with pytest.raises(ValueError, match="sample_counts"):
        OTFusion(reference="largest").fuse(models, FusionInputs(data=x))
    # auto: every model as the reference, the highest fusion-set accuracy kept
    others = [build_model(MLP, seed=s) for s in range(3)]
    y = torch.randint(0, MLP.num_classes, (len(x),), generator=torch.Generator().manual_seed(0))
    inputs = FusionInputs(data=x, labels=y)
    auto = OTFusion(reference="auto", ground_metric="activations").fuse(others, inputs)
    losses = {c["reference"]: c["loss"] for c in auto.details["fusion_set_losses"]}
    chosen = auto.details["reference_chosen"]
    kept = _kept(OTFusion, "reference", [0, 1, 2], others, inputs, ground_metric="activations")
    assert set(losses) == {0, 1, 2} and chosen == kept
    explicit = OTFusion(reference=chosen, ground_metric="activations").fuse(others, inputs)
    for key, value in explicit.model.state_dict().items():
        assert torch.equal(auto.model.state_dict()[key], value), key
    # without labels: the largest model, or model 0 without sample counts
    unlabelled = FusionInputs(data=x, sample_counts=[1, 3, 2])
    assert OTFusion(reference="auto").fuse(others, unlabelled).details["reference"] == 1
    assert OTFusion(reference="auto").fuse(others, FusionInputs(data=x)).details["reference"] == 0
    for bad in ("first", True, 1.0):
        with pytest.raises(ValueError, match="reference"):
            OTFusion(reference=bad)


def test_git_rebasin_score_weighted_average():
    a, b = build_model(MLP, seed=0), build_model(MLP, seed=1)
    x = data_for(MLP)
    scores = [random_scores(a, 0), random_scores(b, 1)]
    plain = GitReBasin().fuse([a, b], FusionInputs(data=x))
    weighted = GitReBasin(use_scores=True).fuse([a, b], FusionInputs(data=x, scores=scores))
    permuted = copy.deepcopy(b)
    levels = a.neuron_levels
    for level, info in zip(levels[:-1], plain.details["levels"], strict=True):
        assert info["permutation"] == weighted.details["levels"][levels.index(level)]["permutation"]
        permute_level(permuted, level, torch.tensor(info["permutation"]))
    # uniform: the plain average of A and permuted B
    expected = average_state_dicts([a, permuted])
    assert all(
        torch.allclose(v, expected[k], atol=1e-6) for k, v in plain.model.state_dict().items()
    )
    # scores: each neuron's row and bias weighted by the matched neurons' normalised scores
    views = [affine_levels(m) for m in (a, permuted, weighted.model)]
    for position, level in enumerate(levels):
        wa, wb, wf = (v[level].weights() for v in views)
        if position == len(levels) - 1:
            lam = torch.full((wa.shape[1],), 0.5)
        else:
            perm = torch.tensor(plain.details["levels"][position]["permutation"])
            sa = scores[0][level] / scores[0][level].sum()
            sb = (scores[1][level] / scores[1][level].sum())[perm]
            lam = sa / (sa + sb)
        assert torch.allclose(wf, lam * wa + (1 - lam) * wb, atol=1e-6)


def test_neuron_costs_of_conv_outputs_in_chunks():
    a, b = torch.randn(10, 5, 3, 3) + 3, torch.randn(10, 6, 3, 3)
    rows_a, rows_b = output_rows(a), output_rows(b)
    full = torch.corrcoef(torch.cat([rows_a, rows_b], 1).T)[:5, 5:]
    assert torch.allclose(correlation(a, b, batch_size=3).float(), full, atol=1e-5)
    distances = torch.cdist(rows_a.T.double(), rows_b.T.double()) ** 2 / len(rows_a)
    assert torch.allclose(squared_distances(a, b, batch_size=4), distances, atol=1e-9)


@pytest.mark.parametrize("spec", [MLP, VGG], ids=["mlp", "vgg"])
def test_repair_matches_the_target_statistics(spec):
    a, b = build_model(spec, seed=0), build_model(spec, seed=1)
    x = data_for(spec, n=24 if spec is MLP else 8)
    fused = build_model(spec)
    fused.load_state_dict(average_state_dicts([a, b]))
    hidden = a.neuron_levels[:-1]
    target = target_statistics(
        [neuron_statistics(a, x, hidden), neuron_statistics(b, x, hidden)], [0.25, 0.75]
    )
    before = neuron_statistics(fused, x)
    assert not torch.allclose(before[hidden[-1]][1], target[hidden[-1]][1], rtol=1e-2)
    repair(fused, [a, b], x, alpha=[1, 3])
    after = neuron_statistics(fused, x)
    for level in hidden:
        assert torch.allclose(after[level][0], target[level][0], rtol=1e-3, atol=1e-4)
        assert torch.allclose(after[level][1], target[level][1], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("spec", [MLP, VGG], ids=["mlp", "vgg"])
def test_repair_of_a_model_fused_with_itself_is_a_no_op(spec):
    model = build_model(spec, seed=0)
    x = data_for(spec, n=32 if spec is MLP else 8)
    state = params(model)
    repair(model, [copy.deepcopy(model), copy.deepcopy(model)], x)
    assert same_params(model, state, atol=1e-5)
    if spec is VGG:
        return
    for method in (OTFusion(repair=True), GitReBasin(repair=True)):
        fused = method.fuse([model, permuted_copy(model)], FusionInputs(data=x)).model
        assert same_params(fused, state, atol=1e-4)


def test_methods_repair_to_their_aligned_models_statistics():
    a, b = build_model(MLP, seed=0), build_model(MLP, seed=1)
    x = data_for(MLP)
    result = GitReBasin(repair=True).fuse([a, b], FusionInputs(data=x))
    permuted = copy.deepcopy(b)
    hidden = a.neuron_levels[:-1]
    for level, info in zip(hidden, result.details["levels"], strict=True):
        permute_level(permuted, level, torch.tensor(info["permutation"]))
    target = target_statistics([neuron_statistics(a, x), neuron_statistics(permuted, x)])
    after = neuron_statistics(result.model, x)
    for level in hidden:
        assert torch.allclose(after[level][1], target[level][1], rtol=1e-3, atol=1e-4)
    assert "repair_seconds" in result.details


@pytest.mark.parametrize("method", ["otfusion", "git-rebasin"])
def test_classifier_outputs_are_never_permuted(method):
    a = build_model(MLP, seed=0).eval()
    b = copy.deepcopy(a)
    head = affine_levels(b)[a.neuron_levels[-1]]
    swap = torch.tensor([1, 0, 3, 2])  # classes swapped: a different function
    head.set_weights(head.weights()[:, swap])
    x = data_for(MLP)
    fused = make_fusion_method(method).fuse([a, b], FusionInputs(data=x)).model
    expected = average_state_dicts([a, b])
    assert all(torch.allclose(v, expected[k], atol=1e-6) for k, v in fused.state_dict().items())
    assert torch.allclose(fused(x), (a(x) + a(x)[:, swap]) / 2, atol=1e-5)


def test_git_rebasin_weight_matching_undoes_permutations_and_is_chosen_with_labels():
    model = build_model(MLP, seed=0).eval()
    x = data_for(MLP)
    copies = [model, permuted_copy(model, seed=1), permuted_copy(model, seed=2)]
    fused = GitReBasin(matching="weights").fuse(copies, FusionInputs(data=x))
    assert same_params(fused.model, params(model), atol=1e-5)
    assert GitReBasin(matching="weights").needs() == {"data", "labels", "sample_counts"}
    # auto: both matchings, the activations preferred (the unlabelled choice)
    y = model(x).argmax(1)
    auto = GitReBasin().fuse(copies, FusionInputs(data=x, labels=y))
    scores = auto.details["fusion_set_losses"]
    assert [c["matching"] for c in scores] == ["activations", "weights"]
    assert auto.details["matching_chosen"] == "activations"  # both exact: no evidence
    assert "matching_chosen" not in GitReBasin().fuse(copies, FusionInputs(data=x)).details
    with pytest.raises(ValueError, match="matching"):
        GitReBasin(matching="neurons")
