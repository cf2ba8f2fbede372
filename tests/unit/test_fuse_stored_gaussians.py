"""``fedfuse fuse`` completes (or makes) its fusion set from the class Gaussians stored beside a
run's uploads: two sites' files written by the upload store a run uses, fused offline."""

import json
import logging
import shutil

import pytest
import torch

from fedfuse.cli.main import main
from fedfuse.data import load_dataset
from fedfuse.federation.stored_gaussians import draw_stored_gaussians
from fedfuse.federation.uploads import ClientUpload, UploadStore
from fedfuse.fusion.statistics.class_gaussians import GaussianFusionSet, fit_class_gaussians
from fedfuse.io.checkpoint import load_checkpoint
from fedfuse.models import build_model, mlp_spec
from fedfuse.models.importance import importance_scores
from fedfuse.training.loop import TrainConfig, train

SPEC = mlp_spec((1, 8, 8), 10, (24,))


def _upload(digits, pid: int, *, gaussians: bool) -> ClientUpload:
    """Site ``pid`` of two: an MLP trained on its half of digits, as a run's site sends it."""
    half = digits.subset(torch.arange(pid, len(digits), 2))
    model = build_model(SPEC, seed=pid)
    losses = train(
        model, half, TrainConfig(epochs=2, batch_size=128, lr=1e-2), seed=pid, progress=False
    )
    inputs, labels = half.inputs(), half.labels
    scores = importance_scores(model, inputs[:32], labels[:32], method="conductance", n_steps=2)
    return ClientUpload(
        model=model,
        scores=scores,
        num_examples=len(half),
        class_counts=torch.bincount(labels, minlength=10).tolist(),
        partition_id=pid,
        num_partitions=2,
        score_method="conductance",
        init="independent",
        train_loss=losses[-1],
        class_gaussians=fit_class_gaussians(inputs, labels, 10, rank=4) if gaussians else None,
    )


