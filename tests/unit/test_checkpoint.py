import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from fedfuse.io.checkpoint import CheckpointError, load_checkpoint, read_metadata, save_checkpoint
from fedfuse.models import build_model, mlp_spec
from fedfuse.models.importance import uniform_scores


@pytest.fixture
def model():
    return build_model(mlp_spec((1, 4, 4), 3, (8, 6)), seed=0)


def _write_raw(path, tensors, document):
    save_file(tensors, str(path), metadata={"fedfuse": json.dumps(document)})


def _raw(model):
    tensors = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    document = {"format": "fedfuse-checkpoint/1", "model": model.spec.to_dict()}
    return tensors, document


def test_round_trip_keeps_weights_scores_and_metadata(tmp_path, model):
    scores = uniform_scores(model)
    path = save_checkpoint(
        tmp_path / "m.safetensors", model, scores=scores, metadata={"class_counts": [5, 0, 2]}
    )
    loaded = load_checkpoint(path, require_scores=True)
    assert loaded.model.spec == model.spec
    for (name, a), b in zip(
        model.state_dict().items(), loaded.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    assert all(torch.equal(scores[k], loaded.scores[k]) for k in scores)
    assert loaded.metadata == {"class_counts": [5, 0, 2]}
    assert read_metadata(path)["model"]["arch"] == "mlp"


def test_missing_file_and_garbage_bytes_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        load_checkpoint(tmp_path / "absent.safetensors")
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x80\x04\x95 this is a pickle, not safetensors" * 10)
    with pytest.raises(CheckpointError, match="garbage.safetensors: not a readable safetensors"):
        load_checkpoint(garbage)
    huge_header = tmp_path / "header.safetensors"
    huge_header.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    with pytest.raises(CheckpointError, match="header.safetensors"):
        load_checkpoint(huge_header)


def test_truncated_file_is_rejected(tmp_path, model):
    path = save_checkpoint(tmp_path / "m.safetensors", model)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="m.safetensors"):
        load_checkpoint(path)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda t, d: t.__setitem__("model.levels.2.weight", torch.zeros(6, 7)),
            r"'levels.2.weight' has shape \(6, 7\), architecture expects \(6, 8\)",
        ),
        (
            lambda t, d: t["model.levels.4.bias"].__setitem__(1, float("nan")),
            r"'levels.4.bias' has 1 NaN/Inf",
        ),
        (lambda t, d: t.pop("model.levels.4.bias"), r"missing \['levels.4.bias'\]"),
        (lambda t, d: t.__setitem__("model.extra", torch.zeros(1)), r"unexpected \['extra'\]"),
        (lambda t, d: d.__setitem__("format", "other/9"), "unsupported checkpoint format"),
        (lambda t, d: d["model"].__setitem__("arch", "transformer"), "unknown architecture"),
        (lambda t, d: t.__setitem__("scores.0", torch.ones(5)), r"scores of level 0 have shape"),
        (lambda t, d: t.__setitem__("scores.1", torch.ones(8)), r"extra \[1\]"),
        (lambda t, d: t.__setitem__("weights", torch.ones(8)), "unexpected tensors"),
    ],
    ids=["shape", "nan", "missing", "extra", "format", "arch", "score-len", "score-lvl", "stray"],
)
def test_invalid_contents_name_file_and_tensor(tmp_path, model, mutate, message):
    tensors, document = _raw(model)
    for level, vector in uniform_scores(model).items():
        tensors[f"scores.{level}"] = vector
    mutate(tensors, document)
    path = tmp_path / "bad.safetensors"
    _write_raw(path, tensors, document)
    with pytest.raises(CheckpointError, match=message) as info:
        load_checkpoint(path)
    assert "bad.safetensors" in str(info.value)


def test_missing_scores_when_required(tmp_path, model):
    path = save_checkpoint(tmp_path / "m.safetensors", model)
    assert load_checkpoint(path).scores is None
    with pytest.raises(CheckpointError, match="no importance scores"):
        load_checkpoint(path, require_scores=True)


def test_failed_save_keeps_the_existing_checkpoint(tmp_path, model):
    path = save_checkpoint(tmp_path / "m.safetensors", model, metadata={"round": 1})
    before = path.read_bytes()
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        save_checkpoint(path, model, metadata={"bad": object()})
    broken = build_model(model.spec)
    with pytest.raises(Exception):  # noqa: B017 - any failure inside the writer
        save_checkpoint(path, broken, scores={0: "not a tensor"})  # type: ignore[dict-item]
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


def test_fisher_information_round_trips_only_when_asked_for_and_must_be_finite(tmp_path, model):
    from fedfuse.fusion.statistics.fisher import site_fisher

    fisher = site_fisher(model, torch.randn(16, *model.spec.input_shape), ["diagonal", "kfac"])
    path = save_checkpoint(tmp_path / "site.safetensors", model, fisher=fisher)
    assert load_checkpoint(path).fisher is None
    loaded = load_checkpoint(path, with_fisher=True).fisher
    assert loaded.keys() == fisher.keys()
    assert all(torch.equal(loaded[k], v) for k, v in fisher.items())
    key = next(iter(fisher))
    fisher[key] = torch.full_like(fisher[key], float("nan"))
    bad = save_checkpoint(tmp_path / "bad.safetensors", model, fisher=fisher)
    with pytest.raises(CheckpointError, match=f"bad.safetensors: Fisher entry '{key}'"):
        load_checkpoint(bad, with_fisher=True)
