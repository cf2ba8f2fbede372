"""The wire format of the server's train message (the initial model, and what the site sends
besides its weights: an :class:`~fedfuse.federation.upload_request.UploadRequest`), of a
client's upload (weights, importance scores, site facts), of the statistics rounds (the
server's request, the site's statistics) and of the fine-tuning round after fusion (the fused
model out, each site's fine-tuned copy back).

Both sides use these helpers, so the record keys are defined once. Tensors travel as Flower
``ArrayRecord``s (numpy buffers, never pickles); the site facts as a ``ConfigRecord``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedfuse.federation.contract import DataContract
from fedfuse.federation.upload_request import ROUND_KINDS, UploadRequest
from fedfuse.federation.uploads import ClientUpload
from fedfuse.fusion.statistics.class_gaussians import ClassGaussians
from fedfuse.fusion.statistics.fisher import FISHER_KINDS
from fedfuse.fusion.statistics.privacy import GaussianStatistics
from fedfuse.fusion.statistics.rounds import SiteStatistics, StatisticsRequest
from fedfuse.io.validation import model_from_state
from fedfuse.models import LeveledModel, ModelSpec

WEIGHTS_KEY = "arrays"
SCORES_KEY = "scores"
METRICS_KEY = "metrics"
SITE_KEY = "site"
GRAMS_KEY = "grams"
FISHER_KEY = "fisher"
GAUSSIANS_KEY = "class-gaussians"
CONFIG_KEY = "config"
#: metrics ``seconds-<phase>``: the wall time of a site's phases
SECONDS_PREFIX = "seconds-"
#: train-message (and contract-query) config key: whether the site uploads its level Gram
#: matrices (:attr:`fedfuse.federation.upload_request.UploadRequest.grams`)
SEND_GRAMS_KEY = "send-grams"
#: train-message (and contract-query) config key: the Fisher kinds the site uploads (a comma list
#: of :data:`fedfuse.fusion.statistics.fisher.FISHER_KINDS`, "" for none)
SEND_FISHER_KEY = "send-fisher"
#: train-message (and contract-query) config key: the rank of the class Gaussians the site
#: uploads (0: none; the run completes its fusion set from them)
SEND_GAUSSIANS_KEY = "send-class-gaussians"
#: train-message (and contract-query) config key: the statistics rounds the run asks after the
#: upload ("", "rounds" or "secure-sums"; the site's policy judges them before it trains)
STATISTICS_ROUNDS_KEY = "statistics-rounds"
#: the keys of an :class:`~fedfuse.federation.upload_request.UploadRequest` in a message's
#: config: every one is required (a site never guesses what the server wants)
UPLOAD_REQUEST_KEYS = (SEND_GRAMS_KEY, SEND_FISHER_KEY, SEND_GAUSSIANS_KEY, STATISTICS_ROUNDS_KEY)
#: train-message config key, to a plain ClientApp: the extras it should send (a comma list of
#: :data:`fedfuse.federation.plain_site.EXTRAS`); reply record of those extras
EXTRAS_KEY = "fusion-extras"
#: train-message config key: the score method of the importance scores asked for
SCORE_METHOD_KEY = "score-method"
#: train-message config key: the run's data contract (JSON of
#: :meth:`fedfuse.federation.contract.DataContract.to_dict`), checked by a site before it trains
CONTRACT_KEY = "data-contract"
#: the Message type of the check before training (a ClientApp ``@app.query("contract")``)
CONTRACT_MESSAGE = "query.contract"
#: reply record of a site that did not upload: it refused (its data breaks the contract) or
#: failed (an error while loading, training or scoring); ``kind``, ``reason`` and who it is
NO_UPLOAD_KEY = "no-upload"
#: longest name or reason a site may send
_MAX_TEXT = 2000


def pack_train_request(
    arrays: ArrayRecord,
    config: ConfigRecord,
    *,
    request: UploadRequest,
    extras: Sequence[str] = (),
    score_method: str = "",
    contract: DataContract | None = None,
) -> RecordDict:
    """The server's train message: the initial model (empty unless ``init="shared"``) and its
    ``config`` with what the site sends besides its weights (``request``) and the data
    ``contract`` added (and, for a plain ClientApp, the ``extras`` to send)."""
    pack_upload_request(config, request)
    if contract is not None:
        config[CONTRACT_KEY] = json.dumps(contract.to_dict())
    if extras:
        config[EXTRAS_KEY] = ",".join(extras)
        config[SCORE_METHOD_KEY] = score_method
    return RecordDict({WEIGHTS_KEY: arrays, CONFIG_KEY: config})


@dataclass(frozen=True)
class TrainRequest:
    """A train message, unpacked: the initial model (None when it holds none), what the site
    sends besides its weights and scores, and the data contract (None: the server sent none)."""

    initial_state: dict[str, torch.Tensor] | None
    upload: UploadRequest
    contract: DataContract | None


def unpack_train_request(content: RecordDict) -> TrainRequest:
    """The :class:`TrainRequest` in a train message; a malformed contract, or an upload request
    missing a key or holding a malformed value, raises ValueError naming it."""
    initial = content.array_records.get(WEIGHTS_KEY)
    initial_state = unpack_tensors(initial) if initial is not None and len(initial) else None
    what = "the train message"
    upload = unpack_upload_request(content.config_records.get(CONFIG_KEY), what=what)
    return TrainRequest(initial_state, upload, unpack_contract(content, what=what))


def pack_upload_request(config: ConfigRecord, request: UploadRequest) -> None:
    """Write ``request`` into a message's ``config``: all of :data:`UPLOAD_REQUEST_KEYS`."""
    config[SEND_GRAMS_KEY] = request.grams
    config[SEND_FISHER_KEY] = ",".join(request.fisher)
    config[SEND_GAUSSIANS_KEY] = request.gaussian_rank
    config[STATISTICS_ROUNDS_KEY] = request.rounds


