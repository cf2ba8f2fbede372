import pytest
import torch
from captum.attr import LayerDeepLift

from fedfuse.models import build_model, mlp_spec, vgg11_spec
from fedfuse.models.importance import (
    SCORE_METHODS,
    importance_scores,
    normalize_scores,
    uniform_scores,
)


def _inputs(n=32, shape=(1, 4, 4), seed=0):
    return torch.rand(n, *shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("method", SCORE_METHODS)
def test_scores_have_one_non_negative_entry_per_neuron(method, tiny_mlp, tiny_vgg):
    for model, shape in ((tiny_mlp, (1, 4, 4)), (tiny_vgg, (3, 32, 32))):
        scores = importance_scores(model, _inputs(6, shape), method=method, n_steps=4)
        assert sorted(scores) == model.neuron_levels
        for level, vector in scores.items():
            assert vector.shape == (model.level_width(level),)
            assert vector.dtype == torch.float32
            assert (vector >= 0).all() and torch.isfinite(vector).all()
            if method != "uniform":
                assert vector.sum() > 0


def test_deeplift_completeness_on_a_bias_free_mlp():
    model = build_model(mlp_spec((1, 4, 4), 3, (8, 6)), seed=0).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.bias.zero_()
    x = _inputs(16)
    target = torch.zeros(16, dtype=torch.long)
    for level in model.neuron_levels[:-1]:
        attribution, delta = LayerDeepLift(model, model.levels[level]).attribute(
            x, baselines=torch.zeros_like(x), target=target, return_convergence_delta=True
        )
        # the level's attributions add up to f(x) - f(baseline) for every sample
        assert delta.abs().max() < 1e-4
        scores = importance_scores(model, x, target, method="deeplift", levels=[level])
        assert torch.allclose(scores[level], attribution.abs().mean(0), atol=1e-6)


@pytest.mark.parametrize("method", ["conductance", "deeplift"])
def test_dead_and_disconnected_neurons_score_zero(method):
    model = build_model(mlp_spec((1, 4, 4), 3, (8, 6)), seed=0).eval()
    first, second = model.levels[0][1], model.levels[2]
    with torch.no_grad():
        first.weight[0].zero_()
        first.bias[0] = -1.0  # neuron 0 never fires, on any input or the baseline
        second.weight[:, 1].zero_()  # neuron 1 feeds nothing downstream
    scores = importance_scores(model, _inputs(), method=method, levels=[0], n_steps=8)[0]
    assert scores[0] < 1e-6 and scores[1] < 1e-6
    assert scores[2:].min() > 1e-4


def test_uniform_and_normalisation():
    model = build_model(mlp_spec((1, 4, 4), 3, (8,)))
    uniform = uniform_scores(model)
    assert torch.allclose(uniform[0], torch.full((8,), 1 / 8))
    raw = {0: torch.tensor([1.0, 3.0]), 2: torch.zeros(3)}
    assert torch.allclose(normalize_scores(raw, "sum")[0], torch.tensor([0.25, 0.75]))
    assert torch.allclose(normalize_scores(raw, "max")[0], torch.tensor([1 / 3, 1.0]))
    assert torch.allclose(normalize_scores(raw, "sum")[2], torch.full((3,), 1 / 3))
    with pytest.raises(ValueError, match="normalisation"):
        normalize_scores(raw, "softmax")


def test_bad_requests_are_named():
    model = build_model(mlp_spec((1, 4, 4), 3, (8,)))
    with pytest.raises(ValueError, match="unknown importance method"):
        importance_scores(model, _inputs(2), method="saliency")
    with pytest.raises(ValueError, match="no neurons"):
        importance_scores(model, _inputs(2), levels=[1])
    with pytest.raises(ValueError, match="targets"):
        importance_scores(model, _inputs(4), torch.zeros(3, dtype=torch.long))


def test_vgg_conv_scores_average_over_spatial_positions():
    model = build_model(vgg11_spec((1, 28, 28), 10, width_multiplier=1 / 16), seed=0)
    scores = importance_scores(model, _inputs(4, (1, 28, 28)), method="deeplift", levels=[0])
    assert scores[0].shape == (4,)


def test_one_pass_conductance_equals_captum_layer_conductance(tiny_mlp, tiny_vgg):
    """All levels from one set of path passes give exactly Captum's per-layer LayerConductance."""
    from captum.attr import LayerConductance

    from fedfuse.models.importance import layer_conductances

    for model, shape in ((tiny_mlp, (1, 4, 4)), (tiny_vgg, (3, 32, 32))):
        model.eval()
        x = _inputs(5, shape, seed=3) - 0.5
        targets = torch.tensor([0, 2, 1, 2, 0])
        levels = model.neuron_levels
        ours = layer_conductances(model, [model.levels[i] for i in levels], x, targets, n_steps=6)
        for level, attribution in zip(levels, ours, strict=True):
            reference = LayerConductance(model, model.levels[level]).attribute(
                x, baselines=torch.zeros_like(x), target=targets, n_steps=6
            )
            assert attribution.shape == reference.shape
            assert torch.allclose(attribution, reference, atol=1e-6, rtol=1e-5), level


def test_every_level_from_one_pass_equals_layer_deeplift_level_by_level(tiny_vgg):
    from fedfuse.models.importance import layer_deeplifts

    x = _inputs(5, (3, 32, 32))
    targets = torch.tensor([0, 1, 2, 0, 1])
    levels = tiny_vgg.eval().neuron_levels
    ours = layer_deeplifts(tiny_vgg, [tiny_vgg.levels[i] for i in levels], x, targets)
    for level, attribution in zip(levels, ours, strict=True):
        expected = LayerDeepLift(tiny_vgg, tiny_vgg.levels[level]).attribute(
            x, baselines=torch.zeros_like(x), target=targets
        )
        assert torch.allclose(attribution, expected, atol=1e-7), level


def test_deeplift_scores_a_model_that_calls_one_relu_twice():
    """torchvision's ResNet blocks call one in-place ReLU twice (Captum's DeepLIFT refuses a
    module run twice): the scores are the same as with a ReLU per call, the model unchanged."""
    from torchvision.models.resnet import BasicBlock

    from fedfuse.models import ModelAdapter

    class Net(torch.nn.Module):
        def __init__(self, distinct: bool = False) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
            self.relu = torch.nn.ReLU(inplace=True)
            self.block = BasicBlock(4, 4)
            if distinct:  # the same function, one ReLU per call, none in place
                self.block.relu = torch.nn.Identity()
                self.first, self.second = torch.nn.ReLU(), torch.nn.ReLU()
            self.distinct = distinct
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, x):
            x = self.relu(self.conv(x))
            if self.distinct:
                b = self.block
                x = self.second(x + b.bn2(b.conv2(self.first(b.bn1(b.conv1(x))))))
            else:
                x = self.block(x)
            return self.fc(x.mean((2, 3)))

    torch.manual_seed(0)
    reused, distinct = Net().eval(), Net(distinct=True).eval()
    distinct.load_state_dict(reused.state_dict(), strict=False)
    x = _inputs(8, (1, 6, 6))
    scores = importance_scores(ModelAdapter(Net, (1, 6, 6)).adapt(reused), x, method="deeplift")
    assert reused.relu.inplace and reused.block.relu.inplace  # the user's model untouched
    first = min(scores)
    targets = reused(x).argmax(1)
    expected = LayerDeepLift(distinct, distinct.conv).attribute(
        x, baselines=torch.zeros_like(x), target=targets
    )
    assert torch.allclose(scores[first], expected.abs().flatten(2).mean(2).mean(0), atol=1e-6)
