"""Image shapes and pixels: a ``CxHxW`` shape, the bytes of N images, and uint8 conversion.

Every converter of site data (:mod:`fedfuse.data.convert`, :mod:`fedfuse.data.image_folder`)
and the prediction of a deployed model (:mod:`fedfuse.deploy.predict`) make uint8
``(C, H, W)`` images the same way: PIL converts grey, RGB and 16-bit grey and resizes
(bilinear), and sizes are checked before anything is allocated. Kept here so that the one
conversion rule serves every source.
"""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from fedfuse.data._common import DataFormatError
from fedfuse.data.npyfile import DEFAULT_MAX_BYTES, format_bytes
from fedfuse.io.limits import DEFAULT_MAX_SIDE

__all__ = [
    "DEFAULT_MAX_SIDE",
    "Shape",
    "check_image_bytes",
    "parse_shape",
    "read_image",
    "resize_images",
]

Shape = tuple[int, int, int]


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


def read_image(
    path: str | Path, shape: Shape, sizes: Counter[tuple[int, int]] | None = None
) -> np.ndarray:
    """One image file as uint8 ``shape``; every failure names the file. ``sizes``, when given,
    counts the file's own size ``(height, width)`` (before any resize)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():  # PIL warns below twice its pixel limit: refuse too
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                if sizes is not None:
                    sizes[(image.height, image.width)] += 1
                return _pil_to_uint8(image, shape, str(path))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
        raise DataFormatError(
            f"{path}: refused as a possible decompression bomb ({error})"
        ) from None
    except (UnidentifiedImageError, OSError, ValueError) as error:
        if isinstance(error, DataFormatError):
            raise
        raise DataFormatError(f"{path}: not a readable image ({error})") from None
