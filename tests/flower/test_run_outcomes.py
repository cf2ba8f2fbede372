"""What a deployment's run reports and keeps: sites by name, refusals before training, the
server's own files checked first, fused models saved before anything can fail, stopped runs.

The sites are fedfuse's real ClientApp handlers on real site files, called in-process by a
stand-in Grid (:class:`tests.fakes.SitesGrid`); the ServerApp is the real one.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict

from fedfuse.data import ImageDataset, load_dataset, save_npz_dataset
from fedfuse.federation.contract import DataContract, SiteRefusal
from fedfuse.federation.scenario import Scenario
from fedfuse.io.checkpoint import load_checkpoint
from fedfuse.strategies import FusionAborted, one_shot_run, server_app
from tests.fakes import SitesGrid
from tests.helpers import deployment_settings, quick_site_settings

pytestmark = pytest.mark.usefixtures("task_identity")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The server's fusion and test files, two digits sites and a site with RGB images."""
    root = tmp_path_factory.mktemp("deployment")
    settings = quick_site_settings()
    train = load_dataset("digits", "train")
    paths = {
        "fusion": save_npz_dataset(root / "fusion.npz", train.subset(range(60))),
        "test": save_npz_dataset(
            root / "test.npz", load_dataset("digits", "test").subset(range(200))
        ),
    }
    scenario = Scenario(settings, 2)
    for pid in range(2):
        paths[f"site-{pid}"] = save_npz_dataset(root / f"site-{pid}.npz", scenario.client_data(pid))
    rng = np.random.default_rng(0)
    rgb = ImageDataset(
        images=torch.from_numpy(rng.integers(0, 256, (40, 3, 8, 8), dtype=np.uint8)),
        labels=torch.arange(40) % 10,
        num_classes=10,
        mean=(0.5, 0.5, 0.5),
        std=(0.3, 0.3, 0.3),
        name="rgb",
    )
    paths["rgb"] = save_npz_dataset(root / "rgb.npz", rgb)
    return paths


def _deployment(files, tmp_path, site_files=("site-0", "site-1"), **changes):
    settings = deployment_settings(files, tmp_path, **{"methods": "kf-linear,fedavg", **changes})
    sites = {
        100 + i: {"partition-id": i, "site-name": f"hospital-{i}", "data-path": str(files[name])}
        for i, name in enumerate(site_files)
    }
    run_config = settings.to_config()
    return SitesGrid(sites, run_config), Context(7, 0, {}, RecordDict(), run_config)


def _report(tmp_path):
    return json.loads((tmp_path / "outputs" / "latest" / "results.json").read_text())


def test_a_site_with_other_images_refuses_before_training_and_the_run_is_partial(
    files, tmp_path, trained
):
    grid, context = _deployment(files, tmp_path, site_files=("site-0", "site-1", "rgb"))
    server_app.main(grid, context)
    report = _report(tmp_path)
    assert report["status"] == "partial"
    # the check before training left the RGB site out: it was never asked to train
    assert grid.trained() == [100, 101] and sorted(trained) == ["hospital-0", "hospital-1"]
    by_name = {site["site"]: site for site in report["sites"]}
    assert by_name["hospital-0"]["status"] == by_name["hospital-1"]["status"] == "uploaded"
    assert by_name["hospital-0"]["node_id"] == 100 and by_name["hospital-1"]["node_id"] == 101
    refused = by_name["hospital-2"]
    assert refused["status"] == "refused" and refused["node_id"] == 102
    assert "its images are 3x8x8, the federation's are 1x8x8" in refused["reason"]
    assert "hospital-2" in report["error"] and "refused" in report["error"]
    assert [c["site_name"] for c in report["clients"]] == ["hospital-0", "hospital-1"]
    assert report["fusions"]["kf-linear"]["status"] == "ok"


def test_too_few_sites_with_the_right_data_end_the_run_before_any_site_trains(
    files, tmp_path, trained
):
    grid, context = _deployment(files, tmp_path, site_files=("site-0", "rgb", "rgb"))
    with pytest.raises(FusionAborted, match="2 site.s. cannot take part and 1 can, 2 needed"):
        server_app.main(grid, context)
    assert grid.trained() == [] and trained == []
    report = _report(tmp_path)
    assert report["status"] == "failed"
    # every site is listed: the two that refused, and the one that was ready but never asked
    assert [(s["site"], s["status"]) for s in report["sites"]] == [
        ("hospital-1", "refused"),
        ("hospital-2", "refused"),
        ("hospital-0", "ready"),
    ]
    assert report["sites"][2]["node_id"] == 100 and report["sites"][2]["partition_id"] == 0


