"""Site data files: the hardened loader, the converters behind ``fedfuse site-data``, its CLI."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from fedfuse.cli.main import main
from fedfuse.data import (
    DataFormatError,
    from_arrays,
    from_image_folder,
    from_medmnist_npz,
    load_npz_dataset,
    save_npz_dataset,
)
from fedfuse.data.images import parse_shape

RNG = np.random.default_rng(0)


def _images(n: int = 6, shape: tuple[int, ...] = (5, 5)) -> np.ndarray:
    return RNG.integers(0, 256, (n, *shape), dtype=np.uint8)


def _valid(**changes) -> dict:
    arrays = {
        "images": _images(),
        "labels": np.arange(6) % 3,
        "num_classes": np.int64(3),
        "mean": np.array([0.5]),
        "std": np.array([0.25]),
    }
    arrays.update(changes)
    return {k: v for k, v in arrays.items() if v is not None}


# ------------------------------------------------------------------------- load_npz_dataset
@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"std": np.array([np.nan])}, r"'std' holds NaN or Inf"),
        ({"std": np.array([np.inf])}, r"'std' holds NaN or Inf"),
        ({"mean": np.array([np.nan])}, r"'mean' holds NaN or Inf"),
        ({"std": np.array([0.0])}, r"'std' must be >= 1e-06"),
        ({"std": np.array([-0.2])}, r"'std' must be >= 1e-06"),
        ({"std": np.array([1e-9])}, r"'std' must be >= 1e-06"),
        ({"std": np.array([0.2, 0.3])}, r"'std' must hold 1 value\(s\).*found shape \(2,\)"),
        ({"mean": np.array(["a"])}, r"'mean' must be numbers"),
        ({"std": None}, r"has 'mean' but not the other"),
        ({"images": _images(6, (2, 5, 5, 5))}, r"'images' must be 3-D .* found shape"),
        ({"images": _images(6, (0, 5))}, r"empty axis"),
        ({"images": _images(4)}, r"4 'images' but 6 'labels'"),
        ({"images": _images(0), "labels": np.zeros(0, int)}, r"'images' is empty"),
        ({"labels": np.zeros((6, 2), int)}, r"'labels' must be 1-D integers"),
        ({"labels": np.linspace(0, 1, 6)}, r"'labels' must be 1-D integers"),
        ({"num_classes": np.array([3, 3])}, r"'num_classes' must be one integer >= 1"),
        ({"num_classes": np.float64(3)}, r"'num_classes' must be one integer >= 1"),
        ({"num_classes": np.int64(0)}, r"'num_classes' must be one integer >= 1"),
    ],
)
def test_invalid_site_files_fail_with_the_file_and_key(tmp_path, changes, message):
    path = tmp_path / "site.npz"
    np.savez(path, **_valid(**changes))
    with pytest.raises(DataFormatError, match=message) as info:
        load_npz_dataset(path)
    assert str(info.value).startswith(f"{path}: ") and "\n" not in str(info.value)


def test_object_arrays_and_npy_files_are_refused_by_name(tmp_path):
    objects = tmp_path / "objects.npz"
    np.savez(objects, **_valid(labels=np.array([1, "x", None] * 2, dtype=object)))
    with pytest.raises(DataFormatError, match=r"objects.npz: cannot read key 'labels'.*pickles"):
        load_npz_dataset(objects)
    npy = tmp_path / "images.npz"  # an .npy saved under an .npz name
    with npy.open("wb") as handle:
        np.save(handle, _images())
    with pytest.raises(DataFormatError, match=r"images.npz: is a single .npy array"):
        load_npz_dataset(npy)
    text = tmp_path / "notes.npz"
    text.write_text("hello")
    with pytest.raises(DataFormatError, match=r"notes.npz: not a readable .npz"):
        load_npz_dataset(text)


def test_a_valid_file_loads_with_its_own_or_measured_statistics(tmp_path):
    np.savez(tmp_path / "given.npz", **_valid())
    given = load_npz_dataset(tmp_path / "given.npz")
    assert given.mean == (0.5,) and given.std == (0.25,) and given.num_classes == 3
    np.savez(tmp_path / "measured.npz", **_valid(mean=None, std=None, labels=np.zeros((6, 1))))
    with pytest.raises(DataFormatError, match="'labels' must be 1-D integers"):
        load_npz_dataset(tmp_path / "measured.npz")
    images = _images()
    np.savez(
        tmp_path / "measured.npz",
        images=images,
        labels=np.zeros((6, 1), np.int64),  # MedMNIST-style column of labels
        num_classes=2,
    )
    measured = load_npz_dataset(tmp_path / "measured.npz")
    assert measured.mean[0] == pytest.approx(images.mean() / 255)
    assert measured.std[0] == pytest.approx((images / 255).std())
    constant = tmp_path / "constant.npz"
    np.savez(
        constant, images=np.full((3, 4, 4), 7, np.uint8), labels=np.zeros(3, int), num_classes=1
    )
    with pytest.raises(DataFormatError, match="constant.npz: 'std' must be >= 1e-06"):
        load_npz_dataset(constant)


# ------------------------------------------------------------------------------- converters
def _write_folder(root, layout: dict[str, int], size=(9, 7), mode="L") -> None:
    for name, count in layout.items():
        (root / name).mkdir(parents=True)
        for i in range(count):
            shape = (size[1], size[0]) if mode == "L" else (size[1], size[0], 3)
            Image.fromarray(RNG.integers(0, 256, shape, dtype=np.uint8)).save(
                root / name / f"{i}.png"
            )


def test_image_folder_with_the_federation_class_list(tmp_path):
    _write_folder(tmp_path / "site", {"cat": 2, "dog": 3}, mode="RGB")
    (tmp_path / "site" / "dog" / "README.txt").write_text("not an image")
    (tmp_path / "site" / ".cache").mkdir()
    data, names = from_image_folder(
        tmp_path / "site", (1, 4, 4), classes=["bird", "cat", "dog", "fish"]
    )
    assert data.input_shape == (1, 4, 4) and data.num_classes == 4 and len(data) == 5
    assert data.labels.tolist() == [1, 1, 2, 2, 2] and names == ["bird", "cat", "dog", "fish"]
    assert np.isclose(data.mean[0], data.images.float().mean().item() / 255, atol=1e-6)
    save_npz_dataset(tmp_path / "site.npz", data)
    again = load_npz_dataset(tmp_path / "site.npz")
    assert torch.equal(again.images, data.images) and again.std == pytest.approx(data.std)


def test_image_folder_labels_from_names_or_integers(tmp_path):
    _write_folder(tmp_path / "named", {"b": 1, "a": 2})
    data, names = from_image_folder(tmp_path / "named", (3, 5, 5))
    assert names == ["a", "b"] and data.labels.tolist() == [0, 0, 1]
    assert data.input_shape == (3, 5, 5)
    _write_folder(tmp_path / "numbered", {"7": 1, "2": 1})
    data, names = from_image_folder(tmp_path / "numbered", (1, 9, 7), num_classes=10)
    assert data.num_classes == 10 and data.labels.tolist() == [2, 7] and names[7] == "7"
    with pytest.raises(DataFormatError, match="folder 7 is not a label below num_classes 5"):
        from_image_folder(tmp_path / "numbered", (1, 9, 7), num_classes=5)


def test_image_folder_errors_name_the_folder_or_file(tmp_path):
    _write_folder(tmp_path / "site", {"cat": 1, "dog": 1})
    with pytest.raises(DataFormatError, match=r"site: folder\(s\) \['dog'\] are not among"):
        from_image_folder(tmp_path / "site", (1, 4, 4), classes=["cat", "cow"])
    with pytest.raises(ValueError, match="2 class folders .* num_classes is 5; list every"):
        from_image_folder(tmp_path / "site", (1, 4, 4), num_classes=5)
    (tmp_path / "site" / "dog" / "broken.png").write_bytes(b"\x89PNG not really")
    with pytest.raises(DataFormatError, match=r"broken.png: not a readable image"):
        from_image_folder(tmp_path / "site", (1, 4, 4))
    (tmp_path / "empty" / "cat").mkdir(parents=True)
    with pytest.raises(DataFormatError, match="empty: no image files"):
        from_image_folder(tmp_path / "empty", (1, 4, 4))
    with pytest.raises(FileNotFoundError, match="absent: no such image folder"):
        from_image_folder(tmp_path / "absent", (1, 4, 4))


def test_sixteen_bit_grey_images_are_rescaled(tmp_path):
    (tmp_path / "site" / "x").mkdir(parents=True)
    values = np.array([[0, 257 * 100], [65535, 257 * 3]], dtype=np.uint16)
    Image.fromarray(values).save(tmp_path / "site" / "x" / "scan.png")
    data, _ = from_image_folder(tmp_path / "site", (1, 2, 2), classes=["x", "y"])
    assert data.images[0, 0].tolist() == [[0, 100], [255, 3]]


def test_medmnist_split_with_metadata_class_count_and_resizing(tmp_path):
    path = tmp_path / "bloodmnist.npz"
    np.savez(
        path,
        train_images=_images(4, (6, 6, 3)),
        train_labels=np.array([[0], [7], [3], [3]]),
        val_images=_images(2, (6, 6, 3)),
        val_labels=np.array([[1], [2]]),
    )
    train = from_medmnist_npz(path, "train")
    assert train.num_classes == 8 and train.input_shape == (3, 6, 6)
    assert train.labels.tolist() == [0, 7, 3, 3]
    val = from_medmnist_npz(path, "val", shape=(1, 4, 4), mean=[0.5], std=[0.5])
    assert val.input_shape == (1, 4, 4) and val.mean == (0.5,)
    with pytest.raises(DataFormatError, match=r"missing keys \['test_images', 'test_labels'\]"):
        from_medmnist_npz(path, "test")
    other = tmp_path / "ward3.npz"
    np.savez(other, train_images=_images(2), train_labels=np.array([[0], [1]]))
    with pytest.raises(ValueError, match="ward3.npz: not named after a MedMNIST set"):
        from_medmnist_npz(other)
    assert from_medmnist_npz(other, num_classes=2).num_classes == 2
    np.savez(tmp_path / "chestmnist.npz", train_images=_images(2), train_labels=np.zeros((2, 14)))
    with pytest.raises(DataFormatError, match="multi-label"):
        from_medmnist_npz(tmp_path / "chestmnist.npz")


def test_arrays_channels_last_labels_and_errors(tmp_path):
    images = _images(5, (8, 8, 3))
    np.save(tmp_path / "x.npy", images)
    np.save(tmp_path / "y.npy", np.array([[0], [1], [2], [1], [0]]))
    data = from_arrays(tmp_path / "x.npy", tmp_path / "y.npy", 4)
    assert data.input_shape == (3, 8, 8) and data.labels.tolist() == [0, 1, 2, 1, 0]
    assert torch.equal(data.images[1, 2], torch.from_numpy(images[1, :, :, 2]))
    np.save(tmp_path / "float.npy", images / 255.0)
    with pytest.raises(DataFormatError, match=r"float.npy: images must be uint8"):
        from_arrays(tmp_path / "float.npy", tmp_path / "y.npy", 4)
    with pytest.raises(DataFormatError, match=r"labels span 0..2, num_classes is 2"):
        from_arrays(tmp_path / "x.npy", tmp_path / "y.npy", 2)
    np.save(tmp_path / "short.npy", np.zeros(3, int))
    with pytest.raises(DataFormatError, match=r"holds 5 images but .*short.npy 3 labels"):
        from_arrays(tmp_path / "x.npy", tmp_path / "short.npy", 4)
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}] * 5, dtype=object))
    with pytest.raises(DataFormatError, match=r"objects.npy: not a readable .npy labels.*pickles"):
        from_arrays(tmp_path / "x.npy", tmp_path / "objects.npy", 4)
    np.savez(tmp_path / "both.npz", images=images)
    with pytest.raises(DataFormatError, match=r"both.npz: is an .npz archive"):
        from_arrays(tmp_path / "both.npz", tmp_path / "y.npy", 4)
    with pytest.raises(DataFormatError, match=r"'std' must be >= 1e-06"):
        from_arrays(tmp_path / "x.npy", tmp_path / "y.npy", 4, mean=[0, 0, 0], std=[1, 0, 1])


def test_parse_shape():
    assert parse_shape("1x28x28") == (1, 28, 28) and parse_shape("3X32X16") == (3, 32, 16)
    for bad in ("28x28", "2x28x28", "1x0x5", "axbxc"):
        with pytest.raises(ValueError, match="shape"):
            parse_shape(bad)


# -------------------------------------------------------------------------------------- CLI
def test_site_data_cli_writes_checks_and_refuses_to_overwrite(tmp_path, capsys):
    _write_folder(tmp_path / "site", {"benign": 2, "malignant": 1})
    out = tmp_path / "out" / "site.npz"
    argv = ["site-data", "folder", str(tmp_path / "site"), "--shape", "1x4x4", "--out", str(out)]
    assert main([*argv, "--classes", "benign,malignant,normal"]) == 0
    printed = capsys.readouterr().out
    assert "3 samples, shape (1, 4, 4), 3 classes" in printed
    assert "0 (benign): 2, 1 (malignant): 1, 2 (normal): 0" in printed
    assert load_npz_dataset(out).num_classes == 3
    assert main(argv) == 2
    assert "site.npz: exists; refusing to overwrite it (use --force)" in capsys.readouterr().err
    assert main([*argv, "--force", "--mean", "0.3", "--std", "0.2"]) == 0
    assert load_npz_dataset(out).std == (0.2,)
    assert main(["site-data", "check", str(out)]) == 0
    assert "mean [0.3], std [0.2]" in capsys.readouterr().out
    np.savez(tmp_path / "bad.npz", **_valid(std=np.array([0.0])))
    assert main(["site-data", "check", str(tmp_path / "bad.npz")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedfuse site-data: error: ") and "bad.npz: 'std' must be" in err
    assert (
        main(["site-data", "folder", str(tmp_path / "site"), "--out", str(tmp_path / "n.npz")]) == 2
    )
    assert "--shape is required" in capsys.readouterr().err


def test_site_data_cli_from_arrays(tmp_path, capsys):
    np.save(tmp_path / "x.npy", _images(4))
    np.save(tmp_path / "y.npy", np.array([0, 1, 1, 0]))
    out = tmp_path / "server.npz"
    argv = ["site-data", "arrays", str(tmp_path / "x.npy"), str(tmp_path / "y.npy")]
    assert main([*argv, "--num-classes", "2", "--out", str(out), "--shape", "1x3x3"]) == 0
    assert load_npz_dataset(out).input_shape == (1, 3, 3)
    assert main([*argv, "--num-classes", "2", "--out", str(tmp_path / "x.txt")]) == 2
    assert "must end in .npz" in capsys.readouterr().err


@pytest.mark.parametrize("side", ["-5", "0"])
def test_a_max_side_below_one_is_refused(tmp_path, capsys, side):
    argv = ["site-data", "folder", str(tmp_path), "--shape", "1x8x8", "--max-side", side]
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--out", str(tmp_path / "o.npz")])
    assert stop.value.code == 2
    assert "--max-side" in capsys.readouterr().err and not (tmp_path / "o.npz").exists()
