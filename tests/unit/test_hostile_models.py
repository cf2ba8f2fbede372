"""Hostile checkpoints, images and results files through ``fedfuse inspect``, ``fuse``,
``predict`` and ``status`` (issue 50): one error line naming the file, bounded memory, nothing
overwritten, nothing printed raw. The rules each case is held to are in :mod:`tests.hostile`;
data files, run options and output paths are in ``test_hostile_inputs_data.py``."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from fedfuse.io.checkpoint import save_checkpoint
from fedfuse.models import build_model, mlp_spec
from tests.hostile import COMMANDS, Case, npy_bytes, run_case, safetensors_bytes, table, write

SPEC = mlp_spec((1, 8, 8), 3, (16,))
META = {
    "normalisation": {"mean": [0.5], "std": [0.25]},
    "class_names": ["cat", "dog", "eel"],
}
ESCAPE = "\x1b]0;pwned\x07\x1b[2J"


def _document(**changes) -> str:
    document = {"format": "fedfuse-checkpoint/1", "model": SPEC.to_dict(), **META, **changes}
    return json.dumps(document)


def _model(folder: Path, name: str = "m.safetensors", seed: int = 0, **meta) -> Path:
    model = build_model(SPEC, seed=seed)
    return save_checkpoint(folder / name, model, metadata={**META, **meta})


def _raw(folder: Path, tensors: dict, name: str = "m.safetensors", **changes) -> Path:
    path = folder / name
    save_file(tensors, str(path), metadata={"fedfuse": _document(**changes)})
    return path


def _state(**replace) -> dict:
    state = {f"model.{k}": v.clone() for k, v in build_model(SPEC, seed=0).state_dict().items()}
    state.update(replace)
    return state


def _png(path: Path, side: int = 8) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((side, side), 128, np.uint8)).save(path)
    return path


def _chunk(kind: bytes, data: bytes) -> bytes:
    body = kind + data
    return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))


def _predict(folder: Path, images: str | Path, *extra: str | Path) -> list:
    return ["predict", _model(folder), images, *extra]


# ---------------------------------------------------------------------------- checkpoints
def _header_longer_than_file(tmp: Path) -> list:
    return ["inspect", write(tmp / "m.safetensors", safetensors_bytes({}, length=10**6))]


def _header_length_max(tmp: Path) -> list:
    return ["inspect", write(tmp / "m.safetensors", safetensors_bytes({}, length=2**64 - 1))]


def _tensor_beyond_file(tmp: Path) -> list:
    header = {
        "__metadata__": {"fedfuse": _document()},
        "model.levels.0.1.weight": {
            "dtype": "F32",
            "shape": [100_000, 100_000],
            "data_offsets": [0, 4 * 10**10],
        },
    }
    return ["inspect", write(tmp / "m.safetensors", safetensors_bytes(header, b"\0" * 64))]


def _shape_disagrees_with_offsets(tmp: Path) -> list:
    header = {
        "__metadata__": {"fedfuse": _document()},
        "model.levels.0.1.weight": {"dtype": "F32", "shape": [16, 64], "data_offsets": [0, 4]},
    }
    return ["inspect", write(tmp / "m.safetensors", safetensors_bytes(header, b"\0" * 8))]


def _duplicate_tensor_names(tmp: Path) -> list:
    meta = json.dumps({"fedfuse": _document()})
    entry = '{"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}'
    bias = f'"model.levels.2.bias": {entry}'
    text = f'{{"__metadata__": {meta}, {bias}, {bias}}}'
    return ["inspect", write(tmp / "m.safetensors", safetensors_bytes(text, b"\0" * 12))]


def _integer_weights(tmp: Path) -> list:
    weight = torch.ones(16, 64, dtype=torch.int64)
    return ["inspect", _raw(tmp, _state(**{"model.levels.0.1.weight": weight}))]


def _infinite_weight_predict(tmp: Path) -> list:
    bias = torch.tensor([0.0, float("inf"), 0.0])
    path = _raw(tmp, _state(**{"model.levels.2.bias": bias}))
    return ["predict", path, _png(tmp / "scan.png")]


def _negative_input_side(tmp: Path) -> list:
    spec = {**SPEC.to_dict(), "input_shape": [1, -8, 8]}
    return ["inspect", _raw(tmp, _state(), model=spec)]


def _metadata_container_bomb(tmp: Path) -> list:
    """21 MB of ``{},`` in the header's JSON: 7 million dicts (0.5 GB, 20 s) if parsed."""
    bomb = "[" + "{}," * 7_000_000 + "{}]"
    text = (
        f'{{"format": "fedfuse-checkpoint/1", "model": {json.dumps(SPEC.to_dict())}, "x": {bomb}}}'
    )
    path = tmp / "m.safetensors"
    save_file(_state(), str(path), metadata={"fedfuse": text})
    return ["inspect", path]