def test_a_site_whose_data_changed_after_the_check_still_refuses_to_train(
    files, tmp_path, monkeypatch
):
    """The train message carries the contract too: a site checks again before it trains."""
    from fedfuse.clients import client_app

    grid, context = _deployment(files, tmp_path, site_files=("site-0", "site-1", "site-1"))
    check = client_app.check_contract

    def swap_after_check(msg, site_context):
        reply = check(msg, site_context)
        if site_context.node_id == 102:  # its file is replaced between the check and training
            site_context.node_config["data-path"] = str(files["rgb"])
        return reply

    monkeypatch.setattr(client_app, "check_contract", swap_after_check)
    server_app.main(grid, context)
    report = _report(tmp_path)
    refused = next(s for s in report["sites"] if s["status"] == "refused")
    assert refused["node_id"] == 102 and "3x8x8" in refused["reason"]
    assert 102 in grid.trained()  # it was asked to train, and refused in its reply


def test_the_contract_names_every_mismatch():
    digits = load_dataset("digits", "train").subset(range(20))
    contract = DataContract.of(digits)
    assert contract.mismatches(digits) == []
    other = DataContract((1, 8, 8), 12, mean=(0.1,), std=(0.2,))
    problems = other.mismatches(digits)
    assert problems[0] == "it declares 10 classes, the federation has 12"
    assert problems[1].startswith("its normalisation is mean [0.3054]")
    named = DataContract((1, 8, 8), 10, class_names=tuple("abcdefghij"))
    assert named.mismatches(digits) == []  # a file without names is not refused for it
    with pytest.raises(SiteRefusal, match="site x: it declares 10 classes"):
        other.check(digits, source="site x")
    round_trip = DataContract.from_dict(named.to_dict(), source="msg")
    assert round_trip.class_names == named.class_names
    with pytest.raises(ValueError, match="msg: 2 class names for 10 classes"):
        DataContract.from_dict({**named.to_dict(), "class_names": ["a", "b"]}, source="msg")
    with pytest.raises(ValueError, match="implausible data contract"):
        DataContract.from_dict({"input_shape": [1, 8, 8], "num_classes": 10**12}, source="m")


def test_a_missing_server_file_is_found_before_any_site_is_asked(files, tmp_path, trained):
    grid, context = _deployment(files, tmp_path, test_data=str(tmp_path / "no-test.npz"))
    with pytest.raises(ValueError, match="run config test-data='.*no-test.npz': no such file"):
        server_app.main(grid, context)
    assert grid.pushed == [] and trained == []
    report = _report(tmp_path)
    assert report["status"] == "failed" and report["failed_phase"] == "preflight"
    assert "no such file on the server" in report["error"]


