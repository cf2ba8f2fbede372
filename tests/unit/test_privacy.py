"""Differentially private statistics: the accountant's budget, per-sample clipping, the noise,
and kf-sites with them (exact properties on small synthetic models and real digits sites)."""

from __future__ import annotations

import math

import pytest
import torch

from fedfuse.clients.records import pack_statistics_request, unpack_statistics_request
from fedfuse.fusion import FusionInputs, LocalSites, make_fusion_method
from fedfuse.fusion.statistics.on_site import site_statistics
from fedfuse.fusion.statistics.privacy import (
    GaussianStatistics,
    calibrate_noise,
    clip_samples,
    noisy_moments,
    spent_epsilon,
)
from fedfuse.fusion.statistics.rounds import StatisticsRequest
from fedfuse.models import build_model, mlp_spec
from tests.helpers import randn


@pytest.mark.parametrize(("epsilon", "rounds"), [(1.0, 4), (4.0, 4), (8.0, 22)])
def test_the_calibrated_noise_spends_the_budget_and_no_less_noise_would(epsilon, rounds):
    sigma = calibrate_noise(epsilon, 1e-5, rounds)
    assert spent_epsilon(sigma, 1e-5, rounds) <= epsilon * 1.0001
    assert spent_epsilon(sigma * 0.97, 1e-5, rounds) > epsilon  # not needlessly noisy
    assert calibrate_noise(epsilon, 1e-5, 2 * rounds) > sigma  # more rounds, more noise


def test_no_noise_spends_an_infinite_budget_and_bad_budgets_are_named():
    assert calibrate_noise(math.inf, 1e-5, 4) == 0.0
    assert spent_epsilon(0.0, 1e-5, 4) == math.inf
    with pytest.raises(ValueError, match="epsilon must be > 0"):
        calibrate_noise(0.0, 1e-5, 4)
    with pytest.raises(ValueError, match="delta must be in"):
        calibrate_noise(1.0, 1.5, 4)
    with pytest.raises(ValueError, match="at least one round"):
        calibrate_noise(1.0, 1e-5, 0)


def test_clipping_bounds_every_sample_over_all_its_rows_and_keeps_small_ones():
    rows = (
        randn(0, 5 * 3, 4) * torch.tensor([0.1, 0.1, 10.0, 1.0, 0.05]).repeat_interleave(3)[:, None]
    )
    clipped = clip_samples(rows, samples=5, clip=2.0)
    per_sample = clipped.reshape(5, 3, 4).pow(2).sum((1, 2)).sqrt()
    assert bool((per_sample <= 2.0 + 1e-6).all())
    before = rows.reshape(5, 3, 4).pow(2).sum((1, 2)).sqrt()
    small = before <= 2.0
    assert torch.equal(clipped.reshape(5, 3, 4)[small], rows.reshape(5, 3, 4)[small])
    # a clipped sample keeps its direction
    big = int(before.argmax())
    direction = torch.nn.functional.cosine_similarity(
        clipped.reshape(5, -1)[big], rows.reshape(5, -1)[big], dim=0
    )
    assert float(direction) == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(ValueError, match="do not split into 4 samples"):
        clip_samples(rows, samples=4, clip=1.0)


def test_one_clipped_sample_moves_the_joint_moments_by_at_most_the_sensitivity():
    rows = clip_samples(randn(1, 40 * 2, 6) * 3, samples=40, clip=1.5)
    full = rows.T.double() @ rows.double()
    without = rows[2:].T.double() @ rows[2:].double()  # sample 0 (rows 0 and 1) removed
    assert float((full - without).norm()) <= 1.5**2 + 1e-9


def test_the_noise_is_symmetric_seeded_and_leaves_a_positive_semidefinite_matrix():
    x = randn(2, 30, 5).double()
    joint = x.T @ x
    mechanism = GaussianStatistics(noise_multiplier=1.0, clip=2.0, noise_seed=3)
    noisy = noisy_moments(joint, mechanism)
    assert torch.allclose(noisy, noisy.T)
    assert float(torch.linalg.eigvalsh(noisy).min()) >= -1e-9
    assert torch.equal(noisy, noisy_moments(joint, mechanism))  # seeded: reproducible
    assert not torch.equal(noisy, noisy_moments(joint, GaussianStatistics(1.0, 2.0)))
    assert torch.allclose(noisy_moments(joint, GaussianStatistics(0.0, 2.0)), joint, atol=1e-9)


def _sites():
    spec = mlp_spec((1, 4, 4), 3, (8,))
    models = [build_model(spec, seed=s) for s in range(2)]
    data = [randn(10 + s, 60, 1, 4, 4) for s in range(2)]
    return models, data


def test_site_statistics_without_noise_are_those_of_the_clipped_rows():
    models, data = _sites()
    request = StatisticsRequest(0, models[1], privacy=GaussianStatistics(0.0, clip=1e9))
    exact = site_statistics(models[0], data[0], StatisticsRequest(0, models[1]), device="cpu")
    wide = site_statistics(models[0], data[0], request, device="cpu")
    for name in ("gram", "cross", "target_gram"):
        assert torch.allclose(getattr(wide, name), getattr(exact, name), rtol=1e-5, atol=1e-4)
    tight = StatisticsRequest(0, models[1], privacy=GaussianStatistics(0.0, clip=0.5))
    clipped = site_statistics(models[0], data[0], tight, device="cpu")
    assert float(clipped.gram.diagonal().sum() + clipped.target_gram.diagonal().sum()) <= (
        60 * 0.5**2 + 1e-4
    )


