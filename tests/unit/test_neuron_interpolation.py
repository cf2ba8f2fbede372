"""Properties that pin the neuron-interpolation fusion math (HF/KF x Linear/Gradient)."""

import pytest
import torch

from fedfuse.fusion import FusionInputs, make_fusion_method
from fedfuse.models import LeveledModel, build_model, mlp_spec, vgg11_spec
from fedfuse.models.affine import affine_view
from fedfuse.models.importance import uniform_scores


def permuted_copy(model: LeveledModel, seed: int = 0) -> LeveledModel:
    """The same function with the neurons of every hidden level shuffled."""
    copy = build_model(model.spec)
    copy.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    levels = copy.neuron_levels
    with torch.no_grad():
        for current, following in zip(levels[:-1], levels[1:], strict=True):
            layer, nxt = (
                affine_view(copy.levels[current]).layer,
                affine_view(copy.levels[following]).layer,
            )
            perm = torch.randperm(layer.weight.shape[0], generator=g)
            layer.weight.copy_(layer.weight[perm])
            layer.bias.copy_(layer.bias[perm])
            inputs_per_neuron = nxt.weight.shape[1] // len(perm)  # flattened conv maps
            w = nxt.weight.view(
                nxt.weight.shape[0], len(perm), inputs_per_neuron, *nxt.weight.shape[2:]
            )
            nxt.weight.copy_(w[:, perm].reshape(nxt.weight.shape))
    return copy


