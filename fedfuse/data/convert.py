"""Turn a site's own data into a validated :class:`ImageDataset` (then a site ``.npz`` file).

Three sources, one result: an image folder (one sub-folder per class), a MedMNIST-format
``.npz`` (``<split>_images`` / ``<split>_labels``) or two ``.npy`` arrays (images, labels).
Every path ends in :func:`build_site_dataset`, which checks shapes, labels and class count and
computes (or checks given) per-channel normalisation statistics, so a file written by
``fedfuse site-data`` always loads with :func:`fedfuse.data.load_npz_dataset`.

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

import logging
import os
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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
from fedfuse.data.npyfile import DEFAULT_MAX_BYTES, format_bytes, read_npy

__all__ = [
    "DEFAULT_MAX_SIDE",
    "IMAGE_SUFFIXES",
    "build_site_dataset",
    "from_arrays",
    "from_image_folder",
    "from_medmnist_npz",
    "image_files",
    "parse_shape",
    "read_image",
    "resize_images",
]

log = logging.getLogger(__name__)

#: File endings read as images in an image folder (others are skipped and counted).
IMAGE_SUFFIXES = frozenset(
    {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm"}
)
Shape = tuple[int, int, int]
#: Largest image height or width a converter makes unless raised.
DEFAULT_MAX_SIDE = 2048


def parse_shape(text: str, *, max_side: int = DEFAULT_MAX_SIDE, name: str = "shape") -> Shape:
    """``"CxHxW"`` (e.g. ``"1x28x28"``, ``"3x64x64"``) as ``(C, H, W)``; C must be 1 or 3 and
    H, W at most ``max_side``. ``name`` names the value in errors (e.g. ``"--shape"``)."""
    parts = text.lower().replace(",", "x").split("x")
    try:
        channels, height, width = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"{name} must be CxHxW, e.g. 1x28x28 or 3x64x64, got {text!r}") from None
    if channels not in (1, 3) or height < 1 or width < 1:
        raise ValueError(f"{name} {text!r}: channels must be 1 or 3 and H, W >= 1")
    if max(height, width) > max_side:
        raise ValueError(
            f"{name} {text!r}: H and W must be at most {max_side} pixels "
            "(max_side, option --max-side)"
        )
    return channels, height, width


def check_image_bytes(count: int, shape: Shape, source: str, max_bytes: int) -> None:
    """Refuse to allocate ``count`` uint8 images of ``shape`` beyond ``max_bytes``."""
    need = count * shape[0] * shape[1] * shape[2]
    if need > max_bytes:
        raise DataFormatError(
            f"{source}: {count} images of shape {shape} need {format_bytes(need)}; the limit is "
            f"{format_bytes(max_bytes)} (max_bytes, option --max-bytes)"
        )


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


# --------------------------------------------------------------------------------- resizing
def _pil_to_uint8(image: Any, shape: Shape, source: str) -> np.ndarray:
    """One PIL image as uint8 ``shape`` (C, H, W): 16-bit grey rescaled, grey/RGB converted,
    then resized (bilinear)."""
    from PIL import Image

    channels, height, width = shape
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        values = np.asarray(image, dtype=np.float64)
        if values.min() < 0 or values.max() > 65535:
            raise DataFormatError(
                f"{source}: {image.mode} image values span {values.min():g}..{values.max():g}, "
                "expected 16-bit 0..65535"
            )
        image = Image.fromarray(np.round(values / 257.0).astype(np.uint8))
    elif image.mode == "F":
        raise DataFormatError(f"{source}: floating-point image; save it as 8- or 16-bit")
    image = image.convert("L" if channels == 1 else "RGB")
    if image.size != (width, height):
        image = image.resize((width, height), Image.Resampling.BILINEAR)
    array = np.asarray(image, dtype=np.uint8)
    return array[None] if channels == 1 else array.transpose(2, 0, 1)


def resize_images(
    images: np.ndarray, shape: Shape, source: str, *, max_bytes: int = DEFAULT_MAX_BYTES
) -> np.ndarray:
    """uint8 (N, C, H, W) converted to ``shape`` (C, H, W): grey <-> RGB, bilinear resize."""
    from PIL import Image

    if images.shape[1:] == shape:
        return images
    check_image_bytes(len(images), shape, source, max_bytes)
    if images.shape[1] not in (1, 3):
        raise DataFormatError(
            f"{source}: cannot convert {images.shape[1]}-channel images to {shape[0]} channel(s)"
        )
    out = np.empty((len(images), *shape), dtype=np.uint8)
    for i, image in enumerate(images):
        pil = (
            Image.fromarray(image[0])
            if images.shape[1] == 1
            else Image.fromarray(np.ascontiguousarray(image.transpose(1, 2, 0)))
        )
        out[i] = _pil_to_uint8(pil, shape, source)
    return out


# ------------------------------------------------------------------------------ image folder
def _folder_labels(
    folders: list[str], classes: Sequence[str] | None, num_classes: int | None, root: Path
) -> tuple[dict[str, int], int]:
    """Label of each class folder and the class count (see :func:`from_image_folder`)."""
    if classes is not None:
        classes = list(classes)
        if len(set(classes)) != len(classes) or not all(classes):
            raise ValueError(f"{root}: class list {classes} has empty or repeated names")
        if num_classes is not None and num_classes != len(classes):
            raise ValueError(
                f"{root}: num_classes {num_classes} but {len(classes)} classes were listed"
            )
        unknown = sorted(set(folders) - set(classes))
        if unknown:
            raise DataFormatError(
                f"{root}: folder(s) {unknown} are not among the classes {classes}"
            )
        return {c: classes.index(c) for c in folders}, len(classes)
    if folders and all(f.isdigit() for f in folders):
        labels = {f: int(f) for f in folders}
        if len(set(labels.values())) != len(labels):
            raise DataFormatError(f"{root}: folders {folders} name the same label twice")
        if num_classes is not None and max(labels.values()) >= num_classes:
            raise DataFormatError(
                f"{root}: folder {max(labels.values())} is not a label below num_classes "
                f"{num_classes}"
            )
        return labels, num_classes if num_classes is not None else max(labels.values()) + 1
    ordered = sorted(folders)
    log.warning(
        "%s: labels follow the sorted folder names %s; every site must then hold the same "
        "folders (else list the federation's classes)",
        root,
        ordered,
    )
    if num_classes is not None and num_classes != len(ordered):
        raise ValueError(
            f"{root}: {len(ordered)} class folders {ordered} but num_classes is {num_classes}; "
            "list every class of the federation in order with --classes so each folder gets "
            "its label"
        )
    return {c: i for i, c in enumerate(ordered)}, len(ordered)


def _check_link(path: Path, inside: Path, follow_links: bool) -> None:
    """Refuse a symbolic link that leads out of ``inside`` (unless ``follow_links``)."""
    try:
        target = path.resolve(strict=True)
    except (OSError, RuntimeError) as error:
        raise DataFormatError(f"{path}: broken or looping symbolic link ({error})") from None
    if not follow_links and not target.is_relative_to(inside):
        raise DataFormatError(
            f"{path}: symbolic link leads out of the image folder {inside} (to {target}); "
            "copy the files in, or follow such links with --follow-links (follow_links=True)"
        )


def _walk_images(folder: Path, inside: Path, follow_links: bool) -> tuple[list[Path], list[Path]]:
    """Image files under ``folder`` (sorted) and the files skipped for their suffix.

    Hidden entries are skipped; a folder that cannot be read is an error naming it; each real
    folder is visited once (so a link back up cannot loop).
    """
    files: list[Path] = []
    skipped: list[Path] = []
    seen: set[str] = set()
    stack = [folder]
    while stack:
        directory = stack.pop()
        real = os.path.realpath(directory)
        if real in seen:
            continue
        seen.add(real)
        try:
            with os.scandir(directory) as scan:
                entries = list(scan)
            for entry in entries:
                if entry.name.startswith("."):
                    continue
                path = Path(entry.path)
                if entry.is_symlink():
                    _check_link(path, inside, follow_links)
                if entry.is_dir():
                    stack.append(path)
                elif not entry.is_file():
                    continue
                elif path.suffix.lower() in IMAGE_SUFFIXES:
                    files.append(path)
                else:
                    skipped.append(path)
        except OSError as error:
            raise DataFormatError(
                f"{directory}: cannot read the folder ({error.strerror or error})"
            ) from None
    return sorted(files), skipped


def image_files(folder: str | Path, *, follow_links: bool = False) -> list[Path]:
    """Every image file under ``folder`` (sorted), by the rules of :func:`from_image_folder`:
    hidden entries skipped, an unreadable folder an error, links out of it refused unless
    ``follow_links``."""
    folder = Path(folder).expanduser()
    inside = folder.resolve()
    return _walk_images(folder, inside, follow_links)[0]


def read_image(path: str | Path, shape: Shape) -> np.ndarray:
    """One image file as uint8 ``shape``; every failure names the file."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():  # PIL warns below twice its pixel limit: refuse too
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                return _pil_to_uint8(image, shape, str(path))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
        raise DataFormatError(
            f"{path}: refused as a possible decompression bomb ({error})"
        ) from None
    except (UnidentifiedImageError, OSError, ValueError) as error:
        if isinstance(error, DataFormatError):
            raise
        raise DataFormatError(f"{path}: not a readable image ({error})") from None


