"""scikit-learn's bundled 8x8 handwritten digits: a tiny dataset that is always available
offline, useful for smoke tests and quick experiments."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fedfuse.data._common import check_split
from fedfuse.data.dataset import ImageDataset

__all__ = ["DIGITS_SEED", "DIGITS_TEST_FRACTION", "load_digits"]

DIGITS_SEED = 0
DIGITS_TEST_FRACTION = 0.2


def load_digits(split: str, root: Path | None = None, download: bool = False) -> ImageDataset:
    """Digits as (N, 1, 8, 8) uint8 (0..16 rescaled to 0..255), 10 classes.

    The 1797 samples are split 80/20 into train/test with
    ``sklearn.model_selection.train_test_split(stratify=labels, random_state=DIGITS_SEED)``,
    so the split is deterministic and class-balanced. Mean/std are measured on the train
    split and used for both splits. ``root`` and ``download`` are ignored (data ships with
    scikit-learn).
    """
    from sklearn.datasets import load_digits as sk_load_digits
    from sklearn.model_selection import train_test_split

    check_split(split)
    bunch = sk_load_digits()
    images = np.rint(bunch.images * (255.0 / 16.0)).astype(np.uint8)[:, None]
    labels = bunch.target.astype(np.int64)
    train_idx, test_idx = train_test_split(
        np.arange(len(labels)),
        test_size=DIGITS_TEST_FRACTION,
        stratify=labels,
        random_state=DIGITS_SEED,
    )
    train_pixels = images[train_idx].astype(np.float64) / 255.0
    idx = np.sort(train_idx if split == "train" else test_idx)
    return ImageDataset(
        images=torch.from_numpy(images[idx]),
        labels=torch.from_numpy(labels[idx]),
        num_classes=10,
        mean=(float(train_pixels.mean()),),
        std=(float(train_pixels.std()),),
        name="digits",
    )
