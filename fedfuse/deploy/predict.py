"""Classify new images with a fused checkpoint, using only what the checkpoint records.

A fused model from a fedfuse run records its input shape, normalisation and class names
(:mod:`fedfuse.federation.provenance`), so whoever receives the file can use it without asking
how the federation prepared its data: images are read, converted to the model's shape, scaled
and normalised as the sites did, and each gets the name of its most probable class.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from fedfuse.data._common import DataFormatError
from fedfuse.data.arrays import to_nchw
from fedfuse.data.image_folder import IMAGE_SUFFIXES, image_files
from fedfuse.data.images import read_image, resize_images
from fedfuse.data.npyfile import DEFAULT_MAX_BYTES, NpzReader
from fedfuse.io.checkpoint import Checkpoint, load_checkpoint
from fedfuse.runtime import resolve_device

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class InputRecipe:
    """How the model's inputs are made: shape (C, H, W), per-channel mean and std of x/255."""

    shape: tuple[int, int, int]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    class_names: tuple[str, ...]


@dataclass
class Predictions:
    """One row per image: its name, the predicted label and class name, and the probability."""

    images: list[str]
    labels: list[int]
    classes: list[str]
    probabilities: list[float]

    def csv(self) -> str:
        rows = ["image,class,probability"]
        rows += [
            f"{_csv_field(image)},{_csv_field(name)},{p:.3f}"
            for image, name, p in zip(self.images, self.classes, self.probabilities, strict=True)
        ]
        return "\n".join(rows) + "\n"


#: first characters that make a spreadsheet read a cell as a formula (CSV injection)
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def _csv_field(text: str) -> str:
    """``text`` as one CSV field: quoted where it holds a comma, quote or line break, and
    prefixed with ``'`` where a spreadsheet would run it as a formula (a file named ``=cmd``)."""
    if text.startswith(FORMULA_STARTS):
        text = "'" + text
    return '"' + text.replace('"', '""') + '"' if any(c in text for c in ',"\n\r') else text


def input_recipe(
    checkpoint: Checkpoint,
    *,
    source: str,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
) -> InputRecipe:
    """The checkpoint's input recipe; ``mean``/``std`` only for files that record none."""
    meta = checkpoint.metadata
    shape = tuple(int(v) for v in checkpoint.model.spec.input_shape)
    if len(shape) != 3:
        raise ValueError(f"{source}: the model takes inputs of shape {shape}, not images")
    recorded = meta.get("normalisation") or {}
    if not isinstance(recorded, dict):
        raise ValueError(f"{source}: 'normalisation' is not an object with 'mean' and 'std'")
    mean = tuple(mean) if mean is not None else _numbers(recorded.get("mean"), source, "mean")
    std = tuple(std) if std is not None else _numbers(recorded.get("std"), source, "std")
    if mean is None or std is None:
        raise ValueError(
            f"{source}: records no normalisation (it was not written by a fedfuse run that "
            "records it); give the federation's --mean and --std"
        )
    channels = shape[0]
    if len(mean) != channels or len(std) != channels:
        raise ValueError(f"{source}: normalisation mean {mean}, std {std} for {channels} channels")
    if not all(math.isfinite(float(v)) for v in (*mean, *std)) or min(map(float, std)) <= 0:
        raise ValueError(
            f"{source}: normalisation mean {list(mean)}, std {list(std)}: every value must be "
            "finite and every std positive (the model would answer NaN or one class for all)"
        )
    names = meta.get("class_names")
    num_classes = checkpoint.model.spec.num_classes
    if names is not None and (
        not isinstance(names, list) or not all(isinstance(n, str) for n in names)
    ):
        raise ValueError(f"{source}: 'class_names' is not a list of names")
    if not names or len(names) != num_classes:
        names = [str(i) for i in range(num_classes)]
    return InputRecipe(
        shape=shape,  # type: ignore[arg-type]
        mean=tuple(float(m) for m in mean),
        std=tuple(float(s) for s in std),
        class_names=tuple(str(n) for n in names),
    )


