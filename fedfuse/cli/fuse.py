"""``fedfuse fuse``: fuse saved checkpoints, or a run's stored uploads, offline.

The library side is :mod:`fedfuse.federation.offline`; this module only parses arguments,
calls it and writes the fused checkpoint and its JSON summary.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedfuse.io.atomic import json_safe, refuse_overwriting_inputs
from fedfuse.io.text import terminal_safe
from fedfuse.settings.bounds import (
    DEFAULT_MAX_FUSED_PARAMETERS,
    Range,
    check_model_size,
    parse_widths,
)

if TYPE_CHECKING:
    from fedfuse.federation.stored_gaussians import GaussianRows
    from fedfuse.fusion import FusionMethod
    from fedfuse.fusion.statistics.class_gaussians import GaussianFusionSet
    from fedfuse.models import LeveledModel, ModelSpec

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------- CLI
class _Help(argparse.HelpFormatter):
    """Fills in ``{methods}`` (the registered fusion methods) and ``{spec}`` (the data-spec
    syntax) when the help is shown: both live in modules that import PyTorch."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = super()._get_help_string(action)
        if text is None or "{" not in text:
            return text
        from fedfuse.federation.offline import SPEC_HELP
        from fedfuse.fusion import FUSION_METHODS

        return text.format(methods=", ".join(sorted(FUSION_METHODS)), spec=SPEC_HELP)