def from_image_folder(
    root: str | Path,
    shape: Shape,
    *,
    classes: Sequence[str] | None = None,
    num_classes: int | None = None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    max_classes: int = DEFAULT_MAX_CLASSES,
    max_bytes: int = DEFAULT_MAX_BYTES,
    follow_links: bool = False,
) -> tuple[ImageDataset, list[str]]:
    """Read ``root/<class>/**/<image>`` into a dataset of ``shape`` (C, H, W).

    Labels: the position of the folder's name in ``classes`` (the federation's class list;
    folders for classes the site lacks may be absent); else, when every folder name is an
    integer, that integer; else the sorted folder names. Images are converted to grey or RGB
    and resized (bilinear); hidden files and files without an image suffix are skipped.
    A sub-folder that cannot be read is an error, and so is a symbolic link leading out of
    ``root`` unless ``follow_links``; ``max_bytes`` bounds the images' total size.

    Returns:
        The dataset (with ``class_names`` unless the folders are integer labels) and the class
        names in label order (integers as text when unnamed).
    """
    root = Path(root).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such image folder")
    inside = root.resolve()
    try:
        entries = sorted(p for p in root.iterdir() if not p.name.startswith("."))
    except OSError as error:
        reason = error.strerror or error
        raise DataFormatError(f"{root}: cannot read the folder ({reason})") from None
    folders = []
    for entry in entries:
        if entry.is_symlink():
            _check_link(entry, inside, follow_links)
        if entry.is_dir():
            folders.append(entry.name)
    if not folders:
        raise DataFormatError(f"{root}: no class sub-folders (expected {root}/<class>/<image>)")
    labels_of, count = _folder_labels(folders, classes, num_classes, root)
    check_num_classes(count, str(root), max_classes=max_classes)
    files: list[tuple[Path, int]] = []
    skipped: list[Path] = []
    for folder in folders:
        found, ignored = _walk_images(root / folder, inside, follow_links)
        files += [(path, labels_of[folder]) for path in found]
        skipped += ignored
        if not found:
            log.warning("%s: class folder %r holds no images", root, folder)
    if skipped:
        log.warning(
            "%s: skipped %d file(s) without an image suffix, e.g. %s",
            root,
            len(skipped),
            skipped[0],
        )
    if not files:
        raise DataFormatError(f"{root}: no image files ({', '.join(sorted(IMAGE_SUFFIXES))})")
    check_image_bytes(len(files), shape, str(root), max_bytes)
    images = np.empty((len(files), *shape), dtype=np.uint8)
    for i, (path, _) in enumerate(files):
        images[i] = read_image(path, shape)
    labels = np.array([label for _, label in files], dtype=np.int64)
    numbered = classes is None and all(f.isdigit() for f in folders)
    names = list(classes) if classes is not None else [""] * count
    if classes is None:
        for folder, label in labels_of.items():
            names[label] = folder
        names = [n or str(i) for i, n in enumerate(names)]
    dataset = build_site_dataset(
        images,
        labels,
        count,
        source=str(root),
        mean=mean,
        std=std,
        name=root.name,
        class_names=None if numbered else names,
        max_classes=max_classes,
    )
    return dataset, names


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
    source = f"{path}[{split}]"
    if shape is not None:
        images = resize_images(images, shape, source, max_bytes=max_bytes)
    return build_site_dataset(
        images,
        labels,
        num_classes,
        source=source,
        mean=mean,
        std=std,
        name=path.stem,
        class_names=classes,
        max_classes=max_classes,
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
    if shape is not None:
        images = resize_images(images, shape, str(images_path), max_bytes=max_bytes)
    return build_site_dataset(
        images,
        labels,
        num_classes,
        source=str(images_path),
        mean=mean,
        std=std,
        name=images_path.stem,
        class_names=classes,
        max_classes=max_classes,
    )
