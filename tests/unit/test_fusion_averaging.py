import pytest
import torch

from fedfuse.fusion import (
    FUSION_METHODS,
    FusionInputs,
    average_state_dicts,
    make_fusion_method,
)
from fedfuse.models import build_model, mlp_spec


@pytest.fixture
def models():
    spec = mlp_spec((1, 4, 4), 3, (8, 6))
    return [build_model(spec, seed=s) for s in range(3)]


def test_vanilla_is_the_coordinatewise_mean(models):
    result = make_fusion_method("vanilla").fuse(models)
    for name, fused in result.model.state_dict().items():
        expected = torch.stack([m.state_dict()[name] for m in models]).mean(0)
        assert torch.allclose(fused, expected, atol=1e-6), name
    assert result.seconds >= 0


def test_fedavg_weights_by_sample_counts(models):
    counts = [100, 300, 0]
    result = make_fusion_method("fedavg").fuse(models, FusionInputs(sample_counts=counts))
    name = "levels.2.weight"
    expected = 0.25 * models[0].state_dict()[name] + 0.75 * models[1].state_dict()[name]
    assert torch.allclose(result.model.state_dict()[name], expected, atol=1e-6)
    assert result.details["weights"] == [0.25, 0.75, 0.0]


@pytest.mark.parametrize("name", ["vanilla", "fedavg"])
def test_fusing_identical_models_returns_that_model(models, name):
    copies = [models[0]] * 3
    fused = make_fusion_method(name).fuse(copies, FusionInputs(sample_counts=[1, 2, 3])).model
    x = torch.randn(5, 1, 4, 4)
    assert torch.allclose(fused(x), models[0](x), atol=1e-6)


def test_inputs_are_not_modified(models):
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in models]
    make_fusion_method("vanilla").fuse(models)
    for model, state in zip(models, before, strict=True):
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def test_bad_calls_are_named(models):
    with pytest.raises(ValueError, match="at least 2 models"):
        make_fusion_method("vanilla").fuse(models[:1])
    with pytest.raises(ValueError, match="needs FusionInputs.sample_counts"):
        make_fusion_method("fedavg").fuse(models)
    with pytest.raises(ValueError, match="2 entries for 3 models"):
        make_fusion_method("fedavg").fuse(models, FusionInputs(sample_counts=[1, 2]))
    other = build_model(mlp_spec((1, 4, 4), 3, (8, 7)))
    with pytest.raises(ValueError, match="model 1 has spec"):
        make_fusion_method("vanilla").fuse([models[0], other])
    with pytest.raises(ValueError, match="own architecture"):
        make_fusion_method("vanilla").fuse(models, target=other.spec)
    with pytest.raises(TypeError, match="LeveledModel"):
        make_fusion_method("vanilla").fuse([models[0], torch.nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="unknown fusion method 'kf'; known"):
        make_fusion_method("kf")
    with pytest.raises(ValueError, match=r"no option\(s\) \['alpha'\]"):
        make_fusion_method("vanilla", alpha=1)
    with pytest.raises(ValueError, match="non-negative"):
        average_state_dicts(models, [1, -1, 1])
    assert {"vanilla", "fedavg"} <= set(FUSION_METHODS)


def test_several_methods_share_and_route_options():
    from fedfuse.fusion import make_fusion_methods

    kf, ot = make_fusion_methods(
        "kf-linear, otfusion", "seed=3 kf-linear.ridge=0.2 otfusion.reg=0.5"
    )
    assert (kf.name, ot.name) == ("kf-linear", "otfusion")
    assert kf.options()["seed"] == 3 and kf.options()["ridge"] == 0.2
    assert ot.options()["reg"] == 0.5 and "seed" not in ot.options()
    with pytest.raises(ValueError, match="accepted by none"):
        make_fusion_methods("vanilla,fedavg", "ridge=0.1")
    with pytest.raises(ValueError, match="names 'otfusion', which is not in"):
        make_fusion_methods("kf-linear", "otfusion.reg=0.1")
    with pytest.raises(ValueError, match="must be int"):
        make_fusion_methods("kf-linear", "n_init=many")
