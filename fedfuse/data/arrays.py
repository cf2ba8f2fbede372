"""A site's own data as one ``.npz`` file: how a real deployment hands data to a SuperNode.

The file holds ``images`` (uint8, ``(N, H, W)``, ``(N, H, W, C)`` or ``(N, C, H, W)``),
``labels`` (integers, ``(N,)``) and ``num_classes`` (the federation's class count, which a site
holding only some classes cannot infer); optionally ``mean`` and ``std`` per channel (else they
are measured on the file's images) and ``class_names`` (a unicode array, one name per class).
It is read with :class:`fedfuse.data.npyfile.NpzReader`, never unpickled, and every key is
checked before a model sees it: a bad file fails here with a one-line :class:`DataFormatError`
naming the file and the key, not later inside training. Sizes are checked before anything is
allocated: each array's header against the file and against ``max_bytes``,
``num_classes`` against the labels and ``max_classes``. Statistics are summed over chunks of
images (exact integer sums), so neither loading nor :func:`check_npz_dataset` makes a float
copy of the images. ``fedfuse site-data`` writes such files from image folders, MedMNIST files
and ``.npy`` arrays (:mod:`fedfuse.data.convert`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfuse.data._common import DataFormatError
from fedfuse.data.dataset import ImageDataset
from fedfuse.data.npyfile import DEFAULT_MAX_BYTES, ArrayHeader, NpzReader
from fedfuse.io.atomic import atomic_path, require_file
from fedfuse.io.limits import DEFAULT_MAX_CLASSES

__all__ = [
    "DEFAULT_MAX_CLASSES",
    "MAX_CLASS_NAME",
    "MIN_STD",
    "REQUIRED_KEYS",
    "SiteSummary",
    "channel_statistics",
    "check_class_names",
    "check_npz_dataset",
    "check_num_classes",
    "check_statistics",
    "load_npz_dataset",
    "save_npz_dataset",
    "to_nchw",
]


REQUIRED_KEYS = ("images", "labels", "num_classes")
OPTIONAL_KEYS = ("mean", "std", "class_names")
#: Smallest per-channel std accepted: below it normalisation divides by (almost) zero.
MIN_STD = 1e-6
#: Longest class name accepted (characters).
MAX_CLASS_NAME = 200
#: Bytes of images summed at a time when statistics are measured.
STATISTICS_CHUNK_BYTES = 8 << 20


# ----------------------------------------------------------------------------- validation
def check_num_classes(
    value: Any, source: str, *, max_classes: int = DEFAULT_MAX_CLASSES, key: str = "num_classes"
) -> int:
    """``value`` as a class count: one integer in ``1..max_classes`` (named ``key`` in errors)."""
    array = np.asarray(value)
    if array.shape != () or not np.issubdtype(array.dtype, np.integer) or int(array) < 1:
        shown = array.tolist() if array.size <= 4 else array.shape
        raise DataFormatError(
            f"{source}: {key!r} must be one integer >= 1, found {array.dtype} {shown}"
        )
    if int(array) > max_classes:
        raise DataFormatError(
            f"{source}: {key!r} is {int(array)}, above the limit of {max_classes} classes "
            "(max_classes, option --max-classes)"
        )
    return int(array)


def check_class_names(names: Any, num_classes: int, source: str) -> tuple[str, ...]:
    """``names`` as one distinct, printable, non-empty name per class (at most
    :data:`MAX_CLASS_NAME` characters each)."""
    array = np.asarray(names)
    if array.ndim != 1 or array.dtype.kind != "U":
        raise DataFormatError(
            f"{source}: 'class_names' must be a 1-D array of text, found {array.dtype} "
            f"{array.shape}"
        )
    if len(array) != num_classes:
        raise DataFormatError(
            f"{source}: 'class_names' holds {len(array)} names, num_classes is {num_classes}"
        )
    checked = tuple(str(n) for n in array.tolist())
    for i, name in enumerate(checked):
        if not name.strip() or not name.isprintable() or len(name) > MAX_CLASS_NAME:
            raise DataFormatError(
                f"{source}: 'class_names'[{i}] {name[:40]!r} must be 1..{MAX_CLASS_NAME} "
                "printable characters"
            )
    if len(set(checked)) != len(checked):
        repeated = sorted({n for n in checked if checked.count(n) > 1})[:5]
        raise DataFormatError(f"{source}: 'class_names' repeats {repeated}")
    return checked


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


# ----------------------------------------------------------------------------- statistics
def image_chunks(images: np.ndarray, chunk_bytes: int = STATISTICS_CHUNK_BYTES) -> Iterator:
    """Views of ``images`` along the first axis, about ``chunk_bytes`` each."""
    row = max(1, math.prod(images.shape[1:]) * images.itemsize)
    step = max(1, chunk_bytes // row)
    for start in range(0, len(images), step):
        yield images[start : start + step]


def channel_statistics(
    chunks: Iterable[np.ndarray], channel_axis: int | None = 1
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of ``x / 255`` over uint8 image chunks, summed exactly.

    Integer sums of values and squares make the result independent of how the images are
    chunked, and no float copy of the images is made. ``channel_axis`` is the chunks' channel
    axis (``None``: one channel).
    """
    sums: list[int] = []
    squares: list[int] = []
    count = 0
    for chunk in chunks:
        if chunk.size == 0:
            continue
        planes = (
            [chunk]
            if channel_axis is None
            else [
                chunk[(slice(None),) * channel_axis + (c,)]
                for c in range(chunk.shape[channel_axis])
            ]
        )
        if not sums:
            sums, squares = [0] * len(planes), [0] * len(planes)
        for c, plane in enumerate(planes):
            sums[c] += int(plane.sum(dtype=np.uint64))
            squares[c] += int(np.square(plane, dtype=np.uint32).sum(dtype=np.uint64))
        count += planes[0].size
    if not count:
        raise ValueError("no images to measure statistics on")
    mean = tuple(s / (255 * count) for s in sums)
    std = tuple(
        math.sqrt((count * q - s * s) / (count * count)) / 255
        for s, q in zip(sums, squares, strict=True)
    )
    return mean, std


