"""The wire format of a scoring round: the server sends a model, each site replies with its
score on its own labelled rows (Flower's federated evaluation).

The server's message is what Flower's stock strategies send and a template ``@app.evaluate()``
handler reads: ``RecordDict({"arrays": ArrayRecord(state), "config": ConfigRecord(...)})``, of
type ``evaluate``; ``state`` is in the sites' own format (fedfuse's leveled model, or the user's
class's state dict for a plain ClientApp). The config adds ``model-spec`` (the leveled model's
architecture, which fedfuse's ClientApp builds the model from; a plain app ignores it). The reply
is a ``MetricRecord`` as the templates write it: accuracy, loss and ``num-examples``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, MessageType, MetricRecord, RecordDict

from fedfuse.fusion.statistics.channels import SiteScore
from fedfuse.io.validation import as_count, model_from_state
from fedfuse.models import LeveledModel, ModelSpec

from .records import CONFIG_KEY, METRICS_KEY, WEIGHTS_KEY, unpack_tensors

#: the Message type of a scoring round (a ClientApp's ``@app.evaluate()`` handler)
SCORE_MESSAGE = MessageType.EVALUATE
#: the metric keys read from a reply, the first present of each (Flower's templates write the
#: first of each)
ACCURACY_KEYS = ("eval_acc", "accuracy", "acc")
LOSS_KEYS = ("eval_loss", "loss")
EXAMPLES_KEY = "num-examples"
SPEC_KEY = "model-spec"


def pack_score_request(
    state: Mapping[str, torch.Tensor], spec: ModelSpec | None = None
) -> RecordDict:
    """The server's message of a scoring round: the model's ``state`` (in the sites' own format)
    and the config, with the leveled model's ``spec`` when the sites run fedfuse's ClientApp."""
    config: dict[str, Any] = {"server-round": 1}
    if spec is not None:
        config[SPEC_KEY] = json.dumps(spec.to_dict())
    arrays = ArrayRecord({name: value.detach().cpu() for name, value in state.items()})
    return RecordDict({WEIGHTS_KEY: arrays, CONFIG_KEY: ConfigRecord(config)})


def unpack_score_request(content: RecordDict) -> LeveledModel:
    """The model a scoring message sends fedfuse's ClientApp, validated (ValueError when
    malformed)."""
    try:
        spec = ModelSpec.from_dict(json.loads(str(content.config_records[CONFIG_KEY][SPEC_KEY])))
        state = unpack_tensors(content.array_records[WEIGHTS_KEY])
    except (KeyError, TypeError, ValueError, RecursionError) as error:
        raise ValueError(f"malformed scoring request ({error!r})") from None
    return model_from_state(spec, state, source="the model of the scoring request")


def pack_score_reply(score: SiteScore) -> RecordDict:
    """A site's reply to a scoring round, under the keys of Flower's templates."""
    metrics = {
        ACCURACY_KEYS[0]: float(score.accuracy),
        LOSS_KEYS[0]: float(score.loss),
        EXAMPLES_KEY: int(score.examples),
    }
    return RecordDict({METRICS_KEY: MetricRecord(metrics)})


def unpack_site_score(content: RecordDict, *, source: str) -> SiteScore:
    """A site's score from its reply: its ``metrics`` MetricRecord (or its only one); accuracy
    in [0, 1], a loss >= 0 (inf allowed: a model that diverged), ``num-examples`` >= 1.
    ValueError naming ``source`` and the key otherwise."""
    records = content.metric_records
    if METRICS_KEY in records:
        metrics = records[METRICS_KEY]
    elif len(records) == 1:
        metrics = next(iter(records.values()))
    else:
        raise ValueError(
            f"{source}: reply has MetricRecords {sorted(records)[:8]}; expected the score as "
            f"{METRICS_KEY!r} (or as its only MetricRecord)"
        )
    key, accuracy = _number(metrics, ACCURACY_KEYS, source)
    if not 0.0 <= accuracy <= 1.0:
        raise ValueError(f"{source}: {key}={accuracy!r} is not an accuracy in [0, 1]")
    key, loss = _number(metrics, LOSS_KEYS, source)
    if math.isnan(loss) or loss < 0:
        raise ValueError(f"{source}: {key}={loss!r} is not a loss (a number >= 0)")
    if EXAMPLES_KEY not in metrics:
        raise ValueError(f"{source}: reply has no {EXAMPLES_KEY!r} metric")
    examples = as_count(metrics[EXAMPLES_KEY], EXAMPLES_KEY, source)
    if examples < 1:
        raise ValueError(f"{source}: {EXAMPLES_KEY} must be >= 1, got {examples}")
    return SiteScore(accuracy, loss, examples)


def _number(metrics: MetricRecord, keys: Sequence[str], source: str) -> tuple[str, float]:
    """The first of ``keys`` present in ``metrics`` and its value, a single number."""
    key = next((k for k in keys if k in metrics), None)
    if key is None:
        raise ValueError(f"{source}: reply has none of the metrics {list(keys)}")
    value = metrics[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{source}: {key} is not a number ({type(value).__name__})")
    return key, float(value)
