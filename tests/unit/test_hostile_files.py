"""Hostile data files: sizes are checked before they are allocated (issue 24).

Each file is built here and handed to the real command (:func:`fedfuse.cli.main.main`) in a
process of its own limited to a 6 GB address space and 60 s, forked from one that has imported
PyTorch and fedfuse once (:mod:`tests.forked_cli`). Each must fail (exit != 0) in at most two
lines of stderr that name the file and the key or option at fault, printing no control
character, its peak memory under 1 GiB over the command's ``--help`` (:mod:`tests.hostile`,
where issue 50's tables are); a valid file still passes.
The rest checks the library pieces in process: streamed statistics, class names, folders that
cannot be read. Uploads and checkpoints are attacked in ``tests/flower/test_hostile_inputs.py``.
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedfuse.data import DataFormatError, from_image_folder, load_npz_dataset, save_npz_dataset
from fedfuse.data.arrays import channel_statistics, check_npz_dataset
from fedfuse.data.convert import from_medmnist_npz
from fedfuse.data.idx import read_idx
from tests.forked_cli import Outcome
from tests.helpers import patience
from tests.hostile import COMMANDS, MEMORY_LIMIT, control_characters

ADDRESS_SPACE = 6 << 30
TIMEOUT_S = 60
REPO = Path(__file__).resolve().parents[2]
RNG = np.random.default_rng(0)


def _fedfuse(*argv: str | Path) -> Outcome:
    return COMMANDS.run(
        [str(a) for a in argv], cwd=REPO, timeout=patience(TIMEOUT_S), address_space=ADDRESS_SPACE
    )


def _assert_refused(result: Outcome, *named: str | Path) -> None:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode != 0, result.stdout
    assert 1 <= len(lines) <= 2, result.stderr
    assert not control_characters(result.stdout + result.stderr), result.stderr
    cost = result.peak_bytes - COMMANDS.baseline(result.args[1])
    assert cost < MEMORY_LIMIT, f"{cost / 2**20:.0f} MiB over the idle peak"
    for text in named:
        assert str(text) in result.stderr, (text, result.stderr)


# ---------------------------------------------------------------------------- file builders
def _npy(shape: tuple[int, ...], dtype: str = "|u1", data: bytes = b"\0" * 1024) -> bytes:
    """An .npy header declaring ``shape`` followed by ``data`` (however little)."""
    buffer = io.BytesIO()
    header = {"descr": dtype, "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(buffer, header)
    return buffer.getvalue() + data


def _npz(path: Path, compression: int = zipfile.ZIP_DEFLATED, **members) -> Path:
    with zipfile.ZipFile(path, "w", compression) as archive:
        for key, value in members.items():
            if not isinstance(value, bytes):
                buffer = io.BytesIO()
                np.save(buffer, value, allow_pickle=False)
                value = buffer.getvalue()
            archive.writestr(f"{key}.npy", value)
    return path


def _site(**changes) -> dict:
    arrays = {
        "images": RNG.integers(0, 256, (20, 28, 28), dtype=np.uint8),
        "labels": np.arange(20) % 10,
        "num_classes": np.int64(10),
    }
    arrays.update(changes)
    return arrays


def _lie_about_size(path: Path, member: str, size: int) -> Path:
    """Rewrite the central directory's uncompressed size of ``member`` to ``size``."""
    raw = bytearray(path.read_bytes())
    name = member.encode()
    at = raw.find(b"PK\x01\x02")
    while at >= 0:
        name_length = struct.unpack_from("<H", raw, at + 28)[0]
        if raw[at + 46 : at + 46 + name_length] == name:
            struct.pack_into("<I", raw, at + 24, size)
        at = raw.find(b"PK\x01\x02", at + 46)
    path.write_bytes(bytes(raw))
    return path


