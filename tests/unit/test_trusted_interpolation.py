"""kf-trust / hf-trust: the fusion set's rows fitted to the models that know their labels."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from fedfuse.fusion import HFTrust, KFTrust, StatisticsRequest, site_statistics
from fedfuse.fusion.inputs import FusionInputs
from fedfuse.fusion.methods.neuron_interpolation.trusted import label_beliefs, trust_weights
from fedfuse.models import build_model, make_spec, mlp_spec
from fedfuse.models.symmetry import permute_model, random_permutations
from tests.helpers import randn

SPEC = mlp_spec((1, 3, 3), 3, (7, 6))


def test_trust_weights_are_the_experts_posterior_and_its_limits():
    probabilities = torch.tensor([[0.9, 0.2, 0.5], [0.1, 0.6, 0.5]])
    beliefs = probabilities.log()
    torch.testing.assert_close(
        trust_weights(beliefs, 1.0), probabilities / probabilities.sum(0), rtol=1e-6, atol=1e-7
    )
    torch.testing.assert_close(trust_weights(beliefs, 0.0), torch.full((2, 3), 0.5))
    squared = probabilities**2 / (probabilities**2).sum(0)
    torch.testing.assert_close(trust_weights(beliefs, 2.0), squared, rtol=1e-6, atol=1e-7)
    assert trust_weights(beliefs, math.inf).tolist() == [[1, 0, 1], [0, 1, 0]]


def test_label_beliefs_are_each_models_log_probability_of_the_label():
    models = [build_model(SPEC, seed=s).eval() for s in (0, 1)]
    data, labels = randn(0, 11, 1, 3, 3), torch.tensor([0, 1, 2] * 3 + [0, 1])
    beliefs = label_beliefs(models, data, labels, batch_size=4, device="cpu")
    with torch.no_grad():
        expected = torch.stack([m(data).log_softmax(1)[torch.arange(11), labels] for m in models])
    torch.testing.assert_close(beliefs, expected)


@pytest.mark.parametrize("level", [0, 2])
def test_a_samples_weight_counts_as_that_many_copies_of_it(level):
    """Weight 2 is the sample twice, weight 0 the sample left out: every sum and the rows."""
    model, fused = build_model(SPEC, seed=0), build_model(SPEC, seed=1)
    request = StatisticsRequest(level, fused, dtype="float64")
    data = randn(2, 9, 1, 3, 3)
    weights = torch.tensor([2.0, 0.0, 1.0, 1.0, 2.0, 0.0, 1.0, 1.0, 1.0])
    repeated = data.repeat_interleave(weights.long(), dim=0)
    weighted = site_statistics(model, data, request, device="cpu", sample_weights=weights)
    copies = site_statistics(model, repeated, request, device="cpu")
    assert weighted.rows == copies.rows == 9
    for name in ("gram", "cross", "target_gram"):
        torch.testing.assert_close(
            getattr(weighted, name), getattr(copies, name), rtol=1e-5, atol=1e-6
        )
    with pytest.raises(ValueError, match="2 sample weights for 9 samples"):
        site_statistics(model, data, request, device="cpu", sample_weights=torch.ones(2))
    with pytest.raises(ValueError, match="finite and >= 0"):
        site_statistics(model, data, request, device="cpu", sample_weights=-weights)


def _fusion_set(seed: int, rows: int = 90):
    return randn(seed, rows, 1, 3, 3), torch.arange(rows) % 3


@pytest.mark.parametrize("method", [KFTrust, HFTrust])
def test_a_model_fused_with_its_permuted_copy_keeps_its_function(method):
    model = build_model(SPEC, seed=3).eval()
    copy_ = permute_model(model, random_permutations(model, torch.Generator().manual_seed(4)))
    data, labels = _fusion_set(5)
    result = method(use_scores=False, device="cpu").fuse(
        [model, copy_], FusionInputs(data=data, labels=labels)
    )
    # on the rows it was fitted on (a ReLU dead on all of them leaves weights undetermined)
    with torch.no_grad():
        torch.testing.assert_close(result.model(data), model(data), rtol=1e-4, atol=1e-4)
    assert result.details["trust"]["rows_per_model"] == [45.0, 45.0]  # equal beliefs
    assert "rounds" not in result.details and len(result.details["fits"]) == 3


def test_with_every_row_trusted_to_one_model_the_fusion_is_that_model():
    """Routing each row to the most confident model: the model trusted on no row answers
    nothing, and the fit on the other's rows gives back the other's function."""
    trusted, ignored = build_model(SPEC, seed=7).eval(), build_model(SPEC, seed=8).eval()
    data = randn(9, 120, 1, 3, 3)
    with torch.no_grad():
        labels = trusted(data).argmax(1)  # what it believes most, so it wins every row
        assert bool(
            (
                trusted(data).softmax(1).max(1).values
                > ignored(data).softmax(1)[torch.arange(120), labels]
            ).all()
        )
    result = KFTrust(use_scores=False, trust_exponent=math.inf, device="cpu").fuse(
        [trusted, ignored], FusionInputs(data=data, labels=labels)
    )
    assert result.details["trust"]["rows_per_model"] == [120.0, 0.0]
    with torch.no_grad():
        torch.testing.assert_close(result.model(data), trusted(data), rtol=1e-4, atol=1e-4)


def test_a_fusion_set_missing_a_class_the_sites_hold_is_named(caplog):
    models = [build_model(SPEC, seed=s).eval() for s in (0, 1)]
    data = randn(1, 60, 1, 3, 3)
    labels = torch.arange(60) % 2  # shows classes 0 and 1, not 2
    with caplog.at_level(
        logging.WARNING, logger="fedfuse.fusion.methods.neuron_interpolation.trusted"
    ):
        KFTrust(use_scores=False, device="cpu").fuse(
            models,
            FusionInputs(data=data, labels=labels, class_counts=[[5, 5, 0], [0, 5, 5]]),
        )
    assert "no row of class(es) [2]" in caplog.text


def test_a_resnet_fused_with_its_permuted_copy_keeps_its_function():
    spec = make_spec("resnet", (1, 12, 12), 4, depth=10, width_multiplier=1 / 16)
    model = build_model(spec, seed=0).train()
    with torch.no_grad():
        for step in range(3):  # non-trivial BatchNorm statistics
            model(randn(step, 16, *spec.input_shape) * 2 + 0.5)
    model.eval()
    copy_ = permute_model(model, random_permutations(model, torch.Generator().manual_seed(3)))
    data, labels = randn(5, 88, *spec.input_shape), torch.arange(88) % 4
    result = KFTrust(use_scores=False, device="cpu").fuse(
        [model, copy_], FusionInputs(data=data, labels=labels)
    )
    fresh = randn(7, 32, *spec.input_shape)
    expected = model(fresh)
    # every piece fitted on 88 images' rows: rounding and the GCV ridge remain
    assert (result.model.eval()(fresh) - expected).abs().max() < 1e-2 * expected.abs().max()
