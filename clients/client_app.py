"""The site's Flower ``ClientApp``: train locally once, score neurons locally, upload both;
then, for methods fitted on the sites' data, answer one statistics query per level; and, when
the run fine-tunes on the sites (``finetune-data="sites"``), train the fused model on the site's
data once more and send it back (``train.finetune``).

Simulation: a site's data is its partition (``partition-id`` / ``num-partitions``, set by Flower)
of the configured dataset. Deployment: start the SuperNode with
``--node-config "partition-id=<site id> site-name='<name>' data-path='/path/site.npz'"`` (see
:mod:`fedfuse.data.arrays` for the file). Run config keys are those of ``RunSettings``.

A site checks its data against the run's data contract (in the train message) before it trains.
When it cannot upload, it still answers, at once: a ``no-upload`` reply that says whether it
refused (its data breaks the contract) or failed, why, and which site it is, so the server names
it in the run's status.

Each handler is glue only: the settings, the site's identity, the message unpacked, one call of
the site's Flower-free work (:mod:`fedfuse.federation.site`), the reply packed.
"""

from __future__ import annotations

import logging

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedfuse.federation.contract import SiteRefusal
from fedfuse.federation.site import (
    answer_statistics_request,
    check_site_data,
    finetune_site,
    train_site,
)
from fedfuse.federation.site_cache import run_site_cache
from fedfuse.runtime import configure_logging
from fedfuse.settings.run import RunSettings

from .records import (
    pack_finetune_reply,
    pack_no_upload,
    pack_site_ready,
    pack_statistics,
    pack_upload,
    unpack_contract,
    unpack_finetune_request,
    unpack_statistics_request,
    unpack_train_request,
)

log = logging.getLogger(__name__)

app = ClientApp()

#: node-config key of a site's name, shown in the server's logs, results and checkpoints
SITE_NAME_KEY = "site-name"


def site_name(context: Context) -> str:
    """The site's name from its node config (``site-name``), or "" when it gave none."""
    return str(context.node_config.get(SITE_NAME_KEY, "")).strip()[:200]


def site_identity(context: Context) -> tuple[int, int, str | None]:
    """(partition id, number of partitions or 0, data file or None) from the node config."""
    config = context.node_config
    data_path = str(config["data-path"]) if config.get("data-path") else None
    try:
        partition_id = int(config["partition-id"])
        num_partitions = int(config.get("num-partitions", 0))
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(
            f"node {context.node_id}: node config needs an integer partition-id ({error!r}); "
            "start the SuperNode with --node-config \"partition-id=<i> data-path='<file.npz>'\""
        ) from None
    if data_path is None and num_partitions < 1:
        raise ValueError(
            f"node {context.node_id}: node config has neither data-path nor num-partitions"
        )
    return partition_id, num_partitions, data_path


def _cannot_take_part(msg: Message, error: Exception, name: str, partition_id: int) -> Message:
    """The reply of a site that refuses (its data breaks the contract) or failed."""
    if isinstance(error, SiteRefusal):
        log.error("refusing the run: %s", error)
        kind, reason = "refused", str(error)
    else:
        log.error("the site failed", exc_info=error)
        kind, reason = "failed", f"{type(error).__name__}: {error}"
    content = pack_no_upload(kind, reason, site_name=name, partition_id=partition_id)
    return Message(content=content, reply_to=msg)


@app.train()
def train_and_upload(msg: Message, context: Context) -> Message:
    """Train on the site's data, compute importance scores, reply with weights + scores (and
    the Gram matrices when the server's message asks for them)."""
    configure_logging()
    name = site_name(context)
    partition_id = -1
    try:
        partition_id, num_partitions, data_path = site_identity(context)
        settings = RunSettings.from_config(context.run_config)
        request = unpack_train_request(msg.content)
        upload = train_site(
            settings,
            partition_id,
            num_partitions,
            request.initial_state,
            data_path=data_path,
            send_grams=request.send_grams,
            cache=run_site_cache(settings, partition_id, num_partitions, data_path),
            contract=request.contract,
            site_name=name,
        )
    except Exception as error:  # the server is told which site cannot take part, and why
        return _cannot_take_part(msg, error, name, partition_id)
    return Message(content=pack_upload(upload), reply_to=msg)


@app.query("contract")
def check_contract(msg: Message, context: Context) -> Message:
    """The check before training: does the site's data match the run's data contract? The
    site answers that it is ready, or refuses (or failed) and says why."""
    configure_logging()
    name = site_name(context)
    partition_id = -1
    try:
        partition_id, num_partitions, data_path = site_identity(context)
        settings = RunSettings.from_config(context.run_config)
        contract = unpack_contract(msg.content, what="the server's check")
        if contract is not None:
            check_site_data(
                settings,
                contract,
                partition_id,
                num_partitions,
                data_path=data_path,
                site_name=name,
            )
    except Exception as error:  # the server is told which site cannot take part, and why
        return _cannot_take_part(msg, error, name, partition_id)
    return Message(content=pack_site_ready(site_name=name, partition_id=partition_id), reply_to=msg)


@app.query("statistics")
def statistics_round(msg: Message, context: Context) -> Message:
    """One statistics round: the site's statistics of the fused prefix and its own model on
    its own data, for the level the server asks (site-statistics fusion, e.g. ``kf-sites``)."""
    configure_logging()
    settings = RunSettings.from_config(context.run_config)
    partition_id, num_partitions, data_path = site_identity(context)
    request, model = unpack_statistics_request(msg.content)
    statistics = answer_statistics_request(
        settings, request, model, partition_id, num_partitions, data_path=data_path
    )
    return Message(content=pack_statistics(statistics), reply_to=msg)


@app.train("finetune")
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
