"""Fuse saved checkpoints offline: ``fedfuse fuse CKPT CKPT ... --method kf-linear``.

One-shot fusion does not need a federation once the clients' checkpoints exist: this module
loads them (with their importance scores and sample/class counts), builds the server's
:class:`~fedfuse.fusion.FusionInputs` from a fusion set given as a short spec string, runs any
registered fusion method, and writes the fused model as a checkpoint that records how it was
made. It is Flower-free; :func:`register_cli` adds the ``fuse`` subcommand to a CLI parser.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from fedfuse.data import ImageDataset, load_dataset, load_npz_dataset
from fedfuse.data._common import SPLITS
from fedfuse.federation.evaluation import format_level_summary
from fedfuse.federation.uploads import UploadStore
from fedfuse.fusion import (
    FUSION_METHODS,
    FusionInputs,
    FusionMethod,
    FusionResult,
    make_fusion_method,
    parse_options,
)
from fedfuse.io.checkpoint import Checkpoint, load_checkpoint, read_metadata, save_checkpoint
from fedfuse.io.validation import as_count
from fedfuse.models import LeveledModel, ModelSpec
from fedfuse.models.importance import Scores

log = logging.getLogger(__name__)

__all__ = [
    "FusionSetSpec",
    "check_data_fits",
    "format_level_summary",
    "fuse_checkpoints",
    "fuse_command",
    "parse_data_spec",
    "parse_options",
    "parse_widths",
    "register_cli",
]

_SPEC_HELP = "an .npz site data file, or name[:split[:n[:seed]]], e.g. fashion-mnist:train:400:0"


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
            raise ValueError(f"data spec {spec!r} is empty; expected {_SPEC_HELP}")
        if text.lower().endswith(".npz") or "/" in text or Path(text).is_file():
            return cls(text=spec, path=Path(text).expanduser())
        parts = text.split(":")
        if len(parts) > 4 or not parts[0]:
            raise ValueError(f"data spec {spec!r} is malformed; expected {_SPEC_HELP}")
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
            f"data spec {spec!r}: {what} must be an integer, got {value!r}; expected {_SPEC_HELP}"
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
def _describe(spec: ModelSpec) -> str:
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
                f"{path}: architecture {_describe(spec)} does not match {paths[0]}: "
                f"{_describe(first)}{hint}"
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


def fuse_pool(
    pool: FusionPool,
    fusion: FusionMethod,
    *,
    fusion_data: ImageDataset | None = None,
    target_widths: tuple[int, ...] | None = None,
    use_scores: bool = True,
) -> FusionResult:
    """Fuse ``pool``'s models with ``fusion``, after checking that it has what the method needs."""
    method = fusion.name
    fusion.check_run(len(pool.models), pool.spec)
    needed = set(fusion.requirements())
    if use_scores and "scores" in fusion.needs():
        needed.add("scores")  # a method weighting by scores gets the checkpoints' own, or stops
    if fusion_data is not None:
        check_data_fits(fusion_data, pool.spec, f"fusion data {fusion_data.name!r}")
    elif "data" in needed:
        raise ValueError(f"fusion method {method!r} needs fusion data (a fusion set), none given")
    if "grams" in needed and pool.grams is None:
        raise ValueError(
            f"fusion method {method!r} needs every site's Gram matrices, and these models have "
            "none (the sites upload them only when a listed strategy needs them)"
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
    inputs = FusionInputs(
        data=None if fusion_data is None else fusion_data.inputs(),
        labels=None if fusion_data is None else fusion_data.labels,
        scores=scores,
        sample_counts=pool.sample_counts,
        class_counts=pool.class_counts,
        grams=pool.grams,
    )
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
        "no" if fusion_data is None else len(fusion_data),
        "yes" if scores is not None else "no",
    )
    return fusion.fuse(pool.models, inputs, target=target)


