"""Flower records of a round summed over sites (:mod:`fedfuse.fusion.statistics.summed_terms`): the
server's request to one site.

A request is either a statistics request (``kf-sites`` / ``hf-sites`` with
``statistics="sums"``, packed as for a statistics round) or RegMean's (``grams="sums"``: the
site's own model and ``fit_bias``), plus whether the round asks the norms and the fixed units
of a secure sum. Under secure
aggregation the site's terms never travel as such: Flower's SecAgg+ client mod masks them.
"""

from __future__ import annotations

import json

from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from fedfuse.fusion.methods.regression.regmean_sums import GramTermsRequest
from fedfuse.fusion.statistics.fixed_point import FixedPoint
from fedfuse.fusion.statistics.privacy import GaussianStatistics
from fedfuse.fusion.statistics.rounds import StatisticsRequest
from fedfuse.fusion.statistics.summed_terms import SummedRequest
from fedfuse.io.validation import model_from_state
from fedfuse.models import LeveledModel, ModelSpec

from .records import (
    WEIGHTS_KEY,
    pack_statistics_request,
    unpack_statistics_request,
    unpack_tensors,
)

#: the record saying what is summed ("statistics" or "regmean") and RegMean's options
SUM_REQUEST_KEY = "fedfuse.sum-request"
#: the fixed units' scales (ArrayRecord) of a secure sum
UNITS_KEY = "fedfuse.sum-units"
#: RegMean's per-level design scales of its differentially private Grams
PRIVACY_KEY = "fedfuse.sum-privacy"


def pack_sum_request(summed: SummedRequest, model: LeveledModel) -> RecordDict:
    """The request of a summed round to one site (``summed.for_site(i)``)."""
    request = summed.request
    if isinstance(request, StatisticsRequest):
        content = pack_statistics_request(request, model)
        config: dict = {"kind": "statistics"}
    else:
        content = RecordDict({WEIGHTS_KEY: ArrayRecord(model.state_dict())})
        config = {
            "kind": "regmean",
            "model-spec": json.dumps(model.spec.to_dict()),
            "fit-bias": json.dumps(request.fit_bias),
        }
        if request.privacy:  # the mechanism, never its noise seed: the site draws its own
            levels = sorted(request.privacy)
            config["dp-levels"] = levels
            config["dp-clips"] = [float(request.privacy[i].clip) for i in levels]
            config["dp-noise-multiplier"] = float(request.privacy[levels[0]].noise_multiplier)
            scales = {
                str(i): request.privacy[i].design_scale.double()
                for i in levels
                if request.privacy[i].design_scale is not None
            }
            if scales:
                content.array_records[PRIVACY_KEY] = ArrayRecord(scales)
    config["norms"] = summed.norms
    if summed.units is not None:
        config["units-clip"] = summed.units.clip
        content.array_records[UNITS_KEY] = ArrayRecord(
            {name: scale.double() for name, scale in summed.units.tensors().items()}
        )
    content.config_records[SUM_REQUEST_KEY] = ConfigRecord(config)
    return content


def unpack_sum_request(content: RecordDict) -> tuple[SummedRequest, LeveledModel]:
    """The round and the site's model from a summed round's message (ValueError when
    malformed)."""
    try:
        config = content.config_records[SUM_REQUEST_KEY]
        kind, norms = str(config["kind"]), bool(config["norms"])
        units = None
        if UNITS_KEY in content.array_records:
            scales = unpack_tensors(content.array_records[UNITS_KEY])
            units = FixedPoint.from_tensors(scales, float(config["units-clip"]))
        if kind == "statistics":
            request, model = unpack_statistics_request(content)
            return SummedRequest(request, units, norms), model
        if kind != "regmean":
            raise ValueError(f"unknown kind {kind!r}")
        spec = ModelSpec.from_dict(json.loads(str(config["model-spec"])))
        state = unpack_tensors(content.array_records[WEIGHTS_KEY])
        fit_bias = json.loads(str(config["fit-bias"]))
        if not (isinstance(fit_bias, bool) or fit_bias == "auto"):
            raise ValueError(f"fit-bias {fit_bias!r}")
        privacy = _unpack_privacy(content, config)
    except (KeyError, TypeError, ValueError, RecursionError) as error:
        raise ValueError(f"malformed summed-round request ({error!r})") from None
    model = model_from_state(spec, state, source="the site's model in the request")
    request = GramTermsRequest(fit_bias, privacy or None)
    return SummedRequest(request, units, norms), model


def _unpack_privacy(content: RecordDict, config: ConfigRecord) -> dict[int, GaussianStatistics]:
    """RegMean's per-level mechanism from a request (empty without one)."""
    if "dp-levels" not in config:
        return {}
    levels = [int(i) for i in config["dp-levels"]]  # type: ignore[union-attr]
    clips = [float(c) for c in config["dp-clips"]]  # type: ignore[union-attr]
    noise = float(config["dp-noise-multiplier"])
    scales = {}
    if PRIVACY_KEY in content.array_records:
        scales = unpack_tensors(content.array_records[PRIVACY_KEY])
    mechanisms = {}
    for level, clip in zip(levels, clips, strict=True):
        scale = scales.get(str(level))
        if scale is not None and (scale.dim() != 1 or not bool((scale > 0).all())):
            raise ValueError("the design scale must be positive numbers")
        mechanisms[level] = GaussianStatistics(noise, clip, design_scale=scale)
    return mechanisms
