"""Turning one client reply into a validated upload, with errors that name the client.

Nothing in a reply is trusted: its records may be missing or of the wrong kind, its spec forged,
its tensors misshapen or not finite, its counts negative or absurd. Every check comes from
:mod:`fedfuse.io.validation`, and sizes are compared with the spec before anything is built.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Collection
from typing import Any

from flwr.app import ConfigRecord, Message
from flwr.common.constant import ErrorCode

from fedfuse.clients.records import (
    EXTRAS_KEY,
    FISHER_KEY,
    GAUSSIANS_KEY,
    GRAMS_KEY,
    METRICS_KEY,
    NO_UPLOAD_KEY,
    SCORE_METHOD_KEY,
    SCORES_KEY,
    SECONDS_PREFIX,
    SITE_KEY,
    WEIGHTS_KEY,
    unpack_tensors,
)
from fedfuse.federation.uploads import ClientUpload
from fedfuse.fusion.statistics.class_gaussians import ClassGaussians
from fedfuse.fusion.statistics.fisher import check_fisher
from fedfuse.io.checkpoint import scores_from_tensors
from fedfuse.io.validation import (
    ContributionError,
    as_count,
    model_from_state,
    validate_grams,
    validate_partition,
    validate_scores,
    validate_site_facts,
)
from fedfuse.models import ModelAdapter, ModelSpec


class SiteDidNotUpload(ContributionError):
    """A site answered without an upload: ``kind`` ``"refused"`` (its data breaks the run's
    contract; it trained nothing) or ``"failed"`` (an error at the site)."""

    def __init__(self, message: str, kind: str, site: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.kind = kind
        self.site = site
        self.reason = reason or message


_PRINTABLE = re.compile(r"[^\w .,:;@/()+=#'-]")


def sender_name(msg: Message) -> str:
    """The site name a reply gives (its site record, or its no-upload record), or ""."""
    if msg.has_error():
        return ""
    for key in (SITE_KEY, NO_UPLOAD_KEY):
        record = msg.content.config_records.get(key)
        if record is not None and "site-name" in record:
            return _PRINTABLE.sub("?", str(record["site-name"]))[:100]
    return ""


def sender_partition(msg: Message) -> int | None:
    """The partition id a reply gives (a non-negative int below a million), or None."""
    if msg.has_error():
        return None
    for key in (SITE_KEY, NO_UPLOAD_KEY):
        record = msg.content.config_records.get(key)
        value = None if record is None else record.get("partition-id")
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1_000_000:
            return value
    return None


def describe_sender(msg: Message, known: str = "") -> str:
    """``<site name> (client <partition-id>, node <id>)`` as far as the reply says who it is:
    ``client <id> (node <id>)`` without a name, ``node <id>`` without a partition id; for a
    reply that says nothing (an error), ``known``: how the site named itself earlier, if it
    did (:meth:`~.roster.SiteRoster.describe`)."""
    node = f"node {msg.metadata.src_node_id}"
    if msg.has_error():
        return known or node
    partition = None
    for key in (SITE_KEY, NO_UPLOAD_KEY):
        record = msg.content.config_records.get(key)
        if record is not None and "partition-id" in record:
            partition = str(record["partition-id"])[:20]
            break
    name = sender_name(msg)
    if partition is None or partition == "-1":
        return f"{name} ({node})" if name else node
    return f"{name} (client {partition}, {node})" if name else f"client {partition} ({node})"


def site_answer(msg: Message) -> SiteDidNotUpload | None:
    """A site's refusal or failure in a reply (its ``no-upload`` record), or None."""
    no_upload = msg.content.config_records.get(NO_UPLOAD_KEY)
    if no_upload is None:
        return None
    kind = "refused" if str(no_upload.get("kind")) == "refused" else "failed"
    reason = short_reason(str(no_upload.get("reason", "")), limit=1000)
    verb = "refused to train" if kind == "refused" else "the client failed"
    return SiteDidNotUpload(
        f"{describe_sender(msg)}: {verb}: {reason}", kind, sender_name(msg), reason
    )


