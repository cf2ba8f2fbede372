"""One call for a Flower app's own ClientApp to send what some fusion methods read from sites.

A ClientApp written for FedAvg (Flower's PyTorch template, for instance) replies with an
``ArrayRecord`` of weights and ``num-examples`` in a ``MetricRecord``; fedfuse's
:class:`~fedfuse.strategies.OneShotFusion` fuses that as it is. Methods that read importance
scores, class counts, Gram matrices or Fisher information from the sites get them when the
ClientApp adds one line before it replies (and so do the class Gaussians the server completes
its fusion set from, ``OneShotFusion(gaussians=...)``)::

    content = RecordDict({"arrays": model_record, "metrics": metric_record})
    add_fusion_extras(content, msg, model, trainloader)
    return Message(content=content, reply_to=msg)

The server's train message says which extras to send (none when no method of the run reads
them, so the line then costs nothing).
"""

from __future__ import annotations

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from torch import nn

from fedfuse.data.tensors import SampleSource
from fedfuse.federation.plain_site import EXTRAS, compute_site_extras

from .records import (
    CONFIG_KEY,
    EXTRAS_KEY,
    SCORE_METHOD_KEY,
    SCORES_KEY,
    SECONDS_PREFIX,
    SEND_GAUSSIANS_KEY,
    put_site_arrays,
)


def requested_extras(msg: Message) -> list[str]:
    """The extras the server's train message asks this site for (known names only)."""
    config = msg.content.config_records.get(CONFIG_KEY)
    if config is None or EXTRAS_KEY not in config:
        return []
    asked = [name.strip() for name in str(config[EXTRAS_KEY]).split(",")]
    return [name for name in EXTRAS if name in asked]


def requested_gaussian_rank(msg: Message) -> int:
    """The rank of the class Gaussians the server's train message asks this site for (0:
    none)."""
    config = msg.content.config_records.get(CONFIG_KEY)
    try:
        return max(0, int(config.get(SEND_GAUSSIANS_KEY, 0))) if config is not None else 0
    except (TypeError, ValueError):
        raise ValueError(
            f"the train message's {SEND_GAUSSIANS_KEY}={config[SEND_GAUSSIANS_KEY]!r} is no rank"
        ) from None


def add_fusion_extras(
    content: RecordDict,
    msg: Message,
    model: nn.Module,
    data: SampleSource,
    *,
    score_samples: int = 512,
    keys: tuple[str, str] | None = None,
) -> RecordDict:
    """Add to the reply ``content`` the extras that the train message ``msg`` asks for, computed
    from the site's trained ``model`` on its training ``data`` (the ``DataLoader`` it trained
    on, in its own normalisation; ``keys`` names the inputs and labels of dict batches).

    Returns ``content`` (changed in place). Adds nothing when nothing is asked for.
    """
    wanted = requested_extras(msg)
    rank = requested_gaussian_rank(msg)
    if not wanted and not rank:
        return content
    config = msg.content.config_records[CONFIG_KEY]
    extras = compute_site_extras(
        model,
        data,
        wanted,
        score_method=str(config.get(SCORE_METHOD_KEY) or "conductance"),
        score_samples=score_samples,
        keys=keys,
        gaussian_rank=rank,
    )
    sent = [*wanted, *(["class-gaussians"] if rank else [])]
    facts: dict[str, str | list[int] | float] = {"sent": ",".join(sent)}
    if extras.scores is not None:
        content[SCORES_KEY] = ArrayRecord({str(k): v for k, v in extras.scores.items()})
        facts[SCORE_METHOD_KEY] = extras.score_method
    put_site_arrays(content, extras.grams, extras.fisher, extras.class_gaussians)
    if extras.class_counts is not None:
        facts["class-counts"] = extras.class_counts
    for phase, seconds in extras.seconds.items():
        facts[f"{SECONDS_PREFIX}{phase}"] = float(seconds)
    content[EXTRAS_KEY] = ConfigRecord(facts)
    return content
