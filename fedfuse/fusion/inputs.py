"""What a fusion method gets besides the models (:class:`FusionInputs`), checked and resolved once.

Every method reads its inputs through these helpers, so a missing or malformed input gets the
same error, naming the method, the field and the model index (or level), whichever method reads
it; and a method that falls back when an input is absent falls back the same way as the others:

* :func:`check_inputs`: the one validation gate (:meth:`FusionMethod.fuse` calls it): required
  fields present, per-model fields of the right length, and the values of the fields the method
  needs well-formed.
* :func:`resolve_scores`: importance scores per model, given or computed on the fusion set with
  a fallback score method, then normalised per level.
* :func:`sample_counts`, :func:`averaging_weights`: model weights from the sample counts;
  :func:`averaging_candidates`: those to try for ``weighted_average="auto"``, kept by
  fusion-set accuracy (:mod:`fedfuse.fusion.blocks.selection`).
* :func:`head_weights`: per class, each model's share of that class's training samples.
* :func:`check_levels`: every model's neuron levels affine and the same.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from fedfuse.fusion.blocks.alignment import affine_levels
from fedfuse.io.validation import validate_scores
from fedfuse.models import LeveledModel, ModelSpec
from fedfuse.models.importance import Scores, importance_scores, normalize_scores, uniform_scores
from fedfuse.runtime import row_major

log = logging.getLogger(__name__)


@dataclass
class FusionInputs:
    """What the server holds besides the models; each method says which fields it needs.

    Attributes:
        data: the fusion set's inputs ``(B, ...)``, normalised like the training data.
        labels: the fusion set's labels (used only by methods that train on it, e.g. KD, LP).
        scores: per model, its importance scores by level.
        sample_counts: per model, the number of training samples it saw (FedAvg weights).
        class_counts: per model, its training samples per class.
        grams: per model, by neuron level, the Gram matrix ``X^T X`` of the level's design rows
            (its inputs with a trailing 1, unfolded for convolutions) summed over the site's own
            data (RegMean needs no fusion set, only these); or its exact factor ``R``
            (``r x d``, ``r < d``, ``R^T R = X^T X``: :mod:`fedfuse.io.grams`).
        fisher: per model, its Fisher information on the site's own data, by entry:
            ``diagonal.<parameter>`` and/or the K-FAC factors ``kfac.<layer>.inputs``,
            ``kfac.<layer>.outputs`` (:func:`fedfuse.fusion.statistics.fisher.site_fisher`).
        sites: a :class:`~fedfuse.fusion.statistics.channels.SiteChannel` reaching the site of each
            model for statistics rounds (the Flower strategy's, or ``LocalSites`` in-process).
    """

    data: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    scores: Sequence[Scores] | None = None
    sample_counts: Sequence[int] | None = None
    class_counts: Sequence[Sequence[int]] | None = None
    grams: Sequence[dict[int, torch.Tensor]] | None = None
    fisher: Sequence[dict[str, torch.Tensor]] | None = None
    sites: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.data, torch.Tensor):  # NCHW batches whatever order the caller's has
            self.data = row_major(self.data)


#: every field of :class:`FusionInputs`
INPUT_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(FusionInputs))
#: the fields holding one entry per model
PER_MODEL_FIELDS = ("scores", "sample_counts", "class_counts", "grams", "fisher")


def check_inputs(
    method: str,
    models: Sequence[LeveledModel],
    inputs: FusionInputs,
    *,
    required: Iterable[str],
    needs: Iterable[str],
) -> None:
    """Raise ValueError, naming ``method``, the field and the model, unless the inputs fit.

    ``required`` fields must be given; every per-model field given must have one entry per
    model; the fields in ``needs`` that are given must be well-formed (the fusion set of the
    models' input shape and finite, labels one class index per sample, scores valid for each
    model, counts finite and non-negative). Gram matrices are checked where they are read (they
    may be memory-mapped, one site at a time).
    """
    for name in sorted(required):
        if getattr(inputs, name) is None:
            raise ValueError(f"{method}: needs FusionInputs.{name}, which was not given")
    for name in PER_MODEL_FIELDS:
        value = getattr(inputs, name)
        if value is not None and len(value) != len(models):
            raise ValueError(
                f"{method}: FusionInputs.{name} has {len(value)} entries for {len(models)} models"
            )
    if inputs.sites is not None and len(inputs.sites) != len(models):
        raise ValueError(
            f"{method}: FusionInputs.sites reaches {len(inputs.sites)} sites for "
            f"{len(models)} models"
        )
    needs = set(needs)
    spec = models[0].spec
    if "data" in needs and inputs.data is not None:
        _check_data(method, inputs.data, spec)
    if "labels" in needs and inputs.labels is not None:
        _check_labels(method, inputs.labels, inputs.data, spec.num_classes)
    if "scores" in needs and inputs.scores is not None:
        for index, (model, scores) in enumerate(zip(models, inputs.scores, strict=True)):
            _check_scores(method, index, model, scores)
    if "sample_counts" in needs and inputs.sample_counts is not None:
        sample_counts(method, inputs, len(models))
    if "class_counts" in needs and inputs.class_counts is not None:
        class_count_matrix(method, inputs.class_counts, len(models), spec.num_classes)


def _check_data(method: str, data: torch.Tensor, spec: ModelSpec) -> None:
    if not isinstance(data, torch.Tensor) or not data.is_floating_point():
        found = data.dtype if isinstance(data, torch.Tensor) else type(data).__name__
        raise ValueError(f"{method}: FusionInputs.data must be a float tensor, got {found}")
    if tuple(data.shape[1:]) != tuple(spec.input_shape):
        raise ValueError(
            f"{method}: FusionInputs.data has samples of shape {tuple(data.shape[1:])}, the "
            f"models take {tuple(spec.input_shape)}"
        )
    if len(data) == 0:
        raise ValueError(f"{method}: FusionInputs.data, the fusion set, is empty")
    if not bool(torch.isfinite(data).all()):
        raise ValueError(f"{method}: FusionInputs.data has NaN/Inf values")


def _check_labels(
    method: str, labels: torch.Tensor, data: torch.Tensor | None, classes: int
) -> None:
    if not isinstance(labels, torch.Tensor) or labels.dim() != 1 or labels.is_floating_point():
        found = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ValueError(
            f"{method}: FusionInputs.labels must be a 1-D tensor of class indices, got {found}"
        )
    if data is not None and len(labels) != len(data):
        raise ValueError(f"{method}: {len(labels)} labels for {len(data)} fusion samples")
    if len(labels) and (int(labels.min()) < 0 or int(labels.max()) >= classes):
        raise ValueError(
            f"{method}: FusionInputs.labels must be class indices in [0, {classes}), got "
            f"[{int(labels.min())}, {int(labels.max())}]"
        )


def _check_scores(method: str, index: int, model: LeveledModel, scores: Scores) -> None:
    source = f"{method}: scores of model {index}"
    if not isinstance(scores, Mapping):
        raise ValueError(f"{source} are a {type(scores).__name__}, expected {{level: tensor}}")
    validate_scores(model, scores, source=source)


def resolve_scores(
    method: str,
    models: Sequence[LeveledModel],
    inputs: FusionInputs,
    *,
    use_scores: bool = True,
    fallback: str = "uniform",
    normalization: str = "sum",
    device: str | torch.device = "auto",
) -> list[Scores]:
    """Each model's importance scores by level, normalised per level (``normalization``).

    ``inputs.scores`` when given (validated); else scores computed on the fusion set with the
    score method ``fallback`` (``"uniform"`` needs no data). ``use_scores=False`` gives uniform
    scores whatever was given.
    """
    if not use_scores:
        raw = [uniform_scores(m) for m in models]
    elif inputs.scores is not None:
        raw = list(inputs.scores)
        for index, (model, scores) in enumerate(zip(models, raw, strict=True)):
            _check_scores(method, index, model, scores)
    else:
        log.info("%s: no scores given; computing %s scores on the fusion set", method, fallback)
        if fallback != "uniform" and inputs.data is None:
            raise ValueError(
                f"{method}: no FusionInputs.scores given, and {fallback} scores need "
                "FusionInputs.data"
            )
        data = inputs.data if inputs.data is not None else torch.empty(0)
        raw = [
            importance_scores(m, data, inputs.labels, method=fallback, device=device)
            for m in models
        ]
    return [normalize_scores(s, normalization) for s in raw]


def sample_counts(method: str, inputs: FusionInputs, count: int) -> list[float]:
    """The models' sample counts as floats: ``count`` finite numbers >= 0 with a positive sum."""
    if inputs.sample_counts is None:
        raise ValueError(f"{method}: needs FusionInputs.sample_counts, which was not given")
    values = list(inputs.sample_counts)
    if len(values) != count:
        raise ValueError(
            f"{method}: FusionInputs.sample_counts has {len(values)} entries for {count} models"
        )
    counts = []
    for index, value in enumerate(values):
        number = _number(value)
        if number is None or not math.isfinite(number) or number < 0:
            raise ValueError(
                f"{method}: the sample count of model {index} is {value!r}; sample counts must "
                "be finite numbers >= 0"
            )
        counts.append(number)
    if sum(counts) <= 0:
        raise ValueError(f"{method}: the sample counts {counts} must have a positive sum")
    return counts


def _number(value: object) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def averaging_weights(method: str, inputs: FusionInputs, count: int, weighted: bool) -> list[float]:
    """Uniform model weights, or the sample counts normalised to sum to 1 when ``weighted``."""
    if not weighted:
        return [1.0 / count] * count
    counts = sample_counts(method, inputs, count)
    return [c / sum(counts) for c in counts]


#: the values of a ``weighted_average`` option: uniform, by sample counts, chosen on the fusion set
WEIGHTED_AVERAGE = (False, True, "auto")


def check_weighted_average(method: str, weighted: object) -> None:
    """Raise ValueError unless ``weighted`` is one of :data:`WEIGHTED_AVERAGE`."""
    if not (isinstance(weighted, bool) or weighted == "auto"):
        raise ValueError(
            f"{method}: weighted_average must be true, false or 'auto', got {weighted!r}"
        )


def averaging_candidates(
    method: str, inputs: FusionInputs, count: int, weighted: bool | str
) -> dict[str, list[float]]:
    """The model weights a method fuses with, by name (``"uniform"`` or ``"samples"``).

    ``weighted=False``: uniform; ``True``: the sample counts normalised (FedAvg's weights).
    ``"auto"``: both, the sample counts first (preferred), when the sample counts and the
    labelled fusion set are given (the method fuses with each and keeps one by fusion-set
    accuracy: :func:`~fedfuse.fusion.blocks.selection.best_on_fusion_set`; when the
    sample counts are all equal the two are one, ``"uniform"``); else the one the inputs allow:
    the sample counts without a labelled fusion set, uniform without sample counts.
    """
    check_weighted_average(method, weighted)
    if weighted != "auto":
        name = "samples" if weighted else "uniform"
        return {name: averaging_weights(method, inputs, count, bool(weighted))}
    uniform = averaging_weights(method, inputs, count, False)
    if inputs.sample_counts is None:
        return {"uniform": uniform}
    samples = averaging_weights(method, inputs, count, True)
    if inputs.data is None or inputs.labels is None:
        return {"samples": samples}
    if all(math.isclose(a, b, rel_tol=1e-12) for a, b in zip(uniform, samples, strict=True)):
        return {"uniform": uniform}
    return {"samples": samples, "uniform": uniform}  # preferred first: the unlabelled choice


@torch.no_grad()
def fusion_set_loss(model: LeveledModel, inputs: FusionInputs, batch_size: int = 256) -> float:
    """Mean cross-entropy of ``model`` on the labelled fusion set (on the CPU): the tie-break
    of the methods' ``"auto"`` choices, after the fusion-set accuracy
    (:func:`~fedfuse.fusion.blocks.selection.best_on_fusion_set`)."""
    if inputs.data is None or inputs.labels is None:
        raise ValueError("the fusion-set loss needs FusionInputs.data and FusionInputs.labels")
    model = model.cpu().eval()
    batches = zip(
        inputs.data.cpu().split(batch_size), inputs.labels.cpu().split(batch_size), strict=True
    )
    total = sum(
        torch.nn.functional.cross_entropy(model(x), y, reduction="sum").item() for x, y in batches
    )
    return total / len(inputs.data)


def class_count_matrix(
    method: str, class_counts: Sequence[Sequence[int]], count: int, classes: int
) -> torch.Tensor:
    """``(models, classes)`` float64 class counts, each row ``classes`` finite counts >= 0."""
    if len(class_counts) != count:
        raise ValueError(
            f"{method}: FusionInputs.class_counts has {len(class_counts)} entries for "
            f"{count} models"
        )
    rows = []
    for index, row in enumerate(class_counts):
        try:
            values = None if isinstance(row, str) else [_number(v) for v in row]
        except TypeError:  # not iterable
            values = None
        if values is None or len(values) != classes:
            raise ValueError(
                f"{method}: the class counts of model {index} must be {classes} numbers, got "
                f"{row!r:.80}"
            )
        if any(v is None or not math.isfinite(v) or v < 0 for v in values):
            raise ValueError(
                f"{method}: the class counts of model {index} must be finite and >= 0, got "
                f"{row!r:.80}"
            )
        rows.append(values)
    return torch.tensor(rows, dtype=torch.float64)


def head_weights(
    method: str, class_counts: Sequence[Sequence[int]] | None, count: int, classes: int
) -> torch.Tensor:
    """``(models, classes)`` weights of each model's logit of each class, summing to 1 per class.

    Model ``k``'s weight for class ``c`` is its share of class ``c``'s training samples; a class
    no model saw, or ``class_counts=None``, weighs the models equally.
    """
    weights = torch.ones(count, classes, dtype=torch.float64)
    if class_counts is not None:
        counts = class_count_matrix(method, class_counts, count, classes)
        seen = counts.sum(0) > 0
        weights[:, seen] = counts[:, seen]
    return weights / weights.sum(0, keepdim=True)


def check_levels(method: str, models: Sequence[LeveledModel]) -> list[int]:
    """Every model's neuron levels must be affine and those of model 0; returns them."""
    levels = models[0].neuron_levels
    for index, model in enumerate(models):
        try:
            affine_levels(model)
        except ValueError as error:
            raise ValueError(f"{method}: model {index}: {error}") from None
        if model.neuron_levels != levels:
            raise ValueError(f"{method}: model {index} has other neuron levels than model 0")
    return levels
