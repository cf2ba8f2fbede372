"""Tests for fedfuse.data: ImageDataset, the on-disk readers and the dataset registry.

Everything except the Debian Fashion-MNIST check runs on tiny files written here; the data
root and $HOME are pointed at temporary directories so no real cache or network is touched.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fedfuse.data import (
    DataFormatError,
    DatasetNotFoundError,
    ImageDataset,
    UnsafePickleError,
    available_datasets,
    load_dataset,
    read_idx,
    resolve_data_root,
    safe_pickle_load,
)
from fedfuse.data import idx as idx_module

FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")


# --------------------------------------------------------------------------- helpers


@pytest.fixture
def data_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Empty data root via $FEDFUSE_DATA, and an empty $HOME."""
    root, home = tmp_path / "data", tmp_path / "home"
    root.mkdir()
    home.mkdir()
    monkeypatch.setenv("FEDFUSE_DATA", str(root))
    monkeypatch.setenv("HOME", str(home))
    return root


def idx_bytes(array: np.ndarray) -> bytes:
    """Encode a uint8 array in the idx format."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_idx(path: Path, array: np.ndarray, gz: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = idx_bytes(array)
    if gz:
        path = path.with_name(path.name + ".gz")
        data = gzip.compress(data)
    path.write_bytes(data)
    return path


def write_mnist_split(directory: Path, prefix: str, n: int, seed: int, gz: bool):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=n, dtype=np.uint8)
    write_idx(directory / f"{prefix}-images-idx3-ubyte", images, gz)
    write_idx(directory / f"{prefix}-labels-idx1-ubyte", labels, gz)
    return images, labels


class _Py2Pickler(pickle._Pickler):
    """Writes ``bytes`` as Python 2 ``str`` opcodes, like the official CIFAR pickles."""

    dispatch = pickle._Pickler.dispatch.copy()

    def save_bytes(self, obj: bytes) -> None:
        self.write(pickle.BINSTRING + struct.pack("<i", len(obj)) + obj)
        self.memoize(obj)

    dispatch[bytes] = save_bytes


def py2_pickle(obj: object) -> bytes:
    buf = io.BytesIO()
    _Py2Pickler(buf, protocol=2).dump(obj)
    # Files written by Python 2 / numpy 1 name numpy.core, not numpy._core.
    return buf.getvalue().replace(b"numpy._core.multiarray", b"numpy.core.multiarray")


def random_cifar_rows(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)


# --------------------------------------------------------------------------- Fashion-MNIST


@pytest.fixture(scope="module")
def fmnist(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ImageDataset]:
    if not FMNIST_DIR.is_dir():
        pytest.skip("Debian package dataset-fashion-mnist not installed")
    empty_root = tmp_path_factory.mktemp("empty-root")
    return {s: load_dataset("fashion-mnist", s, root=empty_root) for s in ("train", "test")}


def test_fashion_mnist_from_debian_package(fmnist: dict[str, ImageDataset]) -> None:
    for split, n in (("train", 60000), ("test", 10000)):
        ds = fmnist[split]
        assert len(ds) == n
        assert ds.images.dtype == torch.uint8 and ds.images.shape == (n, 1, 28, 28)
        assert ds.labels.dtype == torch.int64 and ds.labels.shape == (n,)
        assert ds.labels.min() == 0 and ds.labels.max() == 9
        assert torch.bincount(ds.labels).tolist() == [n // 10] * 10  # balanced classes
        assert ds.num_classes == 10 and ds.input_shape == (1, 28, 28)
        assert ds.name == "fashion-mnist"
        assert ds.mean == pytest.approx((0.2860,)) and ds.std == pytest.approx((0.3530,))
        assert ds.class_names[0] == "T-shirt/top" and ds.class_names[9] == "Ankle boot"
    train = fmnist["train"]
    x = train.inputs()
    assert x.dtype == torch.float32 and x.shape == (60000, 1, 28, 28)
    # The cited statistics really standardise the training set.
    assert abs(x.mean().item()) < 0.01 and abs(x.std().item() - 1) < 0.01
    for i in (0, 1, 12345, 59999):
        xi, yi = train[i]
        assert isinstance(yi, int) and yi == int(train.labels[i])
        torch.testing.assert_close(xi, x[i])
        expected = (train.images[i].float() / 255 - 0.2860) / 0.3530
        torch.testing.assert_close(xi, expected)


def test_fashion_mnist_root_dir_takes_precedence_over_debian(data_root: Path) -> None:
    images, labels = write_mnist_split(data_root / "fashion-mnist", "t10k", 7, seed=1, gz=True)
    ds = load_dataset("fashion-mnist", "test")
    assert len(ds) == 7
    assert torch.equal(ds.images[:, 0], torch.from_numpy(images))
    assert torch.equal(ds.labels, torch.from_numpy(labels.astype(np.int64)))


def test_fashion_mnist_missing_names_debian_package(
    data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(idx_module, "FASHION_MNIST_SYSTEM_DIR", tmp_path / "no-such-dir")
    with pytest.raises(DatasetNotFoundError) as exc:
        load_dataset("fashion-mnist", "train")
    msg = str(exc.value)
    assert str(data_root / "fashion-mnist") in msg
    assert str(data_root / "FashionMNIST" / "raw") in msg
    assert str(tmp_path / "no-such-dir") in msg
    assert "apt-get install dataset-fashion-mnist" in msg
    assert "download=True" in msg and "FEDFUSE_DATA" in msg


# --------------------------------------------------------------------------- idx / MNIST


def test_mnist_idx_plain_and_gzip_layouts(data_root: Path) -> None:
    tr_x, tr_y = write_mnist_split(data_root / "mnist", "train", 5, seed=0, gz=False)
    te_x, te_y = write_mnist_split(data_root / "MNIST" / "raw", "t10k", 3, seed=1, gz=True)
    train, test = load_dataset("mnist", "train"), load_dataset("mnist", "test")
    assert train.images.shape == (5, 1, 28, 28) and test.images.shape == (3, 1, 28, 28)
    assert torch.equal(train.images[:, 0], torch.from_numpy(tr_x))
    assert torch.equal(test.images[:, 0], torch.from_numpy(te_x))
    assert train.labels.tolist() == tr_y.tolist() and test.labels.tolist() == te_y.tolist()
    assert train.labels.dtype == torch.int64
    assert train.mean == pytest.approx((0.1307,)) and train.std == pytest.approx((0.3081,))
    x, _ = train[2]
    torch.testing.assert_close(x, (torch.from_numpy(tr_x[2]).float()[None] / 255 - 0.1307) / 0.3081)


def test_read_idx_roundtrip(tmp_path: Path) -> None:
    arr = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    for gz in (False, True):
        out = read_idx(write_idx(tmp_path / f"a{gz}", arr, gz))
        assert out.dtype == np.uint8 and out.shape == (2, 3, 4) and np.array_equal(out, arr)
        out.flags.writeable = True  # a real, writable copy, not a view of a bytes buffer


@pytest.mark.parametrize("gz", [False, True])
def test_truncated_idx_file_is_a_clear_error(data_root: Path, gz: bool) -> None:
    write_mnist_split(data_root / "mnist", "train", 4, seed=0, gz=gz)
    path = data_root / "mnist" / ("train-images-idx3-ubyte" + (".gz" if gz else ""))
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(DataFormatError) as exc:
        load_dataset("mnist", "train")
    assert str(path) in str(exc.value)
    assert "truncated" in str(exc.value)


def test_idx_bad_magic_and_dtype(tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x12\x34\x08\x01" + struct.pack(">I", 1) + b"\x00")
    with pytest.raises(DataFormatError, match="magic"):
        read_idx(bad)
    ints = tmp_path / "ints"
    ints.write_bytes(b"\x00\x00\x0c\x01" + struct.pack(">I", 1) + b"\x00\x00\x00\x01")
    with pytest.raises(DataFormatError, match="0x0c"):
        read_idx(ints)


def test_idx_image_label_count_mismatch(data_root: Path) -> None:
    d = data_root / "mnist"
    write_idx(d / "train-images-idx3-ubyte", np.zeros((4, 28, 28), np.uint8))
    write_idx(d / "train-labels-idx1-ubyte", np.zeros(3, np.uint8))
    with pytest.raises(DataFormatError, match=r"\(4, 28, 28\).*\(3,\)"):
        load_dataset("mnist")


# --------------------------------------------------------------------------- CIFAR


def test_cifar10_python_version_layout(data_root: Path) -> None:
    rng = np.random.default_rng(0)
    d = data_root / "cifar-10-batches-py"
    d.mkdir()
    rows, labels = [], []
    for i in range(1, 6):
        x, y = random_cifar_rows(rng, 2), [i % 10, (i + 3) % 10]
        rows.append(x)
        labels += y
        batch = {b"batch_label": b"training batch", b"labels": y, b"data": x, b"filenames": []}
        (d / f"data_batch_{i}").write_bytes(py2_pickle(batch))
    test_x = random_cifar_rows(rng, 3)
    (d / "test_batch").write_bytes(py2_pickle({b"labels": [9, 0, 4], b"data": test_x}))

    train = load_dataset("cifar10", "train")
    data = np.concatenate(rows)
    assert train.images.shape == (10, 3, 32, 32) and train.images.dtype == torch.uint8
    assert train.labels.tolist() == labels and train.labels.dtype == torch.int64
    # Row layout is 1024 red, 1024 green, 1024 blue values, each row-major 32x32.
    assert train.images[3, 1, 2, 5] == data[3, 1024 + 2 * 32 + 5]
    assert torch.equal(train.images, torch.from_numpy(data.reshape(10, 3, 32, 32)))
    assert train.num_classes == 10 and train.input_shape == (3, 32, 32)
    assert train.mean == pytest.approx((0.4914, 0.4822, 0.4465))

    test = load_dataset("cifar10", "test")
    assert test.labels.tolist() == [9, 0, 4]
    assert torch.equal(test.images.reshape(3, -1), torch.from_numpy(test_x))


def test_cifar100_fine_labels_with_bytes_keys(data_root: Path) -> None:
    rng = np.random.default_rng(1)
    d = data_root / "cifar-100-python"
    d.mkdir()
    for split, n in (("train", 4), ("test", 2)):
        x = random_cifar_rows(rng, n)
        fine = [99, 0, 42, 7][:n]
        batch = {b"data": x, b"fine_labels": fine, b"coarse_labels": [19] * n}
        (d / split).write_bytes(pickle.dumps(batch, protocol=4))  # py3 pickle, bytes keys
        ds = load_dataset("cifar100", split)
        assert ds.labels.tolist() == fine
        assert ds.num_classes == 100 and len(ds) == n
        assert torch.equal(ds.images.reshape(n, -1), torch.from_numpy(x))


def test_cifar_wrong_shape_is_a_clear_error(data_root: Path) -> None:
    d = data_root / "cifar-100-python"
    d.mkdir()
    path = d / "test"
    path.write_bytes(pickle.dumps({"data": np.zeros((2, 100), np.uint8), "fine_labels": [0, 1]}))
    with pytest.raises(DataFormatError, match=r"\(N, 3072\)") as exc:
        load_dataset("cifar100", "test")
    assert str(path) in str(exc.value)


def test_cifar_labels_nested_by_reference_are_refused_before_expanding(data_root: Path) -> None:
    """A few hundred bytes of pickle whose labels nest one list in another by reference: read
    as an array they would be 10**10 elements (a bare MemoryError at 3.2 GB)."""
    labels: list = [0] * 10
    for _ in range(9):
        labels = [labels] * 10
    d = data_root / "cifar-100-python"
    d.mkdir()
    path = d / "test"
    path.write_bytes(pickle.dumps({"data": np.zeros((2, 3072), np.uint8), "fine_labels": labels}))
    assert len(pickle.dumps(labels)) < 400
    with pytest.raises(DataFormatError, match="flat list of integers, found a list holding list"):
        load_dataset("cifar100", "test")


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _EvalEvil:
    def __reduce__(self):
        return (eval, ("__import__('os').getcwd()",))


def test_malicious_pickle_is_refused_without_executing(data_root: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    d = data_root / "cifar-10-batches-py"
    d.mkdir()
    path = d / "test_batch"
    payload = {"data": np.zeros((1, 3072), np.uint8), "labels": [_Evil(marker)]}
    path.write_bytes(pickle.dumps(payload, protocol=4))
    with pytest.raises(UnsafePickleError, match="system") as exc:
        load_dataset("cifar10", "test")
    assert str(path) in str(exc.value)
    assert not marker.exists()
    pickle.loads(path.read_bytes())  # positive control: a plain unpickle runs the payload
    assert marker.exists()

    evil = tmp_path / "evil.pkl"
    evil.write_bytes(pickle.dumps(_EvalEvil(), protocol=0))
    with pytest.raises(UnsafePickleError, match=r"\.eval from pickle"):
        safe_pickle_load(evil)


# --------------------------------------------------------------------------- MedMNIST


def write_medmnist(path: Path, n: dict[str, int], rgb: bool, num_classes: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    arrays = {}
    for split, k in n.items():
        shape = (k, 28, 28, 3) if rgb else (k, 28, 28)
        arrays[f"{split}_images"] = rng.integers(0, 256, size=shape, dtype=np.uint8)
        arrays[f"{split}_labels"] = rng.integers(0, num_classes, size=(k, 1), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **arrays)
    return arrays


def test_bloodmnist_npz(data_root: Path) -> None:
    arrays = write_medmnist(
        data_root / "medmnist" / "bloodmnist.npz", {"train": 6, "val": 2, "test": 3}, True, 8
    )
    train = load_dataset("bloodmnist", "train")
    assert len(train) == 6  # train only; val is not merged in
    assert train.images.shape == (6, 3, 28, 28) and train.images.dtype == torch.uint8
    # (N, H, W, C) -> (N, C, H, W)
    assert torch.equal(train.images, torch.from_numpy(arrays["train_images"]).permute(0, 3, 1, 2))
    assert train.labels.tolist() == arrays["train_labels"][:, 0].tolist()
    assert train.labels.dtype == torch.int64
    assert train.num_classes == 8 and train.mean == (0.5,) * 3 and train.std == (0.5,) * 3
    test = load_dataset("bloodmnist", "test")
    assert test.labels.tolist() == arrays["test_labels"][:, 0].tolist()


def test_grayscale_medmnist_found_in_home_cache(data_root: Path) -> None:
    arrays = write_medmnist(
        Path.home() / ".medmnist" / "pneumoniamnist.npz", {"train": 4, "test": 2}, False, 2
    )
    ds = load_dataset("pneumoniamnist", "test")
    assert ds.images.shape == (2, 1, 28, 28) and ds.num_classes == 2
    assert torch.equal(ds.images[:, 0], torch.from_numpy(arrays["test_images"]))


def test_medmnist_bad_npz(data_root: Path) -> None:
    path = data_root / "medmnist" / "dermamnist.npz"
    path.parent.mkdir()
    np.savez(path, train_images=np.zeros((2, 28, 28, 3), np.uint8))
    with pytest.raises(DataFormatError, match="train_labels") as exc:
        load_dataset("dermamnist")
    assert str(path) in str(exc.value)
    path.write_bytes(b"not a zip file")
    with pytest.raises(DataFormatError, match="dermamnist.npz"):
        load_dataset("dermamnist")


def test_medmnist_registry_entries(data_root: Path) -> None:
    names = available_datasets()
    for flag in ("bloodmnist", "pathmnist", "octmnist", "tissuemnist", "organamnist"):
        assert flag in names
    assert "chestmnist" not in names and not any(n.endswith("3d") for n in names)
    with pytest.raises(ValueError, match="multi-label"):
        load_dataset("chestmnist")
    with pytest.raises(ValueError, match="3D"):
        load_dataset("organmnist3d")


# --------------------------------------------------------------------------- digits


def test_digits_offline_stratified_split() -> None:
    from sklearn.datasets import load_digits

    train, test = load_dataset("digits", "train"), load_dataset("digits", "test")
    assert len(train) + len(test) == 1797 and len(test) == 360
    assert train.images.shape[1:] == (1, 8, 8) and train.images.dtype == torch.uint8
    assert int(train.images.max()) == 255 and train.num_classes == 10
    # The two splits are exactly the full dataset (as a multiset), so they are disjoint.
    full = load_digits()
    full_rows = np.rint(full.images.reshape(1797, 64) * 255 / 16).astype(np.uint8)
    expected = sorted(r.tobytes() + bytes([y]) for r, y in zip(full_rows, full.target, strict=True))
    got = sorted(
        img.reshape(64).numpy().tobytes() + bytes([int(y)])
        for ds in (train, test)
        for img, y in zip(ds.images, ds.labels, strict=True)
    )
    assert got == expected
    # Stratified: every class is ~20% in test.
    full_counts = np.bincount(full.target)
    assert np.all(np.abs(torch.bincount(test.labels).numpy() - 0.2 * full_counts) <= 1)
    # Deterministic, and both splits share the train statistics.
    again = load_dataset("digits", "test")
    assert torch.equal(again.images, test.images) and torch.equal(again.labels, test.labels)
    assert train.mean == test.mean and abs(train.inputs().mean().item()) < 1e-5


ONE_THREAD_RESNET_ON_DIGITS = """
import torch
from fedfuse.data import load_dataset
from fedfuse.models import build_model, make_spec
torch.set_num_threads(1)
data = load_dataset("digits", "train").subset(range(240))
model = build_model(make_spec("resnet", (1, 8, 8), 10, depth=34, width_multiplier=1 / 16))
for _ in range(3):
    for start in (0, 128):
        x, y = data.inputs(range(start, min(start + 128, 240))), data.labels[start : start + 128]
        torch.nn.functional.cross_entropy(model(x), y).backward()
