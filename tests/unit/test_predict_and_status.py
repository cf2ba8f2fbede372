"""``fedfuse predict`` on a checkpoint that records its classes and normalisation, and
``fedfuse status`` on a run's results."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from fedfuse.cli.main import main
from fedfuse.cli.status import EXIT_CODES, describe
from fedfuse.data import load_dataset
from fedfuse.federation.contract import DataContract
from fedfuse.federation.provenance import fused_model_metadata
from fedfuse.io.checkpoint import load_checkpoint, save_checkpoint
from fedfuse.models import build_model
from fedfuse.settings.run import RunSettings

NAMES = tuple(f"digit-{i}" for i in range(10))


@pytest.fixture(scope="module")
def digits():
    test = load_dataset("digits", "test").subset(range(12))
    return test


@pytest.fixture
def checkpoint(tmp_path, digits):
    settings = RunSettings(dataset="digits", mlp_widths="16", fusion_data="/srv/f.npz")
    model = build_model(settings.model_spec_for(digits), seed=0)
    contract = DataContract.of(digits)
    contract = DataContract(contract.input_shape, 10, NAMES, contract.mean, contract.std)
    meta = fused_model_metadata(
        settings, method="kf-linear", options={}, sites=[], contract=contract, files={}
    )
    return save_checkpoint(tmp_path / "fused.safetensors", model, metadata=meta), model


def _expected(model, digits):
    with torch.no_grad():
        return model(digits.inputs()).argmax(dim=1).tolist()


def test_predict_reads_a_folder_in_the_checkpoints_normalisation(tmp_path, checkpoint, digits):
    path, model = checkpoint
    folder = tmp_path / "scans" / "nested"
    folder.mkdir(parents=True)
    for i, image in enumerate(digits.images):
        Image.fromarray(image[0].numpy()).save(folder / f"scan-{i:02d}.png")
    out = tmp_path / "predictions.csv"
    assert main(["predict", str(path), str(tmp_path / "scans"), "--out", str(out)]) == 0
    rows = out.read_text().splitlines()
    assert rows[0] == "image,class,probability" and len(rows) == 13
    assert rows[1].startswith("nested/scan-00.png,digit-")
    predicted = [NAMES.index(row.split(",")[1]) for row in rows[1:]]
    assert predicted == _expected(model, digits)  # the same scale the sites trained in
    assert all(0.0 < float(row.split(",")[2]) <= 1.0 for row in rows[1:])


def test_predict_reads_an_npz_and_prints_csv(tmp_path, checkpoint, digits, capsys):
    path, model = checkpoint
    np.savez(tmp_path / "new.npz", images=digits.images.numpy())
    assert main(["predict", str(path), str(tmp_path / "new.npz")]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[1].startswith("new.npz:0,")
    assert [NAMES.index(r.split(",")[1]) for r in rows[1:]] == _expected(model, digits)


def test_predict_without_a_recorded_normalisation_says_what_to_give(tmp_path, digits, capsys):
    model = build_model(RunSettings(dataset="digits", mlp_widths="16").model_spec_for(digits))
    bare = save_checkpoint(tmp_path / "bare.safetensors", model)
    np.savez(tmp_path / "new.npz", images=digits.images.numpy())
    assert main(["predict", str(bare), str(tmp_path / "new.npz")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "records no normalisation" in err and "--mean" in err
    argv = ["predict", str(bare), str(tmp_path / "new.npz"), "--mean", "0.3", "--std", "0.4"]
    assert main(argv) == 0
    assert capsys.readouterr().out.splitlines()[1].split(",")[1] in [str(i) for i in range(10)]


@pytest.mark.parametrize("std", ["nan", "inf", "0"])
def test_predict_refuses_a_normalisation_that_would_answer_nonsense(tmp_path, digits, capsys, std):
    """A NaN std gave NaN for every image and an Inf std one class for all, with exit 0."""
    model = build_model(RunSettings(dataset="digits", mlp_widths="16").model_spec_for(digits))
    bare = save_checkpoint(tmp_path / "bare.safetensors", model)
    np.savez(tmp_path / "new.npz", images=digits.images.numpy())
    argv = ["predict", str(bare), str(tmp_path / "new.npz"), "--mean", "0.3", "--std", std]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(bare) in err and "finite" in err and "positive" in err


def test_predict_warns_of_images_not_of_the_models_size(tmp_path, checkpoint, digits, caplog):
    path, _ = checkpoint
    folder = tmp_path / "scans"
    folder.mkdir()
    for i, image in enumerate(digits.images[:3]):
        size = 8 if i else 32  # the model's 8x8, and one photo of another size
        Image.fromarray(image[0].numpy()).resize((size, size)).save(folder / f"scan-{i}.png")
    with caplog.at_level("WARNING", logger="fedfuse.deploy.predict"):
        assert main(["predict", str(path), str(folder), "--out", str(tmp_path / "p.csv")]) == 0
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert f"{folder}: 1 of 3 images are not 8x8" in warning and "1 of 32x32" in warning


def test_predictions_csv_quotes_what_a_spreadsheet_would_run():
    from fedfuse.deploy.predict import Predictions

    rows = Predictions(
        ["=cmd|'/c calc'!A1", "a,b.png", "+1.png", "ok.png"], [0] * 4, ["x"] * 4, [1.0] * 4
    )
    assert rows.csv().splitlines()[1:] == [
        "'=cmd|'/c calc'!A1,x,1.000",
        '"a,b.png",x,1.000',
        "'+1.png,x,1.000",
        "ok.png,x,1.000",
    ]


def test_status_names_the_sites_and_exits_zero_only_when_ok(tmp_path, capsys):
    report = {
        "status": "partial",
        "error": "site site-2 refused: its images are 3x32x32",
        "sites": [
            {"site": "site-0", "node_id": 11, "status": "uploaded", "num_examples": 1500},
            {"site": "site-2", "node_id": 13, "status": "refused", "reason": "3x32x32"},
        ],
        "fusions": {"kf-linear": {"status": "ok", "checkpoint": "/r/fused.safetensors"}},
    }
    run = tmp_path / "outputs" / "run1"
    run.mkdir(parents=True)
    (run / "results.json").write_text(json.dumps(report))
    (tmp_path / "outputs" / "latest").symlink_to("run1")
    assert main(["status", str(tmp_path / "outputs")]) == EXIT_CODES["partial"] != 0
    printed = capsys.readouterr().out.splitlines()
    assert printed == describe(report)
    assert printed[0] == "partial"
    assert "site-0" in printed[2] and "node 11" in printed[2] and "uploaded" in printed[2]
    assert "site-2" in printed[3] and "refused: 3x32x32" in printed[3]
    report["status"] = "ok"
    (run / "results.json").write_text(json.dumps(report))
    assert main(["status", str(run)]) == 0
    # listed in partition order, whatever order they answered in
    report["sites"] = [
        {"partition_id": 2, "node_id": 5, "status": "uploaded"},
        {"partition_id": 10, "node_id": 6, "status": "uploaded"},
        {"partition_id": 0, "node_id": 7, "status": "failed"},
    ]
    assert [line.split()[2] for line in describe(report)[2:5]] == ["0", "2", "10"]
    assert main(["status", str(tmp_path / "nowhere")]) == 2
    assert "no results.json" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("report", "named"),
    [
        ({"status": "ok", "sites": [{"site": "a"}]}, "sites[0] has no 'status'"),
        ({"status": "ok", "sites": "all"}, "'sites' is not a list of objects"),
        ({"status": "ok", "fusions": {"kf-linear": 3}}, "'fusions' is not an object"),
    ],
)
def test_status_of_a_results_file_of_another_shape_names_the_file(tmp_path, capsys, report, named):
    """Valid JSON of the wrong shape ended in a bare KeyError: 'status', without the file."""
    path = tmp_path / "results.json"
    path.write_text(json.dumps(report))
    assert main(["status", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and named in err


def test_status_refuses_a_results_file_larger_than_any_run_writes(tmp_path, capsys):
    path = tmp_path / "results.json"
    with path.open("wb") as file:  # sparse: 65 MiB on paper, nothing on disk
        file.truncate(65 << 20)
    assert main(["status", str(path)]) == 2
    assert "65.0 MiB, larger than any run's results" in capsys.readouterr().err


def test_control_characters_from_files_are_shown_not_obeyed(tmp_path, capsys, checkpoint, digits):
    escape = "\x1b]0;pwned\x07\x1b[2J"
    report = {"status": "failed", "error": f"boom{escape}", "sites": []}
    (tmp_path / "results.json").write_text(json.dumps(report))
    assert main(["status", str(tmp_path)]) == 1
    assert capsys.readouterr().out.splitlines()[1] == "  why: boom\\x1b]0;pwned\\x07\\x1b[2J"
    path, model = checkpoint
    names = [f"digit-{i}{escape}" for i in range(10)]
    loaded = load_checkpoint(path)
    save_checkpoint(path, model, metadata={**loaded.metadata, "class_names": names})
    np.savez(tmp_path / "new.npz", images=digits.images[:2].numpy())
    assert main(["predict", str(path), str(tmp_path / "new.npz")]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\\x1b]0;pwned\\x07" in out