def _class_names_not_a_list(tmp: Path) -> list:
    return ["predict", _model(tmp, class_names=12345), _png(tmp / "scan.png")]


def _normalisation_not_an_object(tmp: Path) -> list:
    return ["predict", _model(tmp, normalisation="0.5/0.25"), _png(tmp / "scan.png")]


def _checkpoint_links_to_dev_zero(tmp: Path) -> list:
    (tmp / "m.safetensors").symlink_to("/dev/zero")
    return ["inspect", tmp / "m.safetensors"]


def _checkpoint_links_to_itself(tmp: Path) -> list:
    (tmp / "m.safetensors").symlink_to(tmp / "m.safetensors")
    return ["inspect", tmp / "m.safetensors"]


def _zero_byte_checkpoint(tmp: Path) -> list:
    return ["inspect", write(tmp / "m.safetensors", b"")]


def _checkpoint_is_a_folder(tmp: Path) -> list:
    (tmp / "m.safetensors").mkdir()
    return ["fuse", tmp / "m.safetensors", _model(tmp, "b.safetensors"), "--output", tmp / "o"]


def _escape_sequences_in_the_path(tmp: Path) -> list:
    return ["inspect", write(tmp / f"m{ESCAPE}\nx.safetensors", b"garbage")]


def _nan_scores_in_fuse(tmp: Path) -> list:
    model = build_model(SPEC, seed=0)
    scores = {0: torch.full((16,), float("nan")), 2: torch.ones(3)}
    good = _model(tmp, "b.safetensors", seed=1)
    bad = save_checkpoint(tmp / "a.safetensors", model, scores=scores, metadata=META)
    return ["fuse", bad, good, "--method", "fedavg", "--output", tmp / "o.safetensors"]


CHECKPOINTS = [
    Case("header-longer-than-file", _header_longer_than_file, ("m.safetensors",)),
    Case("header-length-2**64-1", _header_length_max, ("m.safetensors",)),
    Case("tensor-40-GB-beyond-the-file", _tensor_beyond_file, ("m.safetensors",)),
    Case("tensor-shape-disagrees-with-offsets", _shape_disagrees_with_offsets, ("m.safetensors",)),
    Case("duplicate-tensor-names", _duplicate_tensor_names, ("m.safetensors",)),
    Case("integer-weights", _integer_weights, ("m.safetensors", "levels.0.1.weight")),
    Case("inf-bias-at-predict", _infinite_weight_predict, ("m.safetensors", "levels.2.bias")),
    Case("negative-input-side", _negative_input_side, ("m.safetensors",)),
    Case("metadata-json-container-bomb", _metadata_container_bomb, ("m.safetensors",)),
    Case("class-names-not-a-list", _class_names_not_a_list, ("m.safetensors", "class_names")),
    Case(
        "normalisation-not-an-object",
        _normalisation_not_an_object,
        ("m.safetensors", "normalisation"),
    ),
    Case("checkpoint-links-to-dev-zero", _checkpoint_links_to_dev_zero, ("m.safetensors",)),
    Case("checkpoint-links-to-itself", _checkpoint_links_to_itself, ("m.safetensors",)),
    Case("zero-byte-checkpoint", _zero_byte_checkpoint, ("m.safetensors",)),
    Case("checkpoint-is-a-folder", _checkpoint_is_a_folder, ("m.safetensors",)),
    Case("escape-and-newline-in-path", _escape_sequences_in_the_path, ("x.safetensors",)),
    Case("nan-scores-at-fuse", _nan_scores_in_fuse, ("a.safetensors", "level 0")),
]


# ---------------------------------------------------------------------------- images to predict
def _zero_byte_png(tmp: Path) -> list:
    return _predict(tmp, write(tmp / "scan.png", b""))


