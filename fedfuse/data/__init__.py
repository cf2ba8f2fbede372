"""Datasets for fedfuse: an in-memory ``ImageDataset`` and loaders for common benchmarks.

Typical use::

    from fedfuse.data import load_dataset
    train = load_dataset("fashion-mnist", "train")
    x, y = train.inputs(), train.labels
"""

from ._common import DATA_ENV_VAR, DataFormatError, DatasetNotFoundError, resolve_data_root
from .arrays import load_npz_dataset, save_npz_dataset
from .cifar import UnsafePickleError, safe_pickle_load
from .convert import from_arrays, from_image_folder, from_medmnist_npz
from .dataset import ImageDataset
from .idx import read_idx
from .medmnist import read_medmnist_npz
from .registry import available_datasets, load_dataset, register_dataset

__all__ = [
    "DATA_ENV_VAR",
    "DataFormatError",
    "DatasetNotFoundError",
    "ImageDataset",
    "UnsafePickleError",
    "available_datasets",
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
