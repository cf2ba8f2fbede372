"""Datasets for fedfuse: an in-memory ``ImageDataset`` and loaders for common benchmarks.

Typical use::

    from fedfuse.data import load_dataset
    train = load_dataset("fashion-mnist", "train")
    x, y = train.inputs(), train.labels
"""

from fedfuse.data._common import (
    DATA_ENV_VAR,
    DataFormatError,
    DatasetNotFoundError,
    resolve_data_root,
)
from fedfuse.data.arrays import check_npz_dataset, load_npz_dataset, save_npz_dataset
from fedfuse.data.cifar import UnsafePickleError, safe_pickle_load
from fedfuse.data.convert import from_arrays, from_medmnist_npz
from fedfuse.data.dataset import ImageDataset
from fedfuse.data.idx import read_idx
from fedfuse.data.image_folder import from_image_folder
from fedfuse.data.medmnist import read_medmnist_npz
from fedfuse.data.registry import available_datasets, load_dataset, register_dataset

__all__ = [
    "DATA_ENV_VAR",
    "DataFormatError",
    "DatasetNotFoundError",
    "ImageDataset",
    "UnsafePickleError",
    "available_datasets",
    "check_npz_dataset",
    "from_arrays",
    "from_image_folder",
    "from_medmnist_npz",
    "load_dataset",
    "load_npz_dataset",
    "read_idx",
    "read_medmnist_npz",
    "register_dataset",
    "resolve_data_root",
    "safe_pickle_load",
    "save_npz_dataset",
]
