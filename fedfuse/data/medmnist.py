"""MedMNIST v2/v3 2D loaders (28x28) for the official ``<flag>.npz`` files.

Only single-label 2D sets are registered (the flag list is derived from ``medmnist.INFO``);
``chestmnist`` is multi-label and the ``*3d`` sets are volumetric, so both are refused with
an explanation. The "train" split is the official train split only (the val split is not
merged in); "test" is the official test split. Normalisation uses mean = std = 0.5 per
channel, a simple documented convention rather than measured statistics.
"""

from __future__ import annotations

import logging
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfuse.data._common import DataFormatError, DatasetNotFoundError, check_split, root_hint
from fedfuse.data.dataset import ImageDataset
from fedfuse.data.npyfile import DEFAULT_MAX_BYTES, NpzReader, is_npy

__all__ = ["load_medmnist", "medmnist_flags", "read_medmnist_npz", "unsupported_medmnist"]

log = logging.getLogger(__name__)

_MULTI_LABEL = "multi-label"


@lru_cache(maxsize=1)
def _info() -> dict[str, dict[str, Any]]:
    """``medmnist.INFO`` or ``{}`` when the optional ``medmnist`` package is missing."""
    try:
        from medmnist import INFO  # slow import: only when needed
    except ImportError:
        log.debug("medmnist not installed; MedMNIST datasets unavailable")
        return {}
    return INFO


def _is_2d(flag: str, info: dict[str, Any]) -> bool:
    return not flag.endswith("3d") and info.get("n_channels") in (1, 3)


def medmnist_flags() -> list[str]:
    """Supported MedMNIST flags: 2D, 1 or 3 channels, single-label."""
    return sorted(
        flag
        for flag, info in _info().items()
        if _is_2d(flag, info) and _MULTI_LABEL not in info.get("task", "")
    )


def unsupported_medmnist() -> dict[str, str]:
    """MedMNIST flags known to ``medmnist.INFO`` that fedfuse refuses, with the reason."""
    out = {}
    for flag, info in _info().items():
        if not _is_2d(flag, info):
            out[flag] = "it is a 3D (volumetric) dataset; only 2D images are supported"
        elif _MULTI_LABEL in info.get("task", ""):
            out[flag] = (
                f"it is multi-label ({info['task']}); only single-label classification is supported"
            )
    return out


def read_medmnist_npz(
    path: str | os.PathLike[str],
    split: str,
    n_channels: int | None = None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> tuple[np.ndarray, np.ndarray]:
    """Read ``<split>_images`` / ``<split>_labels`` from a MedMNIST npz (no pickle allowed).

    Each array's header is checked against the file and ``max_bytes`` before it is read (see
    :class:`fedfuse.data.npyfile.NpzReader`). Returns images as uint8 (N, C, H, W) and labels
    as int64 (N,).
    """
    path = Path(path)
    img_key, lab_key = f"{split}_images", f"{split}_labels"
    if is_npy(path):
        raise DataFormatError(f"{path}: expected an npz archive, found a single .npy array")
    try:
        npz = NpzReader(path, max_bytes=max_bytes)
    except DataFormatError as error:
        reason = str(error).removeprefix(f"{path}: not a readable .npz archive ")
        raise DataFormatError(f"{path}: not a readable npz file {reason}") from None
    with npz:
        missing = [k for k in (img_key, lab_key) if k not in npz.files]
        if missing:
            raise DataFormatError(f"{path}: missing keys {missing} (found {npz.files})")
        images_header, labels_header = npz.header(img_key), npz.header(lab_key)
        if images_header.dtype != np.uint8 or not (
            len(images_header.shape) == 3
            or (len(images_header.shape) == 4 and images_header.shape[-1] == 3)
        ):
            raise DataFormatError(
                f"{path}: expected {img_key} uint8 of shape (N, H, W) or (N, H, W, 3), "
                f"found {images_header.dtype} {images_header.shape}"
            )
        if labels_header.shape[:1] != images_header.shape[:1]:
            raise DataFormatError(
                f"{path}: expected {lab_key} integer of shape ({images_header.shape[0]}, 1), "
                f"found {labels_header.dtype} {labels_header.shape}"
            )
        images, labels = npz.read(img_key), npz.read(lab_key)
    if images.dtype != np.uint8 or not (
        images.ndim == 3 or (images.ndim == 4 and images.shape[-1] == 3)
    ):
        raise DataFormatError(
            f"{path}: expected {img_key} uint8 of shape (N, H, W) or (N, H, W, 3), "
            f"found {images.dtype} {images.shape}"
        )
    images = images[:, None] if images.ndim == 3 else images.transpose(0, 3, 1, 2)
    if n_channels is not None and images.shape[1] != n_channels:
        raise DataFormatError(f"{path}: expected {n_channels} channel(s), found {images.shape[1]}")
    if labels.ndim == 2 and labels.shape[1] == 1:
        labels = labels[:, 0]
    if labels.shape != (images.shape[0],) or not np.issubdtype(labels.dtype, np.integer):
        raise DataFormatError(
            f"{path}: expected {lab_key} integer of shape ({images.shape[0]}, 1), "
            f"found {labels.dtype} {labels.shape}"
        )
    return np.ascontiguousarray(images), labels.astype(np.int64)


def load_medmnist(flag: str, split: str, root: Path, download: bool = False) -> ImageDataset:
    """A 2D MedMNIST set at 28x28, from ``<root>/medmnist/<flag>.npz`` or
    ``~/.medmnist/<flag>.npz`` (medmnist's own default cache)."""
    check_split(split)
    info = _info().get(flag)
    if info is None:
        raise ValueError(f"unknown MedMNIST flag {flag!r} (is the medmnist package installed?)")
    if flag in unsupported_medmnist():
        raise ValueError(f"MedMNIST {flag!r} is not supported: {unsupported_medmnist()[flag]}")
    fname = f"{flag}.npz"
    candidates = [root / "medmnist" / fname, Path.home() / ".medmnist" / fname]
    path = next((p for p in candidates if p.is_file()), None)
    if path is None and download:
        import medmnist

        target = root / "medmnist"
        target.mkdir(parents=True, exist_ok=True)
        log.info("downloading %s to %s via medmnist", flag, target)
        getattr(medmnist, info["python_class"])(split=split, download=True, root=str(target))
        path = target / fname if (target / fname).is_file() else None
    if path is None:
        raise DatasetNotFoundError(
            flag,
            split,
            candidates,
            [
                root_hint(root / "medmnist", f"{fname} (from {info['url']})"),
                f"load_dataset({flag!r}, download=True) to fetch it with the medmnist package",
            ],
        )
    log.debug("reading %s %s from %s", flag, split, path)
    images, labels = read_medmnist_npz(path, split, info["n_channels"])
    c = images.shape[1]
    return ImageDataset(
        images=torch.from_numpy(images),
        labels=torch.from_numpy(labels),
        num_classes=len(info["label"]),
        mean=(0.5,) * c,
        std=(0.5,) * c,
        name=flag,
    )
