"""Hostile or broken input wherever a site's bytes enter the server: each gets a named error.

Checkpoint files, Flower replies and saved runs are all attacked the same ways: a forged spec
that claims a huge model, float64 values that overflow float32, absurd or negative counts,
duplicate or out-of-range partition ids, Gram matrices that no data could produce, deeply
nested JSON. None may crash, allocate what the spec claims, or overwrite another site's file.
"""

from __future__ import annotations

import json

import psutil
import pytest
import torch
from flwr.app import ArrayRecord, MetricRecord
from safetensors.torch import save_file

from fedfuse.cli.main import main
from fedfuse.clients.records import GRAMS_KEY, METRICS_KEY, SITE_KEY, WEIGHTS_KEY, pack_upload
from fedfuse.federation.uploads import ClientUpload, UploadStore
from fedfuse.fusion.methods.regression.regmean import level_grams
from fedfuse.io.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from fedfuse.io.validation import ContributionError
from fedfuse.models import build_model, mlp_spec
from fedfuse.models.importance import uniform_scores
from fedfuse.strategies.replies import decode_reply
from tests.fakes import reply_from

SPEC = mlp_spec((1, 4, 4), 3, (8, 6))


pytestmark = pytest.mark.usefixtures("task_identity")


def _upload(partition_id=0, num_partitions=2, seed=0, grams=False):
    model = build_model(SPEC, seed=seed)
    data = torch.randn(40, 1, 4, 4)
    return ClientUpload(
        model=model,
        scores=uniform_scores(model),
        num_examples=40,
        class_counts=[20, 15, 5],
        partition_id=partition_id,
        num_partitions=num_partitions,
        score_method="uniform",
        init="independent",
        train_loss=0.5,
        grams=level_grams(model, data) if grams else None,
    )


def _decode(content):
    return decode_reply(reply_from(content, 7), SPEC, require_scores=True)


def _raw_checkpoint(path, tensors, document):
    save_file(tensors, str(path), metadata={"fedfuse": json.dumps(document)})
    return path


# ---------------------------------------------------------------------------- weights and specs
def test_float64_weights_that_overflow_float32_are_rejected(tmp_path):
    content = pack_upload(_upload())
    state = {
        k: v.double() for k, v in content.array_records[WEIGHTS_KEY].to_torch_state_dict().items()
    }
    state["levels.2.weight"][0, 0] = 1e300  # finite in float64, inf in float32
    content[WEIGHTS_KEY] = ArrayRecord(state)
    with pytest.raises(
        ContributionError, match=r"client 0 \(node 7\): tensor 'levels.2.weight'.*float32"
    ):
        _decode(content)

    model = build_model(SPEC, seed=0)
    tensors = {f"model.{k}": v.double() for k, v in model.state_dict().items()}
    tensors["model.levels.0.1.bias"][0] = -1e39
    document = {"format": "fedfuse-checkpoint/1", "model": SPEC.to_dict()}
    path = _raw_checkpoint(tmp_path / "f64.safetensors", tensors, document)
    with pytest.raises(CheckpointError, match="f64.safetensors: tensor 'levels.0.1.bias'"):
        load_checkpoint(path)


@pytest.mark.parametrize("width", [10**9, 1 << 19])
def test_a_forged_huge_spec_allocates_nothing(tmp_path, width):
    """A 1 KB file whose spec claims a huge layer: refused before any parameter is built."""
    forged = mlp_spec((1, 28, 28), 10, (width,)).to_dict()
    tensors = {"model.levels.0.1.weight": torch.zeros(2, 2)}
    path = _raw_checkpoint(
        tmp_path / "forged.safetensors",
        tensors,
        {"format": "fedfuse-checkpoint/1", "model": forged},
    )
    assert path.stat().st_size < 2048
    before = psutil.Process().memory_info().rss
    with pytest.raises(CheckpointError, match="forged.safetensors"):
        load_checkpoint(path)
    # width 2^19 would be a 1.6 GB float32 layer (784 x 2^19) if it were built
    assert psutil.Process().memory_info().rss - before < 200 * 2**20

    content = pack_upload(_upload())
    content[SITE_KEY]["model-spec"] = json.dumps(forged)
    before = psutil.Process().memory_info().rss
    with pytest.raises(ContributionError):
        # no expected spec to compare
        decode_reply(reply_from(content, 7), None, require_scores=True)
    assert psutil.Process().memory_info().rss - before < 200 * 2**20