@pytest.fixture
def logged(caplog):
    """The draws' log records (the CLI's ``fedfuse`` logger does not propagate to the root once
    the CLI configured logging; before that a record reaches caplog twice: read them once)."""
    logger = logging.getLogger("fedfuse.federation.stored_gaussians")
    logger.addHandler(caplog.handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    yield caplog
    logger.setLevel(level)
    logger.removeHandler(caplog.handler)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two saved runs' upload folders: both sites with Gaussians, and site 1 without."""
    digits = load_dataset("digits", "train")
    folders = {}
    for name, with_second in (("both", True), ("one", False)):
        folder = tmp_path_factory.mktemp(name) / "clients"
        store = UploadStore(folder, expected_spec=SPEC)
        for pid in (0, 1):
            store.add(_upload(digits, pid, gaussians=pid == 0 or with_second), source=f"site {pid}")
        folders[name] = folder
    return folders


def test_fuse_without_fusion_data_draws_rows_from_every_sites_gaussians(
    runs, tmp_path, capsys, logged
):
    output = tmp_path / "fused.safetensors"
    argv = ["fuse", str(runs["both"].parent), "--method", "kf-linear", "--output", str(output)]
    assert main(argv) == 0
    fused = load_checkpoint(output)
    assert fused.model.spec == SPEC
    files = [str(runs["both"] / f"client_{pid}.safetensors") for pid in (0, 1)]
    summary = fused.metadata["fusion_gaussians"]
    assert summary["rows"] == {files[0]: 400, files[1]: 400}  # the default: 400 rows a site
    assert summary["sites_without_gaussians"] == [] and fused.metadata["fusion_examples"] == 800
    out = capsys.readouterr().out
    assert f"800 rows from class Gaussians (seed 0; {files[0]}: 400, {files[1]}: 400)" in out
    drawn = list(dict.fromkeys(r.getMessage() for r in logged.records if "drew" in r.getMessage()))
    assert len(drawn) == 2 and all("drew 400 fusion-set rows" in line for line in drawn)


def test_site_files_with_a_site_lacking_gaussians_name_it_and_fuse_from_the_rest(
    runs, tmp_path, capsys, logged
):
    files = [str(runs["one"] / f"client_{pid}.safetensors") for pid in (0, 1)]
    output = tmp_path / "fused.safetensors"
    argv = ["fuse", *files, "--method", "kf-linear", "--output", str(output)]
    argv += ["--gaussian-samples", "60", "--gaussian-seed", "5"]
    assert main(argv) == 0
    warnings = [r.getMessage() for r in logged.records if r.levelno == logging.WARNING]
    assert any("1 of 2 sites carry no class Gaussians" in w and files[1] in w for w in warnings)
    summary = load_checkpoint(output).metadata["fusion_gaussians"]
    assert summary == {
        "samples_per_site": 60,
        "seed": 5,
        "rows": {files[0]: 60},
        "sites_without_gaussians": [files[1]],
    }
    assert f"none from {files[1]} (no class Gaussians stored)" in capsys.readouterr().out


def test_without_gaussian_rows_a_method_needing_a_fusion_set_gets_the_clear_error(
    runs, tmp_path, capsys
):
    files = [str(runs["both"] / f"client_{pid}.safetensors") for pid in (0, 1)]
    output = tmp_path / "fused.safetensors"
    argv = ["fuse", *files, "--method", "kf-linear", "--output", str(output)]
    assert main([*argv, "--gaussian-samples", "0"]) == 2
    err = capsys.readouterr().err
    assert "needs fusion data (a fusion set), none given" in err and not output.exists()


def test_draws_match_the_online_completion_and_no_gaussians_is_refused_when_asked(runs):
    files = [runs["both"] / f"client_{pid}.safetensors" for pid in (0, 1)]
    rows = draw_stored_gaussians(files, SPEC, 30, seed=7)
    assert rows is not None and len(rows) == 60
    empty = torch.empty(0, *SPEC.input_shape)
    stored = UploadStore.open(runs["both"]).class_gaussians()
    online, labels = GaussianFusionSet(30, seed=7).complete(empty, torch.empty(0).long(), stored)
    assert torch.equal(rows.inputs, online) and torch.equal(rows.labels, labels)
    without = [runs["one"] / "client_1.safetensors"]
    assert draw_stored_gaussians(without, SPEC, 30) is None
    with pytest.raises(ValueError, match="none of the 1 inputs carries class Gaussians"):
        draw_stored_gaussians(without, SPEC, 30, required=True)


def test_a_run_directory_completes_the_given_fusion_set_with_the_runs_own_draws(runs, tmp_path):
    clients = tmp_path / "run" / "clients"
    clients.mkdir(parents=True)
    for pid in (0, 1):
        name = f"client_{pid}.safetensors"
        shutil.copyfile(runs["both"] / name, clients / name)
    settings = {"fusion-gaussian-samples": 25, "seed": 4}
    contract = {"input_shape": [1, 8, 8], "num_classes": 10, "mean": [0.2], "std": [0.3]}
    contract["class_names"] = [f"digit {i}" for i in range(10)]
    report = {"settings": settings, "data_contract": contract, "run_id": 17}
    (clients.parent / "results.json").write_text(json.dumps(report))
    output = tmp_path / "fused.safetensors"
    argv = ["fuse", str(clients.parent), "--method", "kf-linear", "--output", str(output)]
    assert main([*argv, "--fusion-data", "digits:train:50:0"]) == 0
    meta = load_checkpoint(output).metadata
    assert meta["fusion_examples"] == 50 + 2 * 25
    assert meta["fusion_gaussians"]["seed"] == 4 + 3  # the online run's (RunSettings)
    assert list(meta["fusion_gaussians"]["rows"].values()) == [25, 25]
    # it stands alone as the run's own fused models do: fedfuse predict reads these
    assert meta["class_names"][3] == "digit 3" and meta["normalisation"]["std"] == [0.3]
    assert len(meta["sites"]) == 2 and meta["strategy"] == "kf-linear"
