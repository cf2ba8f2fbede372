"""``fedfuse certs``, ``fedfuse keys``, ``fedfuse site-data``: the deployment tools' commands.

The library side is :mod:`fedfuse.deploy.credentials` (TLS certificates, SuperNode keys) and
:mod:`fedfuse.data.convert` and :mod:`fedfuse.data.image_folder` (site data files).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from fedfuse.deploy.credentials import (
    LOOPBACK_NAMES,
    fingerprint,
    make_server_certificates,
    make_supernode_keys,
)
from fedfuse.io.atomic import refuse_overwriting_inputs
from fedfuse.io.limits import DEFAULT_MAX_BYTES, DEFAULT_MAX_CLASSES, DEFAULT_MAX_SIDE, format_bytes
from fedfuse.io.text import one_line, terminal_safe
from fedfuse.settings.bounds import Range

if TYPE_CHECKING:
    from fedfuse.data.arrays import SiteSummary


# ------------------------------------------------------------------------------------- CLI
def _fail(command: str, error: Exception) -> int:
    print(f"fedfuse {command}: error: {one_line(error)}", file=sys.stderr)
    return 2


def certs_command(args: argparse.Namespace) -> int:
    """``fedfuse certs``: CA + SuperLink server certificate."""
    try:
        made = make_server_certificates(
            args.out,
            args.host,
            days=args.days,
            ca_days=args.ca_days,
            loopback=not args.no_loopback,
            force=args.force,
        )
    except (FileExistsError, ValueError) as error:
        return _fail("certs", error)
    ca_pem = x509.load_pem_x509_certificate(made.ca_cert.read_bytes())
    created = "created" if made.ca_created else "reused"
    print(terminal_safe(f"{created} CA: {made.ca_cert} (key {made.ca_key})"))
    print(f"  CA fingerprint {fingerprint(ca_pem.public_bytes(serialization.Encoding.DER))}")
    print(terminal_safe(f"server certificate: {made.server_cert} (key {made.server_key})"))
    print(f"  valid for: {', '.join(made.names)}")
    keep = f"keep {made.ca_key} and {made.server_key} private"
    print(terminal_safe(f"give every site {made.ca_cert}; {keep}"))
    return 0


def keys_command(args: argparse.Namespace) -> int:
    """``fedfuse keys``: SuperNode authentication key pairs."""
    try:
        made = make_supernode_keys(args.out, args.names, force=args.force)
    except (FileExistsError, ValueError) as error:
        return _fail("keys", error)
    for site in made:
        print(terminal_safe(f"{site.name}: private {site.private_key}, public {site.public_key}"))
        print(f"  public key fingerprint {site.fingerprint}")
    return 0


def parse_floats(text: str | None) -> list[float] | None:
    """Comma-separated numbers (``"0.286"`` or ``"0.5,0.5,0.5"``) as floats; None stays None."""
    if text is None:
        return None
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"expected comma-separated numbers, got {text!r}") from None


#: Largest ``--classes @file`` read (10,000 names of 200 characters take 2 MB).
_MAX_CLASS_FILE = 4 << 20
#: Classes listed one per class on the summary's "per class" line; the rest are summed.
_SHOWN_CLASSES = 20


def _class_list(text: str | None) -> list[str] | None:
    if text is None:
        return None
    if text.startswith("@"):
        path = Path(text[1:]).expanduser()
        with path.open("rb") as file:  # read no further than the limit (/dev/zero never ends)
            data = file.read(_MAX_CLASS_FILE + 1)
        if len(data) > _MAX_CLASS_FILE:
            raise ValueError(
                f"{path}: --classes file is larger than {_MAX_CLASS_FILE} bytes; it holds one "
                "class name per line"
            )
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{path}: --classes file is not UTF-8 text ({error})") from None
        return [line.strip() for line in text.splitlines() if line.strip()]
    return [c.strip() for c in text.split(",")]


def byte_size(text: str) -> int:
    """A byte count: ``4294967296``, ``4G``, ``512MiB``, ``2 GB`` (binary units)."""
    cleaned = text.strip().upper().removesuffix("B").removesuffix("I").strip()
    scale = 1
    if cleaned and cleaned[-1] in "KMGT":
        scale = 1 << (10 * ("KMGT".index(cleaned[-1]) + 1))
        cleaned = cleaned[:-1].strip()
    try:
        value = int(float(cleaned) * scale)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(
            f"expected a size such as 4G or 512M, got {text!r}"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a size > 0, got {text!r}")
    return value


def add_max_bytes_argument(parser: argparse.ArgumentParser, limits: str) -> None:
    """``--max-bytes``: the largest ``limits`` (a phrase such as "image array an .npz may hold")."""
    parser.add_argument(
        "--max-bytes",
        type=byte_size,
        default=DEFAULT_MAX_BYTES,
        help=f"largest {limits} (default {format_bytes(DEFAULT_MAX_BYTES)})",
    )


def _print_summary(summary: SiteSummary) -> None:
    names = summary.class_names
    label = [f"{i}" + (f" ({names[i]})" if names else "") for i in range(summary.num_classes)]
    pairs = list(zip(label, summary.class_counts, strict=True))
    shown = ", ".join(f"{lab}: {n}" for lab, n in pairs[:_SHOWN_CLASSES])
    if len(pairs) > _SHOWN_CLASSES:
        rest = summary.class_counts[_SHOWN_CLASSES:]
        shown += f", ... {len(rest)} more classes: {sum(rest)} samples"
    print(f"{summary.samples} samples, shape {summary.input_shape}, {summary.num_classes} classes")
    print(f"per class: {shown}")
    mean, std = [round(m, 6) for m in summary.mean], [round(s, 6) for s in summary.std]
    print(f"mean {mean}, std {std}" + (" (measured)" if summary.measured else ""))


def site_data_command(args: argparse.Namespace) -> int:
    """``fedfuse site-data``: convert a site's data to a validated ``.npz`` (or check one)."""
    from fedfuse.data import save_npz_dataset
    from fedfuse.data.arrays import check_npz_dataset
    from fedfuse.data.convert import from_arrays, from_medmnist_npz
    from fedfuse.data.image_folder import from_image_folder
    from fedfuse.data.images import parse_shape

    limits = {"max_classes": args.max_classes, "max_bytes": args.max_bytes}
    try:
        if args.source == "check":
            summary = check_npz_dataset(args.path, **limits)
        else:
            out = Path(args.out).expanduser()
            if out.suffix != ".npz":
                raise ValueError(f"{out}: the site data file must end in .npz")
            if out.exists() and not args.force:
                raise FileExistsError(f"{out}: exists; refusing to overwrite it (use --force)")
            sources = [args.images, args.labels] if args.source == "arrays" else [args.path]
            refuse_overwriting_inputs(out, sources, "--out")  # even with --force
            stats = {"mean": parse_floats(args.mean), "std": parse_floats(args.std)}
            shape = (
                parse_shape(args.shape, max_side=args.max_side, name="--shape")
                if args.shape
                else None
            )
            classes = _class_list(args.classes)
            if args.source == "folder":
                if shape is None:
                    raise ValueError("--shape is required for an image folder, e.g. 1x28x28")
                dataset, _ = from_image_folder(
                    args.path,
                    shape,
                    classes=classes,
                    num_classes=args.num_classes,
                    follow_links=args.follow_links,
                    **limits,
                    **stats,
                )
            elif args.source == "medmnist":
                dataset = from_medmnist_npz(
                    args.path,
                    args.split,
                    num_classes=args.num_classes,
                    shape=shape,
                    classes=classes,
                    **limits,
                    **stats,
                )
            else:
                if args.num_classes is None and classes is None:
                    raise ValueError("give --num-classes or --classes for .npy arrays")
                dataset = from_arrays(
                    args.images,
                    args.labels,
                    args.num_classes,
                    shape=shape,
                    classes=classes,
                    **limits,
                    **stats,
                )
            save_npz_dataset(out, dataset)
            del dataset
            # what the SuperNode will read: prove it reads back (a chunk at a time)
            summary = check_npz_dataset(out, **limits)
    except (FileExistsError, FileNotFoundError, ValueError, OSError) as error:
        return _fail("site-data", error)
    _print_summary(summary)
    if args.source != "check":
        print(terminal_safe(f"wrote {args.out}"))
    return 0


