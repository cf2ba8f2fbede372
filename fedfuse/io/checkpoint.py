"""Checkpoints: safetensors weights with fedfuse's JSON metadata in the same file.

The file holds the model's tensors under ``model.<name>``, importance scores under
``scores.<level>``, optionally a site's level Gram matrices under ``grams.<level>`` and its
Fisher information under ``fisher.<entry>`` (:mod:`fedfuse.fusion.statistics.fisher`), its
class Gaussians under ``gaussians.<key>`` (:mod:`fedfuse.fusion.statistics.class_gaussians`), and in
the safetensors header a JSON document with the architecture spec and whatever else the writer
attaches (class counts, sample counts, provenance). Nothing is unpickled; loading checks every
tensor's shape against the spec before building anything, and the loaded weights stay memory-mapped
from the file (pages are read when used and can be dropped again by the OS), so a server can hold a
thousand sites' models without a thousand copies in RAM.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from fedfuse.io.atomic import atomic_path, require_file
from fedfuse.io.jsontext import parse_json
from fedfuse.io.validation import (
    ContributionError,
    model_from_state,
    validate_grams,
    validate_scores,
)
from fedfuse.models import LeveledModel, ModelSpec
from fedfuse.models.importance import Scores

FORMAT = "fedfuse-checkpoint/1"
_METADATA_KEY = "fedfuse"


class CheckpointError(ContributionError):
    """A checkpoint file is missing, corrupt, or does not describe a valid model."""


@dataclass
class Checkpoint:
    """A model with its optional importance scores and JSON metadata."""

    model: LeveledModel
    scores: Scores | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    #: the site's level Gram matrices, when the file has them and they were asked for
    grams: dict[int, torch.Tensor] | None = None
    #: the site's Fisher information by entry, when the file has it and it was asked for
    fisher: dict[str, torch.Tensor] | None = None
    #: the site's class Gaussians as tensors (checked by ``ClassGaussians.from_tensors`` where
    #: they are read), when the file has them and they were asked for
    class_gaussians: dict[str, torch.Tensor] | None = None


def save_checkpoint(
    path: str | Path,
    model: LeveledModel,
    *,
    scores: Scores | None = None,
    grams: dict[int, torch.Tensor] | None = None,
    fisher: dict[str, torch.Tensor] | None = None,
    class_gaussians: dict[str, torch.Tensor] | None = None,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Write ``model`` (and ``scores``, ``grams``, ``fisher``, ``class_gaussians``,
    ``metadata``) to ``path``
    atomically.

    The file is written next to its destination and renamed into place, so an interrupted write
    never leaves a truncated checkpoint where a good one was.
    """
    path = Path(path)
    document = {"format": FORMAT, "model": model.spec.to_dict(), **(metadata or {})}
    try:
        header = json.dumps(document)
    except TypeError as error:
        raise ValueError(
            f"checkpoint metadata for {path} is not JSON-serialisable: {error}"
        ) from error
    tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    for level, vector in (scores or {}).items():
        tensors[f"scores.{level}"] = vector.detach().float().cpu().contiguous()
    for level, gram in (grams or {}).items():
        tensors[f"grams.{level}"] = gram.detach().cpu().contiguous()
    for entry, tensor in (fisher or {}).items():
        tensors[f"fisher.{entry}"] = tensor.detach().cpu().contiguous()
    for key, tensor in (class_gaussians or {}).items():
        tensors[f"gaussians.{key}"] = tensor.detach().cpu().contiguous()
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={_METADATA_KEY: header})
    return path


