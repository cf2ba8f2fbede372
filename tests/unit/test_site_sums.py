"""Sum-only statistics: each site sent its reading, the fit made from sums over sites alone.
Exact properties on small synthetic MLPs (the readings, the sums, identical sites)."""

from __future__ import annotations

import copy

import pytest
import torch

from fedfuse.clients.records import pack_statistics_request, unpack_statistics_request
from fedfuse.fusion import FusionInputs, KFSites, LocalSites, StatisticsRequest, site_statistics
from fedfuse.fusion.statistics.readings import fusion_set_readings, readings_from_groups
from fedfuse.fusion.statistics.summed_terms import (
    add_terms,
    statistics_from_terms,
    statistics_terms,
)
from fedfuse.models import build_model, mlp_spec, resnet_spec
from tests.helpers import randn

SPEC = mlp_spec((1, 3, 3), 3, (7, 6))


def test_a_reading_maps_each_group_to_the_weighted_mean_of_the_models_neurons_in_it():
    points = randn(0, 5, 4).double()
    weights = torch.tensor([1.0, 3.0, 2.0, 1.0, 1.0])
    labels = torch.tensor([0, 0, 1, 1, 0])  # model 0: neurons 0-2, model 1: neurons 3-4
    readings, info = readings_from_groups(points, weights, labels, [3, 2], width=2)
    torch.testing.assert_close(readings[0], torch.tensor([[0.25, 0.75, 0], [0, 0, 1.0]]).double())
    torch.testing.assert_close(readings[1], torch.tensor([[0, 1.0], [1.0, 0]]).double())
    assert info["groups_read_by_nearest"] == 0
    assert all(torch.allclose(r.sum(1), torch.ones(2, dtype=torch.float64)) for r in readings)


def test_a_group_without_a_models_neuron_is_read_by_its_nearest_neuron():
    points = torch.tensor([[0.0, 0.0], [10.0, 10.0], [9.0, 9.0]]).double()
    labels = torch.tensor([0, 1, 0])  # model 0 (neuron 0) has nothing in group 1
    readings, info = readings_from_groups(points, torch.ones(3), labels, [1, 2], width=2)
    assert info["groups_read_by_nearest"] == 1
    torch.testing.assert_close(readings[0], torch.ones(2, 1).double())


def test_mapped_statistics_of_two_sites_add_up_to_those_of_the_pooled_data():
    model, fused = build_model(SPEC, seed=0), build_model(SPEC, seed=1)
    reading = torch.softmax(randn(3, 7, 7), 1).double()
    request = StatisticsRequest(0, fused, dtype="float64", readings={0: reading}).for_site(0)
    a, b = randn(1, 20, 1, 3, 3), randn(2, 13, 1, 3, 3)
    parts = [site_statistics(model, d, request, device="cpu") for d in (a, b)]
    pooled = site_statistics(model, torch.cat([a, b]), request, device="cpu")
    total = statistics_from_terms(
        add_terms([statistics_terms(p) for p in parts]), 0, 0, source="test"
    )
    assert total.rows == pooled.rows == 33
    for name in ("gram", "cross", "target_gram"):
        torch.testing.assert_close(
            getattr(total, name), getattr(pooled, name).double(), rtol=1e-5, atol=1e-5
        )
    exact = site_statistics(model, a, StatisticsRequest(0, fused, dtype="float64"), device="cpu")
    torch.testing.assert_close(
        parts[0].cross.double(), exact.cross.double() @ reading.T, rtol=1e-5, atol=1e-5
    )


def test_each_site_is_sent_its_own_reading_only():
    model, fused = build_model(SPEC, seed=0), build_model(SPEC, seed=1)
    readings = {0: torch.eye(7).double(), 1: torch.eye(7).flip(0).double()}
    request = StatisticsRequest(0, fused, readings=readings)
    with pytest.raises(ValueError, match="goes to one site"):
        pack_statistics_request(request, model)
    unpacked, _ = unpack_statistics_request(pack_statistics_request(request.for_site(1), model))
    assert unpacked.readings is None
    torch.testing.assert_close(unpacked.site_reading, readings[1])


def test_sites_that_all_hold_the_same_model_get_it_back_from_sums():
    model = build_model(SPEC, seed=3).eval()
    data = [randn(10 + k, 60, 1, 3, 3) for k in range(3)]
    sites = LocalSites([copy.deepcopy(model) for _ in data], data, device="cpu")
    inputs = FusionInputs(data=randn(9, 50, 1, 3, 3), sites=sites)
    fused = (
        KFSites(use_scores=False, statistics_dtype="float64", statistics="sums")
        .fuse([copy.deepcopy(model) for _ in data], inputs)
        .model
    )
    with torch.no_grad():
        for x in data:
            torch.testing.assert_close(fused(x), model(x), rtol=1e-5, atol=1e-5)


def test_sums_fit_as_the_per_site_fit_given_the_same_readings(monkeypatch):
    """With the readings found on the fusion set handed to the per-site fit, the two agree:
    the sum-only fit loses nothing but the per-site grouping."""
    import fedfuse.fusion.methods.neuron_interpolation.sites as module

    models = [build_model(SPEC, seed=s).eval() for s in (0, 1)]
    data = [randn(20, 40, 1, 3, 3), randn(21, 35, 1, 3, 3)]
    inputs = FusionInputs(data=randn(22, 30, 1, 3, 3), sites=LocalSites(models, data))
    options = dict(use_scores=False, statistics_dtype="float64", ridge=1e-3)
    sums = KFSites(statistics="sums", **options).fuse(models, inputs)
    found: dict[int, list] = {}

    def readings_of_the_fusion_set(self, statistics, scores, index, width):
        def readings_of(gram):
            points_models = [models[m] for m in statistics]
            readings, info = fusion_set_readings(
                points_models,
                index,
                inputs.data,
                [torch.ones(len(statistics[m].cross.T)) for m in statistics],
                width,
                lambda p, w, sizes, k: self._group(p, w, sizes, k, index),
            )
            found[index] = readings
            return dict(zip(statistics, readings, strict=True)), info

        return readings_of

    monkeypatch.setattr(module.SiteInterpolation, "_readings_of", readings_of_the_fusion_set)
    per_site = KFSites(**options).fuse(models, inputs)
    assert found  # the per-site fit used the fusion set's readings
    for name, value in sums.model.state_dict().items():
        torch.testing.assert_close(per_site.model.state_dict()[name], value, rtol=1e-4, atol=1e-5)


def test_sums_refuse_blocks_and_need_a_fusion_set():
    method = KFSites(statistics="sums")
    assert "data" in method.requirements()
    with pytest.raises(ValueError, match="statistics='sums' fits affine levels only"):
        method.check_architecture(build_model(resnet_spec((3, 8, 8), 3, depth=10), seed=0))
    with pytest.raises(ValueError, match="statistics must be 'per-site' or 'sums'"):
        KFSites(statistics="secure")