def _numbers(value: object, source: str, key: str) -> tuple[float, ...] | None:
    """A recorded normalisation's ``key``: a list of numbers (None when not recorded)."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in value
    ):
        raise ValueError(f"{source}: normalisation {key!r} is not a list of numbers")
    return tuple(value)


class LazyImages:
    """``count`` uint8 images made a slice at a time by ``make(start, stop)``, so the set is
    never held whole at the model's size: 100,000 tiny files, or 1x1 images in a kB-sized
    ``.npz``, for a model of 3x512x512 inputs would take 78 GB. ``done()`` runs once the last
    slice is made. Sliced like an array (``images[a:b]``), as :func:`predict` reads it."""

    def __init__(
        self,
        count: int,
        make: Callable[[int, int], np.ndarray],
        done: Callable[[], None] | None = None,
    ):
        self.count, self._make, self._done = count, make, done

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, rows: slice) -> np.ndarray:
        start, stop, _ = rows.indices(self.count)
        batch = self._make(start, stop)
        if stop == self.count and self._done is not None:
            self._done()
        return batch


def read_inputs(
    source: str | Path, shape: tuple[int, int, int], *, max_bytes: int = DEFAULT_MAX_BYTES
) -> tuple[list[str], np.ndarray | LazyImages]:
    """Images to classify, as uint8 ``(N, *shape)`` with a name for each: every image file
    under a folder (sorted; names relative to it), one image file, or the ``images`` array of an
    ``.npz`` (named ``<file>:<index>``). A folder's files are read, and an ``.npz``'s images
    resized, a batch at a time (:class:`LazyImages`)."""
    source = Path(source).expanduser()
    if source.is_dir():
        files = image_files(source)
        if not files:
            raise ValueError(f"{source}: no image files ({', '.join(sorted(IMAGE_SUFFIXES))})")
        sizes: Counter[tuple[int, int]] = Counter()

        def read(start: int, stop: int) -> np.ndarray:
            return np.stack([read_image(path, shape, sizes) for path in files[start:stop]])

        images = LazyImages(len(files), read, lambda: _warn_resized(source, sizes, shape))
        return [str(p.relative_to(source)) for p in files], images
    if not source.is_file():
        raise FileNotFoundError(f"{source}: no such image file or folder")
    if source.suffix.lower() == ".npz":
        with NpzReader(source, max_bytes=max_bytes) as reader:
            if "images" not in reader.files:
                raise ValueError(f"{source}: has no 'images' array (keys {reader.files})")
            found = reader.header("images").dtype
            if found != np.uint8:  # pixels 0..255, as site data files hold them
                raise ValueError(f"{source}: 'images' must be uint8, found {found}")
            stored = to_nchw(reader.read("images"), source)
        _warn_resized(source, Counter({stored.shape[2:]: len(stored)}), shape)
        if stored.shape[1] not in (1, 3) and stored.shape[1:] != shape:
            raise DataFormatError(
                f"{source}: cannot convert {stored.shape[1]}-channel images to {shape[0]} "
                "channel(s)"
            )

        def resize(start: int, stop: int) -> np.ndarray:
            return resize_images(stored[start:stop], shape, str(source), max_bytes=max_bytes)

        names = [f"{source.name}:{i}" for i in range(len(stored))]
        return names, LazyImages(len(stored), resize)
    sizes = Counter()
    image = read_image(source, shape, sizes)
    _warn_resized(source, sizes, shape)
    return [source.name], image[None]


def _warn_resized(source: Path, sizes: Counter, shape: tuple[int, int, int]) -> None:
    """Warn when images of ``source`` are not of the model's size (they are resized to it: a
    model trained on other images answers anyway, so say so)."""
    other = {size: n for size, n in sizes.items() if tuple(size) != shape[1:]}
    if other:
        found = ", ".join(f"{n} of {h}x{w}" for (h, w), n in sorted(other.items()))
        log.warning(
            "%s: %d of %d images are not %dx%d, the model's input size (%s); they were resized: "
            "check that these are the kind of images the model was trained on",
            source,
            sum(other.values()),
            sum(sizes.values()),
            shape[1],
            shape[2],
            found,
        )


#: most bytes of one batch's float inputs
BATCH_BYTES = 64 << 20


@torch.no_grad()
def predict(
    model: torch.nn.Module,
    images: np.ndarray | LazyImages,
    recipe: InputRecipe,
    *,
    batch_size: int = 256,
    device: str = "auto",
    progress: bool = True,
) -> tuple[list[int], list[float]]:
    """The most probable class of each uint8 image and its probability."""
    target = resolve_device(device)
    model = model.to(target).eval()
    mean = torch.tensor(recipe.mean, device=target).view(1, -1, 1, 1)
    std = torch.tensor(recipe.std, device=target).view(1, -1, 1, 1)
    labels: list[int] = []
    probabilities: list[float] = []
    # a batch's float copies stay near BATCH_BYTES whatever the input size (256 images of
    # 3x512x512 would take 0.8 GB per copy)
    per_image = 4 * math.prod(recipe.shape)
    batch_size = max(1, min(batch_size, BATCH_BYTES // per_image))
    starts = range(0, len(images), batch_size)
    for start in tqdm(starts, desc="classifying", unit="batch", disable=not progress):
        batch = torch.from_numpy(images[start : start + batch_size]).to(target)
        x = (batch.float() / 255.0 - mean) / std
        p, label = torch.softmax(model(x), dim=1).max(dim=1)
        labels += label.tolist()
        probabilities += p.tolist()
    return labels, probabilities


def predict_files(
    checkpoint_path: str | Path,
    source: str | Path,
    *,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    batch_size: int = 256,
    device: str = "auto",
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Predictions:
    """Classify the images at ``source`` with the checkpoint at ``checkpoint_path``."""
    checkpoint = load_checkpoint(checkpoint_path)
    recipe = input_recipe(checkpoint, source=str(checkpoint_path), mean=mean, std=std)
    names, images = read_inputs(source, recipe.shape, max_bytes=max_bytes)
    labels, probabilities = predict(
        checkpoint.model, images, recipe, batch_size=batch_size, device=device
    )
    return Predictions(
        images=names,
        labels=labels,
        classes=[recipe.class_names[label] for label in labels],
        probabilities=probabilities,
    )