def test_a_failure_after_fusion_keeps_every_fused_model(files, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("the evaluation crashed")

    monkeypatch.setattr(one_shot_run, "evaluate_fusion", broken)
    grid, context = _deployment(files, tmp_path)
    with pytest.raises(RuntimeError, match="the evaluation crashed"):
        server_app.main(grid, context)
    report = _report(tmp_path)
    assert report["status"] == "failed" and report["failed_phase"] == "evaluate"
    run = tmp_path / "outputs" / "latest"
    assert sorted(p.name for p in run.glob("fused*.safetensors")) == [
        "fused-fedavg.safetensors",
        "fused.safetensors",
    ]
    assert report["fusions"]["kf-linear"]["checkpoint"] == str(run.resolve() / "fused.safetensors")
    assert len(report["saved_checkpoints"]) == 2

    # each checkpoint stands alone: what made it, and what using it needs
    meta = load_checkpoint(run / "fused.safetensors").metadata
    assert meta["strategy"] == "kf-linear" and "ridge" in meta["method_options"]
    assert [(s["name"], s["num_examples"]) for s in meta["sites"]] == [
        ("hospital-0", report["clients"][0]["num_examples"]),
        ("hospital-1", report["clients"][1]["num_examples"]),
    ]
    assert sum(meta["sites"][0]["class_counts"]) == meta["sites"][0]["num_examples"]
    digest = hashlib.sha256(files["test"].read_bytes()).hexdigest()
    assert meta["data_files"]["test-data"]["sha256"] == digest
    assert meta["input_shape"] == [1, 8, 8]
    assert meta["normalisation"]["mean"] == pytest.approx([0.3054], abs=1e-3)
    assert "dataset" not in meta["settings"] and "fusion-samples" not in meta["settings"]
    assert meta["fedfuse_version"] and meta["flower_version"].startswith("1.")


def test_a_stopped_run_reads_stopped_and_keeps_what_it_saved(files, tmp_path, monkeypatch):
    def stop(*args, **kwargs):
        raise KeyboardInterrupt  # what `flwr stop` and Ctrl-C raise in a ServerApp

    monkeypatch.setattr(one_shot_run, "evaluate_fusion", stop)
    grid, context = _deployment(files, tmp_path)
    with pytest.raises(KeyboardInterrupt):
        server_app.main(grid, context)
    report = _report(tmp_path)
    assert report["status"] == "stopped" and "'evaluate'" in report["error"]
    assert (tmp_path / "outputs" / "latest" / "fused.safetensors").is_file()


def test_a_site_that_fails_is_named(files, tmp_path):
    grid, context = _deployment(files, tmp_path, site_files=("site-0", "site-1"))
    grid.contexts[101].node_config["data-path"] = str(tmp_path / "gone.npz")
    with pytest.raises(FusionAborted, match="1 site.s. cannot take part"):
        server_app.main(grid, context)
    report = _report(tmp_path)
    failed = next(s for s in report["sites"] if s["status"] == "failed")
    assert failed["site"] == "hospital-1" and failed["node_id"] == 101
    assert "gone.npz" in failed["reason"]


def test_a_long_method_list_names_the_run_directory_within_a_file_names_limit(tmp_path):
    """Every method named in the run directory was 12,001 names too long for the file system."""
    names = [f"method-{i}" for i in range(12_001)]
    directory = server_app._run_directory(tmp_path, server_app._label(names), 7)
    assert directory.name.endswith("-method-0+12000-more-run7") and len(directory.name) < 255
    assert server_app._label(["kf-linear", "fedavg"]) == "kf-linear+fedavg"


def _crash_on(node, exception):
    """A train handler that raises ``exception`` at ``node`` and trains at the others."""
    from fedfuse.clients.client_app import train_and_upload

    def handler(msg, context):
        if context.node_id == node:
            raise exception
        return train_and_upload(msg, context)

    return handler


def test_a_site_that_dies_without_a_word_is_named_from_its_data_check(files, tmp_path):
    """A SuperNode killed mid-training answers with Flower's error only (no name, no
    partition): the server names it as the site said it was in the data check."""
    grid, context = _deployment(files, tmp_path, site_files=("site-0", "site-1", "site-1"))
    grid.handler = _crash_on(101, RuntimeError("the SuperNode went away"))
    server_app.main(grid, context)
    report = _report(tmp_path)
    assert report["status"] == "partial"
    failed = next(s for s in report["sites"] if s["status"] == "failed")
    assert (failed["site"], failed["partition_id"], failed["node_id"]) == ("hospital-1", 1, 101)
    assert any(
        r.startswith("hospital-1 (client 1, node 101): the client failed")
        for r in report["rejected"]
    )


def test_a_run_stopped_while_the_sites_train_lists_every_site(files, tmp_path):
    """`flwr stop` during training: the sites asked to train are listed by name as pending."""
    grid, context = _deployment(files, tmp_path)
    grid.handler = _crash_on(100, KeyboardInterrupt())  # the stop reaches the server there
    with pytest.raises(KeyboardInterrupt):
        server_app.main(grid, context)
    report = _report(tmp_path)
    assert report["status"] == "stopped"
    assert [(s["site"], s["node_id"], s["status"]) for s in report["sites"]] == [
        ("hospital-0", 100, "pending"),
        ("hospital-1", 101, "pending"),
    ]