def test_the_mechanism_travels_in_the_request_without_its_seed():
    models, _ = _sites()
    request = StatisticsRequest(0, models[1], privacy=GaussianStatistics(1.3, 2.5, noise_seed=9))
    unpacked, _ = unpack_statistics_request(pack_statistics_request(request, models[0]))
    assert unpacked.privacy == GaussianStatistics(1.3, 2.5, noise_seed=None)
    plain, _ = unpack_statistics_request(
        pack_statistics_request(StatisticsRequest(0, models[1]), models[0])
    )
    assert plain.privacy is None


def test_private_kf_sites_records_its_budget_and_without_noise_or_clipping_is_exact():
    models, data = _sites()
    inputs = FusionInputs(data=randn(5, 40, 1, 4, 4), sites=LocalSites(models, data))
    exact = make_fusion_method("kf-sites", use_scores=False).fuse(models, inputs)
    open_ = make_fusion_method("kf-sites", use_scores=False, dp_epsilon=math.inf, dp_clip=1e9).fuse(
        models, inputs
    )
    for name, value in exact.model.state_dict().items():
        assert torch.allclose(open_.model.state_dict()[name], value, atol=1e-4), name
    private = make_fusion_method("kf-sites", use_scores=False, dp_epsilon=4.0, dp_noise_seed=0)
    result = private.fuse(models, inputs)
    budget = result.details["privacy"]
    assert budget["rounds"] == 2 and budget["delta"] == 1e-5
    assert 3.9 <= budget["epsilon"] <= 4.0 + 1e-3
    assert len(budget["clips"]) == 2 and all(c > 0 for c in budget["clips"])
    assert "data" in private.requirements()  # the clip is chosen on the fusion set
    with pytest.raises(ValueError, match="epsilon must be > 0"):
        make_fusion_method("kf-sites", dp_epsilon=-1.0)


def test_private_statistics_refuse_residual_streams_before_any_site_trains():
    from fedfuse.models import resnet_spec

    resnet = build_model(resnet_spec((3, 8, 8), 3, depth=10), seed=0)
    with pytest.raises(ValueError, match="adds to a residual stream"):
        make_fusion_method("kf-sites", dp_epsilon=4.0).check_architecture(resnet)
    make_fusion_method("kf-sites").check_architecture(resnet)  # without DP it fuses them


def _regmean_sites():
    spec = mlp_spec((1, 3, 3), 3, (7, 6))
    models = [build_model(spec, seed=s).eval() for s in range(3)]
    data = [randn(30 + k, 50, 1, 3, 3) for k in range(3)]
    return models, data, LocalSites(models, data, device="cpu")


def test_private_regmean_without_noise_or_clipping_is_regmean_from_sums():
    models, _, sites = _regmean_sites()
    exact = make_fusion_method("regmean", grams="sums").fuse(models, FusionInputs(sites=sites))
    clip_only = make_fusion_method("regmean", grams="sums", dp_epsilon=math.inf, dp_clip=1e9).fuse(
        models, FusionInputs(sites=sites)
    )
    for name, value in exact.model.state_dict().items():
        torch.testing.assert_close(clip_only.model.state_dict()[name], value, rtol=1e-5, atol=1e-6)
    assert clip_only.details["privacy"]["epsilon"] == math.inf


def test_private_regmean_spends_its_budget_over_the_levels_with_seeded_noise():
    models, _, sites = _regmean_sites()
    inputs = FusionInputs(data=randn(9, 40, 1, 3, 3), sites=sites)

    def fused(seed):
        method = make_fusion_method("regmean", grams="sums", dp_epsilon=4.0, dp_noise_seed=seed)
        return method.fuse(models, inputs)

    first, again, other = fused(1), fused(1), fused(2)
    privacy = first.details["privacy"]
    assert privacy["rounds"] == 3 and privacy["epsilon"] <= 4.0 * 1.0001
    assert len(privacy["clips"]) == 3 and all(c > 0 for c in privacy["clips"])
    weight = "levels.0.1.weight"
    assert torch.equal(first.model.state_dict()[weight], again.model.state_dict()[weight])
    assert not torch.equal(first.model.state_dict()[weight], other.model.state_dict()[weight])


def test_private_regmean_needs_sums_and_affine_levels_and_its_mechanism_travels_without_seed():
    from fedfuse.clients.sum_records import pack_sum_request, unpack_sum_request
    from fedfuse.fusion.methods.regression.regmean_sums import GramTermsRequest
    from fedfuse.fusion.statistics.summed_terms import SummedRequest
    from fedfuse.models import resnet_spec

    with pytest.raises(ValueError, match="grams='sums'"):
        make_fusion_method("regmean", dp_epsilon=4.0)
    resnet = build_model(resnet_spec((3, 8, 8), 4, depth=10, width_multiplier=0.125))
    with pytest.raises(ValueError, match="affine levels"):
        make_fusion_method("regmean", grams="sums", dp_epsilon=4.0).check_architecture(resnet)
    model = build_model(mlp_spec((1, 3, 3), 3, (7, 6)))
    mechanism = GaussianStatistics(1.5, 2.0, noise_seed=7, design_scale=torch.rand(10) + 0.5)
    request = GramTermsRequest("auto", {0: mechanism})
    summed, _ = unpack_sum_request(pack_sum_request(SummedRequest(request), model))
    received = summed.request.privacy[0]
    assert (received.noise_multiplier, received.clip, received.noise_seed) == (1.5, 2.0, None)
    torch.testing.assert_close(received.design_scale, mechanism.design_scale.double())