def _data(n, shape, seed=0):
    return torch.randn(n, *shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def mlp():
    return build_model(mlp_spec((1, 4, 4), 3, (8, 6)), seed=0).eval()


def test_permuted_copy_really_is_the_same_function_with_other_weights(mlp):
    other = permuted_copy(mlp)
    x = _data(20, (1, 4, 4))
    assert torch.allclose(other(x), mlp(x), atol=1e-5)
    assert not torch.allclose(other.levels[0][1].weight, mlp.levels[0][1].weight)


@pytest.mark.parametrize("method", ["hf-linear", "kf-linear"])
def test_fusing_a_model_with_its_permuted_copy_reproduces_it(mlp, method):
    other = permuted_copy(mlp, seed=1)
    inputs = FusionInputs(data=_data(200, (1, 4, 4)))
    fused = make_fusion_method(method).fuse([mlp, other], inputs).model
    test = _data(50, (1, 4, 4), seed=9)
    assert torch.allclose(fused(test), mlp(test), atol=1e-4)
    # the vanilla average of the same pair does not
    averaged = make_fusion_method("vanilla").fuse([mlp, other]).model
    assert not torch.allclose(averaged(test), mlp(test), atol=1e-2)


@pytest.mark.usefixtures("one_thread")  # GCV's ridge here moves with the reduction order
def test_permuted_vgg_is_reproduced_by_kf_linear_through_convolutions():
    model = build_model(vgg11_spec((1, 28, 28), 10, width_multiplier=1 / 16), seed=0).eval()
    other = permuted_copy(model, seed=2)
    inputs = FusionInputs(data=_data(300, (1, 28, 28)))
    fused = make_fusion_method("kf-linear", device="cpu").fuse([model, other], inputs).model
    test = _data(16, (1, 28, 28), seed=5)
    assert torch.allclose(fused(test), model(test), atol=1e-3)


@pytest.mark.parametrize(("method", "copies"), [("kf-linear", 3), ("hf-linear", 2)])
def test_fusing_identical_models_returns_that_model(mlp, method, copies):
    fused = make_fusion_method(method).fuse(
        [mlp] * copies, FusionInputs(data=_data(100, (1, 4, 4)))
    )
    test = _data(30, (1, 4, 4), seed=3)
    assert torch.allclose(fused.model(test), mlp(test), atol=1e-4)


@pytest.mark.parametrize("widths", [(5, 4), (12, 9)], ids=["narrower", "wider"])
def test_kf_fuses_into_other_widths(mlp, widths):
    other = build_model(mlp.spec, seed=1)
    target = mlp.spec.with_widths(widths)
    result = make_fusion_method("kf-linear").fuse(
        [mlp, other], FusionInputs(data=_data(100, (1, 4, 4))), target=target
    )
    assert result.model.spec == target
    assert [result.model.level_width(i) for i in result.model.neuron_levels] == [*widths, 3]
    assert torch.isfinite(result.model(_data(5, (1, 4, 4)))).all()
    assert len(result.details["levels"]) == 3


def test_hungarian_refuses_what_it_cannot_match(mlp):
    inputs = FusionInputs(data=_data(50, (1, 4, 4)))
    with pytest.raises(ValueError, match="one-to-one"):
        make_fusion_method("hf-linear").fuse(
            [mlp, mlp], inputs, target=mlp.spec.with_widths([4, 4])
        )


def test_scores_are_validated_and_optional(mlp):
    other = build_model(mlp.spec, seed=1)
    data = _data(60, (1, 4, 4))
    bad = uniform_scores(mlp)
    bad[2] = torch.ones(5)
    with pytest.raises(ValueError, match="scores of model 1: scores of level 2 have shape"):
        make_fusion_method("kf-linear").fuse(
            [mlp, other], FusionInputs(data=data, scores=[uniform_scores(mlp), bad])
        )
    # no scores: computed on the fusion set (uniform by default, or another method)
    for fallback in ("uniform", "deeplift"):
        method = make_fusion_method("kf-linear", fallback_scores=fallback)
        assert torch.isfinite(method.fuse([mlp, other], FusionInputs(data=data)).model(data)).all()
    with pytest.raises(ValueError, match="needs FusionInputs.data"):
        make_fusion_method("kf-linear").fuse([mlp, other])


def test_dominant_importance_makes_the_fused_neuron_copy_that_neuron(mlp):
    other = build_model(mlp.spec, seed=1)
    data = _data(200, (1, 4, 4))
    scores = [uniform_scores(mlp), uniform_scores(other)]
    scores[1][0] = torch.ones(8)
    scores[1][0][3] = 1e9  # model 1's neuron 3 of level 0 dominates its cluster
    fused = make_fusion_method("kf-linear").fuse(
        [mlp, other], FusionInputs(data=data, scores=scores)
    )
    with torch.no_grad():
        target = other.levels[0](data)[:, 3]
        outputs = fused.model.levels[0](data)
    errors = (outputs - target[:, None]).pow(2).mean(0)
    assert errors.min() < 1e-6


def test_gradient_variants_fit_their_targets(mlp):
    other = permuted_copy(mlp, seed=4)
    data = _data(200, (1, 4, 4))
    test = _data(40, (1, 4, 4), seed=8)
    fresh = build_model(mlp.spec, seed=5)
    fresh_error = (fresh(test) - mlp(test)).pow(2).mean()
    for method in ("kf-gradient", "hf-gradient"):
        result = make_fusion_method(
            method, epochs=60, last_epochs=60, lr=1e-2, last_lr=1e-2, device="cpu"
        ).fuse([mlp, other], FusionInputs(data=data))
        error = (result.model(test) - mlp(test)).pow(2).mean()
        assert error < 0.05 * fresh_error
        assert all(level["epochs_run"] >= 1 for level in result.details["levels"])


def test_gradient_setting2_starts_from_model_0(mlp):
    other = build_model(mlp.spec, seed=1)
    method = make_fusion_method("kf-gradient", preset="setting2", epochs=0, last_epochs=0)
    # no training at all: the levels are (1 - 0.1) * model 0 + 0.1 * fresh
    fused = method.fuse([mlp, other], FusionInputs(data=_data(40, (1, 4, 4)))).model
    fresh = build_model(mlp.spec, seed=0)
    expected = 0.9 * mlp.levels[2].weight + 0.1 * fresh.levels[2].weight
    assert torch.allclose(fused.levels[2].weight, expected, atol=1e-6)


def test_variants_reject_options_that_do_not_apply():
    with pytest.raises(ValueError, match=r"no option\(s\) \['epochs'\]"):
        make_fusion_method("kf-linear", epochs=3)
    with pytest.raises(ValueError, match=r"no option\(s\) \['ridge'\]"):
        make_fusion_method("kf-gradient", ridge=0.1)
    with pytest.raises(ValueError, match=r"no option\(s\) \['n_init'\]"):
        make_fusion_method("hf-linear", n_init=3)
    assert make_fusion_method("kf-linear", n_init=2).options()["n_init"] == 2


@pytest.mark.parametrize("method", ["kf-linear", "hf-gradient"])
def test_reported_level_costs_follow_theorems_1_and_2(mlp, method):
    other = build_model(mlp.spec, seed=1)
    options = {"epochs": 5, "last_epochs": 5} if "gradient" in method else {"ridge": 0.0}
    result = make_fusion_method(method, **options).fuse(
        [mlp, other], FusionInputs(data=_data(200, (1, 4, 4)))
    )
    for level in result.details["levels"]:
        # Theorem 1: the representation cost splits into approximation + grouping error
        assert level["representation_cost"] == pytest.approx(
            level["approximation_error"] + level["grouping_error"], rel=1e-9
        )
        if method == "kf-linear":
            # Theorem 2's proof: the exact linear fit leaves the projected grouping error plus
            # the part of the base outputs no weights can reach
            assert level["representation_cost"] == pytest.approx(
                level["projected_grouping_error"] + level["unreachable_error"], rel=1e-6
            )


def _skewed_sites(count: int = 3):
    """``count`` small MLPs, each trained briefly on its own two classes of a 6-class task,
    and a labelled fusion set over all classes with each site's class counts."""
    spec = mlp_spec((1, 4, 4), 6, (8, 6))
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(6, 16, generator=g) * 2
    labels = torch.arange(6).repeat(20)
    data = (centres[labels] + torch.randn(len(labels), 16, generator=g)).view(-1, 1, 4, 4)
    models, counts = [], []
    for site in range(count):
        mine = [(2 * site) % 6, (2 * site + 1) % 6]
        rows = (labels == mine[0]) | (labels == mine[1])
        model = build_model(spec, seed=site)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
        for _ in range(60):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(data[rows]), labels[rows]).backward()
            optimizer.step()
        models.append(model.eval())
        counts.append([int(((labels == c) & rows).sum()) for c in range(6)])
    return models, FusionInputs(data=data, labels=labels, class_counts=counts)


