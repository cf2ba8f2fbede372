"""CIFAR-10 / CIFAR-100 loaders for the official "python version" pickle files.

Pickles can run arbitrary code when loaded, so they are read with ``RestrictedUnpickler``,
which only resolves the few numpy globals needed to rebuild arrays.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfuse.data._common import DataFormatError, DatasetNotFoundError, check_split, root_hint
from fedfuse.data.dataset import ImageDataset

__all__ = [
    "RestrictedUnpickler",
    "UnsafePickleError",
    "load_cifar10",
    "load_cifar100",
    "safe_pickle_load",
]

log = logging.getLogger(__name__)

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)


class UnsafePickleError(pickle.UnpicklingError):
    """A pickle referenced a global outside the allow-list; nothing from it was executed."""


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that only resolves the globals needed to rebuild numpy arrays."""

    ALLOWED: frozenset[tuple[str, str]] = frozenset(
        {
            ("numpy.core.multiarray", "_reconstruct"),
            ("numpy._core.multiarray", "_reconstruct"),
            ("numpy", "ndarray"),
            ("numpy", "dtype"),
        }
    )

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.ALLOWED:
            allowed = ", ".join(f"{m}.{n}" for m, n in sorted(self.ALLOWED))
            raise UnsafePickleError(
                f"refusing to load global {module}.{name} from pickle (allowed: {allowed})"
            )
        return super().find_class(module, name)


def safe_pickle_load(path: str | os.PathLike[str]) -> Any:
    """Load a (Python 2 or 3) pickle of numpy arrays/builtins with ``RestrictedUnpickler``."""
    path = Path(path)
    data = path.read_bytes()
    try:
        # latin1 is what numpy needs to rebuild arrays from Python 2 pickles (the CIFAR files).
        return RestrictedUnpickler(io.BytesIO(data), encoding="latin1").load()
    except UnsafePickleError as e:
        raise UnsafePickleError(f"{path}: {e}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as e:
        raise DataFormatError(f"{path}: corrupt or truncated pickle ({e})") from e


def _get(batch: dict, key: str, path: Path) -> Any:
    """``batch[key]`` where the key may be ``str`` or ``bytes`` (Python 2 pickles)."""
    if not isinstance(batch, dict):
        raise DataFormatError(f"{path}: expected a dict, found {type(batch).__name__}")
    for k in (key, key.encode()):
        if k in batch:
            return batch[k]
    raise DataFormatError(f"{path}: missing key {key!r} (found keys {sorted(map(str, batch))})")


def _flat_labels(labels: Any, path: Path) -> np.ndarray:
    """The labels as an array, refused unless they are an array or a flat list of integers: a
    few hundred bytes of pickle can nest one list in another by reference, which ``np.asarray``
    would expand into billions of elements."""
    if isinstance(labels, np.ndarray):
        return labels
    if isinstance(labels, list) and all(type(x) is int for x in labels):
        return np.asarray(labels)
    kind = type(labels).__name__
    if isinstance(labels, list):
        kind = "a list holding " + type(next(x for x in labels if type(x) is not int)).__name__
    raise DataFormatError(f"{path}: expected the labels as a flat list of integers, found {kind}")


def _read_batch(path: Path, label_key: str) -> tuple[np.ndarray, np.ndarray]:
    batch = safe_pickle_load(path)
    data, labels = _get(batch, "data", path), _flat_labels(_get(batch, label_key, path), path)
    if not (isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 2):
        found = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data)
        raise DataFormatError(f"{path}: expected data uint8 of shape (N, 3072), found {found}")
    if data.shape[1] != 3072:
        found = f"{data.dtype} {data.shape}"
        raise DataFormatError(f"{path}: expected data uint8 of shape (N, 3072), found {found}")
    if labels.shape != (data.shape[0],) or not np.issubdtype(labels.dtype, np.integer):
        raise DataFormatError(
            f"{path}: expected {data.shape[0]} integer {label_key!r}, "
            f"found {labels.dtype} of shape {labels.shape}"
        )
    return data, labels


def _load_cifar(
    name: str,
    split: str,
    root: Path,
    download: bool,
    folder: str,
    files: dict[str, list[str]],
    label_key: str,
    num_classes: int,
    mean: tuple[float, ...],
    std: tuple[float, ...],
    torchvision_class: str,
) -> ImageDataset:
    check_split(split)
    directory = root / folder
    paths = [directory / f for f in files[split]]
    if not all(p.is_file() for p in paths) and download:
        import torchvision.datasets as tvd
        from torchvision.datasets.utils import download_and_extract_archive

        cls = getattr(tvd, torchvision_class)
        log.info("downloading %s to %s", name, root)
        download_and_extract_archive(cls.url, str(root), filename=cls.filename, md5=cls.tgz_md5)
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise DatasetNotFoundError(
            name,
            split,
            missing,
            [
                root_hint(root, f"the extracted '{folder}' folder of the python-version archive"),
                f"load_dataset({name!r}, download=True) to download and extract it",
            ],
        )
    log.debug("reading %s %s from %s", name, split, directory)
    parts = [_read_batch(p, label_key) for p in paths]
    data = np.concatenate([d for d, _ in parts]).reshape(-1, 3, 32, 32)
    labels = np.concatenate([lab for _, lab in parts]).astype(np.int64)
    return ImageDataset(
        images=torch.from_numpy(data),
        labels=torch.from_numpy(labels),
        num_classes=num_classes,
        mean=mean,
        std=std,
        name=name,
    )


def load_cifar10(split: str, root: Path, download: bool = False) -> ImageDataset:
    """CIFAR-10 (N, 3, 32, 32) from ``<root>/cifar-10-batches-py``."""
    files = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}
    return _load_cifar(
        "cifar10",
        split,
        root,
        download,
        "cifar-10-batches-py",
        files,
        "labels",
        10,
        CIFAR10_MEAN,
        CIFAR10_STD,
        "CIFAR10",
    )


def load_cifar100(split: str, root: Path, download: bool = False) -> ImageDataset:
    """CIFAR-100 (N, 3, 32, 32) with the 100 fine labels, from ``<root>/cifar-100-python``."""
    files = {"train": ["train"], "test": ["test"]}
    return _load_cifar(
        "cifar100",
        split,
        root,
        download,
        "cifar-100-python",
        files,
        "fine_labels",
        100,
        CIFAR100_MEAN,
        CIFAR100_STD,
        "CIFAR100",
    )