def _png_bomb(path: Path, side: int = 100_000) -> Path:
    """A few hundred bytes of PNG whose header declares ``side`` x ``side`` grey pixels."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    idat = zlib.compress(b"\0" * (side + 1))  # one row; PIL refuses at the header
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
    path.write_bytes(png)
    return path


def _folder(root: Path, layout: dict[str, int], side: int = 6) -> Path:
    for name, count in layout.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            pixels = RNG.integers(0, 256, (side, side), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i}.png")
    return root


# ---------------------------------------------------------------- hostile files, real command
@pytest.mark.parametrize("num_classes", [10**8, 2**63 - 1])
def test_absurd_num_classes_is_refused_by_name(tmp_path, num_classes):
    path = tmp_path / "site.npz"
    np.savez(path, **_site(num_classes=np.int64(num_classes)))
    _assert_refused(_fedfuse("site-data", "check", path), path, "'num_classes'", "--max-classes")


def test_a_header_claiming_100_million_images_is_refused(tmp_path):
    path = _npz(tmp_path / "forged.npz", **_site(images=_npy((10**8, 28, 28))))
    assert path.stat().st_size < 4096
    _assert_refused(_fedfuse("site-data", "check", path), path, "'images'", "forged")


def test_a_compressed_member_lying_about_its_size_is_refused(tmp_path):
    claim = 5_000_000 * 28 * 28  # 3.7 GiB: under the 4 GiB zip field and the default limit
    path = _npz(tmp_path / "liar.npz", **_site(images=_npy((5_000_000, 28, 28))))
    _lie_about_size(path, "images.npy", claim + 128)
    _assert_refused(_fedfuse("site-data", "check", path), path, "'images'", "forged size")


def test_a_forged_npy_array_is_refused_by_site_data_arrays(tmp_path):
    images = tmp_path / "images.npy"
    images.write_bytes(_npy((10**8, 28, 28)))
    np.save(tmp_path / "labels.npy", np.zeros(10**8 // 10**6, np.int64))
    result = _fedfuse(
        "site-data", "arrays", images, tmp_path / "labels.npy", "--num-classes", "10",
        "--out", tmp_path / "out.npz",
    )  # fmt: skip
    _assert_refused(result, images, "forged")


def test_a_forged_fusion_set_is_refused_by_fuse(tmp_path):
    path = _npz(tmp_path / "fusion.npz", **_site(images=_npy((10**8, 28, 28))))
    result = _fedfuse("fuse", "a.safetensors", "b.safetensors", "--fusion-data", path)
    _assert_refused(result, path, "'images'")


def test_an_array_over_max_bytes_names_the_option(tmp_path):
    path = tmp_path / "site.npz"
    np.savez_compressed(path, **_site())
    result = _fedfuse("site-data", "check", path, "--max-bytes", "8K")
    _assert_refused(result, path, "'images'", "--max-bytes")


def test_a_huge_target_shape_is_refused_before_allocation(tmp_path):
    root = _folder(tmp_path / "site", {"a": 3, "b": 3})
    result = _fedfuse(
        "site-data", "folder", root, "--shape", "3x60000x60000", "--out", tmp_path / "o.npz"
    )
    _assert_refused(result, "--shape", "--max-side")


def test_a_png_decompression_bomb_is_named(tmp_path):
    root = _folder(tmp_path / "site", {"a": 2, "b": 2})
    bomb = _png_bomb(root / "b" / "scan.png")
    result = _fedfuse("site-data", "folder", root, "--shape", "1x8x8", "--out", tmp_path / "o.npz")
    _assert_refused(result, bomb, "decompression bomb")


def test_a_link_out_of_the_folder_is_refused(tmp_path):
    root = _folder(tmp_path / "site", {"a": 2, "b": 2})
    outside = _folder(tmp_path / "elsewhere", {"secret": 1})
    link = root / "a" / "more"
    link.symlink_to(outside / "secret", target_is_directory=True)
    result = _fedfuse("site-data", "folder", root, "--shape", "1x8x8", "--out", tmp_path / "o.npz")
    _assert_refused(result, link, "--follow-links")
    assert not (tmp_path / "o.npz").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a chmod 000 folder (see the next test)")
def test_an_unreadable_class_folder_is_an_error(tmp_path):
    root = _folder(tmp_path / "site", {"a": 2, "b": 2})
    (root / "b").chmod(0)
    try:
        result = _fedfuse(
            "site-data", "folder", root, "--shape", "1x8x8", "--out", tmp_path / "o.npz"
        )
    finally:
        (root / "b").chmod(0o755)
    _assert_refused(result, root / "b", "cannot read")


def test_a_valid_folder_with_a_class_file_round_trips_its_names(tmp_path):
    root = _folder(tmp_path / "site", {"benign": 2, "malignant": 1})
    (tmp_path / "classes.txt").write_text("benign\nmalignant\nnormal\n")
    out, classes = tmp_path / "site.npz", f"@{tmp_path / 'classes.txt'}"
    result = _fedfuse(
        "site-data", "folder", root, "--shape", "1x8x8", "--classes", classes, "--out", out
    )
    assert result.returncode == 0, result.stderr
    assert "0 (benign): 2, 1 (malignant): 1, 2 (normal): 0" in result.stdout
    assert load_npz_dataset(out).class_names == ("benign", "malignant", "normal")


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory) -> list[Path]:
    from fedfuse.io.checkpoint import save_checkpoint
    from fedfuse.models import build_model, mlp_spec

    root = tmp_path_factory.mktemp("checkpoints")
    spec = mlp_spec((1, 8, 8), 10, (16, 16, 16))
    return [save_checkpoint(root / f"m{s}.safetensors", build_model(spec, seed=s)) for s in (0, 1)]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--option", "n_init=1000000000000"], ["n_init", "1 to 1000"]),
        (["--target-widths", "1000000,1000000,1000000"], ["--target-widths", "1000000"]),
    ],
)
def test_absurd_fusion_options_are_refused_before_fusing(two_checkpoints, argv, named):
    _assert_refused(_fedfuse("fuse", *two_checkpoints, "--method", "kf-linear", *argv), *named)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["simulate", "--timeout", "-5"], ["--timeout", "-5"]),
        (["simulate", "--run-config", "local-epochs=-1"], ["local-epochs", "[0, 10000]"]),
        (["simulate", "--run-config", "fused-widths='1000000,1000000,1000000'"], ["fused-widths"]),
        (["compare", "nonexistent=1"], ["nonexistent"]),
        (["compare", "method=nosuch"], ["nosuch", "kf-linear"]),
    ],
)
def test_bad_run_options_are_one_line_before_anything_starts(tmp_path, argv, named):
    where = ["--output-dir", tmp_path] if argv[0] == "simulate" else [f"output_dir={tmp_path}"]
    _assert_refused(_fedfuse(*argv, *where), *named)
    assert not any(tmp_path.iterdir())  # nothing started, nothing written


# ------------------------------------------------------------------------- library, in process
def test_statistics_stream_in_chunks_with_the_same_result(tmp_path):
    images = RNG.integers(0, 256, (50, 3, 7, 5), dtype=np.uint8)
    path = tmp_path / "site.npz"
    np.savez_compressed(path, images=images, labels=np.zeros(50, np.int64), num_classes=1)
    whole = check_npz_dataset(path)
    small = check_npz_dataset(path, chunk_bytes=100)  # one image (105 bytes) per chunk
    assert whole.measured and (small.mean, small.std) == (whole.mean, whole.std)
    reference = (images / 255.0).std(axis=(0, 2, 3))
    np.testing.assert_allclose(whole.std, reference, rtol=1e-12)
    assert load_npz_dataset(path).mean == whole.mean
    last = images.transpose(0, 2, 3, 1)  # channels-last chunks give the same numbers
    assert channel_statistics([last[:7], last[7:]], channel_axis=3) == (whole.mean, whole.std)


def test_class_names_are_stored_validated_and_kept_by_subsets(tmp_path):
    data, _ = from_image_folder(
        _folder(tmp_path / "site", {"cat": 2, "dog": 1}), (1, 4, 4), classes=["cat", "dog", "eel"]
    )
    assert data.class_names == ("cat", "dog", "eel")
    assert data.subset([0]).class_names == data.class_names
    save_npz_dataset(tmp_path / "named.npz", data)
    assert load_npz_dataset(tmp_path / "named.npz").class_names == data.class_names
    old = tmp_path / "old.npz"
    np.savez(old, **_site())
    assert load_npz_dataset(old).class_names is None
    for names, message in [
        (np.array(["a", "b"]), r"'class_names' holds 2 names, num_classes is 10"),
        (np.array([list("abcdefghij")]), r"'class_names' must be a 1-D array of text"),
        (np.arange(10), r"'class_names' must be a 1-D array of text"),
        (np.array(["a"] * 10), r"'class_names' repeats \['a'\]"),
        (np.array([*"abcdefghi", "x\ny"]), r"'class_names'\[9\] .* printable"),
        (np.array([*"abcdefghi", "x" * 300]), r"names of up to 300 characters"),
    ]:
        np.savez(tmp_path / "bad.npz", **_site(class_names=names))
        with pytest.raises(DataFormatError, match=message):
            load_npz_dataset(tmp_path / "bad.npz")
    np.savez(tmp_path / "pickled.npz", **_site(class_names=np.array(list("abcdefghij"), object)))
    with pytest.raises(DataFormatError, match=r"'class_names'.*pickles are refused"):
        load_npz_dataset(tmp_path / "pickled.npz")


def test_num_classes_must_exceed_the_labels_and_stay_under_max_classes(tmp_path):
    path = tmp_path / "site.npz"
    np.savez(path, **_site(num_classes=np.int64(5)))
    with pytest.raises(DataFormatError, match=r"labels span 0..9, num_classes is 5"):
        load_npz_dataset(path)
    np.savez(path, **_site(num_classes=np.int64(50)))
    assert load_npz_dataset(path).num_classes == 50
    with pytest.raises(DataFormatError, match=r"'num_classes' is 50, above the limit of 20"):
        load_npz_dataset(path, max_classes=20)


def test_unreadable_folders_are_errors_even_for_root(tmp_path, monkeypatch):
    root = _folder(tmp_path / "site", {"a": 2, "b": 2})
    real_scandir = os.scandir

    def scandir(path):
        if Path(path) == root / "b":
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    with pytest.raises(DataFormatError, match=r"site/b: cannot read the folder"):
        from_image_folder(root, (1, 4, 4))


def test_links_inside_the_folder_are_followed_and_outside_only_on_request(tmp_path):
    root = _folder(tmp_path / "site", {"a": 2, "b": 1})
    (root / "b" / "again.png").symlink_to(root / "a" / "0.png")
    (root / "b" / "loop").symlink_to(root / "b", target_is_directory=True)
    assert len(from_image_folder(root, (1, 4, 4))[0]) == 4
    outside = _folder(tmp_path / "elsewhere", {"c": 2})
    (root / "c").symlink_to(outside / "c", target_is_directory=True)
    with pytest.raises(DataFormatError, match=r"site/c: symbolic link leads out"):
        from_image_folder(root, (1, 4, 4))
    assert len(from_image_folder(root, (1, 4, 4), follow_links=True)[0]) == 6


def test_bombs_below_pils_hard_limit_are_refused_too(tmp_path, monkeypatch):
    root = _folder(tmp_path / "site", {"a": 1}, side=30)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 600)  # 900 pixels: PIL only warns
    with pytest.raises(DataFormatError, match=r"0.png: refused as a possible decompression bomb"):
        from_image_folder(root, (1, 4, 4))


def test_medmnist_and_idx_readers_check_sizes_first(tmp_path):
    medmnist = _npz(
        tmp_path / "ward.npz",
        train_images=_npy((10**8, 28, 28)),
        train_labels=np.zeros((10**8 // 10**6, 1), np.int64),
    )
    with pytest.raises(DataFormatError, match=r"ward.npz: key 'train_images'.*forged"):
        from_medmnist_npz(medmnist, num_classes=2)
    import gzip

    bomb = tmp_path / "train-images-idx3-ubyte.gz"
    header = b"\x00\x00\x08\x03" + struct.pack(">III", 10**8, 28, 28)
    bomb.write_bytes(gzip.compress(header + b"\0" * (1 << 20)))
    with pytest.raises(DataFormatError, match=r"idx dims \(100000000, 28, 28\) claim"):
        read_idx(bomb)


def test_a_classes_file_that_never_ends_is_refused_at_the_limit(tmp_path):
    """`--classes @/dev/zero` read until a bare MemoryError at 3.2 GB."""
    root = _folder(tmp_path / "site", {"a": 1, "b": 1})
    result = _fedfuse(
        "site-data", "folder", root, "--shape", "1x8x8", "--classes", "@/dev/zero",
        "--out", tmp_path / "o.npz",
    )  # fmt: skip
    _assert_refused(result, "/dev/zero", "larger than")
    assert not (tmp_path / "o.npz").exists()


def test_the_forked_commands_run_under_their_limits():
    """The guard of this file: a command that outgrows its address space or its time ends its own
    process (MemoryError or SIGALRM), so an allocation a command failed to refuse fails here."""
    small = COMMANDS.run(["methods"], cwd=REPO, timeout=60, address_space=1 << 30)
    assert small.returncode not in (0, -14), small.stderr  # out of memory, not out of time
    slow = COMMANDS.run(
        # two VGG11s fused by kf-linear and hf-linear on 400 samples: many seconds anywhere
        ["speed", "--methods", "kf-linear,hf-linear"],
        cwd=REPO,
        timeout=1,
        address_space=ADDRESS_SPACE,
    )
    assert slow.returncode == -14  # SIGALRM
    assert (
        COMMANDS.run(["methods"], cwd=REPO, timeout=60, address_space=ADDRESS_SPACE).returncode == 0
    )
