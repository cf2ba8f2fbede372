"""LeNet-5 (with and without biases), its preset, and the logit-averaging ensemble (issue 25)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from fedfuse.fusion import make_fusion_method
from fedfuse.models import Ensemble, build_model, make_spec
from fedfuse.settings.hydra import compose, settings_from_config
from fedfuse.settings.run import RunSettings


@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32)])
def test_lenet5_has_the_classic_layout(shape):
    model = build_model(make_spec("lenet5", shape, 10), seed=0)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [c.out_channels for c in convs] == [6, 16]
    assert [c.kernel_size for c in convs] == [(5, 5), (5, 5)]
    assert convs[0].padding == ((2, 2) if shape[1] == 28 else (0, 0))
    assert [(m.in_features, m.out_features) for m in linears] == [(400, 120), (120, 84), (84, 10)]
    assert len(model.neuron_levels) == 5 and model.spec.widths == (6, 16, 120, 84)
    assert model(torch.randn(2, *shape)).shape == (2, 10)


def test_lenet5_without_biases_has_no_bias_parameters():
    spec = make_spec("lenet5", (1, 28, 28), 10, bias=False)
    model = build_model(spec)
    assert spec.options["bias"] is False
    assert [n for n, _ in model.named_parameters() if n.endswith("bias")] == []
    assert any(
        n.endswith("bias")
        for n, _ in build_model(make_spec("lenet5", (1, 28, 28), 10)).named_parameters()
    )


def test_lenet5_refuses_inputs_too_small_and_wrong_widths():
    with pytest.raises(ValueError, match="too small"):
        make_spec("lenet5", (1, 8, 8), 10)
    spec = make_spec("lenet5", (1, 28, 28), 10)
    with pytest.raises(ValueError, match="4 hidden widths"):
        build_model(dataclasses.replace(spec, widths=(6, 16)))


@pytest.mark.parametrize("method", ["kf-linear", "regmean", "fedavg", "kf-sites"])
@pytest.mark.parametrize("bias", [True, False])
def test_methods_accept_lenet5(method, bias):
    model = build_model(make_spec("lenet5", (1, 28, 28), 10, bias=bias), device="meta")
    make_fusion_method(method).check_architecture(model)


def test_run_settings_take_lenet5_and_its_options():
    settings = RunSettings(model="lenet5", model_options="bias=false")
    assert settings.architecture_options() == {"bias": False}


def test_the_preset_composes_into_the_issue_setting():
    settings = settings_from_config(compose(["experiment=fmnist-lenet-dir01-5", "method=fedavg"]))
    assert (settings.dataset, settings.model, settings.model_options) == (
        "fashion-mnist",
        "lenet5",
        "bias=false",
    )
    assert (settings.partitioner, settings.dirichlet_alpha_min) == ("dirichlet", 0.1)
    assert settings.dirichlet_min_max_ratio == 1.0  # one alpha for every site
    assert (settings.init, settings.local_epochs, settings.optimizer) == ("shared", 30, "sgd")
    assert (settings.fusion_source, settings.fusion_samples) == ("all", 500)
    config = compose(["experiment=fmnist-lenet-dir01-5"])
    assert config.sites == 5


def test_the_literature_preset_sweeps_alpha_and_sites_over_the_same_recipe():
    overrides = ["experiment=fmnist-lenet-literature", "sites=10", "partition.alpha_min=0.5"]
    config = compose([*overrides, "method=fedfisher-kfac"])
    settings = settings_from_config(config)
    assert (config.sites, settings.dirichlet_alpha_min, settings.local_epochs) == (10, 0.5, 30)
    assert (settings.model_options, settings.init, settings.fusion_samples) == (
        "bias=false",
        "shared",
        500,
    )


# ------------------------------------------------------------------------------ ensemble
class _Fixed(nn.Module):
    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits.expand(len(x), -1)


def test_logit_averaging_is_the_mean_of_the_logits():
    logits = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)) * 3
    members = [_Fixed(row) for row in logits]
    out = Ensemble(members, average="logits")(torch.zeros(2, 1))
    assert torch.allclose(out, logits.mean(0).log_softmax(-1).expand(2, -1), atol=1e-6)
    weighted = Ensemble(members, weights=[1, 2, 1], average="logits")(torch.zeros(1, 1))
    mean = (logits * torch.tensor([[0.25], [0.5], [0.25]])).sum(0)
    assert torch.allclose(weighted[0], mean.log_softmax(-1), atol=1e-6)


def test_probability_averaging_is_unchanged():
    logits = torch.randn(3, 5, generator=torch.Generator().manual_seed(1)) * 3
    members = [_Fixed(row) for row in logits]
    out = Ensemble(members)(torch.zeros(2, 1))
    assert torch.allclose(out.exp(), logits.softmax(-1).mean(0).expand(2, -1), atol=1e-6)
    with pytest.raises(ValueError, match="average must be one of"):
        Ensemble(members, average="votes")
