"""Fuse saved checkpoints offline: ``fedfuse fuse CKPT CKPT ... --method kf-linear``.

One-shot fusion does not need a federation once the clients' checkpoints exist: this module
loads them (with their importance scores and sample/class counts), builds the server's
:class:`~fedfuse.fusion.FusionInputs` (:func:`~fedfuse.federation.upload_inputs.fusion_inputs`)
from a fusion set given as a short spec string, and runs any registered fusion method. It is
Flower-free; the ``fedfuse fuse`` command (:mod:`fedfuse.cli.fuse`) writes the fused model as a
checkpoint that records how it was made.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from fedfuse.data import ImageDataset, load_dataset, load_npz_dataset
from fedfuse.data._common import SPLITS
from fedfuse.federation.evaluation import format_level_summary
from fedfuse.federation.scenario import Scenario
from fedfuse.federation.upload_inputs import UploadFacts, fusion_inputs
from fedfuse.federation.uploads import UploadStore
from fedfuse.fusion import (
    FusionInputs,
    FusionMethod,
    FusionResult,
    make_fusion_method,
    parse_options,
)
from fedfuse.fusion.statistics.class_gaussians import GaussianFusionSet
from fedfuse.io.checkpoint import Checkpoint, load_checkpoint
from fedfuse.io.jsontext import read_json_file
from fedfuse.io.validation import as_count
from fedfuse.models import LeveledModel, ModelSpec
from fedfuse.models.importance import Scores
from fedfuse.settings.run import RunSettings

log = logging.getLogger(__name__)

__all__ = [
    "FusionSetSpec",
    "check_data_fits",
    "format_level_summary",
    "fuse_checkpoints",
    "parse_data_spec",
    "parse_options",
    "parse_widths",
]

SPEC_HELP = "an .npz site data file, or name[:split[:n[:seed]]], e.g. fashion-mnist:train:400:0"


# ---------------------------------------------------------------------------------- data specs
@dataclass(frozen=True)
class FusionSetSpec:
    """A dataset named by a short string: an ``.npz`` site data file or ``name[:split[:n[:seed]]]``.

    Parsing only checks the syntax (cheap, so a CLI can reject a typo before loading anything);
    :meth:`load` reads the data. ``n`` draws that many samples at random (seeded by ``seed``,
    default 0) without replacement; without it the whole split is used.
    """

    text: str
    path: Path | None = None
    name: str = ""
    split: str = "train"
    n: int | None = None
    seed: int = 0

    @classmethod
    def parse(cls, spec: str) -> FusionSetSpec:
        """Parse ``spec``; raises ValueError naming it when it is malformed."""
        text = spec.strip()
        if not text:
            raise ValueError(f"data spec {spec!r} is empty; expected {SPEC_HELP}")
        if text.lower().endswith(".npz") or "/" in text or Path(text).is_file():
            return cls(text=spec, path=Path(text).expanduser())
        parts = text.split(":")
        if len(parts) > 4 or not parts[0]:
            raise ValueError(f"data spec {spec!r} is malformed; expected {SPEC_HELP}")
        name = parts[0]
        split = parts[1] if len(parts) > 1 and parts[1] else "train"
        if split not in SPLITS:
            raise ValueError(f"data spec {spec!r}: split must be one of {SPLITS}, got {split!r}")
        n = _spec_int(spec, "sample count", parts[2]) if len(parts) > 2 and parts[2] else None
        if n is not None and n < 1:
            raise ValueError(f"data spec {spec!r}: sample count must be >= 1, got {n}")
        seed = _spec_int(spec, "seed", parts[3]) if len(parts) > 3 and parts[3] else 0
        return cls(text=spec, name=name, split=split, n=n, seed=seed)

    def load(self) -> ImageDataset:
        """The dataset (or its seeded random sample of ``n``)."""
        if self.path is not None:
            return load_npz_dataset(self.path)
        try:
            dataset = load_dataset(self.name, self.split)
        except ValueError as error:
            raise ValueError(f"data spec {self.text!r}: {error}") from error
        if self.n is None:
            return dataset
        if self.n > len(dataset):
            raise ValueError(
                f"data spec {self.text!r} asks for {self.n} samples, but {self.name}/{self.split} "
                f"has only {len(dataset)}"
            )
        generator = torch.Generator().manual_seed(self.seed)
        chosen = torch.randperm(len(dataset), generator=generator)[: self.n].sort().values
        return dataset.subset(chosen)


def _spec_int(spec: str, what: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"data spec {spec!r}: {what} must be an integer, got {value!r}; expected {SPEC_HELP}"
        ) from None


def parse_data_spec(spec: str) -> ImageDataset:
    """Load the dataset that ``spec`` names (see :class:`FusionSetSpec`)."""
    return FusionSetSpec.parse(spec).load()


# ---------------------------------------------------------------------------------- options
def parse_widths(text: str) -> tuple[int, ...]:
    """``"256,256,256"`` to ``(256, 256, 256)``; every width must be a positive integer."""
    try:
        widths = tuple(int(w) for w in text.split(","))
    except ValueError:
        raise ValueError(
            f"target widths {text!r} must be comma-separated integers, e.g. 256,256,256"
        ) from None
    if any(w < 1 for w in widths):
        raise ValueError(f"target widths {text!r} must all be >= 1")
    return widths


# ---------------------------------------------------------------------------------- fusion
def describe_spec(spec: ModelSpec) -> str:
    shape = "x".join(str(d) for d in spec.input_shape)
    widths = ",".join(str(w) for w in spec.widths)
    extra = f" {spec.options}" if spec.options else ""
    return f"{spec.arch} {shape} -> [{widths}] -> {spec.num_classes}{extra}"


def _check_compatible(
    method: str, cls: type[FusionMethod], checkpoints: list[Checkpoint], paths: list[Path]
) -> None:
    """All models must share one architecture; only a retargetable method allows other widths."""
    first = checkpoints[0].model.spec
    for path, checkpoint in zip(paths[1:], checkpoints[1:], strict=True):
        spec = checkpoint.model.spec
        same_family = (
            spec.arch == first.arch
            and spec.input_shape == first.input_shape
            and spec.num_classes == first.num_classes
            and spec.options == first.options
            and len(spec.widths) == len(first.widths)
        )
        if not same_family or (cls.same_spec and spec != first):
            hint = (
                f"; {method} fuses only models of identical widths (kf-* fuses other widths)"
                if same_family
                else "; fusion needs models of one architecture"
            )
            raise ValueError(
                f"{path}: architecture {describe_spec(spec)} does not match {paths[0]}: "
                f"{describe_spec(first)}{hint}"
            )


def _metadata_counts(
    checkpoints: list[Checkpoint], paths: list[Path], key: str, num_classes: int
) -> tuple[list[Any] | None, list[str]]:
    """Per checkpoint, ``metadata[key]`` validated (None if any lacks it), and those lacking it."""
    values: list[Any] = []
    missing: list[str] = []
    for path, checkpoint in zip(paths, checkpoints, strict=True):
        value = checkpoint.metadata.get(key)
        if value is None:
            missing.append(str(path))
            continue
        source = f"{path}: metadata {key}"
        if key == "num_examples":
            value = as_count(value, "num_examples", source)
            if value < 0:
                raise ValueError(f"{source} must be >= 0, got {value}")
        else:
            if not isinstance(value, list) or len(value) != num_classes:
                raise ValueError(f"{source} must be {num_classes} integers >= 0, got {value!r:.80}")
            value = [as_count(c, "class count", source) for c in value]
            if any(c < 0 for c in value):
                raise ValueError(f"{source} must be {num_classes} integers >= 0, got {value}")
        values.append(value)
    return (None if missing else values), missing


def check_data_fits(data: ImageDataset, spec: ModelSpec, what: str) -> None:
    """Raise ValueError naming ``what`` unless ``data`` fits the models' input shape and classes."""
    if data.input_shape != tuple(spec.input_shape):
        raise ValueError(
            f"{what} has input shape {data.input_shape}, the models take {tuple(spec.input_shape)}"
        )
    if data.num_classes != spec.num_classes:
        raise ValueError(
            f"{what} has {data.num_classes} classes, the models have {spec.num_classes}"
        )


