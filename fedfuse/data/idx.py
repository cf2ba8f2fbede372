"""MNIST / Fashion-MNIST loaders and a small reader for the idx file format.

The idx format (http://yann.lecun.com/exdb/mnist/) is a 4-byte magic number
``0x00 0x00 <dtype> <ndim>``, then ``ndim`` big-endian uint32 dimensions, then the raw
data. Only dtype ``0x08`` (unsigned byte) is used by these datasets and supported here.
"""

from __future__ import annotations

import gzip
import logging
import math
import os
import zlib
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from fedfuse.data._common import DataFormatError, DatasetNotFoundError, check_split, root_hint
from fedfuse.data.dataset import ImageDataset
from fedfuse.data.npyfile import DEFAULT_MAX_BYTES

__all__ = ["read_idx", "load_fashion_mnist", "load_mnist"]

log = logging.getLogger(__name__)

_UBYTE = 0x08
_GZIP_MAGIC = b"\x1f\x8b"
# Directory shipped by the Debian/Ubuntu package ``dataset-fashion-mnist``.
FASHION_MNIST_SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")

_PREFIX = {"train": "train", "test": "t10k"}


def read_idx(path: str | os.PathLike[str], *, max_bytes: int = DEFAULT_MAX_BYTES) -> np.ndarray:
    """Read an idx file (plain or gzip-compressed) of unsigned bytes into a uint8 array.

    Raises ``DataFormatError`` naming the file if it is truncated, corrupt, or not a
    ubyte idx file, so a bad download is reported instead of silently yielding garbage.
    The dimensions are checked against ``max_bytes`` before the data is read, and gzip data is
    decompressed only as far as they say (so a gzip bomb is not expanded).
    """
    path = Path(path)
    with path.open("rb") as handle:
        compressed = handle.read(2) == _GZIP_MAGIC
    try:
        with gzip.open(path, "rb") if compressed else path.open("rb") as handle:
            return _read_idx_stream(handle, path, max_bytes)
    except (OSError, EOFError, zlib.error) as e:
        if not compressed:
            raise
        raise DataFormatError(f"{path}: corrupt or truncated gzip data ({e})") from e


def _read_idx_stream(handle: BinaryIO, path: Path, max_bytes: int) -> np.ndarray:
    magic = handle.read(4)
    if len(magic) < 4:
        raise DataFormatError(f"{path}: file too short ({len(magic)} bytes) for an idx header")
    zero, dtype, ndim = int.from_bytes(magic[:2], "big"), magic[2], magic[3]
    if zero != 0 or ndim == 0:
        raise DataFormatError(
            f"{path}: bad idx magic number 0x{magic.hex()} (expected 0x0000<dtype><ndim>)"
        )
    if dtype != _UBYTE:
        raise DataFormatError(
            f"{path}: unsupported idx dtype 0x{dtype:02x} (expected 0x08, unsigned byte)"
        )
    raw_dims = handle.read(4 * ndim)
    if len(raw_dims) < 4 * ndim:
        raise DataFormatError(f"{path}: truncated idx header (expected {4 + 4 * ndim} bytes)")
    dims = tuple(int.from_bytes(raw_dims[4 * k : 4 + 4 * k], "big") for k in range(ndim))
    expected = math.prod(dims)
    if expected > max_bytes:
        raise DataFormatError(
            f"{path}: idx dims {dims} claim {expected} bytes; the limit is {max_bytes} (max_bytes)"
        )
    data = handle.read(expected + 1)
    found = len(data)
    if found != expected:
        kind = "truncated" if found < expected else "has trailing data"
        shown = found if found < expected else f"more than {expected}"
        raise DataFormatError(
            f"{path}: idx file {kind}: dims {dims} need {expected} data bytes, found {shown}"
        )
    return np.frombuffer(data, dtype=np.uint8).reshape(dims).copy()


def _find_file(directory: Path, stem: str) -> Path | None:
    for candidate in (directory / stem, directory / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _find_pair(dirs: list[Path], split: str) -> tuple[Path, Path] | None:
    """First directory holding both the images and labels idx files of ``split``."""
    prefix = _PREFIX[split]
    for d in dirs:
        images = _find_file(d, f"{prefix}-images-idx3-ubyte")
        labels = _find_file(d, f"{prefix}-labels-idx1-ubyte")
        if images is not None and labels is not None:
            return images, labels
    return None


def _load_idx_dataset(
    name: str,
    split: str,
    root: Path,
    dirs: list[Path],
    download: bool,
    torchvision_class: str,
    mean: float,
    std: float,
    hints: list[str],
    class_names: tuple[str, ...],
) -> ImageDataset:
    check_split(split)
    found = _find_pair(dirs, split)
    if found is None and download:
        import torchvision.datasets as tvd

        log.info("downloading %s to %s via torchvision", name, root)
        getattr(tvd, torchvision_class)(str(root), train=split == "train", download=True)
        found = _find_pair([root / torchvision_class / "raw"], split)
    if found is None:
        raise DatasetNotFoundError(name, split, dirs, hints)
    images_path, labels_path = found
    log.debug("reading %s %s from %s", name, split, images_path.parent)
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.ndim != 3 or labels.ndim != 1 or images.shape[0] != labels.shape[0]:
        raise DataFormatError(
            f"{images_path}, {labels_path}: expected images (N, H, W) and labels (N,), "
            f"found {images.shape} and {labels.shape}"
        )
    return ImageDataset(
        images=torch.from_numpy(images).unsqueeze(1),
        labels=torch.from_numpy(labels.astype(np.int64)),
        num_classes=10,
        mean=(mean,),
        std=(std,),
        name=name,
        class_names=class_names,
    )


#: Fashion-MNIST's classes in label order (Xiao et al., 2017), so that a fused checkpoint of a
#: default run names what it predicts
FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)


def load_fashion_mnist(split: str, root: Path, download: bool = False) -> ImageDataset:
    """Fashion-MNIST (N, 1, 28, 28); searches ``<root>/fashion-mnist``, the torchvision
    layout ``<root>/FashionMNIST/raw`` and the Debian package directory, in that order."""
    dirs = [root / "fashion-mnist", root / "FashionMNIST" / "raw", FASHION_MNIST_SYSTEM_DIR]
    hints = [
        "install the Debian/Ubuntu package: apt-get install dataset-fashion-mnist",
        root_hint(
            root / "fashion-mnist",
            "the 4 idx files ({train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz])",
        ),
        "load_dataset('fashion-mnist', download=True) to fetch it with torchvision",
    ]
    return _load_idx_dataset(
        "fashion-mnist",
        split,
        root,
        dirs,
        download,
        "FashionMNIST",
        0.2860,
        0.3530,
        hints,
        FASHION_MNIST_CLASSES,
    )


def load_mnist(split: str, root: Path, download: bool = False) -> ImageDataset:
    """MNIST (N, 1, 28, 28); searches ``<root>/mnist`` then ``<root>/MNIST/raw``."""
    dirs = [root / "mnist", root / "MNIST" / "raw"]
    hints = [
        root_hint(
            root / "mnist", "the 4 idx files ({train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz])"
        ),
        "load_dataset('mnist', download=True) to fetch it with torchvision",
    ]
    digits = tuple(str(d) for d in range(10))
    return _load_idx_dataset(
        "mnist", split, root, dirs, download, "MNIST", 0.1307, 0.3081, hints, digits
    )