# --------------------------------------------------------------------------------- writing
def save_npz_dataset(path: str | Path, dataset: ImageDataset) -> Path:
    """Write ``dataset`` (its normalisation statistics and class names) as a site data file."""
    path = Path(path)
    extra = {}
    if dataset.class_names is not None:
        extra["class_names"] = np.asarray(dataset.class_names, dtype=np.str_)
    with atomic_path(path) as tmp, tmp.open("wb") as handle:
        np.savez_compressed(
            handle,
            images=dataset.images.numpy(),
            labels=dataset.labels.numpy(),
            num_classes=np.int64(dataset.num_classes),
            mean=np.asarray(dataset.mean, dtype=np.float64),
            std=np.asarray(dataset.std, dtype=np.float64),
            **extra,
        )
    return path


# --------------------------------------------------------------------------------- reading
def _image_layout(shape: tuple[int, ...], source: Any, key: str = "images") -> int | None:
    """Channel axis of images of ``shape``: None (N, H, W), 3 (N, H, W, C) or 1 (N, C, H, W)."""
    if len(shape) == 3:
        return None
    if len(shape) == 4:
        # channels-last when the last axis looks like channels and the second does not
        return 3 if shape[-1] in (1, 3) and shape[1] not in (1, 3) else 1
    raise DataFormatError(
        f"{source}: {key!r} must be 3-D (N, H, W) or 4-D (N, H, W, C) / (N, C, H, W), "
        f"found shape {shape}"
    )


def to_nchw(images: np.ndarray, source: str | Path, key: str = "images") -> np.ndarray:
    """``images`` as (N, C, H, W): adds the channel axis of 3-D input, moves channels-last."""
    axis = _image_layout(images.shape, source, key)
    if axis is None:
        return images[:, None]
    if axis == 3:
        return np.ascontiguousarray(images.transpose(0, 3, 1, 2))
    return images


def _nchw_shape(shape: tuple[int, ...], axis: int | None) -> tuple[int, int, int, int]:
    if axis is None:
        return (shape[0], 1, shape[1], shape[2])
    if axis == 3:
        return (shape[0], shape[3], shape[1], shape[2])
    return tuple(shape)  # type: ignore[return-value]