def unpack_upload_request(config: ConfigRecord | None, *, what: str) -> UploadRequest:
    """The :class:`~fedfuse.federation.upload_request.UploadRequest` in a message's ``config``
    (``what`` names the message); a missing key or a malformed value is a ValueError naming
    it."""
    config = config if config is not None else ConfigRecord()
    missing = [key for key in UPLOAD_REQUEST_KEYS if key not in config]
    if missing:
        raise ValueError(
            f"{what} lacks {', '.join(map(repr, missing))}: the server says what the site sends "
            "besides its weights (is the server an older fedfuse than the site?)"
        )
    grams = config[SEND_GRAMS_KEY]
    if not isinstance(grams, bool):
        raise ValueError(f"{what}: {SEND_GRAMS_KEY}={grams!r} must be true or false")
    fisher = tuple(kind for kind in str(config[SEND_FISHER_KEY]).split(",") if kind)
    unknown = sorted(set(fisher) - set(FISHER_KINDS))
    if unknown:
        raise ValueError(f"{what} asks for unknown Fisher kinds {unknown} ({SEND_FISHER_KEY})")
    rank = config[SEND_GAUSSIANS_KEY]
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(
            f"{what} asks for class Gaussians of rank {rank!r}, not a whole number >= 0 "
            f"({SEND_GAUSSIANS_KEY})"
        )
    rounds = str(config[STATISTICS_ROUNDS_KEY])
    if rounds not in ROUND_KINDS:
        raise ValueError(f"{what}: {STATISTICS_ROUNDS_KEY}={rounds!r} must be one of {ROUND_KINDS}")
    return UploadRequest(grams=grams, fisher=fisher, gaussian_rank=rank, rounds=rounds)


def unpack_contract(content: RecordDict, *, what: str) -> DataContract | None:
    """The data contract in a message's config (None when it carries none)."""
    config = content.config_records.get(CONFIG_KEY)
    if config is None or CONTRACT_KEY not in config:
        return None
    try:
        document = json.loads(str(config[CONTRACT_KEY]))
    except json.JSONDecodeError as error:
        raise ValueError(f"{what}'s data contract is not JSON ({error})") from None
    return DataContract.from_dict(document, source=what)


def pack_contract_query(contract: DataContract, request: UploadRequest) -> RecordDict:
    """The check before training: the run's data contract, for every site to compare its data
    with, and what the train message will ask it to send, for its policy to judge (the reply is
    :func:`pack_site_ready` or a refusal, :func:`pack_no_upload`)."""
    config = ConfigRecord({CONTRACT_KEY: json.dumps(contract.to_dict())})
    pack_upload_request(config, request)
    return RecordDict({CONFIG_KEY: config})


