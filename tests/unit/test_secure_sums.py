"""Sums over sites in SecAgg+'s fixed point: exact properties of the units, and the fused
models of a quantised secure sum against the sum in the clear.

The secure channel here is in-process: each site's terms go through Flower's own SecAgg+
quantisation (``quantize`` / ``dequantize``, clipping and rounding as its client mod does) and
are added as integers, without the masks (Flower's tests cover the cryptography). The real
protocol runs in ``tests/flower/test_secure_aggregation.py`` and ``tests/e2e``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.common.secure_aggregation.quantization import dequantize, quantize

from fedfuse.clients.sum_records import pack_sum_request, unpack_sum_request
from fedfuse.fusion import FusionInputs, KFSites, LocalSites, StatisticsRequest
from fedfuse.fusion.methods.regression.regmean import RegMean, level_grams
from fedfuse.fusion.methods.regression.regmean_sums import GramTermsRequest
from fedfuse.fusion.methods.selection.auto import Auto
from fedfuse.fusion.statistics.fixed_point import FixedPoint, quantization_levels
from fedfuse.fusion.statistics.summed_terms import (
    NORMS_CLIP,
    SiteSums,
    SummedRequest,
    site_sum_terms,
)
from fedfuse.models import build_model, mlp_spec, resnet_spec
from fedfuse.strategies.secure_sums import check_secure_methods
from tests.helpers import randn

SPEC = mlp_spec((1, 6, 6), 4, (20, 16))
#: the stated tolerance: a fused weight of a secure sum is within this share of the largest
#: weight of its tensor from the fused weight of the sum in the clear
TOLERANCE = 1e-4


class QuantisedSites(LocalSites):
    """LocalSites whose sums pass through SecAgg+'s arithmetic: clipped and quantised per site
    in the request's units, added as integers, dequantised and decoded. ``largest`` records
    each round's largest value in fixed units."""

    secure = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        np.random.seed(0)  # SecAgg+ rounds stochastically with NumPy's global generator
        self.largest: list[tuple[bool, float]] = []

    def sum_terms(self, summed: SummedRequest) -> SiteSums:
        units = summed.units
        assert units is not None
        parts = [
            site_sum_terms(summed.for_site(i), model, data, device="cpu")
            for i, (model, data) in enumerate(zip(self.models, self.data, strict=True))
        ]
        self.largest.append(
            (summed.norms, max(float(t.abs().max()) for p in parts for t in p.values()))
        )
        count, levels = len(parts), quantization_levels(len(parts))
        total = {}
        for name in parts[0]:
            summed_ints = sum(
                quantize([p[name].numpy()], units.clip, levels)[0].astype(np.int64) for p in parts
            )
            values = dequantize([summed_ints], units.clip, levels)[0] - (count - 1) * units.clip
            total[name] = torch.from_numpy(values)
        terms = units.decode(total)
        error = {n: units.resolution(n, tuple(t.shape), count) for n, t in terms.items()}
        return SiteSums(terms, list(range(count)), {}, error)


def _sites(scales=(1.0, 2.0, 3.0, 4.0)):
    models = [build_model(SPEC, seed=s).eval() for s in range(len(scales))]
    data = [randn(10 + k, 80, 1, 6, 6) * scale for k, scale in enumerate(scales)]
    return models, data


def _close(secure, plain):
    for (name, a), (_, b) in zip(
        plain.state_dict().items(), secure.state_dict().items(), strict=True
    ):
        assert float((a - b).abs().max()) <= TOLERANCE * float(a.abs().max()), name


def test_kf_sites_from_a_quantised_secure_sum_is_the_fit_of_the_sum_in_the_clear():
    models, data = _sites()
    fusion = randn(99, 60, 1, 6, 6)
    method = KFSites(use_scores=False, statistics="sums", statistics_dtype="float64")
    plain = method.fuse(
        models, FusionInputs(data=fusion, sites=LocalSites(models, data, device="cpu"))
    )
    sites = QuantisedSites(models, data, device="cpu")
    secure = method.fuse(models, FusionInputs(data=fusion, sample_counts=[80] * 4, sites=sites))
    _close(secure.model, plain.model)
    # the terms stay inside SecAgg+'s range in both rounds: nothing was clipped
    assert all(value <= (NORMS_CLIP if norms else 1.0) for norms, value in sites.largest)
    assert len(sites.largest) == 2 * 3  # a norms and a terms round per level


