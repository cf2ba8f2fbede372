"""Checks on everything that arrives from elsewhere (a client, a file) before the server uses it.

Every check raises :class:`ContributionError` with a message that names the source (a client,
a file), the tensor or field, and what was expected versus found, so a bad upload is easy to
trace. Two rules hold throughout:

* sizes are compared with what the architecture spec implies before anything of that size is
  allocated (the spec is built on PyTorch's meta device), so a forged spec costs nothing;
* values are checked after the cast to the dtype the server computes in (float32 weights,
  float64 Gram matrices), so a float64 value that overflows float32 is caught, not carried.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fedfuse.io.grams import is_gram_factor
from fedfuse.models import LeveledModel, ModelSpec, build_model
from fedfuse.models.affine import affine_view, gram_levels
from fedfuse.models.importance import Scores

#: largest sample count a site may report: far above any real site, small enough to stay exact
#: in float64 arithmetic (sample-count weights)
MAX_EXAMPLES = 1 << 48


class ContributionError(ValueError):
    """A model, its weights, its scores or its site facts do not match what fusion expects."""


def validate_state_dict(
    model: LeveledModel | ModelSpec, state: Mapping[str, Any], *, source: str
) -> dict[str, torch.Tensor]:
    """Check ``state`` against the architecture and return it cast to float32.

    Names, shapes and dtypes are compared with the spec's (meta-device) shapes first; only then
    are the values cast to float32 and checked to be finite (BatchNorm variances non-negative).
    Integer buffers (BatchNorm's batch counters) stay integers and must be non-negative.
    """
    spec = model.spec if isinstance(model, LeveledModel) else model
    try:
        reference = build_model(spec, device="meta").state_dict()
    except (ValueError, TypeError, RuntimeError) as error:  # unknown arch, inconsistent spec
        raise ContributionError(f"{source}: {error}") from None
    expected = {name: tuple(t.shape) for name, t in reference.items()}
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    if missing or unexpected:
        raise ContributionError(
            f"{source}: weights do not match architecture {spec.arch!r} "
            f"(missing {missing or 'none'}, unexpected {unexpected or 'none'})"
        )
    checked: dict[str, torch.Tensor] = {}
    for name, shape in expected.items():
        tensor = state[name]
        if not isinstance(tensor, torch.Tensor):
            raise ContributionError(f"{source}: tensor {name!r} is a {type(tensor).__name__}")
        if tuple(tensor.shape) != shape:
            raise ContributionError(
                f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"architecture expects {shape}"
            )
        if not reference[name].is_floating_point():  # a counter (BatchNorm's batches seen)
            if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
                raise ContributionError(
                    f"{source}: tensor {name!r} is a counter; expected an integer dtype, "
                    f"got {tensor.dtype}"
                )
            if (tensor < 0).any():
                raise ContributionError(f"{source}: counter {name!r} is negative")
            checked[name] = tensor.to(reference[name].dtype)
            continue
        if not tensor.is_floating_point():
            raise ContributionError(f"{source}: tensor {name!r} has non-float dtype {tensor.dtype}")
        cast = tensor.float()
        if not torch.isfinite(cast).all():
            bad = int((~torch.isfinite(cast)).sum())
            raise ContributionError(
                f"{source}: tensor {name!r} has {bad} NaN/Inf values (as float32)"
            )
        if name.endswith("running_var") and (cast < 0).any():
            raise ContributionError(f"{source}: tensor {name!r} has negative variances")
        checked[name] = cast
    return checked


def model_from_state(spec: ModelSpec, state: Mapping[str, Any], *, source: str) -> LeveledModel:
    """A ``spec`` model holding ``state``, validated before any parameter memory is allocated.

    The model is built on the meta device and adopts the checked tensors (no copy for float32
    input, so memory-mapped tensors stay memory-mapped).
    """
    checked = validate_state_dict(spec, state, source=source)
    model = build_model(spec, device="meta")
    model.load_state_dict(checked, assign=True)
    return model


def load_validated_state(
    model: LeveledModel, state: Mapping[str, torch.Tensor], *, source: str
) -> LeveledModel:
    """Validate ``state`` against ``model`` and copy it into ``model`` (float32)."""
    model.load_state_dict(validate_state_dict(model, state, source=source))
    return model


def validate_scores(model: LeveledModel, scores: Scores, *, source: str) -> None:
    """Check that ``scores`` cover every neuron level with finite, non-negative vectors."""
    expected = set(model.neuron_levels)
    missing = sorted(expected - scores.keys())
    unexpected = sorted(scores.keys() - expected)
    if missing or unexpected:
        raise ContributionError(
            f"{source}: importance scores for levels {sorted(scores)}; the model's neuron levels "
            f"are {sorted(expected)} (missing {missing or 'none'}, extra {unexpected or 'none'})"
        )
    for level, vector in scores.items():
        width = model.level_width(level)
        if vector.dim() != 1 or len(vector) != width:
            raise ContributionError(
                f"{source}: scores of level {level} have shape {tuple(vector.shape)}, "
                f"expected ({width},)"
            )
        if not vector.is_floating_point():
            raise ContributionError(f"{source}: scores of level {level} have dtype {vector.dtype}")
        cast = vector.float()
        if not torch.isfinite(cast).all() or (cast < 0).any():
            raise ContributionError(
                f"{source}: scores of level {level} must be finite and non-negative"
            )


def validate_grams(
    model: LeveledModel, grams: Mapping[int, torch.Tensor], *, source: str
) -> dict[int, torch.Tensor]:
    """Check a site's level Gram matrices ``X^T X`` and return them as float64.

    One per level that has a Gram (:func:`~fedfuse.models.affine.gram_levels`: not a user's
    BatchNorm cut as a level of its own), with the level's design width ``d`` (fan-in plus the
    bias column), finite, and either the ``d x d`` matrix, symmetric and positive semi-definite
    (as every ``X^T X`` is; one that is not cannot have come from data, and would make RegMean's
    solve meaningless), or its factor ``R`` (``r x d``, ``r < d``: :mod:`fedfuse.io.grams`),
    which is positive semi-definite by construction and is kept as the factor.
    """

    expected = gram_levels(model)
    if sorted(grams) != expected:
        raise ContributionError(
            f"{source}: Gram matrices for levels {sorted(grams)}, expected {expected}"
        )
    checked: dict[int, torch.Tensor] = {}
    for level, gram in grams.items():
        view = affine_view(model.levels[level])
        size = view.fan_in if view is not None else None
        shape = tuple(gram.shape)
        factor = is_gram_factor(gram) and size is not None
        if gram.dim() != 2 or (shape[0] != shape[1] and not factor) or (size and shape[1] != size):
            raise ContributionError(
                f"{source}: Gram matrix of level {level} has shape {shape}, "
                f"expected ({size}, {size}) or a factor (rows < {size}, {size})"
            )
        if not gram.is_floating_point():
            raise ContributionError(
                f"{source}: Gram matrix of level {level} has dtype {gram.dtype}"
            )
        cast = gram.double()
        if not torch.isfinite(cast).all():
            raise ContributionError(f"{source}: Gram matrix of level {level} has NaN/Inf values")
        if not factor:
            scale = float(cast.abs().max())
            if float((cast - cast.T).abs().max()) > 1e-6 * scale:
                raise ContributionError(f"{source}: Gram matrix of level {level} is not symmetric")
            if not _positive_semidefinite(cast):
                raise ContributionError(
                    f"{source}: Gram matrix of level {level} is not positive semi-definite"
                )
        checked[level] = cast
    return checked


def _positive_semidefinite(gram: torch.Tensor) -> bool:
    """Whether ``gram`` is PSD up to rounding: a Cholesky of ``gram + 1e-6 * mean(diag) * I``."""
    diagonal = gram.diagonal()
    if (diagonal < 0).any():
        return False
    shift = 1e-6 * max(float(diagonal.mean()), 1e-300) + 1e-300
    _, info = torch.linalg.cholesky_ex(gram + shift * torch.eye(len(gram), dtype=gram.dtype))
    return int(info) == 0


def validate_site_facts(
    num_examples: Any, class_counts: Any, num_classes: int, *, source: str
) -> tuple[int, list[int]]:
    """A site's sample count and per-class counts as ints, or a named error.

    The count must be a positive integer up to :data:`MAX_EXAMPLES`; the class counts
    ``num_classes`` non-negative integers summing to it.
    """
    count = as_count(num_examples, "num-examples", source)
    if count < 1:
        raise ContributionError(f"{source}: num-examples must be >= 1, got {count}")
    if isinstance(class_counts, str | bytes) or not isinstance(class_counts, Sequence):
        raise ContributionError(f"{source}: class counts must be a list, got {class_counts!r}")
    counts = [as_count(c, "class count", source) for c in class_counts]
    if len(counts) != num_classes:
        raise ContributionError(
            f"{source}: {len(counts)} class counts for a {num_classes}-class model"
        )
    if any(c < 0 for c in counts):
        raise ContributionError(f"{source}: negative class counts {counts}")
    if sum(counts) != count:
        raise ContributionError(
            f"{source}: class counts {counts} sum to {sum(counts)}, not num-examples {count}"
        )
    return count, counts


def as_count(value: Any, what: str, source: str) -> int:
    """``value`` as an int in ``[-MAX_EXAMPLES, MAX_EXAMPLES]`` (floats only when integral)."""
    if isinstance(value, bool):
        raise ContributionError(f"{source}: {what} must be an integer, got {value!r}")
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise ContributionError(f"{source}: {what} must be an integer, got {value!r}")
        value = int(value)
    if not isinstance(value, int):
        raise ContributionError(
            f"{source}: {what} must be an integer, got {type(value).__name__} {value!r:.40}"
        )
    if abs(value) > MAX_EXAMPLES:
        digits = len(str(abs(value)))
        raise ContributionError(f"{source}: {what} is implausibly large ({digits} digits)")
    return value


def validate_partition(partition_id: Any, num_partitions: Any, *, source: str) -> tuple[int, int]:
    """A site's ``partition-id`` and ``num-partitions`` (0: a deployment) as checked ints."""
    pid = as_count(partition_id, "partition-id", source)
    total = as_count(num_partitions, "num-partitions", source)
    if pid < 0 or total < 0:
        raise ContributionError(
            f"{source}: partition-id {pid} and num-partitions {total} must be >= 0"
        )
    if total and pid >= total:
        raise ContributionError(
            f"{source}: partition-id {pid} is outside 0..{total - 1} (num-partitions {total})"
        )
    return pid, total
