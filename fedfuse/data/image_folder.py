"""An image folder (one sub-folder per class) read into a validated site dataset.

The folder is walked with care for what a site's disk may hold: hidden entries and files without
an image suffix are skipped, a sub-folder that cannot be read is an error naming it, a symbolic
link that leads out of the folder is refused unless followed on purpose, and each real folder is
visited once. Labels come from the federation's class list, integer folder names, or the sorted
folder names. Apart from :mod:`fedfuse.data.convert` (arrays and MedMNIST files) because the
walk and its rules are this source's alone.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedfuse.data._common import DataFormatError
from fedfuse.data.arrays import DEFAULT_MAX_CLASSES, check_num_classes
from fedfuse.data.convert import build_site_dataset
from fedfuse.data.dataset import ImageDataset
from fedfuse.data.images import Shape, check_image_bytes, read_image
from fedfuse.data.npyfile import DEFAULT_MAX_BYTES

__all__ = ["IMAGE_SUFFIXES", "from_image_folder", "image_files"]

log = logging.getLogger(__name__)

#: File endings read as images in an image folder (others are skipped and counted).
IMAGE_SUFFIXES = frozenset(
    {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm"}
)


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
