"""A site's own data as one ``.npz`` file: how a real deployment hands data to a SuperNode.

The file holds ``images`` (uint8, ``(N, H, W)``, ``(N, H, W, C)`` or ``(N, C, H, W)``),
``labels`` (integers, ``(N,)``) and ``num_classes`` (the federation's class count, which a site
holding only some classes cannot infer); optionally ``mean`` and ``std`` per channel (else they
are measured on the file's images). It is read with ``allow_pickle=False``, and every key is
checked before a model sees it: a bad file fails here with a one-line :class:`DataFormatError`
naming the file and the key, not later inside training. ``fedfuse site-data`` writes such files
from image folders, MedMNIST files and ``.npy`` arrays (:mod:`fedfuse.data.convert`).
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfuse.data._common import DataFormatError
from fedfuse.data.dataset import ImageDataset
from fedfuse.io.atomic import atomic_path

__all__ = [
    "MIN_STD",
    "REQUIRED_KEYS",
    "check_statistics",
    "load_npz_dataset",
    "save_npz_dataset",
    "to_nchw",
]

REQUIRED_KEYS = ("images", "labels", "num_classes")
OPTIONAL_KEYS = ("mean", "std")
#: Smallest per-channel std accepted: below it normalisation divides by (almost) zero.
MIN_STD = 1e-6
_READ_ERRORS = (OSError, ValueError, zipfile.BadZipFile, EOFError)


def save_npz_dataset(path: str | Path, dataset: ImageDataset) -> Path:
    """Write ``dataset`` (with its normalisation statistics) as a site data file."""
    path = Path(path)
    with atomic_path(path) as tmp, tmp.open("wb") as handle:
        np.savez_compressed(
            handle,
            images=dataset.images.numpy(),
            labels=dataset.labels.numpy(),
            num_classes=np.int64(dataset.num_classes),
            mean=np.asarray(dataset.mean, dtype=np.float64),
            std=np.asarray(dataset.std, dtype=np.float64),
        )
    return path


def to_nchw(images: np.ndarray, source: str | Path, key: str = "images") -> np.ndarray:
    """``images`` as (N, C, H, W): adds the channel axis of 3-D input, moves channels-last."""
    if images.ndim == 3:
        return images[:, None]
    if images.ndim == 4:
        # channels-last when the last axis looks like channels and the second does not
        if images.shape[-1] in (1, 3) and images.shape[1] not in (1, 3):
            return np.ascontiguousarray(images.transpose(0, 3, 1, 2))
        return images
    raise DataFormatError(
        f"{source}: {key!r} must be 3-D (N, H, W) or 4-D (N, H, W, C) / (N, C, H, W), "
        f"found shape {images.shape}"
    )


def _read_archive(path: Path) -> dict[str, np.ndarray]:
    """The archive's known keys as arrays; each unreadable key is named in the error."""
    try:
        archive = np.load(path, allow_pickle=False)
    except _READ_ERRORS as error:
        raise DataFormatError(f"{path}: not a readable .npz site data file ({error})") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise DataFormatError(
            f"{path}: is a single .npy array, not an .npz archive with keys "
            f"{list(REQUIRED_KEYS)} (write one with `fedfuse site-data`)"
        )
    arrays: dict[str, np.ndarray] = {}
    with archive:
        missing = [k for k in REQUIRED_KEYS if k not in archive.files]
        if missing:
            raise DataFormatError(
                f"{path}: site data lacks {missing} (has {sorted(archive.files)})"
            )
        for key in (*REQUIRED_KEYS, *OPTIONAL_KEYS):
            if key not in archive.files:
                continue
            try:
                arrays[key] = archive[key]
            except _READ_ERRORS as error:
                reason = (
                    "it holds Python objects (pickles are refused)"
                    if "allow_pickle" in str(error)
                    else str(error)
                )
                raise DataFormatError(f"{path}: cannot read key {key!r}: {reason}") from None
    return arrays


def _num_classes(value: np.ndarray, path: Path) -> int:
    if value.shape != () or not np.issubdtype(value.dtype, np.integer) or int(value) < 1:
        raise DataFormatError(
            f"{path}: 'num_classes' must be one integer >= 1, found {value.dtype} "
            f"{value.tolist() if value.size <= 4 else value.shape}"
        )
    return int(value)


def check_statistics(mean: Any, std: Any, channels: int, source: str) -> tuple[tuple, tuple]:
    """Validated per-channel ``(mean, std)``: ``channels`` finite values, ``std >= MIN_STD``.

    ``source`` names the file (or option) in the error; a scalar is accepted for one channel.
    """
    checked = []
    for key, value in (("mean", mean), ("std", std)):
        array = np.atleast_1d(np.asarray(value))
        if not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)):
            raise DataFormatError(f"{source}: {key!r} must be numbers, found {array.dtype}")
        array = array.astype(np.float64)
        if array.shape != (channels,):
            raise DataFormatError(
                f"{source}: {key!r} must hold {channels} value(s) (one per channel), "
                f"found shape {array.shape}"
            )
        if not np.isfinite(array).all():
            raise DataFormatError(f"{source}: {key!r} holds NaN or Inf: {array.tolist()}")
        checked.append(array)
    mean_array, std_array = checked
    if (std_array < MIN_STD).any():
        raise DataFormatError(
            f"{source}: 'std' must be >= {MIN_STD:g} per channel, found {std_array.tolist()} "
            "(constant images cannot be normalised)"
        )
    return tuple(mean_array.tolist()), tuple(std_array.tolist())


def load_npz_dataset(path: str | Path, *, name: str | None = None) -> ImageDataset:
    """Read and validate a site data file; errors name the file and the offending key."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such site data file")
    arrays = _read_archive(path)
    images, labels = arrays["images"], arrays["labels"]
    num_classes = _num_classes(arrays["num_classes"], path)
    if images.dtype != np.uint8:
        raise DataFormatError(f"{path}: 'images' must be uint8, found {images.dtype}")
    if labels.ndim == 2 and labels.shape[1] == 1:  # MedMNIST-style (N, 1) labels
        labels = labels[:, 0]
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise DataFormatError(
            f"{path}: 'labels' must be 1-D integers, found {labels.dtype} {labels.shape}"
        )
    images = to_nchw(images, path)
    if len(images) != len(labels):
        raise DataFormatError(f"{path}: {len(images)} 'images' but {len(labels)} 'labels'")
    if len(images) == 0:
        raise DataFormatError(f"{path}: 'images' is empty (0 samples)")
    if min(images.shape[1:]) < 1:
        raise DataFormatError(f"{path}: 'images' has an empty axis, shape {images.shape}")
    if labels.min() < 0 or labels.max() >= num_classes:
        raise DataFormatError(
            f"{path}: labels span {labels.min()}..{labels.max()}, num_classes is {num_classes}"
        )
    channels = images.shape[1]
    mean, std = arrays.get("mean"), arrays.get("std")
    if (mean is None) != (std is None):
        raise DataFormatError(f"{path}: has {'mean' if std is None else 'std'!r} but not the other")
    if mean is None:
        scaled = images.astype(np.float64) / 255.0
        mean, std = scaled.mean(axis=(0, 2, 3)), scaled.std(axis=(0, 2, 3))
    mean, std = check_statistics(mean, std, channels, str(path))
    return ImageDataset(
        images=torch.from_numpy(np.ascontiguousarray(images)),
        labels=torch.from_numpy(labels.astype(np.int64)),
        num_classes=num_classes,
        mean=mean,
        std=std,
        name=name or path.stem,
    )
