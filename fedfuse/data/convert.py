"""Turn a site's own data into a validated :class:`ImageDataset` (then a site ``.npz`` file).

Three sources, one result: an image folder (one sub-folder per class), a MedMNIST-format
``.npz`` (``<split>_images`` / ``<split>_labels``) or two ``.npy`` arrays (images, labels).
Every path ends in :func:`build_site_dataset`, which checks shapes, labels and class count and
computes (or checks given) per-channel normalisation statistics, so a file written by
``fedfuse site-data`` always loads with :func:`fedfuse.data.load_npz_dataset`.

The class count must be the federation's, not the site's: a site that holds only some classes
cannot infer it, so it comes from an explicit class list, ``num_classes`` or MedMNIST's metadata.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfuse.data._common import DataFormatError
from fedfuse.data.arrays import check_statistics, to_nchw
from fedfuse.data.dataset import ImageDataset

__all__ = [
    "IMAGE_SUFFIXES",
    "build_site_dataset",
    "from_arrays",
    "from_image_folder",
    "from_medmnist_npz",
    "parse_shape",
    "resize_images",
]

log = logging.getLogger(__name__)

#: File endings read as images in an image folder (others are skipped and counted).
IMAGE_SUFFIXES = frozenset(
    {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm"}
)
Shape = tuple[int, int, int]


def parse_shape(text: str) -> Shape:
    """``"CxHxW"`` (e.g. ``"1x28x28"``, ``"3x64x64"``) as ``(C, H, W)``; C must be 1 or 3."""
    parts = text.lower().replace(",", "x").split("x")
    try:
        channels, height, width = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"shape must be CxHxW, e.g. 1x28x28 or 3x64x64, got {text!r}") from None
    if channels not in (1, 3) or height < 1 or width < 1:
        raise ValueError(f"shape {text!r}: channels must be 1 or 3 and H, W >= 1")
    return channels, height, width


def build_site_dataset(
    images: np.ndarray,
    labels: np.ndarray,
    num_classes: int,
    *,
    source: str,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    name: str = "",
) -> ImageDataset:
    """Validate uint8 (N, C, H, W) images and labels; attach (measured or given) statistics.

    Args:
        images: uint8 array (N, C, H, W).
        labels: integer array (N,) in ``0..num_classes-1``.
        num_classes: the federation's number of classes.
        source: what the data came from, named in every error.
        mean, std: per-channel statistics of ``x / 255``; measured on ``images`` when omitted
            (give the federation's agreed values so every site normalises the same way).
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
    if labels.min() < 0 or labels.max() >= num_classes:
        raise DataFormatError(
            f"{source}: labels span {labels.min()}..{labels.max()}, num_classes is {num_classes}"
        )
    if (mean is None) != (std is None):
        raise DataFormatError(f"{source}: give both mean and std, or neither")
    if mean is None:
        scaled = images.astype(np.float64) / 255.0
        mean, std = scaled.mean(axis=(0, 2, 3)), scaled.std(axis=(0, 2, 3))
    mean_t, std_t = check_statistics(mean, std, images.shape[1], source)
    return ImageDataset(
        images=torch.from_numpy(np.ascontiguousarray(images)),
        labels=torch.from_numpy(labels.astype(np.int64)),
        num_classes=num_classes,
        mean=mean_t,
        std=std_t,
        name=name,
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


def resize_images(images: np.ndarray, shape: Shape, source: str) -> np.ndarray:
    """uint8 (N, C, H, W) converted to ``shape`` (C, H, W): grey <-> RGB, bilinear resize."""
    from PIL import Image

    if images.shape[1:] == shape:
        return images
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


def from_image_folder(
    root: str | Path,
    shape: Shape,
    *,
    classes: Sequence[str] | None = None,
    num_classes: int | None = None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
) -> tuple[ImageDataset, list[str]]:
    """Read ``root/<class>/**/<image>`` into a dataset of ``shape`` (C, H, W).

    Labels: the position of the folder's name in ``classes`` (the federation's class list;
    folders for classes the site lacks may be absent); else, when every folder name is an
    integer, that integer; else the sorted folder names. Images are converted to grey or RGB
    and resized (bilinear); hidden files and files without an image suffix are skipped.

    Returns:
        The dataset and the class names in label order (integers as text when unnamed).
    """
    from PIL import Image, UnidentifiedImageError

    root = Path(root).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such image folder")
    folders = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not folders:
        raise DataFormatError(f"{root}: no class sub-folders (expected {root}/<class>/<image>)")
    labels_of, count = _folder_labels(folders, classes, num_classes, root)
    files: list[tuple[Path, int]] = []
    skipped: list[Path] = []
    for folder in folders:
        found = 0
        for path in sorted((root / folder).rglob("*")):
            if path.name.startswith(".") or not path.is_file():
                continue
            if path.suffix.lower() not in IMAGE_SUFFIXES:
                skipped.append(path)
                continue
            files.append((path, labels_of[folder]))
            found += 1
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
    images = np.empty((len(files), *shape), dtype=np.uint8)
    for i, (path, _) in enumerate(files):
        try:
            with Image.open(path) as image:
                images[i] = _pil_to_uint8(image, shape, str(path))
        except (UnidentifiedImageError, OSError, ValueError) as error:
            if isinstance(error, DataFormatError):
                raise
            raise DataFormatError(f"{path}: not a readable image ({error})") from None
    labels = np.array([label for _, label in files], dtype=np.int64)
    names = list(classes) if classes is not None else [""] * count
    if classes is None:
        for folder, label in labels_of.items():
            names[label] = folder
        names = [n or str(i) for i, n in enumerate(names)]
    dataset = build_site_dataset(
        images, labels, count, source=str(root), mean=mean, std=std, name=root.name
    )
    return dataset, names


# --------------------------------------------------------------------------------- MedMNIST
def _medmnist_classes(path: Path) -> int | None:
    """Class count of a MedMNIST file from its name (``bloodmnist.npz``, ``bloodmnist_64.npz``)."""
    from fedfuse.data.medmnist import _info, unsupported_medmnist

    flag = re.sub(r"_\d+$", "", path.stem.lower())
    info = _info().get(flag)
    if info is None:
        return None
    if flag in unsupported_medmnist():
        raise DataFormatError(
            f"{path}: MedMNIST {flag!r} is not supported: {unsupported_medmnist()[flag]}"
        )
    return len(info["label"])


def from_medmnist_npz(
    path: str | Path,
    split: str = "train",
    *,
    num_classes: int | None = None,
    shape: Shape | None = None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
) -> ImageDataset:
    """One split (``train``, ``val``, ``test``) of a MedMNIST-format ``.npz``.

    ``num_classes`` defaults to MedMNIST's metadata when the file is named after its set
    (``bloodmnist.npz``, ``bloodmnist_64.npz``); ``shape`` resizes (default: keep).
    """
    from fedfuse.data.medmnist import read_medmnist_npz

    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such MedMNIST file")
    if split not in ("train", "val", "test"):
        raise ValueError(f"split must be train, val or test, got {split!r}")
    known = _medmnist_classes(path)  # refuses unsupported sets before reading them
    num_classes = num_classes if num_classes is not None else known
    if num_classes is None:
        raise ValueError(f"{path}: not named after a MedMNIST set, so give the number of classes")
    images, labels = read_medmnist_npz(path, split)
    source = f"{path}[{split}]"
    if shape is not None:
        images = resize_images(images, shape, source)
    return build_site_dataset(
        images, labels, num_classes, source=source, mean=mean, std=std, name=path.stem
    )


# ----------------------------------------------------------------------------------- arrays
def _load_npy(path: Path, what: str) -> np.ndarray:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such {what} file")
    try:
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as error:
        reason = (
            "it holds Python objects (pickles are refused)" if "pickle" in str(error) else error
        )
        raise DataFormatError(f"{path}: not a readable .npy {what} array ({reason})") from None
    if not isinstance(array, np.ndarray):
        array.close()
        raise DataFormatError(f"{path}: is an .npz archive, expected one .npy {what} array")
    return array


def from_arrays(
    images_path: str | Path,
    labels_path: str | Path,
    num_classes: int,
    *,
    shape: Shape | None = None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
) -> ImageDataset:
    """Images (uint8 ``(N, H, W)``, ``(N, H, W, C)`` or ``(N, C, H, W)`` ``.npy``) and labels
    (integer ``(N,)`` or ``(N, 1)`` ``.npy``); ``shape`` resizes (default: keep)."""
    images_path, labels_path = Path(images_path).expanduser(), Path(labels_path).expanduser()
    images = _load_npy(images_path, "images")
    labels = _load_npy(labels_path, "labels")
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
        images = resize_images(images, shape, str(images_path))
    return build_site_dataset(
        images,
        labels,
        num_classes,
        source=str(images_path),
        mean=mean,
        std=std,
        name=images_path.stem,
    )