def load_checkpoint(
    path: str | Path,
    *,
    require_scores: bool = False,
    with_grams: bool = False,
    with_fisher: bool = False,
    with_class_gaussians: bool = False,
) -> Checkpoint:
    """Read and validate a checkpoint written by :func:`save_checkpoint`.

    Args:
        path: the file.
        require_scores: raise unless the file holds importance scores.
        with_grams: also load and validate the Gram matrices (``Checkpoint.grams``; None when
            the file has none). Otherwise they are neither read nor checked.
        with_fisher: also load the Fisher information (``Checkpoint.fisher``; checked finite
            here, against the model where a method reads it).
        with_class_gaussians: also load the class Gaussians' tensors (checked where read).

    Raises:
        CheckpointError: naming the file and the problem (not a safetensors file, missing or
            malformed metadata, unknown or implausible architecture, missing/unexpected/
            misshapen tensors, NaN/Inf values, bad or missing scores or Grams).
    """
    try:
        path = require_file(path, "checkpoint")
    except (OSError, ValueError) as error:
        raise CheckpointError(str(error)) from None
    try:
        with safe_open(str(path), framework="pt") as handle:
            header = handle.metadata() or {}
            names = list(handle.keys())  # noqa: SIM118
            document = _parse_header(path, header)
            spec = _parse_spec(path, document)
            stray = sorted(n for n in names if not n.startswith(_PREFIXES))
            if stray:
                raise CheckpointError(f"{path}: unexpected tensors {stray}")
            wanted = [
                n
                for n in names
                if (with_grams or not n.startswith("grams."))
                and (with_fisher or not n.startswith("fisher."))
                and (with_class_gaussians or not n.startswith("gaussians."))
            ]
            tensors = {name: handle.get_tensor(name) for name in wanted}
    except (SafetensorError, OSError, ValueError) as error:
        if isinstance(error, CheckpointError):
            raise
        raise CheckpointError(f"{path}: not a readable safetensors file ({error})") from error

    source = str(path)
    state = _strip(tensors, "model.")
    try:
        model = model_from_state(spec, state, source=source)
    except ContributionError as error:
        raise CheckpointError(str(error)) from None

    scores = _levels(path, _strip(tensors, "scores."), "score") or None
    if scores is not None:
        try:
            validate_scores(model, scores, source=source)
        except ContributionError as error:
            raise CheckpointError(str(error)) from None
        scores = {level: vector.float() for level, vector in scores.items()}
    elif require_scores:
        raise CheckpointError(f"{path}: has no importance scores, and scores are required")
    grams = _levels(path, _strip(tensors, "grams."), "Gram matrix") or None
    if grams is not None:
        try:
            grams = validate_grams(model, grams, source=source)
        except ContributionError as error:
            raise CheckpointError(str(error)) from None
    fisher = _strip(tensors, "fisher.") or None
    for entry, tensor in (fisher or {}).items():
        if not tensor.is_floating_point() or not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"{path}: Fisher entry {entry!r} is not finite floats")
    metadata = {k: v for k, v in document.items() if k not in ("format", "model")}
    return Checkpoint(
        model=model,
        scores=scores,
        metadata=metadata,
        grams=grams,
        fisher=fisher,
        class_gaussians=_strip(tensors, "gaussians.") or None,
    )


_PREFIXES = ("model.", "scores.", "grams.", "fisher.", "gaussians.")


def _strip(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}


def _levels(path: Path, tensors: dict[str, torch.Tensor], what: str) -> dict[int, torch.Tensor]:
    try:
        return {int(level): value for level, value in tensors.items()}
    except ValueError:
        raise CheckpointError(f"{path}: malformed {what} tensor names {sorted(tensors)}") from None


def _parse_header(path: Path, header: dict[str, str]) -> dict[str, Any]:
    """The fedfuse JSON document of a safetensors header, or a CheckpointError naming ``path``."""
    if _METADATA_KEY not in header:
        raise CheckpointError(f"{path}: no fedfuse metadata in the safetensors header")
    try:  # bounded: a header's JSON of {},{},... would parse to gigabytes of objects
        document = parse_json(header[_METADATA_KEY], str(path), what="fedfuse metadata")
    except ValueError as error:
        raise CheckpointError(str(error)) from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        found = document.get("format") if isinstance(document, dict) else type(document).__name__
        raise CheckpointError(
            f"{path}: unsupported checkpoint format {found!r:.80}, expected {FORMAT!r}"
        )
    return document


def _parse_spec(path: Path, document: dict[str, Any]) -> ModelSpec:
    try:
        return ModelSpec.from_dict(document.get("model"))  # type: ignore[arg-type]
    except (ValueError, TypeError, OverflowError) as error:
        raise CheckpointError(f"{path}: {error}"[:500]) from None


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The JSON metadata of a checkpoint, without loading its tensors."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as handle:
            header = handle.metadata() or {}
    except (SafetensorError, OSError, ValueError) as error:
        raise CheckpointError(f"{path}: cannot read fedfuse metadata ({error})") from error
    return _parse_header(path, header)


def scores_to_tensors(scores: Scores) -> dict[str, torch.Tensor]:
    """Scores as a flat ``{"<level>": tensor}`` mapping (for records and files)."""
    return {str(level): vector for level, vector in scores.items()}


def scores_from_tensors(tensors: dict[str, torch.Tensor], *, source: str) -> Scores:
    """Inverse of :func:`scores_to_tensors`; names ``source`` on malformed keys."""
    try:
        return {int(key): value.float() for key, value in tensors.items()}
    except ValueError:
        raise ContributionError(f"{source}: malformed score keys {sorted(tensors)}") from None