print("trained")
"""


def test_images_are_kept_in_plain_nchw_order_whatever_numpy_gave() -> None:
    # NumPy's fancy indexing gives the one-channel axis stride 1: torch reads that as NHWC.
    sliced = torch.from_numpy(np.zeros((10, 8, 8), np.uint8)[:, None][np.array([1, 3, 5])])
    assert sliced.stride() == (64, 1, 8, 1)
    data = ImageDataset(sliced, torch.zeros(3, dtype=torch.int64), num_classes=1, mean=(0.5,),
                        std=(0.25,))  # fmt: skip
    assert data.images.stride() == data.inputs().stride() == (64, 64, 8, 1)
    digits = load_dataset("digits", "train")
    assert digits.inputs(range(5)).stride() == torch.empty(5, 1, 8, 8).stride()


def test_a_library_users_channels_last_tensors_are_used_in_nchw_order() -> None:
    # the library's other doors for data a user made: the fusion set and fine-tuning data
    from fedfuse.fusion import FusionInputs
    from fedfuse.runtime import row_major

    nhwc = torch.randn(6, 4, 5, 5).to(memory_format=torch.channels_last)
    inputs = FusionInputs(data=nhwc)
    assert inputs.data.stride() == (100, 25, 5, 1) and torch.equal(inputs.data, nhwc)
    plain = torch.randn(6, 4, 5, 5)
    assert row_major(plain) is plain and FusionInputs(data=plain).data is plain


def test_a_resnet_trains_on_digits_on_one_thread() -> None:
    """Channels-last batches crashed torch 2.14.1's one-thread backward (a corrupted heap) in
    the ResNet's 1x1 strided shortcut; in a child process, since a crash takes its process."""
    done = subprocess.run(
        [sys.executable, "-c", ONE_THREAD_RESNET_ON_DIGITS], capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.strip() == "trained", done.stderr[-2000:]


# --------------------------------------------------------------------------- registry


def test_missing_dataset_message(data_root: Path) -> None:
    with pytest.raises(DatasetNotFoundError) as exc:
        load_dataset("mnist", "test")
    assert isinstance(exc.value, FileNotFoundError)
    msg = str(exc.value)
    assert "'mnist'" in msg and "'test'" in msg
    assert str(data_root / "mnist") in msg and str(data_root / "MNIST" / "raw") in msg
    assert "download=True" in msg and "FEDFUSE_DATA" in msg

    with pytest.raises(DatasetNotFoundError) as exc:
        load_dataset("cifar100")
    assert str(data_root / "cifar-100-python" / "train") in str(exc.value)

    with pytest.raises(DatasetNotFoundError) as exc:
        load_dataset("bloodmnist", "test")
    msg = str(exc.value)
    assert str(data_root / "medmnist" / "bloodmnist.npz") in msg
    assert str(Path.home() / ".medmnist" / "bloodmnist.npz") in msg
    assert "download=True" in msg


def test_unknown_name_and_split(data_root: Path) -> None:
    with pytest.raises(ValueError) as exc:
        load_dataset("imagenet")
    for name in ("fashion-mnist", "mnist", "cifar10", "cifar100", "digits", "bloodmnist"):
        assert name in str(exc.value)
    with pytest.raises(ValueError, match="split"):
        load_dataset("digits", "val")


def test_data_root_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("FEDFUSE_DATA", raising=False)
    default = tmp_path / "home" / ".cache" / "fedfuse"
    assert resolve_data_root() == default
    monkeypatch.setenv("FEDFUSE_DATA", str(tmp_path / "env"))
    assert resolve_data_root() == tmp_path / "env"
    assert resolve_data_root(tmp_path / "explicit") == tmp_path / "explicit"

    # A dataset under each root is found by the matching rule.
    write_mnist_split(default / "mnist", "t10k", 2, seed=0, gz=False)
    write_mnist_split(tmp_path / "env" / "mnist", "t10k", 3, seed=0, gz=False)
    write_mnist_split(tmp_path / "explicit" / "mnist", "t10k", 4, seed=0, gz=False)
    assert len(load_dataset("mnist", "test", root=tmp_path / "explicit")) == 4
    assert len(load_dataset("mnist", "test", root=str(tmp_path / "explicit"))) == 4
    assert len(load_dataset("mnist", "test")) == 3
    monkeypatch.delenv("FEDFUSE_DATA")
    assert len(load_dataset("mnist", "test")) == 2


# --------------------------------------------------------------------------- ImageDataset


def make_ds(n: int = 10, c: int = 3, num_classes: int = 5) -> ImageDataset:
    g = torch.Generator().manual_seed(0)
    return ImageDataset(
        images=torch.randint(0, 256, (n, c, 4, 4), dtype=torch.uint8, generator=g),
        labels=torch.arange(n, dtype=torch.int64) % num_classes,
        num_classes=num_classes,
        mean=tuple(0.1 * (k + 1) for k in range(c)),
        std=tuple(0.2 * (k + 1) for k in range(c)),
        name="toy",
    )


def test_getitem_and_inputs_normalise_per_channel() -> None:
    ds = make_ds()
    mean = torch.tensor(ds.mean).view(1, 3, 1, 1)
    std = torch.tensor(ds.std).view(1, 3, 1, 1)
    expected = (ds.images.float() / 255 - mean) / std
    torch.testing.assert_close(ds.inputs(), expected)
    torch.testing.assert_close(ds.inputs([7, 2]), expected[[7, 2]])
    x, y = ds[-1]
    assert x.dtype == torch.float32 and x.shape == (3, 4, 4) and y == 9 % 5
    torch.testing.assert_close(x, expected[-1])
    before = ds.images.clone()
    ds[0], ds.inputs()
    assert torch.equal(ds.images, before)  # normalising never writes into the uint8 store
    with pytest.raises(IndexError):
        ds[10]


def test_subset_accepts_sequences_arrays_tensors_and_masks() -> None:
    ds = make_ds()
    for idx in ([3, 1, 3], np.array([3, 1, 3]), torch.tensor([3, 1, 3])):
        sub = ds.subset(idx)
        assert len(sub) == 3 and sub.labels.tolist() == [3, 1, 3]
        assert torch.equal(sub.images, ds.images[[3, 1, 3]])
        assert (sub.num_classes, sub.mean, sub.std, sub.name) == (5, ds.mean, ds.std, "toy")
    mask = ds.labels == 0
    assert ds.subset(mask).labels.tolist() == [0, 0]
    empty = ds.subset([])
    assert len(empty) == 0 and empty.inputs().shape == (0, 3, 4, 4)
    with pytest.raises(IndexError, match="out of range"):
        ds.subset([0, 10])
    with pytest.raises(TypeError):
        ds.subset([0.5])
    # A subset owns its data: changing it does not affect the parent.
    sub = ds.subset([0])
    sub.images.zero_()
    assert ds.images[0].any()


def test_dataloader_batches() -> None:
    ds = make_ds()
    xb, yb = next(iter(torch.utils.data.DataLoader(ds, batch_size=4)))
    torch.testing.assert_close(xb, ds.inputs(range(4)))
    assert yb.tolist() == ds.labels[:4].tolist()


def test_validation_errors_name_dataset_and_expectation() -> None:
    ds = make_ds()
    good = dict(images=ds.images, labels=ds.labels, num_classes=5, mean=ds.mean, std=ds.std)
    cases = [
        (dict(images=ds.images.float()), r"'toy'.*uint8.*torch.float32"),
        (dict(images=ds.images[:, 0]), r"\(N, C, H, W\).*\(10, 4, 4\)"),
        (dict(labels=ds.labels.int()), r"int64.*torch.int32"),
        (dict(labels=ds.labels[:9]), "10 images but 9 labels"),
        (dict(num_classes=3), r"\[0, 2\].*\[0, 4\]"),
        (dict(mean=(0.5,)), "3 per-channel"),
        (dict(std=(1.0, 0.0, 1.0)), "std"),
    ]
    for override, pattern in cases:
        with pytest.raises((ValueError, TypeError), match=pattern):
            ImageDataset(**{**good, **override, "name": "toy"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        ds.num_classes = 3  # type: ignore[misc]
