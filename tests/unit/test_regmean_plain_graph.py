"""RegMean on a user's own CNN with BatchNorm and a residual add (issue 49), as FusionBench does
it: every Linear and Conv2d merged by the Gram of its own inputs (unfolded patches for a
convolution), every other parameter and buffer averaged by the sites' sample counts, and the
result back in the user's class."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedfuse.federation import site_fusion_inputs
from fedfuse.fusion import FusionInputs, make_fusion_method

SHAPE = (2, 6, 6)
MERGED = ("conv1", "conv2", "fc")  # the Linear/Conv2d modules RegMean solves for


class ResidualNet(nn.Module):
    """A user's CNN: BatchNorm after each convolution, one residual add, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(4)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        x = self.bn1(self.conv1(x)).relu()
        x = (x + self.bn2(self.conv2(x))).relu()
        return self.fc(self.pool(x).flatten(1))


def _site(seed: int, samples: int) -> tuple[ResidualNet, tuple[torch.Tensor, torch.Tensor]]:
    """A model trained a few steps on its own random data (BatchNorm statistics included)."""
    torch.manual_seed(seed)
    model = ResidualNet()
    x, y = torch.randn(samples, *SHAPE), torch.randint(0, 3, (samples,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.eval(), (x, y)


@pytest.fixture(scope="module")
def sites():
    return [_site(0, 12), _site(1, 30)]


def _regmean(models, inputs, **options):
    result = make_fusion_method("regmean", **options).fuse(list(models), inputs)
    return result.model


def test_fedfuse_methods_says_regmean_takes_a_residual_norm_model():
    from fedfuse.cli.methods import PLAIN_RESIDUAL, architectures, describe

    specs = {PLAIN_RESIDUAL: architectures()[PLAIN_RESIDUAL]}
    assert describe(make_fusion_method("regmean"), specs)["accepts"][PLAIN_RESIDUAL] == "yes"


@torch.no_grad()
def test_regmean_of_a_model_with_itself_is_the_model(sites):
    model, data = sites[0]
    inputs = site_fusion_inputs([model, model], [data, data], "regmean")
    fused = _regmean([model, model], inputs, alpha=1.0)
    assert type(fused) is ResidualNet
    for key, value in model.state_dict().items():
        torch.testing.assert_close(fused.state_dict()[key], value, atol=1e-5, rtol=1e-4)
    x = data[0]
    torch.testing.assert_close(fused(x), model(x), atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_a_dominant_gram_gives_its_sites_linear_and_conv_weights(sites):
    models = [m for m, _ in sites]
    inputs = site_fusion_inputs(models, [d for _, d in sites], "regmean")
    assert inputs.grams is not None and inputs.sample_counts == [12, 30]
    loud = {level: gram * 1e6 for level, gram in inputs.grams[1].items()}
    dominated = FusionInputs(grams=[inputs.grams[0], loud], sample_counts=inputs.sample_counts)
    fused = _regmean(models, dominated, alpha=1.0)
    for name in MERGED:
        mine, theirs = fused.get_submodule(name), models[1].get_submodule(name)
        torch.testing.assert_close(mine.weight, theirs.weight, atol=1e-4, rtol=1e-3)
        if theirs.bias is not None:
            torch.testing.assert_close(mine.bias, theirs.bias, atol=1e-4, rtol=1e-3)
        # and not the average: the sites differ
        assert not torch.allclose(models[0].get_submodule(name).weight, theirs.weight)


@torch.no_grad()
def test_every_other_parameter_and_buffer_is_the_sample_weighted_average(sites):
    models = [m for m, _ in sites]
    inputs = site_fusion_inputs(models, [d for _, d in sites], "regmean")
    fused = _regmean(models, inputs)
    states = [m.state_dict() for m in models]
    others = [k for k in states[0] if k.split(".")[0] not in MERGED]
    assert {k.split(".")[0] for k in others} == {"bn1", "bn2"}
    for key in others:
        if not states[0][key].is_floating_point():
            continue  # BatchNorm's batch counter
        expected = (12 * states[0][key] + 30 * states[1][key]) / 42
        torch.testing.assert_close(fused.state_dict()[key], expected, atol=1e-6, rtol=1e-5)
    # without sample counts: the plain average
    plain = _regmean(models, FusionInputs(grams=inputs.grams))
    expected = (states[0]["bn1.running_var"] + states[1]["bn1.running_var"]) / 2
    torch.testing.assert_close(plain.state_dict()["bn1.running_var"], expected)


@torch.no_grad()
def test_the_fused_model_loads_strictly_into_a_fresh_instance(sites):
    models = [m for m, _ in sites]
    inputs = site_fusion_inputs(models, [d for _, d in sites], "regmean")
    fused = _regmean(models, inputs)
    fresh = ResidualNet()
    fresh.load_state_dict(fused.state_dict(), strict=True)
    x = sites[0][1][0]
    torch.testing.assert_close(fresh.eval()(x), fused.eval()(x))
    assert torch.isfinite(fresh(x)).all()


def test_a_sites_grams_pass_the_servers_validation_without_the_batchnorm_level(sites):
    from fedfuse.io.validation import validate_grams
    from fedfuse.models import ModelAdapter
    from fedfuse.models.affine import gram_levels

    model, data = sites[0]
    leveled = ModelAdapter(ResidualNet, SHAPE).adapt(model)
    grams = site_fusion_inputs([model, model], [data, data], "regmean").grams[0]
    assert sorted(grams) == gram_levels(leveled) != leveled.neuron_levels  # bn1: no Gram
    assert sorted(validate_grams(leveled, grams, source="site 0")) == gram_levels(leveled)
