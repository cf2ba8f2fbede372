import pytest
import torch
from torch import nn

from fedfuse.models import Ensemble, ModelSpec, build_model, make_spec, mlp_spec, vgg11_spec
from fedfuse.models.capture import capture_levels, predict
from tests.helpers import assert_levels_compose


@pytest.mark.parametrize(
    "spec",
    [
        mlp_spec((1, 28, 28), 10, (32, 16)),
        vgg11_spec((1, 28, 28), 10, width_multiplier=1 / 16),
        vgg11_spec((3, 32, 32), 100, width_multiplier=1 / 16),
    ],
    ids=["mlp", "vgg-28x28x1", "vgg-32x32x3"],
)
def test_composing_all_levels_is_the_forward_pass(spec, generator):
    model = build_model(spec, seed=1).eval()
    x = torch.randn(5, *spec.input_shape, generator=generator)
    assert_levels_compose(model, x, spec.num_classes)


def test_neuron_levels_and_widths_follow_the_spec():
    model = build_model(mlp_spec((1, 4, 4), 3, (8, 6)))
    assert model.neuron_levels == [0, 2, 4]
    assert [model.level_width(i) for i in model.neuron_levels] == [8, 6, 3]
    assert not model.has_neurons(1)
    with pytest.raises(ValueError, match="no neurons"):
        model.level_width(1)


def test_vgg_widths_scale_and_pooling_adapts_to_input_size():
    small = build_model(vgg11_spec((1, 28, 28), 10, width_multiplier=0.25))
    large = build_model(vgg11_spec((3, 32, 32), 10, width_multiplier=0.25))
    assert small.spec.widths == (16, 32, 64, 64, 128, 128, 128, 128)
    pools = lambda m: sum(isinstance(level, nn.MaxPool2d) for level in m.levels)  # noqa: E731
    assert (pools(small), pools(large)) == (4, 5)
    assert [small.level_width(i) for i in small.neuron_levels][-1] == 10


def test_seeded_build_is_repeatable_and_independent_seeds_differ():
    spec = mlp_spec((1, 4, 4), 3, (8,))
    a, b, c = build_model(spec, seed=3), build_model(spec, seed=3), build_model(spec, seed=4)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.levels[0][1].weight, c.levels[0][1].weight)


def test_spec_round_trip_and_rejections():
    spec = make_spec("vgg11", (3, 32, 32), 10, width_multiplier=0.5)
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    assert spec.with_widths([1] * 8).widths == (1,) * 8
    with pytest.raises(ValueError, match="unknown fields"):
        ModelSpec.from_dict({**spec.to_dict(), "bogus": 1})
    with pytest.raises(ValueError, match="lacks"):
        ModelSpec.from_dict({"arch": "mlp"})
    with pytest.raises(ValueError, match="unknown architecture"):
        build_model(ModelSpec("densenet", (3, 32, 32), 10, (4,)))
    with pytest.raises(ValueError, match="resnet spec options"):
        build_model(ModelSpec("resnet", (3, 32, 32), 10, (4,)))
    with pytest.raises(ValueError, match="vit spec options"):
        build_model(ModelSpec("vit", (3, 32, 32), 10, (4, 4), {"patch": "x"}))
    with pytest.raises(ValueError, match="hidden widths"):
        spec.with_widths([4, 4])


def test_capture_levels_matches_forward(tiny_vgg, generator):
    x = torch.randn(7, 3, 32, 32, generator=generator)
    captured = capture_levels(tiny_vgg, x, batch_size=3)
    assert sorted(captured) == list(range(tiny_vgg.num_levels))
    for index, io in captured.items():
        assert torch.allclose(io.inputs, tiny_vgg.forward_levels(x, 0, index), atol=1e-6)
        assert torch.allclose(io.outputs, tiny_vgg.forward_levels(x, 0, index + 1), atol=1e-6)
    assert torch.allclose(predict(tiny_vgg, x, batch_size=2), tiny_vgg(x), atol=1e-6)
    with pytest.raises(ValueError, match="do not exist"):
        capture_levels(tiny_vgg, x, levels=[999])


def test_ensemble_averages_probabilities(generator):
    spec = mlp_spec((1, 4, 4), 3, (8,))
    models = [build_model(spec, seed=s).eval() for s in range(3)]
    x = torch.randn(4, 1, 4, 4, generator=generator)
    expected = torch.stack([m(x).softmax(-1) for m in models]).mean(0)
    assert torch.allclose(Ensemble(models)(x).exp(), expected, atol=1e-6)
    weighted = Ensemble(models, weights=[1, 0, 0])(x).exp()
    assert torch.allclose(weighted, models[0](x).softmax(-1), atol=1e-6)
