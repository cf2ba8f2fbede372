"""A simulated split written once and memory-mapped by every site, instead of each site loading
and splitting the whole training set itself.

One directory per split (dataset, data root, partitioner and its options, seed, number of sites,
per-site cap) holds the training samples reordered so that each site's samples are contiguous:

* ``images.npy`` (uint8, ``(N, C, H, W)``) and ``labels.npy`` (int64), site by site;
* ``indices.npy``: each row's index in the original training set;
* ``offsets.npy``: site ``k`` owns rows ``offsets[k]:offsets[k + 1]``;
* ``meta.json``: classes, normalisation statistics and the key, written last.

The first process that needs a split builds it under an exclusive file lock (the others wait,
then read it); a site then maps ``images.npy`` and copies only its own rows. Directories live
under ``$FEDFUSE_CACHE`` (default ``~/.cache/fedfuse/partitions``) and can be deleted at any time.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfuse.data import ImageDataset

log = logging.getLogger(__name__)

CACHE_ENV_VAR = "FEDFUSE_CACHE"
FORMAT = "fedfuse-partitions/1"


def cache_root() -> Path:
    """``$FEDFUSE_CACHE``, else ``~/.cache/fedfuse/partitions``."""
    env = os.environ.get(CACHE_ENV_VAR)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fedfuse" / "partitions"


def cache_key(fields: dict[str, Any]) -> str:
    """A short stable digest of everything that determines a split."""
    text = json.dumps({"format": FORMAT, **fields}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


class PartitionCache:
    """The memory-mapped samples of one simulated split (see the module docstring)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        meta = json.loads((directory / "meta.json").read_text())
        if meta.get("format") != FORMAT:
            raise ValueError(f"{directory}: not a {FORMAT} partition cache")
        self.meta = meta
        self.offsets = np.load(directory / "offsets.npy")
        self._images = np.load(directory / "images.npy", mmap_mode="r")
        self._labels = np.load(directory / "labels.npy", mmap_mode="r")
        self._indices = np.load(directory / "indices.npy", mmap_mode="r")

    @property
    def num_clients(self) -> int:
        return len(self.offsets) - 1

    def client_rows(self, client: int) -> slice:
        if not 0 <= client < self.num_clients:
            raise ValueError(f"partition-id {client} is outside 0..{self.num_clients - 1}")
        return slice(int(self.offsets[client]), int(self.offsets[client + 1]))

    def client_data(self, client: int) -> ImageDataset:
        """Site ``client``'s samples (a copy of its rows only)."""
        rows = self.client_rows(client)
        return ImageDataset(
            images=torch.from_numpy(np.array(self._images[rows])),
            labels=torch.from_numpy(np.array(self._labels[rows])),
            num_classes=int(self.meta["num_classes"]),
            mean=tuple(self.meta["mean"]),
            std=tuple(self.meta["std"]),
            name=str(self.meta["name"]),
        )

    def partitions(self) -> list[np.ndarray]:
        """Every site's indices into the original training set."""
        return [np.array(self._indices[self.client_rows(k)]) for k in range(self.num_clients)]

    @classmethod
    def open_or_build(
        cls,
        fields: dict[str, Any],
        build: Callable[[], tuple[ImageDataset, list[np.ndarray]]],
        *,
        root: Path | None = None,
    ) -> PartitionCache:
        """The cache for ``fields``, built with ``build()`` (the training set and the split's
        index arrays) by the first process that needs it."""
        root = root or cache_root()
        directory = root / cache_key(fields)
        if (directory / "meta.json").is_file():
            return cls(directory)
        root.mkdir(parents=True, exist_ok=True)
        with _exclusive(root / f"{directory.name}.lock"):
            if not (directory / "meta.json").is_file():  # another process may have built it
                train, parts = build()
                _write(directory, train, parts, fields)
                log.info("wrote the partition cache %s (%d sites)", directory, len(parts))
        return cls(directory)


@contextmanager
def _exclusive(lock_path: Path):
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write(
    directory: Path, train: ImageDataset, parts: list[np.ndarray], fields: dict[str, Any]
) -> None:
    """Write the cache into a temporary directory, then rename it into place."""
    order = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]) if parts else np.zeros(0)
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        index = torch.from_numpy(order)
        np.save(tmp / "images.npy", train.images[index].numpy())
        np.save(tmp / "labels.npy", train.labels[index].numpy())
        np.save(tmp / "indices.npy", order)
        np.save(tmp / "offsets.npy", offsets)
        meta = {
            "format": FORMAT,
            "fields": fields,
            "num_classes": train.num_classes,
            "mean": list(train.mean),
            "std": list(train.std),
            "name": train.name,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, default=str))
        if directory.exists():  # a half-written directory from a crash: replace it
            shutil.rmtree(directory)
        tmp.rename(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
