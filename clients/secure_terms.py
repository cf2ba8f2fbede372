"""The site's vector in the SecAgg+ stage that collects masked vectors
(:mod:`fedfuse.clients.secure`): its terms of the summed round
(:func:`~fedfuse.federation.site.answer_sum_request`, in the request's fixed units), as the
parameters of a ``FitRes`` with weight 1. Imported by that stage only: the other stages of
SecAgg+ start without PyTorch.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_STATE
from flwr.compat.common import recorddict_compat as compat

from fedfuse.federation.site import answer_sum_request
from fedfuse.fusion.statistics.summed_terms import SummedRequest
from fedfuse.runtime import configure_logging
from fedfuse.settings.run import RunSettings

from .site_context import count_round, site_of, site_policy
from .sum_records import unpack_sum_request

log = logging.getLogger(__name__)


def masked_terms(msg: Message, context: Context) -> Message:
    """The site's terms as SecAgg+ reads them: a FitRes whose parameters are the terms in the
    request's fixed units, by sorted name, with weight 1 (the server adds, not averages)."""
    configure_logging()
    settings = RunSettings.from_config(context.run_config)
    site = site_of(context)
    summed, model = unpack_sum_request(msg.content)
    if summed.units is None:
        raise ValueError("a secure summed round must carry its fixed units")
    policy = site_policy(context)
    # step 1 of a sum (its norms) is counted with the terms it prepares
    policy.check_round("secure-sums", count_round(context, count=not summed.norms))
    key = summed.key()
    kept = None if summed.norms else _kept_sources(context, key)
    if kept is not None:
        log.info("site %d: the terms read from the numbers of the norms step", site.partition_id)
    if kept is None and not summed.norms and _noised(summed):
        log.warning(
            "site %d: the terms of a noised sum without its first step's numbers: noised anew "
            "(a second release of the same data)",
            site.partition_id,
        )
    terms, sources = answer_sum_request(settings, summed, model, site, policy=policy, sources=kept)
    if summed.norms:  # the terms step reads the same numbers: computed, and noised, once
        _keep_sources(context, key, sources)
    arrays = [terms[name].double().numpy() for name in sorted(terms)]
    secagg = context.state.config_records.get(RECORD_KEY_STATE)
    clip = float(secagg.get("clipping_range", 0.0)) if secagg is not None else 0.0
    largest = max(float(abs(a).max()) for a in arrays)
    if clip and largest > clip:  # SecAgg+ clips silently; the site at least says so
        log.warning(
            "site %d: a term reaches %.3g in fixed units, beyond SecAgg+'s range %.3g; it is "
            "clipped",
            site.partition_id,
            largest,
            clip,
        )
    reply = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), 1, {})
    return Message(compat.fitres_to_recorddict(reply, keep_input=False), reply_to=msg)


#: where a site keeps what its norms step computed, for the terms step of the same sum (a
#: RecordDict's keys are shared by its record types: the key of the sum has its own)
_SOURCES_RECORD = "fedfuse.secure-sources"
_SOURCES_KEY_RECORD = "fedfuse.secure-sources-key"


def _keep_sources(context: Context, key: str, sources: Mapping[str, torch.Tensor]) -> None:
    context.state.array_records[_SOURCES_RECORD] = ArrayRecord(
        {name: tensor.double().cpu() for name, tensor in sources.items()}
    )
    context.state.config_records[_SOURCES_KEY_RECORD] = ConfigRecord({"key": key})


def _kept_sources(context: Context, key: str) -> dict[str, torch.Tensor] | None:
    """The numbers kept by the norms step of the same sum (then dropped), or None."""
    config = context.state.config_records.pop(_SOURCES_KEY_RECORD, None)
    record = context.state.array_records.pop(_SOURCES_RECORD, None)
    if config is None or record is None:
        return None
    if config.get("key") != key:
        return None
    return dict(record.to_torch_state_dict())


def _noised(summed: SummedRequest) -> bool:
    request = summed.request
    return bool(getattr(request, "privacy", None))