def test_deeply_nested_json_is_an_error_not_a_crash(tmp_path, capsys):
    nested = "[" * 100_000 + "]" * 100_000
    path = tmp_path / "nested.safetensors"
    save_file({"model.x": torch.zeros(1)}, str(path), metadata={"fedfuse": nested})
    with pytest.raises(CheckpointError, match="nested too deeply"):
        load_checkpoint(path)
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nested too deeply" in err

    content = pack_upload(_upload())
    content[SITE_KEY]["model-spec"] = nested
    with pytest.raises(ContributionError, match="nested too deeply"):
        _decode(content)


# ---------------------------------------------------------------------------- site facts
@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("class-counts", [25, 20, -5], "negative class counts"),
        ("class-counts", [20, 15], "2 class counts for a 3-class model"),
        ("class-counts", [20, 15, 4], "sum to 39, not num-examples 40"),
        ("partition-id", -1, "must be >= 0"),
        ("partition-id", 2, r"partition-id 2 is outside 0..1"),
        ("partition-id", "zero", "partition-id must be an integer"),
        ("num-partitions", 10**30, "implausibly large"),
    ],
)
def test_bad_site_facts_are_named(field, value, message):
    content = pack_upload(_upload())
    content[SITE_KEY][field] = value
    with pytest.raises(ContributionError, match=message):
        _decode(content)


@pytest.mark.parametrize("count", [float("inf"), 1e300, 0, -3, 40.5])
def test_absurd_sample_counts_are_rejected(count):
    content = pack_upload(_upload())
    content[METRICS_KEY] = MetricRecord({"num-examples": count, "train-loss": 0.1})
    with pytest.raises(ContributionError, match="num-examples"):
        _decode(content)


