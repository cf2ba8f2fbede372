"""DENSE: the generator, its BatchNorm-statistics loss, the synthetic fusion set and the
data-free fusion, on real digits sites that each know half of the classes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedfuse.data import load_dataset
from fedfuse.fusion import FusionInputs, make_fusion_method
from fedfuse.fusion.methods.trained.dense import (
    Generator,
    _BatchNormStatistics,
    synthesize_fusion_set,
)
from fedfuse.models import build_model, make_spec
from fedfuse.training.loop import TrainConfig, train

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def sites():
    """Two digits MLPs from one initialisation, one trained on classes 0-4, one on 5-9."""
    data = load_dataset("digits", "train")
    spec = make_spec("mlp", data.input_shape, 10, widths=(48, 48))
    models = []
    for half in (0, 1):
        index = [i for i in range(len(data)) if (int(data.labels[i]) >= 5) == bool(half)]
        model = build_model(spec, seed=0)
        train(model, data.subset(index), TrainConfig(epochs=15, lr=3e-3), seed=half, device="cpu")
        models.append(model.eval())
    return models, load_dataset("digits", "test")


def _accuracy(model, test) -> float:
    with torch.no_grad():
        return float((model.eval()(test.inputs()).argmax(1) == test.labels).float().mean())


@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32), (1, 8, 8), (1, 6, 6), (5,)])
def test_the_generator_makes_inputs_of_the_models_shape_at_the_scale_of_normalised_data(shape):
    generator = Generator(shape, classes=10, latent=16)
    x = generator(torch.randn(32, 16), torch.arange(32) % 10)
    assert x.shape == (32, *shape)
    x = x.detach()
    assert abs(float(x.mean())) < 1e-4 and abs(float(x.std()) - 1) < 0.05
    assert generator.convolutional == (len(shape) == 3 and shape[1] % 4 == 0)


def test_batchnorm_loss_is_zero_on_the_statistics_a_layer_was_trained_on():
    layer = nn.BatchNorm2d(3)
    x = torch.randn(64, 3, 5, 5) * 2 + 1
    layer.running_mean = x.mean((0, 2, 3))
    layer.running_var = x.var((0, 2, 3), unbiased=False)
    layer.eval()
    statistics = _BatchNormStatistics([nn.Sequential(layer)])
    layer(x)
    assert float(statistics.take()) < 1e-5
    layer(torch.randn(64, 3, 5, 5))
    assert float(statistics.take()) > 1.0
    statistics.remove()


def test_a_synthetic_fusion_set_is_what_the_ensemble_calls_confidently(sites):
    models, _ = sites
    untrained, _ = synthesize_fusion_set(models, 200, epochs=0, batch_size=64, device="cpu")
    inputs, labels = synthesize_fusion_set(models, 200, epochs=100, batch_size=64, device="cpu")
    assert inputs.shape == (200, *models[0].spec.input_shape)
    assert bool(torch.isfinite(inputs).all())
    with torch.no_grad():
        teacher = torch.stack([m(inputs) for m in models]).mean(0).softmax(1)
        before = torch.stack([m(untrained) for m in models]).mean(0).softmax(1)
    assert torch.equal(teacher.argmax(1), labels)
    confidence, at_start = float(teacher.max(1).values.mean()), float(before.max(1).values.mean())
    assert confidence > 0.55 and confidence > at_start + 0.2, (confidence, at_start)
    assert len(labels.unique()) >= 8  # every class drawn, not one mode


def test_dense_distills_both_sites_without_any_data_and_is_deterministic(sites):
    models, test = sites
    options = {"epochs": 30, "batch_size": 64, "device": "cpu"}
    fused = make_fusion_method("dense", **options).fuse(models, FusionInputs())
    bases = [_accuracy(m, test) for m in models]
    assert max(bases) < 0.55  # each site knows half of the classes
    assert _accuracy(fused.model, test) > max(bases) + 0.1
    # the same seed, the same model (3 epochs are as good a check of that as 30)
    short = {**options, "epochs": 3}
    once, again = (make_fusion_method("dense", **short).fuse(models, FusionInputs()) for _ in "ab")
    for key, value in once.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[key], value), key
