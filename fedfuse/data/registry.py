"""Dataset registry: one entry point, ``load_dataset(name, split)``, for every supported set."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path

from fedfuse.data._common import DatasetNotFoundError, check_split, resolve_data_root
from fedfuse.data.cifar import load_cifar10, load_cifar100
from fedfuse.data.dataset import ImageDataset
from fedfuse.data.digits import load_digits
from fedfuse.data.idx import load_fashion_mnist, load_mnist
from fedfuse.data.medmnist import load_medmnist, medmnist_flags, unsupported_medmnist

__all__ = [
    "DatasetNotFoundError",
    "Loader",
    "available_datasets",
    "load_dataset",
    "register_dataset",
]

log = logging.getLogger(__name__)

Loader = Callable[[str, Path, bool], ImageDataset]
"""A loader takes ``(split, resolved_data_root, download)`` and returns an ImageDataset."""

_LOADERS: dict[str, Loader] = {
    "fashion-mnist": load_fashion_mnist,
    "mnist": load_mnist,
    "cifar10": load_cifar10,
    "cifar100": load_cifar100,
    "digits": load_digits,
}


def _normalise_name(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def register_dataset(name: str, loader: Loader, *, overwrite: bool = False) -> None:
    """Register a custom loader under ``name`` so ``load_dataset(name)`` can find it."""
    key = _normalise_name(name)
    if not overwrite and (key in _LOADERS or key in medmnist_flags()):
        raise ValueError(f"dataset {key!r} is already registered (pass overwrite=True)")
    _LOADERS[key] = loader


def available_datasets() -> list[str]:
    """Names accepted by ``load_dataset`` (MedMNIST ones only if ``medmnist`` is installed)."""
    return sorted({*_LOADERS, *medmnist_flags()})


def load_dataset(
    name: str,
    split: str = "train",
    *,
    root: str | os.PathLike[str] | None = None,
    download: bool = False,
) -> ImageDataset:
    """Load split ``"train"`` or ``"test"`` of dataset ``name`` as an ``ImageDataset``.

    Files are looked up under the data root (``root``, else ``$FEDFUSE_DATA``, else
    ``~/.cache/fedfuse``) plus a few well-known locations per dataset. When they are missing,
    ``download=True`` fetches them into the data root; otherwise ``DatasetNotFoundError``
    explains where we looked and how to get the data.
    """
    key = _normalise_name(name)
    check_split(split)
    loader = _LOADERS.get(key)
    if loader is None and key in medmnist_flags():
        loader = partial(load_medmnist, key)
    if loader is None:
        reason = unsupported_medmnist().get(key)
        if reason is not None:
            raise ValueError(f"dataset {name!r} is not supported: {reason}")
        raise ValueError(
            f"unknown dataset {name!r}; known datasets: {', '.join(available_datasets())}"
        )
    data_root = resolve_data_root(root)
    log.debug("loading %s/%s (data root %s)", key, split, data_root)
    return loader(split, data_root, download)