def unpack_contract_query(content: RecordDict) -> tuple[DataContract | None, UploadRequest]:
    """The data contract and the upload request in a check before training (ValueError names
    what is missing or malformed)."""
    what = "the server's check"
    request = unpack_upload_request(content.config_records.get(CONFIG_KEY), what=what)
    return unpack_contract(content, what=what), request


def pack_site_ready(*, site_name: str, partition_id: int) -> RecordDict:
    """A site's answer to the check before training: its data complies with the contract."""
    record = ConfigRecord({"site-name": site_name[:_MAX_TEXT], "partition-id": int(partition_id)})
    return RecordDict({SITE_KEY: record})


def pack_no_upload(kind: str, reason: str, *, site_name: str, partition_id: int) -> RecordDict:
    """The reply of a site that sends no upload: ``kind`` ``"refused"`` (its data breaks the
    run's contract; nothing was trained) or ``"failed"`` (an error), with the reason."""
    return RecordDict(
        {
            NO_UPLOAD_KEY: ConfigRecord(
                {
                    "kind": kind,
                    "reason": reason[:_MAX_TEXT],
                    "site-name": site_name[:_MAX_TEXT],
                    "partition-id": int(partition_id),
                }
            )
        }
    )


def pack_upload(upload: ClientUpload) -> RecordDict:
    """The reply content of a client's train message."""
    content = RecordDict(
        {
            WEIGHTS_KEY: ArrayRecord(upload.model.state_dict()),
            SCORES_KEY: ArrayRecord({str(k): v for k, v in upload.scores.items()}),
            METRICS_KEY: MetricRecord(
                {
                    "num-examples": upload.num_examples,
                    "train-loss": upload.train_loss,
                    **{f"{SECONDS_PREFIX}{k}": float(v) for k, v in upload.seconds.items()},
                }
            ),
            SITE_KEY: ConfigRecord(
                {
                    "partition-id": upload.partition_id,
                    "num-partitions": upload.num_partitions,
                    "site-name": upload.site_name,
                    "ray-node": upload.ray_node,
                    "model-spec": json.dumps(upload.model.spec.to_dict()),
                    "score-method": upload.score_method,
                    "init": upload.init,
                }
            ),
        }
    )
    if upload.class_counts is not None:  # None: the site's policy keeps them
        content.config_records[SITE_KEY]["class-counts"] = [int(c) for c in upload.class_counts]
    put_site_arrays(content, upload.grams, upload.fisher, upload.class_gaussians)
    return content


def put_site_arrays(
    content: RecordDict,
    grams: Mapping[int, torch.Tensor] | None,
    fisher: Mapping[str, torch.Tensor] | None,
    class_gaussians: ClassGaussians | None,
) -> None:
    """Put a site's Grams, Fisher and class Gaussians into the reply ``content``, each under its
    key (one that is None is left out): what :func:`pack_upload` and the plain app's
    ``add_fusion_extras`` both send."""
    if grams is not None:
        content[GRAMS_KEY] = ArrayRecord({str(k): v for k, v in grams.items()})
    if fisher is not None:
        content[FISHER_KEY] = ArrayRecord(dict(fisher))
    if class_gaussians is not None:
        content[GAUSSIANS_KEY] = ArrayRecord(class_gaussians.to_tensors())


