"""Completing a fusion set from the models' BatchNorm statistics (fedfuse.fusion.inversion)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedfuse.fusion.inversion import (
    InvertedFusionSet,
    batchnorm_layers,
    check_invertible,
    invert_batchnorm,
    site_classes,
)
from fedfuse.settings.run import RunSettings


def _bn_net(seed: int = 0) -> nn.Sequential:
    """A small conv net whose BatchNorm holds the statistics of a shifted, narrow input
    distribution (reachable by construction, far from the noise inversion starts from)."""
    torch.manual_seed(seed)
    net = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    )
    data = 0.3 * torch.randn(64, 1, 6, 6) + 1.0
    with torch.no_grad():
        h = net[0](data)
        net[1].running_mean.copy_(h.mean((0, 2, 3)))
        net[1].running_var.copy_(h.var((0, 2, 3), unbiased=False))
    return net


def _mismatch(net: nn.Sequential, x: torch.Tensor) -> float:
    with torch.no_grad():
        h = net[0](x)
    norm = net[1]
    mean, var = h.mean((0, 2, 3)), h.var((0, 2, 3), unbiased=False)
    return float((mean - norm.running_mean).norm() + (var - norm.running_var).norm())


def test_inversion_matches_the_statistics_and_the_labels() -> None:
    net = _bn_net()
    labels = torch.tensor([0, 1, 2] * 8)
    start = torch.randn(len(labels), 1, 6, 6, generator=torch.Generator().manual_seed(5))
    kwargs = {"steps": 300, "lr": 0.05, "tv_weight": 0.0, "seed": 5, "device": "cpu"}
    x = invert_batchnorm(net, labels, (1, 6, 6), **kwargs)
    unmatched = invert_batchnorm(net, labels, (1, 6, 6), bn_weight=0.0, **kwargs)
    assert x.shape == start.shape
    # the BatchNorm term is what brings the batch statistics to the running ones
    assert _mismatch(net, x) < 0.2 * min(_mismatch(net, start), _mismatch(net, unmatched))
    with torch.no_grad():  # and the label term steers the rows towards their classes
        ce = torch.nn.functional.cross_entropy
        assert ce(net.eval()(x), labels) < ce(net(start), labels)


def test_inversion_leaves_the_model_as_found() -> None:
    net = _bn_net().train()
    net[5].weight.requires_grad_(False)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    x1 = invert_batchnorm(net, torch.tensor([0, 1]), (1, 6, 6), steps=3, seed=1, device="cpu")
    assert net.training
    assert [p.requires_grad for p in net.parameters()] == [True, True, True, True, False, True]
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    x2 = invert_batchnorm(net, torch.tensor([0, 1]), (1, 6, 6), steps=3, seed=1, device="cpu")
    assert torch.equal(x1, x2)  # deterministic for a seed


def test_models_without_batchnorm_are_named() -> None:
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(36, 3))
    assert batchnorm_layers(mlp) == []
    with pytest.raises(ValueError, match="Sequential.*no BatchNorm"):
        check_invertible(mlp, where="fusion_set.invert_samples")
    with pytest.raises(ValueError, match="steps >= 1"):
        invert_batchnorm(_bn_net(), torch.tensor([0]), (1, 6, 6), steps=0)


def test_completion_appends_each_models_rows_for_its_classes() -> None:
    models = [_bn_net(0), _bn_net(1)]
    real = torch.randn(5, 1, 6, 6)
    labels = torch.tensor([0, 0, 1, 0, 1])
    counts = torch.tensor([[10, 4, 0], [0, 0, 7]])
    inverted = InvertedFusionSet(samples=4, steps=2, device="cpu")
    inputs, targets = inverted.complete(models, real, labels, num_classes=3, class_counts=counts)
    assert inputs.shape == (5 + 2 * 4, 1, 6, 6)
    assert torch.equal(inputs[:5], real) and torch.equal(targets[:5], labels)
    assert targets[5:9].tolist() == [0, 1, 0, 1]  # site 0 holds classes 0 and 1
    assert targets[9:].tolist() == [2, 2, 2, 2]
    assert inverted.seconds is not None
    off = InvertedFusionSet(samples=0)
    assert off.complete(models, real, labels, num_classes=3)[0] is real
    assert site_classes(None, 0, 3) == [0, 1, 2]


def test_the_run_settings_refuse_inverting_a_synthetic_fusion_set() -> None:
    settings = RunSettings(fusion_invert_samples=100)
    assert settings.invert_label() == "+inv(x100)"
    assert RunSettings(fusion_invert_samples=5, fusion_invert_steps=50).invert_label() == (
        "+inv(x5,steps=50)"
    )
    assert RunSettings().invert_label() == ""
    with pytest.raises(ValueError, match="fusion-invert-samples.*synthetic"):
        RunSettings(fusion_invert_samples=10, fusion_source="synthetic")
    with pytest.raises(ValueError, match="fusion-invert-samples"):
        RunSettings.from_config({"fusion-invert-samples": -1})


def test_completed_inputs_keep_everything_but_the_fusion_set() -> None:
    from fedfuse.fusion import FusionInputs

    models = [_bn_net(0), _bn_net(1)]
    real, labels = torch.randn(3, 1, 6, 6), torch.tensor([0, 1, 0])
    inputs = FusionInputs(data=real, labels=labels, class_counts=[[5, 5, 0], [0, 0, 5]])
    completed = InvertedFusionSet(samples=2, steps=1, device="cpu").complete_inputs(models, inputs)
    assert completed.data.shape[0] == 3 + 2 * 2 and torch.equal(completed.data[:3], real)
    assert completed.labels.tolist() == [0, 1, 0, 0, 1, 2, 2]
    assert completed.class_counts == inputs.class_counts
    empty = FusionInputs(class_counts=[[1]])
    assert InvertedFusionSet(samples=2).complete_inputs(models, empty) is empty
