"""Fusion speed and memory benchmark: wall time and peak RSS of fusing two models.

Timing does not need trained models: the fused models are independently initialised and the
fusion set is random, with the shapes of the paper's runtime experiment (two VGG11s, the run
default of :data:`~fedfuse.settings.run.DEFAULT_FUSION_SAMPLES` samples of 32x32x3; App. F.5
Table 10). Each method runs ``repeats`` times in this process; the median
is reported next to the paper's GPU time for the same method, as a ratio.
"""

from __future__ import annotations

import argparse
import logging
import resource
import statistics
from typing import Any

import torch

from fedfuse.fusion import FusionInputs, make_fusion_method, parse_options
from fedfuse.fusion.base import parse_method_names
from fedfuse.models import build_model, make_spec
from fedfuse.runtime import resolve_device
from fedfuse.settings.run import DEFAULT_FUSION_SAMPLES

log = logging.getLogger(__name__)

#: The paper's Table 10 (seconds, VGG11 on CIFAR-10, 400 samples, uniform scores, RTX A5000).
PAPER_VGG11_SECONDS = {"hf-linear": 14.2, "kf-linear": 78.3, "kf-gradient": 16.5}


def peak_rss_gib() -> float:
    """Peak resident set size of this process so far, in GiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def measure(
    methods: list[str],
    *,
    arch: str = "vgg11",
    input_shape: tuple[int, ...] = (3, 32, 32),
    width: float = 1.0,
    fusion_samples: int = DEFAULT_FUSION_SAMPLES,
    repeats: int = 1,
    device: str = "auto",
    options: dict[str, dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Fuse two independently initialised models with each method; seconds and peak RSS."""
    arch_options: dict[str, Any] = (
        {"width_multiplier": width} if arch == "vgg11" else {"widths": (int(width),) * 3}
    )
    spec = make_spec(arch, input_shape, 10, **arch_options)
    models = [build_model(spec, seed=s) for s in (1, 2)]
    data = torch.randn(fusion_samples, *input_shape, generator=torch.Generator().manual_seed(0))
    inputs = FusionInputs(data=data, sample_counts=[1, 1])
    rows = []
    for name in methods:
        method = (
            make_fusion_method(name, **{"device": device, **(options or {}).get(name, {})})
            if name not in ("vanilla", "fedavg")
            else make_fusion_method(name)
        )
        seconds = [method.fuse(models, inputs).seconds for _ in range(repeats)]
        median = statistics.median(seconds)
        paper = PAPER_VGG11_SECONDS.get(name) if arch == "vgg11" and width == 1.0 else None
        rows.append(
            {
                "method": name,
                "seconds": median,
                "all_seconds": seconds,
                "paper_seconds": paper,
                "ratio_to_paper": median / paper if paper else None,
                "peak_rss_gib": peak_rss_gib(),
            }
        )
        log.info(
            "%s: %.2f s (median of %d), peak RSS %.2f GiB",
            name,
            median,
            repeats,
            rows[-1]["peak_rss_gib"],
        )
    return rows


def format_speed_table(rows: list[dict[str, Any]], header: str) -> str:
    lines = [
        header,
        "",
        "| method | seconds (median) | paper GPU seconds | ratio | peak RSS GiB |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        paper = f"{r['paper_seconds']:.1f}" if r["paper_seconds"] else "-"
        ratio = f"{r['ratio_to_paper']:.2f}x" if r["ratio_to_paper"] else "-"
        lines.append(
            f"| {r['method']} | {r['seconds']:.2f} | {paper} | {ratio} | {r['peak_rss_gib']:.2f} |"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """``fedfuse speed``: print the timing table."""
    if args.threads:
        torch.set_num_threads(args.threads)
    methods = parse_method_names(args.methods)
    shared = parse_options(args.options) if args.options else {}
    options = {m: shared for m in methods if m not in ("vanilla", "fedavg")}
    shape = tuple(int(d) for d in args.input_shape.split(","))
    rows = measure(
        methods,
        arch=args.arch,
        input_shape=shape,
        width=args.width,
        fusion_samples=args.fusion_samples,
        repeats=args.repeats,
        device=args.device,
        options=options,
    )
    header = (
        f"fusing two {args.arch} (width {args.width}) on {args.fusion_samples} samples of "
        f"{args.input_shape}; device {resolve_device(args.device)}, "
        f"{torch.get_num_threads()} threads"
    )
    print(format_speed_table(rows, header))
    return 0


def register_cli(subparsers: Any) -> None:
    parser = subparsers.add_parser("speed", help="time and memory of fusing two models")
    parser.add_argument("--methods", default="vanilla,hf-linear,kf-linear,kf-gradient")
    parser.add_argument("--arch", default="vgg11", choices=["vgg11", "mlp"])
    parser.add_argument(
        "--width", type=float, default=1.0, help="vgg11 width multiplier, or the mlp's hidden width"
    )
    parser.add_argument("--input-shape", default="3,32,32")
    parser.add_argument(
        "--fusion-samples",
        "--samples",
        type=int,
        default=DEFAULT_FUSION_SAMPLES,
        help="samples in the (random) fusion set",
    )
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--options", default="", help='options for every method, "k=v ..."')
    parser.set_defaults(handler=run)