def test_huge_num_examples_in_checkpoint_metadata_is_one_cli_line(tmp_path, capsys):
    paths = []
    for seed in (0, 1):
        metadata = {"num_examples": 10**400, "class_counts": [1, 1, 1]}
        path = tmp_path / f"m{seed}.safetensors"
        paths.append(save_checkpoint(path, build_model(SPEC, seed=seed), metadata=metadata))
    assert (
        main(["fuse", *map(str, paths), "--method", "fedavg", "--output", str(tmp_path / "o")]) == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "num_examples" in err and "implausibly large" in err


# ---------------------------------------------------------------------------- Gram matrices
def test_gram_matrices_must_be_symmetric_and_positive_semidefinite():
    upload = _upload(grams=True)
    assert _decode(pack_upload(upload)).grams is not None
    for mutate, message in (
        (lambda g: g.__setitem__((0, 1), g[0, 1] + 1.0), "not symmetric"),
        (lambda g: g.sub_(torch.eye(len(g)) * 2 * float(g.diagonal().max())), "not positive"),
        (lambda g: g.__setitem__((0, 0), float("nan")), "NaN/Inf"),
    ):
        content = pack_upload(upload)
        grams = content.array_records[GRAMS_KEY].to_torch_state_dict()
        mutate(grams["2"])
        content[GRAMS_KEY] = ArrayRecord(grams)
        with pytest.raises(
            ContributionError,
            match=f"Gram matrix of level 2 .*{message}|Gram matrix of level 2 has {message}",
        ):
            _decode(content)


# ---------------------------------------------------------------------------- the upload store
def test_a_duplicate_partition_id_never_overwrites_the_first_upload(tmp_path):
    store = UploadStore(tmp_path, expected_spec=SPEC)
    first = store.add(_upload(partition_id=1, seed=0), source="client 1 (node 3)")
    before = first.path.read_bytes()
    with pytest.raises(
        ContributionError,
        match=r"client 1 \(node 9\): partition-id 1 was already uploaded by client 1 \(node 3\)",
    ):
        store.add(_upload(partition_id=1, seed=5), source="client 1 (node 9)")
    assert first.path.read_bytes() == before and len(store) == 1


def test_store_round_trip_is_lazy_and_validated(tmp_path):
    store = UploadStore(tmp_path, expected_spec=SPEC)
    uploads = [_upload(partition_id=k, num_partitions=3, seed=k, grams=True) for k in (2, 0)]
    for upload in uploads:
        store.add(upload, source=f"client {upload.partition_id}")
    reopened = UploadStore.open(tmp_path)
    assert [e.partition_id for e in reopened.entries] == [0, 2]
    models = reopened.models()
    assert len(models) == 2
    for model, upload in zip(models, sorted(uploads, key=lambda u: u.partition_id), strict=True):
        for a, b in zip(
            model.state_dict().values(), upload.model.state_dict().values(), strict=True
        ):
            assert torch.equal(a, b)
    grams = reopened.grams()
    assert grams is not None and torch.equal(grams[1][0], uploads[0].grams[0])

    # a site file altered on disk (a NaN weight) is named when the run is opened again
    path = reopened.entries[0].path
    header = json.loads(_header(path))
    tensors = dict(load_checkpoint(path).model.state_dict())
    tensors["levels.2.bias"] = tensors["levels.2.bias"].clone()
    tensors["levels.2.bias"][0] = float("nan")
    _raw_checkpoint(path, {f"model.{k}": v for k, v in tensors.items()}, header)
    with pytest.raises(CheckpointError, match="client_0.safetensors: tensor 'levels.2.bias'"):
        UploadStore.open(tmp_path)


def _header(path):
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return handle.metadata()["fedfuse"]


def test_strategy_names_a_site_with_another_num_partitions_and_keeps_the_rest(tmp_path):
    from fedfuse.fusion import make_fusion_method
    from fedfuse.strategies.one_shot import OneShotFusion

    strategy = OneShotFusion(
        [make_fusion_method("vanilla")], store=UploadStore(tmp_path, expected_spec=SPEC)
    )
    strategy._sent = [1, 2, 3]
    replies = [
        reply_from(pack_upload(_upload(partition_id=0, num_partitions=3)), 1),
        reply_from(pack_upload(_upload(partition_id=1, num_partitions=3, seed=1)), 2),
        reply_from(pack_upload(_upload(partition_id=2, num_partitions=5, seed=2)), 3),
    ]
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert arrays is not None and metrics["num-uploads"] == 2
    assert strategy.num_partitions == 3
    assert strategy.problems == [
        "client 2 (node 3): reports num-partitions 5, 2 other site(s) report 3"
    ]
    assert (tmp_path / "client_2.rejected").is_file()  # kept for inspection, not fused


# ---------------------------------------------------------------------------- run config and CLI
class _Run:
    run_id = 42


class _Grid:
    run = _Run()


class _Context:
    def __init__(self, run_config):
        self.run_config = run_config


def test_an_unvalidated_strategy_never_becomes_a_path(tmp_path):
    from fedfuse.strategies import server_app

    out = tmp_path / "outputs"
    config = {"strategy": "../../escaped,kf-linear", "output-dir": str(out)}
    with pytest.raises(ValueError, match="unknown fusion method '../../escaped'"):
        server_app.main(_Grid(), _Context(config))
    runs = [p for p in out.iterdir() if p.name != "latest"]
    assert len(runs) == 1 and runs[0].name.endswith("-invalid-config-run42")
    assert not (tmp_path / "escaped").exists() and not any(tmp_path.glob("*escaped*"))
    report = json.loads((runs[0] / "results.json").read_text())
    assert report["status"] == "failed" and "../../escaped" in report["error"]


@pytest.mark.parametrize(
    ("option", "needle"),
    [
        ("ridge=abc", "option ridge='abc' must be float or None"),
        ("device=bogus", "device 'bogus' is not a device"),
        ("n_init=1e400", "must be a finite number"),
        ("seed=" + "[" * 5000 + "]" * 5000, "nested too deeply"),
    ],
)
def test_bad_options_are_one_cli_line(tmp_path, capsys, option, needle):
    paths = [
        save_checkpoint(tmp_path / f"m{s}.safetensors", build_model(SPEC, seed=s)) for s in (0, 1)
    ]
    argv = ["fuse", *map(str, paths), "--method", "kf-linear", "--option", option]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err


def test_a_npy_file_named_npz_is_one_cli_line(tmp_path, capsys):
    import numpy as np

    fake = tmp_path / "fusion.npz"
    with open(fake, "wb") as handle:
        np.save(handle, np.zeros((4, 4, 4), dtype=np.uint8))
    paths = [
        save_checkpoint(tmp_path / f"m{s}.safetensors", build_model(SPEC, seed=s)) for s in (0, 1)
    ]
    assert main(["fuse", *map(str, paths), "--fusion-data", str(fake)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fusion.npz" in err, err