def _truncated_png(tmp: Path) -> list:
    data = _png(tmp / "full.png", side=64).read_bytes()
    (tmp / "full.png").unlink()
    write(tmp / "scans" / "ok.png", _png(tmp / "ok.png").read_bytes())
    (tmp / "ok.png").unlink()
    write(tmp / "scans" / "cut.png", data[: len(data) // 2])
    return _predict(tmp, tmp / "scans")


def _text_named_png(tmp: Path) -> list:
    return _predict(tmp, write(tmp / "scan.png", "patient: Jane Doe\n" * 20))


def _gif_bomb(tmp: Path) -> list:
    """A 30-byte GIF whose screen and frame declare 65535 x 65535 pixels."""
    header = b"GIF89a" + struct.pack("<HH", 65535, 65535) + b"\x00\x00\x00"
    frame = b"\x2c" + struct.pack("<HHHH", 0, 0, 65535, 65535) + b"\x00"
    data = header + frame + b"\x02\x02\x44\x01\x00\x3b"
    return _predict(tmp, write(tmp / "scan.gif", data))


def _png_text_chunk_bomb(tmp: Path) -> list:
    """A valid 8x8 PNG with a zTXt chunk that inflates to 64 MB (PIL stops at 1 MB)."""
    ihdr = struct.pack(">IIBBBBB", 8, 8, 8, 0, 0, 0, 0)
    idat = zlib.compress(b"\0" * (9 * 8))
    ztxt = b"Comment\0\0" + zlib.compress(b"A" * (64 << 20), 1)
    data = b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"zTXt", ztxt)
    data += _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")
    return _predict(tmp, write(tmp / "scan.png", data))


def _folder_named_like_an_image(tmp: Path) -> list:
    _png(tmp / "scans" / "a.png")
    (tmp / "scans" / "b.png").mkdir()
    return [*_predict(tmp, tmp / "scans"), "--out", tmp / "p.csv"]


def _image_links_to_dev_zero(tmp: Path) -> list:
    _png(tmp / "scans" / "a.png")
    (tmp / "scans" / "z.png").symlink_to("/dev/zero")
    return _predict(tmp, tmp / "scans")


def _image_links_to_itself(tmp: Path) -> list:
    _png(tmp / "scans" / "a.png")
    (tmp / "scans" / "loop.png").symlink_to(tmp / "scans" / "loop.png")
    return _predict(tmp, tmp / "scans")


def _five_channel_npz(tmp: Path) -> list:
    np.savez(tmp / "new.npz", images=np.zeros((2, 5, 8, 8), np.uint8))
    return _predict(tmp, tmp / "new.npz")


def _float_images_npz(tmp: Path) -> list:
    np.savez(tmp / "new.npz", images=np.full((2, 1, 8, 8), np.nan))
    return _predict(tmp, tmp / "new.npz")


def _npz_images_forged(tmp: Path) -> list:
    forged = npy_bytes(header={"descr": "|u1", "fortran_order": False, "shape": (10**9, 8, 8)})
    import zipfile

    with zipfile.ZipFile(tmp / "new.npz", "w") as archive:
        archive.writestr("images.npy", forged + b"\0" * 64)
    return _predict(tmp, tmp / "new.npz")


def _out_is_the_checkpoint(tmp: Path) -> list:
    model = _model(tmp)
    return ["predict", model, _png(tmp / "scan.png"), "--out", model]


def _out_is_the_image(tmp: Path) -> list:
    scan = _png(tmp / "scan.png")
    return [*_predict(tmp, scan), "--out", scan]


def _out_is_a_folder(tmp: Path) -> list:
    (tmp / "results").mkdir()
    return [*_predict(tmp, _png(tmp / "scan.png")), "--out", tmp / "results"]


def _escape_in_image_name(tmp: Path) -> list:
    return _predict(tmp, _png(tmp / f"=HYPERLINK{ESCAPE}.png"))


def _tiny_images_for_a_large_model(tmp: Path) -> list:
    """A 1 kB .npz of 256 1x1 images for a model of 1x768x768 inputs: 0.15 GB resized, then
    0.6 GB per float copy of one 256-image batch (1.4 GB in all before batches were capped)."""
    spec = mlp_spec((1, 768, 768), 3, (4,))
    model = save_checkpoint(tmp / "big.safetensors", build_model(spec, seed=0), metadata=META)
    np.savez_compressed(tmp / "new.npz", images=np.zeros((256, 1, 1), np.uint8))
    return ["predict", model, tmp / "new.npz", "--out", tmp / "p.csv"]


IMAGES = [
    Case("zero-byte-png", _zero_byte_png, ("scan.png",)),
    Case("truncated-png-in-folder", _truncated_png, ("cut.png",)),
    Case("text-file-named-png", _text_named_png, ("scan.png",)),
    Case("gif-65535-squared", _gif_bomb, ("scan.gif", "decompression bomb")),
    Case("png-ztxt-chunk-bomb", _png_text_chunk_bomb, ("scan.png", "MAX_TEXT_CHUNK")),
    Case("folder-named-b.png", _folder_named_like_an_image, succeeds=True, writes=("p.csv",)),
    Case("image-links-to-dev-zero", _image_links_to_dev_zero, ("z.png",)),
    Case("image-links-to-itself", _image_links_to_itself, ("loop.png",)),
    Case("five-channel-npz", _five_channel_npz, ("new.npz",)),
    Case("float-nan-images-npz", _float_images_npz, ("new.npz", "images")),
    Case("npz-images-forged-64-GB", _npz_images_forged, ("new.npz", "images")),
    Case("out-is-the-checkpoint", _out_is_the_checkpoint, ("--out", "m.safetensors")),
    Case("out-is-the-image", _out_is_the_image, ("--out", "scan.png")),
    Case("out-is-a-folder", _out_is_a_folder, ("results",)),
    Case(
        "escape-sequence-in-image-name",
        _escape_in_image_name,
        succeeds=True,
        printed=("'=HYPERLINK\\x1b]0;pwned\\x07\\x1b[2J.png,",),  # a formula quoted, escaped
    ),
    Case(
        "1x1-images-for-768x768-model",
        _tiny_images_for_a_large_model,
        succeeds=True,
        writes=("p.csv",),
    ),
    Case(
        "out-with-escapes",
        lambda t: [*_predict(t, _png(t / "scan.png")), "--out", t / f"p{ESCAPE}.csv"],
        succeeds=True,
        writes=(f"p{ESCAPE}.csv",),
        printed=("wrote", "\\x1b]0;pwned"),
    ),
]


# ---------------------------------------------------------------------------- results files
def _results(tmp: Path, text: str | bytes) -> list:
    return ["status", write(tmp / "run" / "results.json", text)]


def _results_container_bomb(tmp: Path) -> list:
    """60 MB of ``{},``: 20 million dicts, 1.4 GB and a minute to parse (refused unread)."""
    return _results(tmp, '{"status": "ok", "sites": [' + "{}," * 20_000_000 + "{}]}")


def _results_just_under_the_limit(tmp: Path) -> list:
    """15 MiB of ``{},``, under the limit: parsed (5 million dicts) within the memory bound."""
    return _results(tmp, '{"status": "ok", "sites": [' + "{}," * 5_200_000 + "{}]}")


def _results_nested_deeply(tmp: Path) -> list:
    return _results(tmp, '{"status": "ok", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")


def _results_links_to_dev_zero(tmp: Path) -> list:
    (tmp / "run").mkdir()
    (tmp / "run" / "results.json").symlink_to("/dev/zero")
    return ["status", tmp / "run"]


def _results_huge_integer(tmp: Path) -> list:
    return _results(tmp, '{"status": "ok", "sites": [], "n": ' + "9" * 100_000 + "}")


def _results_not_utf8(tmp: Path) -> list:
    return _results(tmp, b'{"status": "ok", "error": "\xff\xfe"}')


def _results_site_not_an_object(tmp: Path) -> list:
    return _results(tmp, json.dumps({"status": "failed", "sites": [{"status": "uploaded"}, 7]}))


def _results_latest_loops(tmp: Path) -> list:
    (tmp / "outputs").mkdir()
    (tmp / "outputs" / "latest").symlink_to(tmp / "outputs" / "latest")
    return ["status", tmp / "outputs"]


RESULTS = [
    Case("results-container-bomb", _results_container_bomb, ("results.json",)),
    Case("results-15-MiB-of-objects", _results_just_under_the_limit, ("results.json", "sites[0]")),
    Case("results-nested-100000-deep", _results_nested_deeply, ("results.json", "nested")),
    Case("results-links-to-dev-zero", _results_links_to_dev_zero, ("run",)),
    Case("results-100000-digit-number", _results_huge_integer, ("results.json",)),
    Case("results-not-utf8", _results_not_utf8, ("results.json",)),
    Case("results-site-not-an-object", _results_site_not_an_object, ("results.json", "sites")),
    Case("results-latest-links-to-itself", _results_latest_loops, ("outputs",)),
]


@pytest.mark.parametrize("case", **table(CHECKPOINTS + IMAGES + RESULTS))
def test_hostile_models_images_and_results(tmp_path, case):
    run_case(case, tmp_path)


def test_the_idle_baseline_is_the_servers_own_size():
    """The memory each case is measured from: a command that does nothing holds about what the
    server holds (PyTorch imported), far more than 100 MB and far less than the 1 GiB allowed."""
    idle = COMMANDS.baseline("inspect")
    assert 100 << 20 < idle < 2 << 30
