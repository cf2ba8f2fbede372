"""Turn a site's own data into a validated :class:`ImageDataset` (then a site ``.npz`` file).

Three sources, one result: an image folder (one sub-folder per class; read by
:mod:`fedfuse.data.image_folder`), a MedMNIST-format ``.npz`` (``<split>_images`` /
``<split>_labels``) or two ``.npy`` arrays (images, labels), both read here. Every path ends in
:func:`build_site_dataset`, which checks shapes, labels and class count and computes (or checks
given) per-channel normalisation statistics, so a file written by ``fedfuse site-data`` always
loads with :func:`fedfuse.data.load_npz_dataset`. Images are converted and resized by
:mod:`fedfuse.data.images`.

The class count must be the federation's, not the site's: a site that holds only some classes
cannot infer it, so it comes from an explicit class list, ``num_classes`` or MedMNIST's metadata.
Class names, when known, travel in the dataset (and so in the site file).

Sizes are checked before they are allocated: ``max_side`` bounds a target shape's H and W,
``max_bytes`` the images' bytes (the number of images times the shape) and every ``.npy``
header, ``max_classes`` the class count. In an image folder, a sub-folder that cannot be read is
an error naming it, an image PIL refuses as a decompression bomb is an error naming the file,
and a symbolic link that leads out of the folder is refused (``follow_links=True`` follows it).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from fedfuse.data._common import DataFormatError
from fedfuse.data.arrays import (
    DEFAULT_MAX_CLASSES,
    channel_statistics,
    check_class_names,
    check_num_classes,
    check_statistics,
    image_chunks,
    to_nchw,
)
from fedfuse.data.dataset import ImageDataset
from fedfuse.data.images import Shape, resize_images
from fedfuse.data.npyfile import DEFAULT_MAX_BYTES, read_npy

__all__ = ["build_site_dataset", "from_arrays", "from_medmnist_npz"]


def build_site_dataset(
    images: np.ndarray,
    labels: np.ndarray,
    num_classes: int,
    *,
    source: str,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    name: str = "",
    class_names: Sequence[str] | None = None,
    max_classes: int = DEFAULT_MAX_CLASSES,
) -> ImageDataset:
    """Validate uint8 (N, C, H, W) images and labels; attach (measured or given) statistics.

    Args:
        images: uint8 array (N, C, H, W).
        labels: integer array (N,) in ``0..num_classes-1``.
        num_classes: the federation's number of classes.
        source: what the data came from, named in every error.
        mean, std: per-channel statistics of ``x / 255``; measured on ``images`` when omitted
            (give the federation's agreed values so every site normalises the same way).
            Measured in chunks with exact integer sums (no float copy of the images).
        class_names: one name per class, in label order (optional).
        max_classes: most classes ``num_classes`` may be.
    """
    if images.dtype != np.uint8 or images.ndim != 4:
        raise DataFormatError(
            f"{source}: images must be uint8 (N, C, H, W), found {images.dtype} {images.shape}"
        )
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise DataFormatError(
            f"{source}: labels must be 1-D integers, found {labels.dtype} {labels.shape}"
        )
    if len(images) != len(labels):
        raise DataFormatError(f"{source}: {len(images)} images but {len(labels)} labels")
    if len(images) == 0:
        raise DataFormatError(f"{source}: no samples")
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise DataFormatError(f"{source}: num_classes must be an integer >= 1, got {num_classes}")
    check_num_classes(num_classes, source, max_classes=max_classes)
    if labels.min() < 0 or labels.max() >= num_classes:
        raise DataFormatError(
            f"{source}: labels span {labels.min()}..{labels.max()}, num_classes is {num_classes}"
        )
    if (mean is None) != (std is None):
        raise DataFormatError(f"{source}: give both mean and std, or neither")
    names = None
    if class_names is not None:
        names = check_class_names(np.asarray(list(class_names), dtype=np.str_), num_classes, source)
    if mean is None:
        mean, std = channel_statistics(image_chunks(images))
    mean_t, std_t = check_statistics(mean, std, images.shape[1], source)
    return ImageDataset(
        images=torch.from_numpy(np.ascontiguousarray(images)),
        labels=torch.from_numpy(labels.astype(np.int64)),
        num_classes=num_classes,
        mean=mean_t,
        std=std_t,
        name=name,
        class_names=names,
    )


def _resized_site_dataset(
    images: np.ndarray,
    labels: np.ndarray,
    num_classes: int,
    source: str,
    name: str,
    *,
    shape: Shape | None,
    mean: Sequence[float] | None,
    std: Sequence[float] | None,
    classes: Sequence[str] | None,
    max_classes: int,
    max_bytes: int,
) -> ImageDataset:
    """The converters' last step: ``images`` resized to ``shape`` (None: kept as they are) within
    ``max_bytes``, then :func:`build_site_dataset` with the class names ``classes``."""
    if shape is not None:
        images = resize_images(images, shape, source, max_bytes=max_bytes)
    return build_site_dataset(
        images,
        labels,
        num_classes,
        source=source,
        mean=mean,
        std=std,
        name=name,
        class_names=classes,
        max_classes=max_classes,
    )


# --------------------------------------------------------------------------------- MedMNIST
def _medmnist_classes(path: Path) -> list[str] | None:
    """Class names of a MedMNIST file from its name (``bloodmnist.npz``, ``bloodmnist_64.npz``)."""
    from fedfuse.data.medmnist import _info, unsupported_medmnist

    flag = re.sub(r"_\d+$", "", path.stem.lower())
    info = _info().get(flag)
    if info is None:
        return None
    if flag in unsupported_medmnist():
        raise DataFormatError(
            f"{path}: MedMNIST {flag!r} is not supported: {unsupported_medmnist()[flag]}"
        )
    labels = info["label"]
    return [str(labels.get(str(i), i)) for i in range(len(labels))]


def _class_count(num_classes: int | None, classes: Sequence[str] | None, source: str) -> int | None:
    """The class count from ``num_classes`` and/or a class list (which must agree)."""
    if classes is None:
        return num_classes
    if num_classes is not None and num_classes != len(classes):
        raise ValueError(
            f"{source}: num_classes {num_classes} but {len(classes)} classes were listed"
        )
    return len(classes)


def from_medmnist_npz(
    path: str | Path,
    split: str = "train",
    *,
    num_classes: int | None = None,
    shape: Shape | None = None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    classes: Sequence[str] | None = None,
    max_classes: int = DEFAULT_MAX_CLASSES,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> ImageDataset:
    """One split (``train``, ``val``, ``test``) of a MedMNIST-format ``.npz``.

    ``num_classes`` and the class names default to MedMNIST's metadata when the file is named
    after its set (``bloodmnist.npz``, ``bloodmnist_64.npz``); ``classes`` names them instead;
    ``shape`` resizes (default: keep); ``max_bytes`` bounds the arrays read and made.
    """
    from fedfuse.data.medmnist import read_medmnist_npz

    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such MedMNIST file")
    if split not in ("train", "val", "test"):
        raise ValueError(f"split must be train, val or test, got {split!r}")
    known = _medmnist_classes(path)  # refuses unsupported sets before reading them
    if classes is None and known is not None and num_classes in (None, len(known)):
        classes = known
    num_classes = _class_count(num_classes, classes, str(path))
    if num_classes is None:
        raise ValueError(f"{path}: not named after a MedMNIST set, so give the number of classes")
    images, labels = read_medmnist_npz(path, split, max_bytes=max_bytes)
    return _resized_site_dataset(
        images,
        labels,
        num_classes,
        f"{path}[{split}]",
        path.stem,
        shape=shape,
        mean=mean,
        std=std,
        classes=classes,
        max_classes=max_classes,
        max_bytes=max_bytes,
    )


# ----------------------------------------------------------------------------------- arrays
def from_arrays(
    images_path: str | Path,
    labels_path: str | Path,
    num_classes: int | None = None,
    *,
    shape: Shape | None = None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    classes: Sequence[str] | None = None,
    max_classes: int = DEFAULT_MAX_CLASSES,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> ImageDataset:
    """Images (uint8 ``(N, H, W)``, ``(N, H, W, C)`` or ``(N, C, H, W)`` ``.npy``) and labels
    (integer ``(N,)`` or ``(N, 1)`` ``.npy``); ``shape`` resizes (default: keep).

    The class count is ``num_classes`` or the length of ``classes`` (the names, in label
    order); each ``.npy`` header is checked against its file and ``max_bytes`` before reading.
    """
    images_path, labels_path = Path(images_path).expanduser(), Path(labels_path).expanduser()
    num_classes = _class_count(num_classes, classes, str(images_path))
    if num_classes is None:
        raise ValueError(f"{images_path}: give the number of classes or the class names")
    images = read_npy(images_path, "images", max_bytes=max_bytes)
    labels = read_npy(labels_path, "labels", max_bytes=max_bytes)
    if images.dtype != np.uint8:
        raise DataFormatError(
            f"{images_path}: images must be uint8 (0..255), found {images.dtype}; "
            "scale and convert them first"
        )
    images = to_nchw(images, images_path, key="images")
    if labels.ndim == 2 and labels.shape[1] == 1:
        labels = labels[:, 0]
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise DataFormatError(
            f"{labels_path}: labels must be 1-D integers, found {labels.dtype} {labels.shape}"
        )
    if len(images) != len(labels):
        raise DataFormatError(
            f"{images_path} holds {len(images)} images but {labels_path} {len(labels)} labels"
        )
    if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):  # before resizing
        raise DataFormatError(
            f"{labels_path}: labels span {labels.min()}..{labels.max()}, "
            f"num_classes is {num_classes}"
        )
    return _resized_site_dataset(
        images,
        labels,
        num_classes,
        str(images_path),
        images_path.stem,
        shape=shape,
        mean=mean,
        std=std,
        classes=classes,
        max_classes=max_classes,
        max_bytes=max_bytes,
    )
