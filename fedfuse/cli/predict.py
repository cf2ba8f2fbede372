"""``fedfuse predict``: classify images with a fused checkpoint (:mod:`fedfuse.deploy.predict`)."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path
from typing import Any

from fedfuse.cli.deploy import add_max_bytes_argument, parse_floats
from fedfuse.io.atomic import atomic_path, refuse_overwriting_inputs
from fedfuse.io.text import terminal_safe


def predict_command(args: argparse.Namespace) -> int:
    from fedfuse.data.image_folder import IMAGE_SUFFIXES
    from fedfuse.deploy.predict import predict_files

    if args.out is not None:  # before reading anything: never replace what it classifies
        out, images = Path(args.out).expanduser(), Path(args.images).expanduser()
        refuse_overwriting_inputs(out, [args.checkpoint, images], "--out")
        if (
            images.is_dir()
            and out.suffix.lower() in IMAGE_SUFFIXES
            and out.resolve().is_relative_to(images.resolve())
        ):
            raise ValueError(f"--out {out} is an image in the folder it classifies")
    predictions = predict_files(
        args.checkpoint,
        args.images,
        mean=parse_floats(args.mean),
        std=parse_floats(args.std),
        batch_size=args.batch_size,
        device=args.device,
        max_bytes=args.max_bytes,
    )
    if args.out is None:  # names from the checkpoint and the files: escaped on a terminal
        print("".join(terminal_safe(row) + "\n" for row in predictions.csv().splitlines()), end="")
        return 0
    out = Path(args.out).expanduser()
    with atomic_path(out) as tmp:
        tmp.write_text(predictions.csv())
    counts = Counter(predictions.classes)
    summary = ", ".join(f"{c} {n}" for c, n in counts.items())
    print(terminal_safe(f"{len(predictions.images)} images: {summary}"))
    print(terminal_safe(f"wrote {out}"))
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def register_cli(commands: Any) -> None:
    parser = commands.add_parser(
        "predict",
        help="classify images with a fused checkpoint (its class names and normalisation)",
        description="Classify images with a checkpoint, in the input shape, normalisation and "
        "class names it records. Prints (or writes) CSV: image,class,probability.",
    )
    parser.add_argument("checkpoint", help="a fused .safetensors checkpoint")
    parser.add_argument(
        "images",
        help="an image folder (searched recursively), an image, or an .npz with an 'images' array",
    )
    parser.add_argument("--out", help="write the CSV here instead of printing it")
    parser.add_argument("--batch-size", type=_positive, default=256)
    parser.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda")
    parser.add_argument("--mean", help="per-channel mean, only for checkpoints that record none")
    parser.add_argument("--std", help="per-channel std, only for checkpoints that record none")
    add_max_bytes_argument(parser, "image array an .npz may hold")
    parser.set_defaults(handler=predict_command)