@dataclass(frozen=True)
class SiteSummary:
    """What :func:`check_npz_dataset` found in a valid site data file."""

    path: Path
    samples: int
    input_shape: tuple[int, int, int]
    num_classes: int
    class_counts: tuple[int, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    class_names: tuple[str, ...] | None = None
    measured: bool = False  # statistics measured on the images (the file has none)


@dataclass
class _SiteFile:
    """A site file's small keys read and checked, and its images' header checked."""

    images: ArrayHeader
    channel_axis: int | None
    labels: np.ndarray
    num_classes: int
    class_names: tuple[str, ...] | None
    statistics: tuple[tuple, tuple] | None


def _read_class_names(reader: NpzReader, num_classes: int) -> tuple[str, ...]:
    path, header = reader.path, reader.header("class_names")
    if len(header.shape) != 1 or header.dtype.kind != "U":
        raise DataFormatError(
            f"{path}: 'class_names' must be a 1-D array of text, found {header.dtype} "
            f"{header.shape}"
        )
    if header.count != num_classes:
        raise DataFormatError(
            f"{path}: 'class_names' holds {header.count} names, num_classes is {num_classes}"
        )
    if header.dtype.itemsize > 4 * MAX_CLASS_NAME:  # 4 bytes a character
        raise DataFormatError(
            f"{path}: 'class_names' holds names of up to {header.dtype.itemsize // 4} "
            f"characters, at most {MAX_CLASS_NAME} are accepted"
        )
    return check_class_names(reader.read("class_names"), num_classes, str(path))


def _read_statistics(reader: NpzReader, channels: int) -> tuple[tuple, tuple]:
    path = reader.path
    for key in ("mean", "std"):
        header = reader.header(key)
        if header.dtype.kind not in "biuf":
            raise DataFormatError(f"{path}: {key!r} must be numbers, found {header.dtype}")
        if header.count > channels:
            raise DataFormatError(
                f"{path}: {key!r} must hold {channels} value(s) (one per channel), "
                f"found shape {header.shape}"
            )
    return check_statistics(reader.read("mean"), reader.read("std"), channels, str(path))


def _open_site_file(reader: NpzReader, max_classes: int) -> _SiteFile:
    """Check every header, then read and check all keys but the images (in that order, so
    the cheapest check names the problem)."""
    path = reader.path
    missing = [k for k in REQUIRED_KEYS if k not in reader.files]
    if missing:
        raise DataFormatError(f"{path}: site data lacks {missing} (has {sorted(reader.files)})")
    present = [k for k in (*REQUIRED_KEYS, *OPTIONAL_KEYS) if k in reader.files]
    headers = {k: reader.header(k) for k in present}
    if headers["num_classes"].nbytes > 64:
        raise DataFormatError(
            f"{path}: 'num_classes' must be one integer >= 1, found "
            f"{headers['num_classes'].dtype} {headers['num_classes'].shape}"
        )
    num_classes = check_num_classes(reader.read("num_classes"), str(path), max_classes=max_classes)
    images, labels = headers["images"], headers["labels"]
    if images.dtype != np.uint8:
        raise DataFormatError(f"{path}: 'images' must be uint8, found {images.dtype}")
    label_shape = labels.shape
    if len(label_shape) == 2 and label_shape[1] == 1:  # MedMNIST-style (N, 1) labels
        label_shape = label_shape[:1]
    if len(label_shape) != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise DataFormatError(
            f"{path}: 'labels' must be 1-D integers, found {labels.dtype} {labels.shape}"
        )
    axis = _image_layout(images.shape, path)
    shape = _nchw_shape(images.shape, axis)
    if shape[0] != label_shape[0]:
        raise DataFormatError(f"{path}: {shape[0]} 'images' but {label_shape[0]} 'labels'")
    if shape[0] == 0:
        raise DataFormatError(f"{path}: 'images' is empty (0 samples)")
    if min(shape[1:]) < 1:
        raise DataFormatError(f"{path}: 'images' has an empty axis, shape {shape}")
    label_array = reader.read("labels").reshape(-1)
    low, high = int(label_array.min()), int(label_array.max())
    if low < 0 or high >= num_classes:
        raise DataFormatError(f"{path}: labels span {low}..{high}, num_classes is {num_classes}")
    names = _read_class_names(reader, num_classes) if "class_names" in headers else None
    if ("mean" in headers) != ("std" in headers):
        raise DataFormatError(
            f"{path}: has {'mean' if 'std' not in headers else 'std'!r} but not the other"
        )
    return _SiteFile(
        images=images,
        channel_axis=axis,
        labels=label_array,
        num_classes=num_classes,
        class_names=names,
        statistics=_read_statistics(reader, shape[1]) if "mean" in headers else None,
    )


def _site_reader(path: str | Path, max_bytes: int) -> NpzReader:
    path = require_file(path, "site data")
    with path.open("rb") as handle:
        if handle.read(6) == b"\x93NUMPY":
            raise DataFormatError(
                f"{path}: is a single .npy array, not an .npz archive with keys "
                f"{list(REQUIRED_KEYS)} (write one with `fedfuse site-data`)"
            )
    try:
        return NpzReader(path, max_bytes=max_bytes)
    except DataFormatError as error:
        reason = str(error).removeprefix(f"{path}: not a readable .npz archive ")
        raise DataFormatError(f"{path}: not a readable .npz site data file {reason}") from None


def check_npz_headers(
    path: str | Path, *, max_classes: int = DEFAULT_MAX_CLASSES, max_bytes: int = DEFAULT_MAX_BYTES
) -> None:
    """Every check of :func:`load_npz_dataset` short of reading the images (a few kB read): the
    keys, every header against what the file holds, the labels, classes and statistics."""
    with _site_reader(path, max_bytes) as reader:
        _open_site_file(reader, max_classes)


def load_npz_dataset(
    path: str | Path,
    *,
    name: str | None = None,
    max_classes: int = DEFAULT_MAX_CLASSES,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> ImageDataset:
    """Read and validate a site data file; errors name the file and the offending key.

    Args:
        path: the ``.npz`` file.
        name: the dataset's name (default: the file's stem).
        max_classes: most classes ``num_classes`` may declare.
        max_bytes: most bytes any one array of the file may hold; each array's header is
            also checked against what the file can hold before anything is allocated.
    """
    path = Path(path)
    with _site_reader(path, max_bytes) as reader:
        site = _open_site_file(reader, max_classes)
        images = to_nchw(reader.read("images"), path)
    mean, std = site.statistics or check_statistics(
        *channel_statistics(image_chunks(images)), images.shape[1], str(path)
    )
    return ImageDataset(
        images=torch.from_numpy(np.ascontiguousarray(images)),
        labels=torch.from_numpy(site.labels.astype(np.int64)),
        num_classes=site.num_classes,
        mean=mean,
        std=std,
        name=name or path.stem,
        class_names=site.class_names,
    )


def check_npz_dataset(
    path: str | Path,
    *,
    max_classes: int = DEFAULT_MAX_CLASSES,
    max_bytes: int = DEFAULT_MAX_BYTES,
    chunk_bytes: int = STATISTICS_CHUNK_BYTES,
) -> SiteSummary:
    """Validate a site data file as :func:`load_npz_dataset` does, holding only a chunk of
    ``chunk_bytes`` of images at a time; returns its summary (counts, statistics, names)."""
    path = Path(path)
    with _site_reader(path, max_bytes) as reader:
        site = _open_site_file(reader, max_classes)
        chunks = reader.chunks("images", chunk_bytes)
        if site.statistics is None:
            mean, std = channel_statistics(chunks, site.channel_axis)
        else:
            for _ in chunks:  # read every byte: a corrupt member fails here, not at the site
                pass
            mean, std = site.statistics
    shape = _nchw_shape(site.images.shape, site.channel_axis)
    if site.statistics is None:
        mean, std = check_statistics(mean, std, shape[1], str(path))
    counts = np.bincount(site.labels.astype(np.int64), minlength=site.num_classes)
    return SiteSummary(
        path=path,
        samples=shape[0],
        input_shape=(shape[1], shape[2], shape[3]),
        num_classes=site.num_classes,
        class_counts=tuple(int(n) for n in counts),
        mean=tuple(mean),
        std=tuple(std),
        class_names=site.class_names,
        measured=site.statistics is None,
    )