def fuse_checkpoints(
    paths: Sequence[str | Path],
    method: str,
    *,
    options: dict[str, Any] | None = None,
    fusion_data: ImageDataset | None = None,
    target_widths: tuple[int, ...] | None = None,
    use_scores: bool = True,
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
        pool, fusion, fusion_data=fusion_data, target_widths=target_widths, use_scores=use_scores
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
        try:
            settings = json.loads(results.read_text()).get("settings")
        except (json.JSONDecodeError, RecursionError, AttributeError):
            raise ValueError(f"{results}: not a readable results file") from None
    assert store.expected_spec is not None
    pool = FusionPool(
        models=store.models(),
        names=[str(e.path) for e in entries],
        spec=store.expected_spec,
        scores=[e.scores for e in entries],
        sample_counts=[e.num_examples for e in entries],
        class_counts=[e.class_counts for e in entries],
        grams=store.grams(),
    )
    return pool, store, settings


def run_fusion_set(settings: dict[str, Any], store: UploadStore) -> ImageDataset:
    """The fusion set the run's server used (same settings and seed), rebuilt."""
    from fedfuse.federation.scenario import RunSettings, Scenario

    run = RunSettings.from_config(settings, allow_unknown=True)
    partitions = {e.num_partitions for e in store.entries}
    return Scenario(run, max(partitions)).fusion_set()


# ---------------------------------------------------------------------------------- reporting
#: (details key, column header, format) of the per-level table, in display order
def _json_safe(value: Any) -> Any:
    """``value`` as plain JSON types (tensors and other objects become strings)."""
    return json.loads(json.dumps(value, default=str))


# ---------------------------------------------------------------------------------- CLI
def register_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``fuse`` subcommand to ``subparsers`` (from ``add_subparsers``); return it."""
    parser = subparsers.add_parser(
        "fuse",
        help="fuse saved checkpoints into one model",
        description=(
            "Fuse two or more checkpoints with a registered fusion method and write the fused "
            "model as a checkpoint recording the method, options, sources and per-level details."
        ),
    )
    parser.add_argument(
        "checkpoints",
        nargs="+",
        metavar="CKPT",
        help="checkpoints to fuse, or one run directory (its saved uploads are fused again)",
    )
    parser.add_argument(
        "--method", default="kf-linear", help=f"fusion method: {', '.join(sorted(FUSION_METHODS))}"
    )
    parser.add_argument("--fusion-data", metavar="SPEC", help=f"the fusion set: {_SPEC_HELP}")
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a method option (repeatable); values are JSON when they parse, else strings",
    )
    parser.add_argument(
        "--target-widths", metavar="W,W,...", help="hidden widths of the fused model"
    )
    parser.add_argument("--test-data", metavar="SPEC", help="evaluate on this data (same syntax)")
    parser.add_argument(
        "--output",
        help="fused checkpoint to write, replaced atomically if it exists (default: "
        "fused.safetensors, or for a run directory <run>/refused-<method>-<time>.safetensors)",
    )
    parser.add_argument(
        "--no-scores",
        action="store_true",
        help="ignore the checkpoints' importance scores (the method's fallback is used)",
    )
    parser.add_argument("--progress", action="store_true", help="show a progress bar")
    parser.set_defaults(handler=fuse_command)
    return parser


def fuse_command(args: argparse.Namespace) -> int:
    """Handler of ``fedfuse fuse``: fuse checkpoint files, or the uploads of a saved run."""
    # Everything cheap is checked before anything is loaded or fused.
    options = parse_options(args.option)
    if args.progress and "progress" in _accepted(args.method):
        options.setdefault("progress", True)
    fusion = make_fusion_method(args.method, **options)
    widths = parse_widths(args.target_widths) if args.target_widths else None
    fusion_spec = FusionSetSpec.parse(args.fusion_data) if args.fusion_data else None
    test_spec = FusionSetSpec.parse(args.test_data) if args.test_data else None
    run_dir = Path(args.checkpoints[0]) if len(args.checkpoints) == 1 else None
    if run_dir is not None and not run_dir.is_dir():
        raise ValueError(
            f"{run_dir}: give a run directory (with clients/client_<id>.safetensors), or two or "
            "more checkpoint files"
        )
    output = Path(args.output) if args.output else _default_output(run_dir, args.method)
    if output.is_dir():
        raise ValueError(f"output {output} is a directory; give a checkpoint file name")

    if run_dir is not None:
        pool, store, settings = run_pool(run_dir)
        sources = [str(e.path) for e in store.entries]
        fusion_data = fusion_spec.load() if fusion_spec else None
        if fusion_data is None and settings is not None:  # the run's own fusion set
            fusion_data = run_fusion_set(settings, store)
        test_data = test_spec.load() if test_spec else None
        if test_data is not None:
            check_data_fits(test_data, pool.spec, f"test data {args.test_data!r}")
        result = fuse_pool(
            pool,
            fusion,
            fusion_data=fusion_data,
            target_widths=widths,
            use_scores=not args.no_scores,
        )
        base_models: Sequence[LeveledModel] = pool.models
    else:
        fusion_data = fusion_spec.load() if fusion_spec else None
        test_data = test_spec.load() if test_spec else None
        if test_data is not None:  # fail before fusing when the first checkpoint's spec is readable
            try:
                first = ModelSpec.from_dict(read_metadata(args.checkpoints[0]).get("model"))
            except (ValueError, AttributeError):
                first = None  # fuse_checkpoints reports the broken file
            if first is not None:
                check_data_fits(test_data, first, f"test data {args.test_data!r}")
        result, checkpoints = fuse_checkpoints(
            args.checkpoints,
            args.method,
            options=options,
            fusion_data=fusion_data,
            target_widths=widths,
            use_scores=not args.no_scores,
        )
        sources = [str(p) for p in args.checkpoints]
        base_models = [c.model for c in checkpoints]
    if test_data is not None:
        check_data_fits(test_data, result.model.spec, f"test data {args.test_data!r}")
    metadata = {
        "method": args.method,
        "options": _json_safe(options),
        "resolved_options": _json_safe(fusion.options()),
        "sources": sources,
        "fusion_data": args.fusion_data or ("the run's fusion set" if run_dir else None),
        "fusion_examples": None if fusion_data is None else len(fusion_data),
        "fusion_seconds": result.seconds,
        "details": _json_safe(result.details),
    }
    try:
        save_checkpoint(output, result.model, metadata=metadata)
    except OSError as error:
        raise ValueError(f"cannot write {output}: {error}") from error
    fused = _describe(result.model.spec)
    print(f"fused {len(sources)} models with {args.method}: {fused}")
    print(format_level_summary(result))
    if test_data is not None:
        from fedfuse.federation.evaluation import evaluate_fusion, format_accuracy_table

        device = str(options.get("device", "auto"))
        evaluation = evaluate_fusion(
            base_models, {args.method: result.model}, test_data, device=device
        )
        print(format_accuracy_table(evaluation))
    print(f"fused checkpoint: {output}")
    return 0


def _default_output(run_dir: Path | None, method: str) -> Path:
    if run_dir is None:
        return Path("fused.safetensors")
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return run_dir / f"refused-{method}-{stamp}.safetensors"


def _accepted(method: str) -> list[str]:
    cls = FUSION_METHODS.get(method)
    return cls.accepted_options() if cls else []