def decode_reply(
    msg: Message, expected: ModelSpec | None, *, require_scores: bool, known: str = ""
) -> ClientUpload:
    """Validate one train reply and rebuild its model; raises :class:`ContributionError`
    (:class:`SiteDidNotUpload` for a site that refused or failed and said so). ``known``: how
    the site named itself earlier, for a reply that says nothing (:func:`describe_sender`)."""
    source = describe_sender(msg, known)
    if msg.has_error():
        what = (
            "its SuperNode went offline"
            if msg.error.code == ErrorCode.NODE_UNAVAILABLE
            else "the client failed"
        )
        raise SiteDidNotUpload(f"{source}: {what}: {short_reason(msg.error.reason)}", "failed")
    answer = site_answer(msg)
    if answer is not None:
        raise answer
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
    scores = _scores(content, model, source)
    if scores is None and require_scores:
        raise ContributionError(f"{source}: sent no importance scores, and the strategy needs them")
    site_size = _site_size(
        metrics.get("num-examples"), site.get("class-counts"), spec.num_classes, source
    )
    partition = validate_partition(
        site.get("partition-id"), site.get("num-partitions"), source=source
    )
    return _upload(
        model,
        scores,
        site_size,
        partition,
        metrics.get("train-loss"),
        score_method=str(site.get("score-method", ""))[:64],
        init=str(site.get("init", ""))[:64],
        grams=_grams(content, model, source),
        fisher=_fisher(content, model, source),
        class_gaussians=_class_gaussians(content, model.spec, source),
        seconds=_seconds(metrics),
        site_name=sender_name(msg),
        ray_node=_PRINTABLE.sub("?", str(site.get("ray-node", "")))[:64],
    )


#: the line a plain ClientApp adds to send the extras (error messages point to it)
EXTRAS_HINT = (
    "add `fedfuse.clients.add_fusion_extras(content, msg, model, trainloader)` to the "
    "ClientApp before it replies"
)


def decode_plain_reply(
    msg: Message,
    adapter: ModelAdapter,
    *,
    partition_id: int,
    num_partitions: int,
    wanted: Collection[str] = (),
    known: str = "",
) -> ClientUpload:
    """Validate the reply of a plain Flower ClientApp (an ``ArrayRecord`` of the user's model's
    weights and ``num-examples`` in a ``MetricRecord``, as Flower's templates send) and rebuild
    its model through ``adapter``; the ``wanted`` extras (:mod:`fedfuse.clients.extras`, and
    ``class-gaussians``) must be there. Raises :class:`ContributionError` naming the node."""
    source = describe_sender(msg, known)
    if msg.has_error():
        raise ContributionError(f"{source}: the client failed: {short_reason(msg.error.reason)}")
    content = msg.content
    weights_key = _weights_key(content, source)
    state = _tensors(content, weights_key, source)
    to_fedfuse = {user: ours for ours, user in adapter.user_names().items()}
    missing = sorted(set(to_fedfuse) - set(state))
    unexpected = sorted(set(state) - set(to_fedfuse))
    if missing or unexpected:
        raise ContributionError(
            f"{source}: its {weights_key!r} weights are not a {adapter.model_class.__name__}'s "
            f"(missing {missing[:8] or 'none'}, unexpected {unexpected[:8] or 'none'})"
        )
    model = model_from_state(
        adapter.spec, {to_fedfuse[name]: value for name, value in state.items()}, source=source
    )
    metrics = _metric(content, "num-examples", source)
    extras = content.config_records.get(EXTRAS_KEY) or ConfigRecord()
    scores = _scores(content, model, source)
    grams = _grams(content, model, source)
    fisher = _fisher(content, model, source)
    gaussians = _class_gaussians(content, model.spec, source)
    sent = set(fisher or ())
    for name, present in (
        ("class-gaussians", gaussians is not None),
        ("scores", scores is not None),
        ("class-counts", "class-counts" in extras),
        ("grams", grams is not None),
        ("fisher-diagonal", any(k.startswith("diagonal.") for k in sent)),
        ("fisher-kfac", any(k.startswith("kfac.") for k in sent)),
    ):
        if name in wanted and not present:
            raise ContributionError(
                f"{source}: sent no {name}, which the server asked for: {EXTRAS_HINT}"
            )
    site_size = _site_size(
        metrics["num-examples"], extras.get("class-counts"), adapter.spec.num_classes, source
    )
    loss = next((metrics[k] for k in ("train-loss", "train_loss", "loss") if k in metrics), None)
    return _upload(
        model,
        scores,
        site_size,
        (partition_id, num_partitions),
        loss,
        score_method=str(extras.get(SCORE_METHOD_KEY, ""))[:64],
        init="",
        grams=grams,
        fisher=fisher,
        class_gaussians=gaussians,
        seconds=_seconds(extras),
    )