def register_cli(commands: argparse._SubParsersAction) -> None:
    """Add ``certs``, ``keys`` and ``site-data`` to the ``fedfuse`` command line."""
    certs = commands.add_parser(
        "certs",
        help="make a CA and the SuperLink's TLS server certificate",
        description=make_server_certificates.__doc__.splitlines()[0],
    )
    certs.add_argument("--out", required=True, help="directory for ca.crt, server.pem, keys")
    certs.add_argument(
        "--host",
        action="append",
        required=True,
        help="a DNS name or IP address the sites use to reach the SuperLink (repeatable)",
    )
    certs.add_argument("--days", type=int, default=825, help="server certificate validity")
    certs.add_argument("--ca-days", type=int, default=3650, help="validity of a new CA")
    certs.add_argument(
        "--no-loopback",
        action="store_true",
        help=f"leave out {', '.join(LOOPBACK_NAMES)} (the SuperLink needs them itself)",
    )
    certs.add_argument("--force", action="store_true", help="overwrite server.pem/server.key")
    certs.set_defaults(handler=certs_command)

    keys = commands.add_parser(
        "keys",
        help="make SuperNode authentication key pairs (<name>.key, <name>.pub)",
        description=make_supernode_keys.__doc__.splitlines()[0],
    )
    keys.add_argument("names", nargs="+", help="site names, e.g. site-0 site-1")
    keys.add_argument("--out", required=True, help="directory for the key files")
    keys.add_argument("--force", action="store_true", help="overwrite existing key files")
    keys.set_defaults(handler=keys_command)

    site = commands.add_parser(
        "site-data",
        help="turn a site's images into a validated .npz site data file (or check one)",
        description="Convert a site's data to the .npz file a SuperNode reads (data-path).",
    )
    sources = site.add_subparsers(dest="source", required=True)
    folder = sources.add_parser("folder", help="an image folder, one sub-folder per class")
    folder.add_argument("path", help="folder holding <class>/<image files>")
    folder.add_argument(
        "--follow-links",
        action="store_true",
        help="follow symbolic links that lead out of the folder (refused by default)",
    )
    medmnist = sources.add_parser("medmnist", help="a MedMNIST-format .npz")
    medmnist.add_argument("path", help="e.g. bloodmnist.npz (keys train_images, ...)")
    medmnist.add_argument("--split", default="train", choices=["train", "val", "test"])
    arrays = sources.add_parser("arrays", help="images and labels as two .npy files")
    arrays.add_argument("images", help="uint8 images .npy: (N,H,W), (N,H,W,C) or (N,C,H,W)")
    arrays.add_argument("labels", help="integer labels .npy: (N,) or (N,1)")
    for parser in (folder, medmnist, arrays):
        parser.add_argument("--out", required=True, help="the .npz file to write")
        parser.add_argument(
            "--shape",
            help="CxHxW of the federation's model input, e.g. 1x28x28 (images are converted "
            "and resized; required for folders)",
        )
        parser.add_argument(
            "--classes",
            help="the federation's classes in label order, comma-separated or @file (one per "
            "line); stored in the file. Folders default to the sorted folder names, or the "
            "folder names as integer labels",
        )
        parser.add_argument(
            "--num-classes",
            type=int,
            help="the federation's number of classes (arrays: this or --classes)",
        )
        parser.add_argument("--mean", help="per-channel mean of x/255, e.g. 0.286 (agreed)")
        parser.add_argument("--std", help="per-channel std of x/255, e.g. 0.353 (agreed)")
        parser.add_argument(
            "--max-side",
            type=Range(1, 1 << 16).argument("--max-side"),
            default=DEFAULT_MAX_SIDE,
            help=f"largest H or W --shape may ask for (default {DEFAULT_MAX_SIDE})",
        )
        parser.add_argument("--force", action="store_true", help="overwrite --out")
    check = sources.add_parser("check", help="validate a site .npz file and summarise it")
    check.add_argument("path")
    for parser in (folder, medmnist, arrays, check):
        add_max_bytes_argument(
            parser, "array (images, labels) a file may hold or a conversion may make, e.g. 8G"
        )
        parser.add_argument(
            "--max-classes",
            type=int,
            default=DEFAULT_MAX_CLASSES,
            help=f"most classes a file may declare (default {DEFAULT_MAX_CLASSES})",
        )
    site.set_defaults(handler=site_data_command)