@pytest.mark.parametrize("name", ["kf-linear", "hf-linear"])
def test_auto_head_keeps_the_target_of_lower_fusion_set_loss(name):
    models, inputs = _skewed_sites()
    auto = make_fusion_method(name, use_scores=False, device="cpu").fuse(models, inputs)
    head = auto.details["levels"][-1]
    losses = head["head_fusion_set_losses"]
    assert set(losses) == {"uniform", "classes"}
    assert head["head"] == min(losses, key=losses.get)
    x = inputs.data
    for target, flag in (("uniform", False), ("classes", True)):  # each loss is the real one
        explicit = make_fusion_method(name, use_scores=False, head_weights=flag, device="cpu")
        model = explicit.fuse(models, inputs).model
        with torch.no_grad():
            loss = torch.nn.functional.cross_entropy(model(x), inputs.labels).item()
            if target == head["head"]:
                assert torch.equal(auto.model(x), model(x))
        assert loss == pytest.approx(losses[target], rel=1e-5)


def test_auto_head_falls_back_to_what_the_inputs_allow():
    models, inputs = _skewed_sites()
    fuse = make_fusion_method("kf-linear", use_scores=False, device="cpu").fuse
    no_labels = FusionInputs(data=inputs.data, class_counts=inputs.class_counts)
    assert fuse(models, no_labels).details["levels"][-1]["head"] == "classes"
    no_counts = FusionInputs(data=inputs.data, labels=inputs.labels)
    assert fuse(models, no_counts).details["levels"][-1]["head"] == "uniform"
    equal = FusionInputs(data=inputs.data, labels=inputs.labels, class_counts=[[5] * 6] * 3)
    assert fuse(models, equal).details["levels"][-1]["head"] == "classes"  # one target
    with pytest.raises(ValueError, match="head_weights"):
        make_fusion_method("kf-linear", head_weights="yes")
