"""Hostile data files, run options, output paths and credentials through ``fedfuse site-data``,
``simulate``, ``fuse``, ``certs`` and ``keys`` (issue 50): one error line naming the file, key
or option, bounded memory, nothing overwritten, nothing unpickled, nothing printed raw. The
rules each case is held to are in :mod:`tests.hostile`; checkpoints, images and results files
are in ``test_hostile_models.py``."""

from __future__ import annotations

import io
import os
import pickle
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest

from fedfuse.io.checkpoint import save_checkpoint
from fedfuse.models import build_model, mlp_spec
from tests.hostile import (
    COMMANDS,
    MEMORY_LIMIT,
    Case,
    npy_bytes,
    npy_with_raw_header,
    run_case,
    table,
    write,
)

RNG = np.random.default_rng(0)
ESCAPE = "\x1b]0;pwned\x07\x1b[2J"


def _labels(tmp: Path, labels: np.ndarray | bytes | None = None) -> Path:
    if labels is None:
        labels = np.arange(20) % 10
    if isinstance(labels, np.ndarray):
        labels = npy_bytes(labels)
    return write(tmp / "labels.npy", labels)


def _images(tmp: Path, images: np.ndarray | bytes | None = None) -> Path:
    if images is None:
        images = RNG.integers(0, 256, (20, 8, 8), dtype=np.uint8)
    if isinstance(images, np.ndarray):
        images = npy_bytes(images)
    return write(tmp / "images.npy", images)


def _arrays(tmp: Path, images: Path, labels: Path, *extra: str) -> list:
    return ["site-data", "arrays", images, labels, "--num-classes", "10", "--out", tmp / "o.npz",
            *extra]  # fmt: skip


