"""In-memory image classification dataset shared by all fedfuse components."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

from fedfuse.runtime import row_major

__all__ = ["ImageDataset"]

IndexLike = Sequence[int] | np.ndarray | torch.Tensor


def _as_index(indices: IndexLike, n: int, name: str) -> torch.Tensor:
    """Convert ``indices`` to a 1-D int64 (or bool mask) tensor usable for indexing."""
    name = name or "ImageDataset"
    if isinstance(indices, torch.Tensor):
        idx = indices.detach().cpu()
    else:
        arr = np.asarray(indices)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        idx = torch.from_numpy(np.ascontiguousarray(arr))
    if idx.ndim != 1:
        raise ValueError(f"{name}: indices must be 1-D, got shape {tuple(idx.shape)}")
    if idx.dtype == torch.bool:
        if idx.numel() != n:
            raise ValueError(f"{name}: boolean mask has length {idx.numel()}, dataset has {n}")
        return idx
    if idx.dtype.is_floating_point or idx.dtype.is_complex:
        raise TypeError(f"{name}: indices must be integers or a boolean mask, got {idx.dtype}")
    idx = idx.long()
    if idx.numel() and (int(idx.min()) < -n or int(idx.max()) >= n):
        raise IndexError(
            f"{name}: index out of range [{-n}, {n}): min {int(idx.min())}, max {int(idx.max())}"
        )
    return idx


@dataclass(frozen=True, eq=False)
class ImageDataset(Dataset):
    """Images kept as uint8 (N, C, H, W) with int64 labels; normalised to float on access.

    Keeping the raw uint8 images (4x smaller than float32) lets whole datasets live in memory
    and be partitioned across many simulated clients cheaply; normalisation
    ``(x / 255 - mean) / std`` (per channel) is applied when samples are read.
    """

    images: torch.Tensor
    labels: torch.Tensor
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    name: str = ""
    #: The classes' names in label order, when known (e.g. from a site file's ``class_names``).
    class_names: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        who = f"ImageDataset {self.name!r}" if self.name else "ImageDataset"
        x, y = self.images, self.labels
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            raise TypeError(
                f"{who}: images and labels must be torch.Tensor, "
                f"found {type(x).__name__} and {type(y).__name__}"
            )
        if x.dtype != torch.uint8 or x.ndim != 4:
            raise ValueError(
                f"{who}: expected images uint8 of shape (N, C, H, W), "
                f"found {x.dtype} of shape {tuple(x.shape)}"
            )
        if y.dtype != torch.int64 or y.ndim != 1:
            raise ValueError(
                f"{who}: expected labels int64 of shape (N,), found {y.dtype} of shape "
                f"{tuple(y.shape)}"
            )
        if x.shape[0] != y.shape[0]:
            raise ValueError(f"{who}: {x.shape[0]} images but {y.shape[0]} labels")
        object.__setattr__(self, "images", row_major(x))  # NumPy's slices read as NHWC
        if isinstance(self.num_classes, bool) or not isinstance(self.num_classes, int):
            raise TypeError(f"{who}: num_classes must be int, found {self.num_classes!r}")
        if self.num_classes < 1:
            raise ValueError(f"{who}: expected num_classes >= 1, found {self.num_classes}")
        if y.numel() and (int(y.min()) < 0 or int(y.max()) >= self.num_classes):
            raise ValueError(
                f"{who}: expected labels in [0, {self.num_classes - 1}], "
                f"found range [{int(y.min())}, {int(y.max())}]"
            )
        if self.class_names is not None:
            names = tuple(self.class_names)
            if len(names) != self.num_classes or not all(isinstance(n, str) for n in names):
                raise ValueError(
                    f"{who}: expected {self.num_classes} class names (text), found {len(names)}"
                )
            object.__setattr__(self, "class_names", names)
        c = x.shape[1]
        mean, std = tuple(float(m) for m in self.mean), tuple(float(s) for s in self.std)
        if len(mean) != c or len(std) != c:
            raise ValueError(
                f"{who}: expected {c} per-channel mean/std values, "
                f"found {len(mean)} mean and {len(std)} std"
            )
        if any(not s > 0 for s in std):
            raise ValueError(f"{who}: std values must be > 0, found {std}")
        object.__setattr__(self, "mean", mean)
        object.__setattr__(self, "std", std)
        # Broadcastable (C, 1, 1) tensors, precomputed once for _normalise.
        object.__setattr__(self, "_mean_t", torch.tensor(mean, dtype=torch.float32).view(c, 1, 1))
        object.__setattr__(self, "_std_t", torch.tensor(std, dtype=torch.float32).view(c, 1, 1))

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        """Return the normalised float32 image (C, H, W) and its integer label."""
        return self._normalise(self.images[i]), int(self.labels[i])

    def __repr__(self) -> str:
        return (
            f"ImageDataset(name={self.name!r}, n={len(self)}, shape={self.input_shape}, "
            f"num_classes={self.num_classes})"
        )

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """Shape (C, H, W) of one sample."""
        _, c, h, w = self.images.shape
        return (int(c), int(h), int(w))

    def subset(self, indices: IndexLike) -> ImageDataset:
        """Return a new dataset holding the samples at ``indices`` (same classes and stats)."""
        idx = _as_index(indices, len(self), self.name)
        return ImageDataset(
            images=self.images[idx],
            labels=self.labels[idx],
            num_classes=self.num_classes,
            mean=self.mean,
            std=self.std,
            name=self.name,
            class_names=self.class_names,
        )

    def inputs(self, indices: IndexLike | None = None) -> torch.Tensor:
        """Normalised float32 batch (N, C, H, W) of all samples, or those at ``indices``."""
        if indices is None:
            return self._normalise(self.images)
        return self._normalise(self.images[_as_index(indices, len(self), self.name)])

    def _normalise(self, x: torch.Tensor) -> torch.Tensor:
        """``(x / 255 - mean) / std`` per channel; works for (C,H,W) and (N,C,H,W)."""
        mean, std = self._mean_t.to(x.device), self._std_t.to(x.device)
        return x.to(torch.float32).div_(255.0).sub_(mean).div_(std)
