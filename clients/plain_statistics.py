"""Statistics rounds in a Flower app's own ClientApp: one query handler, a few lines.

Methods fitted on the sites' data (``kf-sites``, ``hf-sites``) ask every site, after the train
round, for the statistics of its own model and of the fused model so far on its own data, one
round per level (:mod:`fedfuse.strategies.statistics_rounds`). A plain ClientApp (Flower's
PyTorch template, say) answers them by adding::

    from fedfuse.clients import answer_statistics

    @app.query("statistics")
    def statistics(msg: Message, context: Context) -> Message:
        partition_id = context.node_config["partition-id"]
        num_partitions = context.node_config["num-partitions"]
        trainloader, _ = load_data(partition_id, num_partitions)
        return answer_statistics(msg, context, Net, trainloader)

and the ServerApp passes ``client_statistics=True`` to
:class:`~fedfuse.strategies.OneShotFusion`. Each request carries the site's own trained model
(the server kept its upload) and the fused prefix, so the site keeps nothing between messages
(Flower may start a new ClientApp process for each); its ``Context.state`` only counts the
rounds it answered, for its policy. The statistics are computed as fedfuse's own ClientApp
computes them (:func:`fedfuse.federation.site.statistics_on_data`), on the data the handler
passes (in the app's own normalisation).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from flwr.app import Context, Message, RecordDict
from torch import nn

from fedfuse.data.tensors import SampleSource, collect_samples
from fedfuse.federation.site import statistics_on_data
from fedfuse.models import ModelAdapter, ModelSpec

from .handlers import no_upload_reply
from .records import REQUEST_KEY, pack_statistics, unpack_statistics_request
from .site_context import count_round, site_name, site_policy

log = logging.getLogger(__name__)


def answer_statistics(
    msg: Message,
    context: Context,
    model_fn: Callable[[], nn.Module],
    data: SampleSource,
    *,
    keys: tuple[str, str] | None = None,
    device: str = "auto",
) -> Message:
    """The reply of a plain ClientApp to one statistics round (a ``query.statistics`` message).

    Args:
        msg: the server's statistics request (it holds the site's own model and the fused one).
        context: the ClientApp's context: its node config names the site (``site-name``) and
            states its policy (:class:`~fedfuse.federation.policy.SitePolicy`), its state counts
            the rounds answered.
        model_fn: the app's model class (or a function building one), as the ServerApp's
            ``OneShotFusion(model_fn=...)``.
        data: the site's training data in its own normalisation (the ``DataLoader`` it trained
            on, or an ``(inputs, labels)`` pair; ``keys`` names the inputs of dict batches).
        device: where to compute (``"auto"``: CUDA when available).

    Returns the statistics, or, when the site's policy refuses the round, the request or the
    model is not the server's, or the data does not fit, a reply that says so and names the
    site (as fedfuse's own ClientApp answers); it never raises.
    """
    name = site_name(context)
    who = name or f"node {context.node_id}"
    try:
        partition_id = int(context.node_config.get("partition-id", -1))
    except (TypeError, ValueError):
        partition_id = -1
    try:
        policy = site_policy(context)
        policy.check_round("rounds", count_round(context))
        _register_model(model_fn, msg.content, who)
        request, model = unpack_statistics_request(msg.content)
        inputs, _ = collect_samples(data, keys=keys, what=f"{who}'s data")
        statistics = statistics_on_data(
            request, model, inputs, who=who, policy=policy, device=device
        )
    except Exception as error:  # the server is told which site sends nothing, and why
        return no_upload_reply(
            msg, error, site_name=who, partition_id=partition_id, doing="a statistics round"
        )
    return Message(content=pack_statistics(statistics), reply_to=msg)


def _register_model(model_fn: Callable[[], nn.Module], content: RecordDict, who: str) -> None:
    """Make the request's model spec buildable here: the app's model traced and registered, as
    the server registered it; ValueError when the server's model is not ``model_fn``'s."""
    try:
        config = content.config_records[REQUEST_KEY]
        spec = ModelSpec.from_dict(json.loads(str(config["model-spec"])))
    except (KeyError, TypeError, ValueError, RecursionError) as error:
        raise ValueError(f"malformed statistics request ({error!r})") from None
    adapter = ModelAdapter(model_fn, spec.input_shape)
    if adapter.spec != spec:
        raise ValueError(
            f"{who}: the server's model is {spec.arch} {spec.to_dict()}, this ClientApp's "
            f"model_fn builds {adapter.name} {adapter.spec.to_dict()}: pass the model class "
            "the ServerApp gives OneShotFusion(model_fn=...)"
        )
    adapter.register()
