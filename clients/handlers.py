"""The work behind each of the ClientApp's handlers (:mod:`fedfuse.clients.client_app`).

Each handler is glue only: the settings, the site's identity, the message unpacked, one call of
the site's Flower-free work (:mod:`fedfuse.federation.site`), the reply packed. This module
imports PyTorch and the data and fusion stack; the ClientApp imports it on its first message
that needs it.
"""

from __future__ import annotations

import logging

from flwr.app import Context, Message

from fedfuse.federation.contract import SiteRefusal
from fedfuse.federation.site import (
    SiteIdentity,
    SiteSetup,
    answer_statistics_request,
    check_site_data,
    finetune_site,
    train_site,
)
from fedfuse.federation.site_cache import run_site_cache
from fedfuse.federation.site_data import load_site_data
from fedfuse.federation.site_score import score_on_site
from fedfuse.runtime import configure_logging, release_free_memory
from fedfuse.settings.run import RunSettings

from .records import (
    pack_finetune_reply,
    pack_no_upload,
    pack_site_ready,
    pack_statistics,
    pack_upload,
    unpack_contract_query,
    unpack_finetune_request,
    unpack_statistics_request,
    unpack_train_request,
)
from .score_records import pack_score_reply, unpack_score_request
from .site_context import count_round, site_identity, site_name, site_of, site_policy

log = logging.getLogger(__name__)


def no_upload_reply(
    msg: Message, error: Exception, *, site_name: str, partition_id: int, doing: str = "the run"
) -> Message:
    """The reply of a site that does not answer ``msg`` with what it asks: it refuses (a
    :class:`~fedfuse.federation.contract.SiteRefusal`: its data or its policy) or it failed (any
    other error), with the reason, its name and its partition id (-1: unknown)."""
    if isinstance(error, SiteRefusal):
        log.error("refusing %s: %s", doing, error)
        kind, reason = "refused", str(error)
    else:
        log.error("the site failed", exc_info=error)
        kind, reason = "failed", f"{type(error).__name__}: {error}"
    content = pack_no_upload(kind, reason, site_name=site_name, partition_id=partition_id)
    return Message(content=content, reply_to=msg)


def _cannot_take_part(
    msg: Message, error: Exception, context: Context, site: SiteIdentity | None
) -> Message:
    """The reply of a site that refuses (its data breaks the contract) or failed (``site``:
    None when it failed before it knew who it is)."""
    partition_id = site.partition_id if site is not None else -1
    return no_upload_reply(msg, error, site_name=site_name(context), partition_id=partition_id)


def train_and_upload(msg: Message, context: Context) -> Message:
    """Train on the site's data, compute importance scores, reply with weights + scores and
    whatever else the server's message asks for (Grams, Fisher, class Gaussians)."""
    configure_logging()
    site = None
    try:
        site = site_of(context)
        settings = RunSettings.from_config(context.run_config)
        request = unpack_train_request(msg.content)
        setup = SiteSetup(
            contract=request.contract,
            policy=site_policy(context),
            cache=run_site_cache(settings, site.partition_id, site.num_partitions, site.data_path),
        )
        upload = train_site(settings, site, request.upload, request.initial_state, setup)
    except Exception as error:  # the server is told which site cannot take part, and why
        return _cannot_take_part(msg, error, context, site)
    finally:  # a simulation's worker trains site after site: hand back what this one freed
        release_free_memory()
    return Message(content=pack_upload(upload), reply_to=msg)


def check_contract(msg: Message, context: Context) -> Message:
    """The check before training: does the site's data match the run's data contract, and does
    its policy allow what the run will ask it to send? The site answers that it is ready, or
    refuses (or failed) and says why."""
    configure_logging()
    site = None
    try:
        site = site_of(context)
        settings = RunSettings.from_config(context.run_config)
        contract, request = unpack_contract_query(msg.content)
        policy = site_policy(context)
        samples = 0  # the site's size matters to its policy only with a minimum of rows
        if contract is not None:
            samples = len(check_site_data(settings, contract, site))
        elif policy.min_statistic_rows:
            data = load_site_data(settings, site.partition_id, site.num_partitions, site.data_path)
            samples = len(data)
        policy.check_request(settings.method_names(), request, samples)
    except Exception as error:  # the server is told which site cannot take part, and why
        return _cannot_take_part(msg, error, context, site)
    ready = pack_site_ready(site_name=site.name, partition_id=site.partition_id)
    return Message(content=ready, reply_to=msg)


def statistics_round(msg: Message, context: Context) -> Message:
    """One statistics round: the site's statistics of the fused prefix and its own model on
    its own data, for the level the server asks (site-statistics fusion, e.g. ``kf-sites``)."""
    configure_logging()
    settings = RunSettings.from_config(context.run_config)
    site = site_of(context)
    policy = site_policy(context)
    request, model = unpack_statistics_request(msg.content)
    try:
        policy.check_round("rounds", count_round(context))
        statistics = answer_statistics_request(settings, request, model, site, policy=policy)
    except SiteRefusal as refusal:  # the server is told why, and sends this site no more
        return no_upload_reply(
            msg,
            refusal,
            site_name=site.name,
            partition_id=site.partition_id,
            doing="a statistics round",
        )
    return Message(content=pack_statistics(statistics), reply_to=msg)


def score_model(msg: Message, context: Context) -> Message:
    """A scoring round (Flower's federated evaluation): the accuracy, loss and row count of the
    model the server sent on the site's training rows (it holds no held-out split;
    :func:`~fedfuse.federation.site_score.score_on_site`). A site whose policy does not send
    ``"scores"`` refuses, naming it; one that cannot score answers that it failed, and why."""
    configure_logging()
    site = None
    try:
        site = site_of(context)
        site_policy(context).check_scores()  # before the model is even read
        settings = RunSettings.from_config(context.run_config)
        model = unpack_score_request(msg.content)
        score = score_on_site(settings, model, site)
    except Exception as error:  # the server is told which site cannot score, and why
        return _cannot_take_part(msg, error, context, site)
    return Message(content=pack_score_reply(score), reply_to=msg)


def finetune_round(msg: Message, context: Context) -> Message:
    """The fine-tuning round after fusion: the fused model the server sent, trained on the
    site's own data for ``finetune-epochs`` and sent back for averaging."""
    configure_logging()
    settings = RunSettings.from_config(context.run_config)
    partition_id, num_partitions, data_path = site_identity(context)
    model = unpack_finetune_request(msg.content)
    tuned = finetune_site(settings, model, partition_id, num_partitions, data_path=data_path)
    return Message(
        content=pack_finetune_reply(tuned.model, tuned.num_examples, tuned.details, partition_id),
        reply_to=msg,
    )
