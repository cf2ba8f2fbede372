"""``fedfuse speed``: the command line of the fusion speed and memory benchmark.

The benchmark is :mod:`fedfuse.experiments.speed`; it imports PyTorch, so it is imported when
the command runs, not when the command line is parsed.
"""

from __future__ import annotations

import argparse
from typing import Any

from fedfuse.experiments.speed_options import ARCHS, DEFAULT_METHODS, PLAIN_ARCHS
from fedfuse.settings.defaults import DEFAULT_FUSION_SAMPLES

#: the plain model ``--arch`` offers (its help names it)
PLAIN = "torchvision-resnet18"


def speed_command(args: argparse.Namespace) -> int:
    """``fedfuse speed``: print the timing table (:func:`fedfuse.experiments.speed.run`)."""
    from fedfuse.experiments.speed import run

    return run(args)


def register_cli(subparsers: Any) -> None:
    """Add ``fedfuse speed`` to the CLI's subcommands."""
    parser = subparsers.add_parser("speed", help="time and memory of fusing N models (default 2)")
    parser.add_argument(
        "--methods",
        default=None,
        help='comma list, or "all" (every method that accepts the architecture); default: '
        f"{DEFAULT_METHODS['vgg11']} for vgg11, {DEFAULT_METHODS[PLAIN]} for {PLAIN}, all for "
        "resnet and vit",
    )
    parser.add_argument(
        "--arch",
        default="vgg11",
        choices=list(ARCHS),
        help=f"{PLAIN}: torchvision's resnet18(num_classes=10), adapted as a user's plain model, "
        f"timed beside fedfuse's own ResNet-18 of the same layers ({PLAIN_ARCHS[PLAIN][1]}), "
        "with the ratio of the two",
    )
    parser.add_argument(
        "--width", type=float, default=1.0, help="vgg11 width multiplier, or the mlp's hidden width"
    )
    parser.add_argument(
        "--model-options",
        default="",
        help='spec options, "k=v ...": resnet depth=18 width_multiplier=1.0 stem=cifar; '
        "vit patch=8 depth=7 heads=12 hidden=384 mlp=384 (the defaults)",
    )
    parser.add_argument("--input-shape", default="3,32,32")
    parser.add_argument(
        "--fusion-samples",
        "--samples",
        type=int,
        default=DEFAULT_FUSION_SAMPLES,
        help="samples in the (random) fusion set",
    )
    parser.add_argument("--models", type=int, default=2, help="how many models to fuse")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--device", default="auto", help="auto: CUDA when present")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument(
        "--options",
        default="",
        help='method options, "k=v method.k=v ...": unprefixed ones go to every method taking them',
    )
    parser.set_defaults(handler=speed_command)