def unpack_tensors(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """An ArrayRecord as a dict of CPU tensors."""
    return dict(record.to_torch_state_dict())


# ---------------------------------------------------------------------- statistics rounds
#: the Message type of a statistics round (a ClientApp ``@app.query("statistics")`` handler)
STATISTICS_MESSAGE = "query.statistics"
FUSED_KEY = "fused"
REQUEST_KEY = "request"
#: a sum-only statistics request's reading of the site's neurons (fused width x width)
READING_KEY = "reading"
STATISTICS_KEY = "statistics"


def pack_statistics_request(request: StatisticsRequest, model: LeveledModel) -> RecordDict:
    """The server's message of one statistics round to one site: the fused model so far, the
    site's own model (the server holds it; the site need not keep state between rounds) and
    the request's settings."""
    if request.readings is not None:
        raise ValueError("a statistics request goes to one site: pack request.for_site(i)")
    reading = {} if request.site_reading is None else {"reading": request.site_reading}
    if request.privacy is not None and request.privacy.design_scale is not None:
        reading["dp-design-scale"] = request.privacy.design_scale
    return RecordDict(
        {
            FUSED_KEY: ArrayRecord(request.fused.state_dict()),
            WEIGHTS_KEY: ArrayRecord(model.state_dict()),
            **({READING_KEY: ArrayRecord(reading)} if reading else {}),
            REQUEST_KEY: ConfigRecord(
                {
                    "level": request.level,
                    "fused-spec": json.dumps(request.fused.spec.to_dict()),
                    "model-spec": json.dumps(model.spec.to_dict()),
                    "max-samples": -1 if request.max_samples is None else request.max_samples,
                    "dtype": request.dtype,
                    "seed": request.seed,
                    "gram-rank": -1 if request.gram_rank is None else request.gram_rank,
                    "piece": request.piece,
                    # the mechanism, never its noise seed: the site draws its own noise
                    **(
                        {
                            "dp-noise-multiplier": request.privacy.noise_multiplier,
                            "dp-clip": request.privacy.clip,
                            "dp-target-scale": request.privacy.target_scale,
                        }
                        if request.privacy is not None
                        else {}
                    ),
                }
            ),
        }
    )


def unpack_statistics_request(content: RecordDict) -> tuple[StatisticsRequest, LeveledModel]:
    """The request and the site's model from a statistics message, validated (ValueError)."""
    try:
        config = content.config_records[REQUEST_KEY]
        fused_spec = ModelSpec.from_dict(json.loads(str(config["fused-spec"])))
        model_spec = ModelSpec.from_dict(json.loads(str(config["model-spec"])))
        fused_state = unpack_tensors(content.array_records[FUSED_KEY])
        model_state = unpack_tensors(content.array_records[WEIGHTS_KEY])
        level, max_samples = int(config["level"]), int(config["max-samples"])
        dtype, seed = str(config["dtype"]), int(config["seed"])
        gram_rank = int(config.get("gram-rank", -1))
        piece = int(config.get("piece", 0))
        reading, arrays = None, {}
        if READING_KEY in content.array_records:
            arrays = unpack_tensors(content.array_records[READING_KEY])
        if "reading" in arrays:
            reading = arrays["reading"].double()
            if reading.dim() != 2 or not bool(torch.isfinite(reading).all()):
                raise ValueError("the reading must be a finite matrix")
        columns = arrays.get("dp-design-scale")
        if columns is not None and (columns.dim() != 1 or not bool((columns > 0).all())):
            raise ValueError("the design scale must be positive numbers")
        privacy = None
        if "dp-noise-multiplier" in config:
            privacy = GaussianStatistics(
                float(config["dp-noise-multiplier"]),
                float(config["dp-clip"]),
                target_scale=float(config.get("dp-target-scale", 1.0)),
                design_scale=columns,
            )
    except (KeyError, TypeError, ValueError, RecursionError) as error:
        raise ValueError(f"malformed statistics request ({error!r})") from None
    fused = model_from_state(fused_spec, fused_state, source="the fused model of the request")
    model = model_from_state(model_spec, model_state, source="the site's model in the request")
    request = StatisticsRequest(
        level,
        fused,
        None if max_samples < 0 else max_samples,
        dtype,
        seed,
        None if gram_rank < 0 else gram_rank,
        piece=piece,
        privacy=privacy,
        site_reading=reading,
    )
    return request, model


def pack_statistics(statistics: SiteStatistics) -> RecordDict:
    """A site's reply to a statistics round."""
    return RecordDict(
        {
            STATISTICS_KEY: ArrayRecord(statistics.tensors()),
            METRICS_KEY: MetricRecord(
                {
                    "level": statistics.level,
                    "piece": statistics.piece,
                    "rows": statistics.rows,
                    "translation-ridge": statistics.translation_ridge,
                    "gram-floor": statistics.gram_floor,
                    f"{SECONDS_PREFIX}statistics": statistics.seconds,
                }
            ),
        }
    )


def unpack_statistics(content: RecordDict, *, source: str) -> SiteStatistics:
    """A site's statistics from its reply; ValueError naming ``source`` when malformed (shapes
    and values are checked by :meth:`SiteStatistics.check`, which knows the level)."""
    try:
        tensors = unpack_tensors(content.array_records[STATISTICS_KEY])
        metrics = content.metric_records[METRICS_KEY]
        missing = sorted(set(SiteStatistics.TENSORS) - set(tensors))
        if missing:
            raise KeyError(f"statistics {missing}")
        rows, level, piece = metrics["rows"], metrics["level"], metrics.get("piece", 0)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (rows, level, piece)):
            raise TypeError(f"rows {rows!r}, level {level!r}, piece {piece!r} must be integers")
        ridge = float(metrics.get("translation-ridge", 0.0))
        floor = float(metrics.get("gram-floor", 0.0))
        seconds = float(metrics.get(f"{SECONDS_PREFIX}statistics", 0.0))
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"{source}: malformed statistics reply ({error})"[:300]) from None
    return SiteStatistics(
        level=level,
        rows=rows,
        gram=tensors["gram"],
        cross=tensors["cross"],
        target_gram=tensors["target_gram"],
        translation=tensors["translation"],
        translation_ridge=ridge,
        gram_floor=floor,
        seconds=seconds,
        piece=piece,
        **{name: tensors.get(name) for name in SiteStatistics.STREAM_TENSORS},
    )