def register_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``fuse`` subcommand to ``subparsers`` (from ``add_subparsers``); return it."""
    parser = subparsers.add_parser(
        "fuse",
        help="fuse saved checkpoints into one model",
        description=(
            "Fuse two or more checkpoints with a registered fusion method and write the fused "
            "model as a checkpoint recording the method, options, sources and per-level details."
        ),
        formatter_class=_Help,
    )
    parser.add_argument(
        "checkpoints",
        nargs="+",
        metavar="CKPT",
        help="checkpoints to fuse, or one run directory (its saved uploads are fused again)",
    )
    parser.add_argument("--method", default="kf-linear", help="fusion method: {methods}")
    parser.add_argument("--fusion-data", metavar="SPEC", help="the fusion set: {spec}")
    parser.add_argument(
        "--gaussian-samples",
        type=Range(0, 10**6).argument("--gaussian-samples"),
        metavar="N",
        help="rows per site drawn from the class Gaussians stored in the site files (a run with "
        "fusion-gaussian-samples > 0), appended to the fusion set, or the fusion set without "
        "--fusion-data; 0: never (default: whenever the method reads a fusion set and the "
        "inputs carry Gaussians, the run's own count, else 400)",
    )
    parser.add_argument(
        "--gaussian-seed",
        type=Range(0, 2**31 - 1).argument("--gaussian-seed"),
        metavar="S",
        help="seed of those draws, site k drawing from S+k (default: the run's own, else 0)",
    )
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
    parser.add_argument(
        "--max-parameters",
        type=Range(1, 10**12).argument("--max-parameters"),
        default=DEFAULT_MAX_FUSED_PARAMETERS,
        help="refuse target widths whose fused model has more parameters, checked before "
        "anything is allocated (default: %(default)s)",
    )
    parser.add_argument("--test-data", metavar="SPEC", help="evaluate on this data (same syntax)")
    parser.add_argument(
        "--output",
        help="fused checkpoint to write, replaced atomically if it exists (default: "
        "fused.safetensors, or for a run directory <run>/fused-again-<method>-<time>.safetensors)",
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
    from fedfuse.federation.evaluation import format_level_summary
    from fedfuse.federation.offline import (
        FusionSetSpec,
        check_data_fits,
        describe_spec,
        fuse_checkpoints,
        fuse_pool,
        run_fusion_set,
        run_gaussian_completion,
        run_pool,
        run_provenance,
    )
    from fedfuse.fusion import make_fusion_method, parse_options
    from fedfuse.io.checkpoint import save_checkpoint

    # Everything cheap is checked before anything is loaded or fused.
    options = parse_options(args.option)
    if args.progress and "progress" in _accepted(args.method):
        options.setdefault("progress", True)
    fusion = make_fusion_method(args.method, **options)
    widths = None
    if args.target_widths:
        widths = tuple(parse_widths(args.target_widths, "--target-widths"))
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
    inputs = [Path(c) for c in args.checkpoints] + [
        Path(s) for s in (args.fusion_data, args.test_data) if s
    ]
    if run_dir is not None:  # the run's uploads are inputs too
        inputs += sorted((run_dir / "clients").glob("*.safetensors"))
    refuse_overwriting_inputs(output, inputs, "--output")

    if run_dir is not None:
        pool, store, settings = run_pool(run_dir)
        _check_target(pool.spec, widths, args.max_parameters)
        sources = [str(e.path) for e in store.entries]
        fusion_data = fusion_spec.load() if fusion_spec else None
        if fusion_data is None and settings is not None:  # the run's own fusion set
            fusion_data = run_fusion_set(settings, store)
        rows = _gaussian_rows(
            args,
            fusion,
            [e.path for e in store.entries],
            pool.spec,
            run_gaussian_completion(settings),
        )
        test_data = test_spec.load() if test_spec else None
        if test_data is not None:
            check_data_fits(test_data, pool.spec, f"test data {args.test_data!r}")
        result = fuse_pool(
            pool,
            fusion,
            fusion_data=fusion_data,
            target_widths=widths,
            use_scores=not args.no_scores,
            extra_rows=None if rows is None else (rows.inputs, rows.labels),
        )
        base_models: Sequence[LeveledModel] = pool.models
    else:
        _check_target(_first_spec(args.checkpoints[0]), widths, args.max_parameters)
        fusion_data = fusion_spec.load() if fusion_spec else None
        test_data = test_spec.load() if test_spec else None
        first = _first_spec(args.checkpoints[0])
        if test_data is not None and first is not None:  # fail before fusing
            check_data_fits(test_data, first, f"test data {args.test_data!r}")
        rows = None if first is None else _gaussian_rows(args, fusion, args.checkpoints, first)
        result, checkpoints = fuse_checkpoints(
            args.checkpoints,
            args.method,
            options=options,
            fusion_data=fusion_data,
            target_widths=widths,
            use_scores=not args.no_scores,
            extra_rows=None if rows is None else (rows.inputs, rows.labels),
        )
        sources = [str(p) for p in args.checkpoints]
        base_models = [c.model for c in checkpoints]
    if test_data is not None:
        check_data_fits(test_data, result.model.spec, f"test data {args.test_data!r}")
    metadata = {
        "method": args.method,
        "options": json_safe(options),
        "resolved_options": json_safe(fusion.options()),
        "sources": sources,
        "fusion_data": args.fusion_data or ("the run's fusion set" if run_dir else None),
        "fusion_examples": None
        if fusion_data is None and rows is None
        else (0 if fusion_data is None else len(fusion_data)) + (0 if rows is None else len(rows)),
        "fusion_gaussians": None if rows is None else rows.summary(),
        "fusion_seconds": result.seconds,
        "details": json_safe(result.details),
    }
    if run_dir is not None:  # stands alone as the run's own fused models do
        provenance = run_provenance(run_dir, store, method=args.method, options=options)
        metadata = {**provenance, **metadata}
    try:
        save_checkpoint(output, result.model, metadata=metadata)
    except OSError as error:
        raise ValueError(f"cannot write {output}: {error}") from error
    fused = describe_spec(result.model.spec)
    print(f"fused {len(sources)} models with {args.method}: {fused}")
    if rows is not None:
        print(f"fusion set: {rows.describe()}")
    print(format_level_summary(result))
    if test_data is not None:
        from fedfuse.federation.evaluation import evaluate_fusion, format_accuracy_table

        device = str(options.get("device", "auto"))
        evaluation = evaluate_fusion(
            base_models, {args.method: result.model}, test_data, device=device
        )
        print(format_accuracy_table(evaluation))
    print(terminal_safe(f"fused checkpoint: {output}"))
    return 0


def _gaussian_rows(
    args: argparse.Namespace,
    fusion: FusionMethod,
    paths: Sequence[str | Path],
    spec: ModelSpec,
    run: GaussianFusionSet | None = None,
) -> GaussianRows | None:
    """The fusion-set rows drawn from the class Gaussians stored in the site files at ``paths``
    (``--gaussian-samples``; default: the run's own completion ``run``, else 400 rows per site
    whenever the method reads a fusion set); None when none are drawn."""
    from fedfuse.federation.stored_gaussians import (
        DEFAULT_GAUSSIAN_SAMPLES,
        draw_stored_gaussians,
        reads_fusion_set,
    )

    asked = args.gaussian_samples
    if asked == 0:
        return None
    if not reads_fusion_set(fusion):
        if asked is not None:
            log.warning("%s reads no fusion set: --gaussian-samples is ignored", fusion.name)
        return None
    samples = asked if asked is not None else run.samples if run else DEFAULT_GAUSSIAN_SAMPLES
    seed = args.gaussian_seed if args.gaussian_seed is not None else run.seed if run else 0
    return draw_stored_gaussians(paths, spec, samples, seed=seed, required=asked is not None)


def _first_spec(path: str) -> ModelSpec | None:
    """The model spec a checkpoint's metadata records (None when it cannot be read: loading
    the checkpoint then reports the broken file)."""
    from fedfuse.io.checkpoint import read_metadata
    from fedfuse.models import ModelSpec

    try:
        return ModelSpec.from_dict(read_metadata(path).get("model"))
    except (ValueError, AttributeError, OSError):
        return None


def _check_target(
    spec: ModelSpec | None, widths: tuple[int, ...] | None, max_parameters: int
) -> None:
    """Refuse target widths whose fused model is over ``max_parameters``, before allocation."""
    if spec is None or widths is None:
        return
    try:
        target = spec.with_widths(widths)
    except ValueError:
        return  # the fusion reports widths that do not fit the architecture
    text = ",".join(map(str, widths))
    check_model_size(
        target, max_parameters, f"--target-widths {text}: the fused {spec.arch}", "--max-parameters"
    )


def _default_output(run_dir: Path | None, method: str) -> Path:
    if run_dir is None:
        return Path("fused.safetensors")
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return run_dir / f"fused-again-{method}-{stamp}.safetensors"


def _accepted(method: str) -> list[str]:
    from fedfuse.fusion import FUSION_METHODS

    cls = FUSION_METHODS.get(method)
    return cls.accepted_options() if cls else []