def test_a_site_far_stronger_than_the_fusion_set_is_not_clipped():
    # a column norm 1000 times the fusion set's; the norms round's range is 65536 times
    models, data = _sites(scales=(1.0, 100.0))
    fusion = randn(99, 60, 1, 6, 6) * 0.1
    method = KFSites(use_scores=False, statistics="sums", statistics_dtype="float64")
    plain = method.fuse(
        models, FusionInputs(data=fusion, sites=LocalSites(models, data, device="cpu"))
    )
    sites = QuantisedSites(models, data, device="cpu")
    secure = method.fuse(models, FusionInputs(data=fusion, sample_counts=[80, 81], sites=sites))
    _close(secure.model, plain.model)
    assert all(value <= (NORMS_CLIP if norms else 1.0) for norms, value in sites.largest)


@pytest.mark.parametrize(
    "spec", [SPEC, resnet_spec((3, 8, 8), 4, depth=10, width_multiplier=0.125)]
)
def test_regmean_from_sums_is_regmean_from_each_sites_grams(spec):
    models = [build_model(spec, seed=s).eval() for s in range(3)]
    data = [randn(20 + k, 40, *spec.input_shape) * (1 + k) for k in range(3)]
    grams = [level_grams(m, d) for m, d in zip(models, data, strict=True)]
    per_site = RegMean().fuse(models, FusionInputs(grams=grams)).model
    sums = RegMean(grams="sums").fuse(
        models, FusionInputs(sites=LocalSites(models, data, device="cpu"))
    )
    for (name, a), (_, b) in zip(
        per_site.state_dict().items(), sums.model.state_dict().items(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    secure = RegMean(grams="sums").fuse(
        models,
        FusionInputs(
            data=randn(99, 30, *spec.input_shape),
            sample_counts=[40] * 3,
            sites=QuantisedSites(models, data, device="cpu"),
        ),
    )
    _close(secure.model, per_site)


def test_fixed_units_encode_and_decode_and_travel_as_named_tensors():
    units = FixedPoint(
        {
            "gram": (torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])),
            "rows": (torch.tensor([5.0]), None),
        },
        clip=2.0,
    )
    terms = {"gram": torch.tensor([[3.0, 4.0], [6.0, 8.0]]), "rows": torch.tensor([10.0])}
    encoded = units.encode(terms)
    torch.testing.assert_close(encoded["gram"], torch.ones(2, 2, dtype=torch.float64))
    torch.testing.assert_close(units.decode(encoded)["rows"], terms["rows"].double())
    again = FixedPoint.from_tensors(units.tensors(), 2.0)
    torch.testing.assert_close(again.encode(terms)["gram"], encoded["gram"])
    with pytest.raises(ValueError, match="positive and finite"):
        FixedPoint({"gram": (torch.tensor([0.0]), None)})
    # the resolution of a sum: one step of 2 clip / Q per site, in the term's own units
    step = 2 * 2.0 / quantization_levels(3) * 3
    torch.testing.assert_close(
        units.resolution("rows", (1,), 3), torch.tensor([5.0 * step], dtype=torch.float64)
    )


def test_summed_requests_travel_with_their_units_and_reading():
    model, fused = build_model(SPEC, seed=0), build_model(SPEC, seed=1)
    reading = torch.rand(20, 20, dtype=torch.float64)
    units = FixedPoint({"gram": (torch.ones(37, dtype=torch.float64), None)}, clip=NORMS_CLIP)
    request = StatisticsRequest(0, fused, readings={3: reading})
    summed, site_model = unpack_sum_request(
        pack_sum_request(SummedRequest(request, units, norms=True).for_site(3), model)
    )
    assert summed.norms and summed.units.clip == NORMS_CLIP
    torch.testing.assert_close(summed.request.site_reading, reading)
    torch.testing.assert_close(summed.units.scales["gram"][0], units.scales["gram"][0])
    regmean, _ = unpack_sum_request(pack_sum_request(SummedRequest(GramTermsRequest(False)), model))
    assert regmean.request == GramTermsRequest(False) and regmean.units is None
    for (_, a), (_, b) in zip(
        model.state_dict().items(), site_model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b)


def test_secure_aggregation_refuses_methods_that_read_each_site():
    with pytest.raises(ValueError, match="regmean-sums"):
        check_secure_methods([RegMean()])
    with pytest.raises(ValueError, match="kf-sites-sums"):
        check_secure_methods([KFSites()])
    with pytest.raises(ValueError, match="auto reads each site's scores.*auto.score_on=fusion"):
        check_secure_methods([Auto(candidates="kf-linear,fedavg")])
    check_secure_methods([RegMean(grams="sums"), KFSites(statistics="sums")])
    check_secure_methods([Auto(candidates="kf-linear,fedavg", score_on="fusion-set")])