# ---------------------------------------------------------------------- fine-tuning round
#: the Message type of the fine-tuning round after fusion (``@app.train("finetune")``)
FINETUNE_MESSAGE = "train.finetune"
FINETUNE_KEY = "finetune"
#: the fine-tuning details a site reports (``loss-before`` ...: on its own data)
_FINETUNE_METRICS = ("loss_before", "loss_after", "accuracy_before", "accuracy_after")


def pack_finetune_request(model: LeveledModel, label: str = "") -> RecordDict:
    """The server's message of the fine-tuning round: the fused model to train on the site's
    data (the options are the run config's ``finetune-*`` keys, which every site reads)."""
    return RecordDict(
        {
            WEIGHTS_KEY: ArrayRecord(model.state_dict()),
            FINETUNE_KEY: ConfigRecord(
                {"model-spec": json.dumps(model.spec.to_dict()), "label": str(label)}
            ),
        }
    )


def unpack_finetune_request(content: RecordDict) -> LeveledModel:
    """The fused model of a fine-tuning message, validated (ValueError when malformed)."""
    try:
        config = content.config_records[FINETUNE_KEY]
        spec = ModelSpec.from_dict(json.loads(str(config["model-spec"])))
        state = unpack_tensors(content.array_records[WEIGHTS_KEY])
    except (KeyError, TypeError, ValueError, RecursionError) as error:
        raise ValueError(f"malformed fine-tuning request ({error!r})") from None
    return model_from_state(spec, state, source="the fused model of the fine-tuning request")


def pack_finetune_reply(
    model: LeveledModel, num_examples: int, details: dict, partition_id: int
) -> RecordDict:
    """A site's reply to the fine-tuning round: its fine-tuned copy of the fused model."""
    return RecordDict(
        {
            WEIGHTS_KEY: ArrayRecord(model.state_dict()),
            METRICS_KEY: MetricRecord(
                {
                    "num-examples": int(num_examples),
                    **{
                        key.replace("_", "-"): float(details[key])
                        for key in _FINETUNE_METRICS
                        if key in details
                    },
                    f"{SECONDS_PREFIX}finetune": float(details.get("seconds", 0.0)),
                }
            ),
            SITE_KEY: ConfigRecord({"partition-id": int(partition_id)}),
        }
    )


def unpack_finetune_reply(
    content: RecordDict, spec: ModelSpec, *, source: str
) -> tuple[LeveledModel, dict[str, float]]:
    """A site's fine-tuned model (architecture ``spec``, finite weights) and its metrics;
    ValueError naming ``source`` when anything is malformed."""
    try:
        state = unpack_tensors(content.array_records[WEIGHTS_KEY])
        metrics = content.metric_records.get(METRICS_KEY) or {}
        facts = {
            str(k)[:32]: float(v)
            for k, v in list(metrics.items())[:16]
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"{source}: malformed fine-tuning reply ({error})"[:300]) from None
    return model_from_state(spec, state, source=source), facts