def _upload(
    model: Any,
    scores: Any,
    site_size: tuple[int, list[int] | None],
    partition: tuple[int, int],
    train_loss: Any,
    **reported: Any,
) -> ClientUpload:
    """The upload a decoded reply describes: no ``scores`` read as empty ones, a ``train_loss``
    that is not a number as NaN; ``reported``: the other fields the reply filled."""
    num_examples, class_counts = site_size
    partition_id, num_partitions = partition
    return ClientUpload(
        model=model,
        scores=scores or {},
        num_examples=num_examples,
        class_counts=class_counts,
        partition_id=partition_id,
        num_partitions=num_partitions,
        train_loss=float(train_loss) if isinstance(train_loss, int | float) else float("nan"),
        **reported,
    )


def _site_size(
    num_examples: Any, class_counts: Any, num_classes: int, source: str
) -> tuple[int, list[int] | None]:
    """A site's example count and its class counts (None: its policy keeps its case mix,
    ``send-class-counts=false``), checked."""
    if class_counts is not None:
        return validate_site_facts(num_examples, class_counts, num_classes, source=source)
    count = as_count(num_examples, "num-examples", source)
    if count < 1:
        raise ContributionError(f"{source}: num-examples must be >= 1, got {count}")
    return count, None


def _weights_key(content: Any, source: str) -> str:
    """The record of the model's weights: ``arrays``, else the reply's only other ArrayRecord."""
    if WEIGHTS_KEY in content.array_records:
        return WEIGHTS_KEY
    others = [
        key
        for key in content.array_records
        if key not in (SCORES_KEY, GRAMS_KEY, FISHER_KEY, GAUSSIANS_KEY)
    ]
    if len(others) != 1:
        raise ContributionError(
            f"{source}: reply has ArrayRecords {sorted(content.array_records)}; expected the "
            f"model's weights as {WEIGHTS_KEY!r} (or as its only ArrayRecord)"
        )
    return others[0]


def _metric(content: Any, key: str, source: str) -> Any:
    """The first MetricRecord of the reply that holds ``key``."""
    for record in content.metric_records.values():
        if key in record:
            return record
    raise ContributionError(
        f"{source}: reply has no {key!r} metric (a MetricRecord such as "
        f"MetricRecord({{{key!r}: len(trainloader.dataset)}}))"
    )


def _scores(content: Any, model: Any, source: str) -> Any:
    """The reply's importance scores, validated against ``model`` (None when it sent none)."""
    if SCORES_KEY not in content.array_records or not len(content.array_records[SCORES_KEY]):
        return None
    scores = scores_from_tensors(_tensors(content, SCORES_KEY, source), source=source)
    validate_scores(model, scores, source=source)
    return scores


def _grams(content: Any, model: Any, source: str) -> dict[int, Any] | None:
    """The reply's level Gram matrices, validated against ``model`` (None when it sent none)."""
    if GRAMS_KEY not in content.array_records:
        return None
    raw = _tensors(content, GRAMS_KEY, source)
    try:
        levels = {int(key): value for key, value in raw.items()}
    except ValueError:
        raise ContributionError(f"{source}: malformed Gram matrix keys {sorted(raw)}") from None
    return validate_grams(model, levels, source=source)


def _class_gaussians(content: Any, spec: ModelSpec, source: str) -> ClassGaussians | None:
    """The reply's class Gaussians, checked against the model's inputs and classes (None when
    it sent none; a run that draws from them checks that every site did)."""
    if GAUSSIANS_KEY not in content.array_records:
        return None
    tensors = _tensors(content, GAUSSIANS_KEY, source)
    try:
        return ClassGaussians.from_tensors(
            tensors, spec.input_shape, num_classes=spec.num_classes, source=source
        )
    except ValueError as error:
        raise ContributionError(str(error)) from None


def _fisher(content: Any, model: Any, source: str) -> dict[str, Any] | None:
    """The reply's Fisher information, each entry checked against ``model`` (None when it sent
    none; which kinds a method needs is checked when it fuses)."""
    if FISHER_KEY not in content.array_records:
        return None
    fisher = _tensors(content, FISHER_KEY, source)
    try:
        check_fisher(model, fisher, source=source)
    except ValueError as error:
        raise ContributionError(str(error)) from None
    return fisher


def _seconds(record: Any) -> dict[str, float]:
    """The ``seconds-<phase>`` entries of a record: a site's phase timings, sanitised."""
    return {
        key.removeprefix(SECONDS_PREFIX)[:32]: float(value)
        for key, value in list(record.items())[:64]
        if key.startswith(SECONDS_PREFIX)
        and isinstance(value, int | float)
        and math.isfinite(value)
        and value >= 0
    }


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
