"""Turning one client reply into a validated upload, with errors that name the client.

Nothing in a reply is trusted: its records may be missing or of the wrong kind, its spec forged,
its tensors misshapen or not finite, its counts negative or absurd. Every check comes from
:mod:`fedfuse.io.validation`, and sizes are compared with the spec before anything is built.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from flwr.app import ConfigRecord, Message

from fedfuse.clients.records import (
    GRAMS_KEY,
    METRICS_KEY,
    SCORES_KEY,
    SECONDS_PREFIX,
    SITE_KEY,
    WEIGHTS_KEY,
    unpack_tensors,
)
from fedfuse.federation.uploads import ClientUpload
from fedfuse.io.checkpoint import scores_from_tensors
from fedfuse.io.validation import (
    ContributionError,
    model_from_state,
    validate_grams,
    validate_partition,
    validate_scores,
    validate_site_facts,
)
from fedfuse.models import ModelSpec


def describe_sender(msg: Message) -> str:
    """``client <partition-id> (node <id>)`` when the reply says its partition, else the node."""
    node = f"node {msg.metadata.src_node_id}"
    if not msg.has_error():
        site = msg.content.config_records.get(SITE_KEY)
        if site is not None and "partition-id" in site:
            return f"client {str(site['partition-id'])[:20]} ({node})"
    return node


def decode_reply(msg: Message, expected: ModelSpec | None, *, require_scores: bool) -> ClientUpload:
    """Validate one train reply and rebuild its model; raises :class:`ContributionError`."""
    source = describe_sender(msg)
    if msg.has_error():
        raise ContributionError(f"{source}: the client failed: {short_reason(msg.error.reason)}")
    content = msg.content
    for key, records in (
        (WEIGHTS_KEY, content.array_records),
        (METRICS_KEY, content.metric_records),
        (SITE_KEY, content.config_records),
    ):
        if key not in records:
            raise ContributionError(f"{source}: reply lacks the {key!r} record")
    site = content.config_records[SITE_KEY]
    metrics = content.metric_records[METRICS_KEY]
    spec = _spec(site, source)
    if expected is not None and spec != expected:
        raise ContributionError(
            f"{source}: sent architecture {spec.to_dict()}, the server expects {expected.to_dict()}"
        )
    model = model_from_state(spec, _tensors(content, WEIGHTS_KEY, source), source=source)
    if SCORES_KEY in content.array_records and len(content.array_records[SCORES_KEY]):
        scores = scores_from_tensors(_tensors(content, SCORES_KEY, source), source=source)
        validate_scores(model, scores, source=source)
    elif require_scores:
        raise ContributionError(f"{source}: sent no importance scores, and the strategy needs them")
    else:
        scores = {}
    num_examples, counts = validate_site_facts(
        metrics.get("num-examples"), site.get("class-counts"), spec.num_classes, source=source
    )
    partition_id, num_partitions = validate_partition(
        site.get("partition-id"), site.get("num-partitions"), source=source
    )
    grams = None
    if GRAMS_KEY in content.array_records:
        raw = _tensors(content, GRAMS_KEY, source)
        try:
            levels = {int(key): value for key, value in raw.items()}
        except ValueError:
            raise ContributionError(f"{source}: malformed Gram matrix keys {sorted(raw)}") from None
        grams = validate_grams(model, levels, source=source)
    train_loss = metrics.get("train-loss", float("nan"))
    seconds = {
        key.removeprefix(SECONDS_PREFIX)[:32]: float(value)
        for key, value in list(metrics.items())[:64]
        if key.startswith(SECONDS_PREFIX)
        and isinstance(value, int | float)
        and math.isfinite(value)
        and value >= 0
    }
    return ClientUpload(
        model=model,
        scores=scores,
        num_examples=num_examples,
        class_counts=counts,
        partition_id=partition_id,
        num_partitions=num_partitions,
        score_method=str(site.get("score-method", ""))[:64],
        init=str(site.get("init", ""))[:64],
        grams=grams,
        train_loss=float(train_loss) if isinstance(train_loss, int | float) else float("nan"),
        seconds=seconds,
    )


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def short_reason(reason: str, limit: int = 300) -> str:
    """A client's error reason as one line: Flower wraps the ClientApp's exception in Ray's
    traceback, whose last ``Message:`` (or last line) is what the site's code said."""
    text = _ANSI.sub("", str(reason))
    if "Message:" in text:
        text = text.rsplit("Message:", 1)[1]
    else:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        text = lines[-1] if lines else text
    text = " ".join(text.split()).rstrip("'>")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _spec(site: ConfigRecord, source: str) -> ModelSpec:
    """The model spec a client declared, parsed defensively (forged specs are common input)."""
    try:
        return ModelSpec.from_dict(json.loads(str(site["model-spec"])))
    except KeyError:
        raise ContributionError(f"{source}: its site record has no model-spec") from None
    except (ValueError, TypeError, OverflowError) as error:
        raise ContributionError(f"{source}: unusable model spec ({error})"[:300]) from None
    except RecursionError:
        raise ContributionError(f"{source}: model spec is nested too deeply") from None


def _tensors(content: Any, key: str, source: str) -> dict[str, Any]:
    try:
        return unpack_tensors(content.array_records[key])
    except (ValueError, TypeError, RuntimeError) as error:
        raise ContributionError(f"{source}: unreadable {key!r} arrays ({error})") from None