class _Marker:
    """Unpickled, it creates a file: proof that a pickle was run."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def _site(tmp: Path, name: str = "site.npz", **changes) -> Path:
    arrays = {
        "images": RNG.integers(0, 256, (20, 8, 8), dtype=np.uint8),
        "labels": np.arange(20) % 10,
        "num_classes": np.int64(10),
    }
    arrays.update(changes)
    np.savez(tmp / name, **arrays)
    return tmp / name


# ---------------------------------------------------------------------------- .npy arrays
def _pickled_images(tmp: Path) -> list:
    payload = pickle.dumps(np.array([_Marker(tmp / "PWNED")], dtype=object))
    header = {"descr": "|O", "fortran_order": False, "shape": (1,)}
    return _arrays(tmp, _images(tmp, npy_bytes(header=header, data=payload)), _labels(tmp))


def _header_is_python_code(tmp: Path) -> list:
    code = "{'descr': __import__('os').system('touch PWNED'), 'fortran_order': False, "
    code += "'shape': (20, 8, 8), }"
    return _arrays(tmp, _images(tmp, npy_with_raw_header(code, b"\0" * 1280)), _labels(tmp))


def _negative_label_count(tmp: Path) -> list:
    labels = npy_with_raw_header("{'descr': '<i8', 'fortran_order': False, 'shape': (-20,), }")
    return _arrays(tmp, _images(tmp), _labels(tmp, labels))


def _fortran_order_images(tmp: Path) -> list:
    return _arrays(tmp, _images(tmp, np.asfortranarray(RNG.integers(0, 256, (20, 8, 8), np.uint8))),
                   _labels(tmp))  # fmt: skip


def _text_images(tmp: Path) -> list:
    return _arrays(tmp, _images(tmp, np.full((20, 8, 8), "pixel")), _labels(tmp))


def _label_2_to_the_62(tmp: Path) -> list:
    labels = np.arange(20) % 10
    labels[3] = 2**62
    return _arrays(tmp, _images(tmp), _labels(tmp, labels))


def _nan_labels(tmp: Path) -> list:
    return _arrays(tmp, _images(tmp), _labels(tmp, np.full(20, np.nan)))


def _header_length_4_gb(tmp: Path) -> list:
    forged = b"\x93NUMPY\x02\x00" + struct.pack("<I", 2**32 - 1) + b"{'descr': '|u1'" + b" " * 64
    return _arrays(tmp, _images(tmp, forged), _labels(tmp))


def _images_link_to_dev_zero(tmp: Path) -> list:
    (tmp / "images.npy").symlink_to("/dev/zero")
    return _arrays(tmp, tmp / "images.npy", _labels(tmp))


def _no_images(tmp: Path) -> list:
    return _arrays(tmp, _images(tmp, np.zeros((0, 8, 8), np.uint8)), _labels(tmp, np.zeros(0, int)))


def _out_with_escapes(tmp: Path) -> list:
    return [*_arrays(tmp, _images(tmp), _labels(tmp))[:-1], tmp / f"o{ESCAPE}.npz"]


ARRAYS = [
    Case("pickled-object-images", _pickled_images, ("images.npy", "pickles are refused")),
    Case("npy-header-is-python-code", _header_is_python_code, ("images.npy",)),
    Case("negative-label-count", _negative_label_count, ("labels.npy", "negative")),
    Case("fortran-order-images", _fortran_order_images, succeeds=True, writes=("o.npz",)),
    Case("text-images", _text_images, ("images", "uint8")),
    Case("label-2**62", _label_2_to_the_62, ("labels.npy", "labels span")),
    Case("nan-labels", _nan_labels, ("labels",)),
    Case("npy-v2-header-length-4-GB", _header_length_4_gb, ("images.npy",)),
    Case("images-link-to-dev-zero", _images_link_to_dev_zero, ("images.npy",)),
    Case("zero-images", _no_images, ("images",)),
    Case("out-with-escapes", _out_with_escapes, succeeds=True, writes=(f"o{ESCAPE}.npz",)),
]


# ---------------------------------------------------------------------------- .npz site files
def _bzip2_member(tmp: Path) -> list:
    site = _site(tmp, "plain.npz")
    with zipfile.ZipFile(site) as source, zipfile.ZipFile(tmp / "site.npz", "w") as out:
        for info in source.infolist():
            out.writestr(info.filename, source.read(info), zipfile.ZIP_BZIP2)
    site.unlink()
    return ["site-data", "check", tmp / "site.npz"]


def _duplicate_members(tmp: Path) -> list:
    site = _site(tmp, "plain.npz")
    with zipfile.ZipFile(site) as source, zipfile.ZipFile(tmp / "site.npz", "w") as out:
        for info in source.infolist():
            out.writestr(info.filename, source.read(info))
        other = io.BytesIO()
        np.save(other, np.zeros(20, np.int64))
        with pytest.warns(UserWarning, match="Duplicate name"):
            out.writestr("labels.npy", other.getvalue())
    site.unlink()
    return ["site-data", "check", tmp / "site.npz"]


def _member_named_with_escapes(tmp: Path) -> list:
    with zipfile.ZipFile(tmp / "site.npz", "w") as out:
        out.writestr(f"../../{ESCAPE}\n.npy", npy_bytes(np.zeros(3)))
    return ["site-data", "check", tmp / "site.npz"]


def _site_file_is_a_fifo(tmp: Path) -> list:
    os.mkfifo(tmp / "site.npz")
    return ["site-data", "check", tmp / "site.npz"]


def _nan_num_classes(tmp: Path) -> list:
    return ["site-data", "check", _site(tmp, num_classes=np.float64("nan"))]


def _multi_label_medmnist(tmp: Path) -> list:
    np.savez(
        tmp / "ward.npz",
        train_images=RNG.integers(0, 256, (20, 8, 8), dtype=np.uint8),
        train_labels=RNG.integers(0, 2, (20, 3)),
    )
    return ["site-data", "medmnist", tmp / "ward.npz", "--num-classes", "2", "--out", tmp / "o.npz"]


def _medmnist_out_is_its_input(tmp: Path) -> list:
    np.savez(
        tmp / "ward.npz",
        train_images=RNG.integers(0, 256, (20, 8, 8), dtype=np.uint8),
        train_labels=(np.arange(20) % 2)[:, None],
    )
    ward = tmp / "ward.npz"
    return ["site-data", "medmnist", ward, "--num-classes", "2", "--out", ward, "--force"]


def _folder_out_is_a_folder(tmp: Path) -> list:
    from PIL import Image

    for name in ("a", "b"):
        (tmp / "site" / name).mkdir(parents=True)
        Image.fromarray(RNG.integers(0, 256, (8, 8), np.uint8)).save(tmp / "site" / name / "0.png")
    (tmp / "out.npz").mkdir()
    return ["site-data", "folder", tmp / "site", "--shape", "1x8x8", "--out", tmp / "out.npz",
            "--force"]  # fmt: skip


def _class_folder_with_escapes(tmp: Path) -> list:
    from PIL import Image

    for name in ("a", f"b{ESCAPE}"):
        (tmp / "site" / name).mkdir(parents=True)
        Image.fromarray(np.zeros((8, 8), np.uint8)).save(tmp / "site" / name / "0.png")
    return ["site-data", "folder", tmp / "site", "--shape", "1x8x8", "--out", tmp / "o.npz"]


def _max_bytes_nan(tmp: Path) -> list:
    return ["site-data", "check", _site(tmp), "--max-bytes", "nan"]


SITE_FILES = [
    Case("bzip2-members", _bzip2_member, ("site.npz", "bzip2")),
    Case("duplicate-members", _duplicate_members, ("site.npz", "labels")),
    Case("member-named-with-escapes", _member_named_with_escapes, ("site.npz",)),
    Case("site-file-is-a-fifo", _site_file_is_a_fifo, ("site.npz",)),
    Case("nan-num-classes", _nan_num_classes, ("site.npz", "num_classes")),
    Case("multi-label-medmnist", _multi_label_medmnist, ("ward.npz", "train_labels")),
    Case("medmnist-out-is-its-input", _medmnist_out_is_its_input, ("--out", "ward.npz")),
    Case("folder-out-is-a-folder", _folder_out_is_a_folder, ("out.npz",)),
    Case("class-folder-with-escapes", _class_folder_with_escapes, ("site",)),
    Case("max-bytes-nan", _max_bytes_nan, ("--max-bytes",)),
]


# ---------------------------------------------------------------------------- run options
def _simulate(tmp: Path, run_config: str) -> list:
    return ["simulate", "--output-dir", tmp / "outputs", "--run-config", run_config]


def _forged_test_data(tmp: Path) -> list:
    forged = npy_bytes(header={"descr": "|u1", "fortran_order": False, "shape": (10**8, 8, 8)})
    with zipfile.ZipFile(tmp / "test.npz", "w") as out:
        out.writestr("images.npy", forged + b"\0" * 64)
        out.writestr("labels.npy", npy_bytes(np.zeros(10, np.int64)))
        out.writestr("num_classes.npy", npy_bytes(np.int64(10)))
    return _simulate(tmp, f"test-data='{tmp / 'test.npz'}'")


def _two_checkpoints(tmp: Path) -> list[Path]:
    spec = mlp_spec((1, 8, 8), 3, (16,))
    return [save_checkpoint(tmp / f"m{s}.safetensors", build_model(spec, seed=s)) for s in (0, 1)]


def _fuse(tmp: Path, *extra: str) -> list:
    return ["fuse", *_two_checkpoints(tmp), "--output", tmp / "o.safetensors", *extra]


RUN_OPTIONS = [
    Case("local-epochs-nan", lambda t: _simulate(t, "local-epochs=nan"), ("local-epochs",)),
    Case("seed-10**26", lambda t: _simulate(t, "seed=99999999999999999999999999"), ("seed",)),
    Case(
        "strategy-with-bidi-override",
        lambda t: _simulate(t, 'strategy="fedavg\u202e"'),
        ("fedavg\\u202e",),
    ),
    Case("1000-character-key", lambda t: _simulate(t, "k" * 1000 + "=1"), ("kkkk",)),
    Case(
        "run-config-with-escapes",
        lambda t: _simulate(t, f'output-dir="{ESCAPE}"'),
        ("--run-config", "\\x1b"),
    ),
    Case("forged-test-data", _forged_test_data, ("test.npz", "'images'")),
    Case("target-widths-nan", lambda t: _fuse(t, "--target-widths", "nan"), ("--target-widths",)),
    Case("max-parameters--1", lambda t: _fuse(t, "--max-parameters", "-1"), ("--max-parameters",)),
    Case("megabyte-option", lambda t: _fuse(t, "--option", "x" * (1 << 20) + "=1"), ("xxxx",)),
    Case(
        "gaussian-samples-10**15",
        lambda t: _fuse(t, "--gaussian-samples", str(10**15), "--method", "regmean"),
        ("--gaussian-samples",),
    ),
    Case("fuse-output-is-a-folder", lambda t: _fuse(t, "--output", t), ("is a directory",)),
]


# ---------------------------------------------------------------------------- credentials
def _certs(tmp: Path, *extra: str) -> list:
    return ["certs", "--out", tmp / "pki", *extra]


def _certs_out_is_a_file(tmp: Path) -> list:
    write(tmp / "pki", "not a folder")
    return _certs(tmp, "--host", "superlink.example")


CREDENTIALS = [
    Case(
        "certs-days-10**12",
        lambda t: _certs(t, "--host", "a.example", "--days", str(10**12)),
        ("days",),
    ),
    Case(
        "certs-host-with-escapes", lambda t: _certs(t, "--host", f"a{ESCAPE}b"), ("host", "\\x1b")
    ),
    Case("certs-host-300-letters", lambda t: _certs(t, "--host", "a" * 300 + ".example"), ("aaa",)),
    Case("certs-out-is-a-file", _certs_out_is_a_file, ("pki", "not a folder")),
    Case(
        "keys-out-is-a-file",
        lambda t: ["keys", "site-0", "--out", write(t / "k", "not a folder")],
        ("k:", "not a folder"),
    ),
    Case(
        "certs-out-with-escapes",
        lambda t: ["certs", "--out", t / f"pki{ESCAPE}", "--host", "a.example"],
        succeeds=True,
        writes=tuple(
            f"pki{ESCAPE}" + name
            for name in ("", "/ca.crt", "/ca.key", "/server.pem", "/server.key")
        ),
    ),
    Case("keys-name-escapes-folder", lambda t: ["keys", "../escaped", "--out", t / "k"], ("../",)),
    Case("keys-name-ends-in-newline", lambda t: ["keys", "site\n", "--out", t / "k"], ("site",)),
]


@pytest.mark.parametrize("case", **table(ARRAYS + SITE_FILES + RUN_OPTIONS + CREDENTIALS))
def test_hostile_data_options_and_outputs(tmp_path, case):
    run_case(case, tmp_path)
    assert not (tmp_path / "PWNED").exists()  # nothing was unpickled or evaluated


def test_the_memory_meter_sees_what_a_command_really_holds(tmp_path):
    """The control of every case's memory rule: a command that does hold 1.2 GB (an honest,
    sparse .npy of that size read whole) is measured above the 1 GiB allowed."""
    header = {"descr": "|u1", "fortran_order": False, "shape": (1_200_000_000,)}
    images = write(tmp_path / "images.npy", npy_bytes(header=header))
    with images.open("r+b") as file:
        file.truncate(images.stat().st_size + 1_200_000_000)  # a hole: nothing on disk
    argv = _arrays(tmp_path, images, _labels(tmp_path))
    result = COMMANDS.run([str(a) for a in argv], cwd=tmp_path, timeout=120, address_space=6 << 30)
    assert result.returncode == 2 and "images.npy" in result.stderr, result.stderr
    assert result.peak_bytes - COMMANDS.baseline("site-data") > MEMORY_LIMIT
