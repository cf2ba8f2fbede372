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
from fedfuse.io.checkpoint import save_checkpoint
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
    assert main(["status", str(tmp_path / "nowhere")]) == 2
    assert "no results.json" in capsys.readouterr().err