def _names(names: Sequence[str | Path]) -> str:
    return ", ".join(str(p) for p in names)


@dataclass
class FusionPool:
    """Base models and what is known of them: from checkpoint files, or a saved run.

    ``models`` may be a lazy sequence (a run's models are memory-mapped one by one); every list
    is in model order, and ``missing_*`` name the sources that lack a count.
    """

    models: Sequence[LeveledModel]
    names: list[str]
    spec: ModelSpec
    scores: list[Scores | None]
    sample_counts: list[int] | None
    class_counts: list[list[int]] | None
    missing_sample_counts: list[str] = field(default_factory=list)
    missing_class_counts: list[str] = field(default_factory=list)
    grams: Sequence[dict[int, torch.Tensor]] | None = None
    fisher: Sequence[dict[str, torch.Tensor]] | None = None


def fuse_pool(
    pool: FusionPool,
    fusion: FusionMethod,
    *,
    fusion_data: ImageDataset | None = None,
    target_widths: tuple[int, ...] | None = None,
    use_scores: bool = True,
    extra_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> FusionResult:
    """Fuse ``pool``'s models with ``fusion``, after checking that it has what the method needs.

    ``extra_rows`` (normalised inputs and their labels, e.g. drawn from the sites' stored class
    Gaussians: :mod:`fedfuse.federation.stored_gaussians`) follow ``fusion_data``'s rows in the
    fusion set, or are the whole fusion set without it."""
    method = fusion.name
    fusion.check_run(len(pool.models), pool.spec)
    needed = set(fusion.requirements())
    if use_scores and "scores" in fusion.needs():
        needed.add("scores")  # a method weighting by scores gets the checkpoints' own, or stops
    if fusion_data is not None:
        check_data_fits(fusion_data, pool.spec, f"fusion data {fusion_data.name!r}")
    elif "data" in needed and extra_rows is None:
        raise ValueError(f"fusion method {method!r} needs fusion data (a fusion set), none given")
    if "grams" in needed and pool.grams is None:
        raise ValueError(
            f"fusion method {method!r} needs every site's Gram matrices, and these models have "
            "none (the sites upload them only when a method of the run needs them)"
        )
    if "fisher" in needed and pool.fisher is None:
        raise ValueError(
            f"fusion method {method!r} needs every site's Fisher information, and these models "
            "have none (the sites upload it only when a method of the run needs it)"
        )
    scores = None
    if use_scores:
        lacking = [n for n, s in zip(pool.names, pool.scores, strict=True) if s is None]
        if not lacking:
            scores = list(pool.scores)
        elif "scores" in needed:
            raise ValueError(
                f"{method} weights neurons by importance scores, but these models have "
                f"none: {_names(lacking)}; save them with scores, or fuse with uniform weights "
                "(option use_scores=false)"
            )
    for field_name, missing in (
        ("sample_counts", pool.missing_sample_counts),
        ("class_counts", pool.missing_class_counts),
    ):
        if field_name in needed and missing:
            key = "num_examples" if field_name == "sample_counts" else "class_counts"
            raise ValueError(f"{method} needs each model's {key!r}; missing in {_names(missing)}")
    facts = UploadFacts(scores, pool.sample_counts, pool.class_counts, pool.grams, pool.fisher)
    inputs = fusion_inputs(facts, fusion_data)
    if extra_rows is not None:
        inputs = _with_rows(inputs, *extra_rows)
    target = None
    if target_widths is not None:
        try:
            target = pool.spec.with_widths(target_widths)
        except ValueError as error:
            raise ValueError(f"target widths {tuple(target_widths)}: {error}") from None
    log.info(
        "fusing %d models with %s (fusion set: %s samples, scores: %s)",
        len(pool.models),
        method,
        "no" if inputs.data is None else len(inputs.data),
        "yes" if scores is not None else "no",
    )
    return fusion.fuse(pool.models, inputs, target=target)


def _with_rows(inputs: FusionInputs, rows: torch.Tensor, labels: torch.Tensor) -> FusionInputs:
    """``inputs`` with ``rows`` (and their ``labels``) appended to the fusion set, or as it."""
    if inputs.data is None:
        return replace(inputs, data=rows, labels=labels)
    data = torch.cat([inputs.data, rows.to(inputs.data.dtype)])
    if inputs.labels is None:
        return replace(inputs, data=data)
    return replace(
        inputs, data=data, labels=torch.cat([inputs.labels, labels.to(inputs.labels.dtype)])
    )


def fuse_checkpoints(
    paths: Sequence[str | Path],
    method: str,
    *,
    options: dict[str, Any] | None = None,
    fusion_data: ImageDataset | None = None,
    target_widths: tuple[int, ...] | None = None,
    use_scores: bool = True,
    extra_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[FusionResult, list[Checkpoint]]:
    """Load the checkpoints at ``paths`` and fuse them with the registered ``method``.

    Args:
        paths: two or more checkpoints written by :func:`~fedfuse.io.checkpoint.save_checkpoint`.
        method: a name in :data:`~fedfuse.fusion.FUSION_METHODS`, e.g. ``"kf-linear"``.
        options: the method's constructor options (unknown ones are an error).
        fusion_data: the server's fusion set (inputs and labels); methods needing data need it.
        target_widths: hidden widths of the fused model (default: the first model's).
        use_scores: pass the checkpoints' importance scores to the method. When the method
            weights by importance and some checkpoint has none, that is an error naming it.
        extra_rows: normalised inputs and labels appended to the fusion set (:func:`fuse_pool`).

    Returns:
        The fusion result and the loaded checkpoints (base models first to last).

    Raises:
        CheckpointError: a file is missing or invalid (the message names it).
        ValueError: options, architectures, data or metadata do not fit (named in the message).
    """
    paths = [Path(p) for p in paths]
    if len(paths) < 2:
        raise ValueError(f"fusion needs at least 2 checkpoints, got {len(paths)}")
    fusion = make_fusion_method(method, **dict(options or {}))
    checkpoints = [load_checkpoint(p) for p in paths]
    _check_compatible(method, type(fusion), checkpoints, paths)
    first = checkpoints[0].model.spec
    sample_counts, missing_samples = _metadata_counts(
        checkpoints, paths, "num_examples", first.num_classes
    )
    class_counts, missing_classes = _metadata_counts(
        checkpoints, paths, "class_counts", first.num_classes
    )
    pool = FusionPool(
        models=[c.model for c in checkpoints],
        names=[str(p) for p in paths],
        spec=first,
        scores=[c.scores for c in checkpoints],
        sample_counts=sample_counts,
        class_counts=class_counts,
        missing_sample_counts=missing_samples,
        missing_class_counts=missing_classes,
    )
    result = fuse_pool(
        pool,
        fusion,
        fusion_data=fusion_data,
        target_widths=target_widths,
        use_scores=use_scores,
        extra_rows=extra_rows,
    )
    return result, checkpoints


def run_pool(run_dir: str | Path) -> tuple[FusionPool, UploadStore, dict[str, Any] | None]:
    """The uploads a one-shot run saved (``<run dir>/clients``), and its run settings.

    Returns the pool (models memory-mapped on access), the store, and the run config recorded in
    its ``results.json`` (None when there is none).
    """
    run_dir = Path(run_dir)
    clients = run_dir / "clients" if (run_dir / "clients").is_dir() else run_dir
    store = UploadStore.open(clients)
    entries = store.entries
    settings = None
    results = run_dir / "results.json"
    if results.is_file():
        report = read_json_file(results, what="run's results")
        if not isinstance(report, dict):
            raise ValueError(f"{results}: not a readable results file (no JSON object)")
        settings = report.get("settings")
    assert store.expected_spec is not None
    pool = FusionPool(
        models=store.models(),
        names=[str(e.path) for e in entries],
        spec=store.expected_spec,
        scores=[e.scores for e in entries],
        sample_counts=[e.num_examples for e in entries],
        class_counts=[e.class_counts for e in entries],
        grams=store.grams(),
        fisher=store.fisher(),
    )
    return pool, store, settings


def run_fusion_set(settings: dict[str, Any], store: UploadStore) -> ImageDataset:
    """The fusion set the run's server used (same settings and seed), rebuilt."""
    run = RunSettings.from_config(settings, allow_unknown=True)
    partitions = {e.num_partitions for e in store.entries}
    return Scenario(run, max(partitions)).fusion_set()


def run_gaussian_completion(settings: dict[str, Any] | None) -> GaussianFusionSet | None:
    """How the run recorded in ``settings`` completed its fusion set from the sites' class
    Gaussians (rows per site and seed); None when it did not, or there are no settings."""
    if settings is None:
        return None
    return RunSettings.from_config(settings, allow_unknown=True).fusion_gaussians()


def run_provenance(
    run_dir: str | Path, store: UploadStore, *, method: str, options: dict[str, Any]
) -> dict[str, Any]:
    """What a checkpoint fused again from a saved run needs to stand alone, as the run's own
    fused models record it (:func:`~fedfuse.federation.provenance.fused_model_metadata`): the
    sites, the server's data files, the input shape, class names and normalisation; empty when
    the run left no readable ``results.json``."""
    from fedfuse.federation.contract import DataContract
    from fedfuse.federation.provenance import fused_model_metadata

    results = Path(run_dir) / "results.json"
    try:
        report = read_json_file(results, what="run's results")
        settings = RunSettings.from_config(report["settings"])
    except (OSError, ValueError, KeyError, TypeError, RecursionError, AttributeError):
        return {}
    document = report.get("data_contract")
    contract = DataContract.from_dict(document, source=str(results)) if document else None
    return fused_model_metadata(
        settings,
        method=method,
        options=options,
        sites=[entry.facts for entry in store.entries],
        contract=contract,
        files=report.get("data_files") or {},
        run_id=report.get("run_id"),
    )
