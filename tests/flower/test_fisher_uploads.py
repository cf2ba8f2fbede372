"""Fisher information over Flower, with fedfuse's real ClientApp handlers and ServerApp: the
sites upload the Fisher kinds the run's methods read, once and with their models, and nothing
when no method reads it; a site whose policy keeps it refuses before training; a broken entry
is named with its site."""

from __future__ import annotations

import pytest
import torch

from fedfuse.clients.records import FISHER_KEY, SEND_FISHER_KEY
from tests.fakes import hospital_files, run_hospitals

pytestmark = pytest.mark.usefixtures("task_identity")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The server's fusion and test files and three digits sites."""
    return hospital_files(tmp_path_factory.mktemp("fisher"), 3)


def _train_messages(grid):
    return [m for m in grid.pushed if m.metadata.message_type == "train"]


def test_sites_upload_the_fisher_kinds_the_run_reads_and_every_method_fuses(files, tmp_path):
    grid, report, _ = run_hospitals(
        files,
        tmp_path,
        3,
        methods="fisher-merging,fedfisher-kfac,fedavg",
        init="shared",
        local_epochs=30,
    )
    asked = {
        str(m.content.config_records["config"][SEND_FISHER_KEY]) for m in _train_messages(grid)
    }
    assert asked == {"diagonal,kfac"}
    for name in ("fisher-merging", "fedfisher-kfac", "fedavg"):
        assert report["fusions"][name]["status"] == "ok", report["fusions"][name]
    parts = [client["upload_parts"] for client in report["clients"]]
    assert all(p["fisher"] > p["weights"] for p in parts)  # diagonal (= weights) plus K-FAC
    evaluation = report["accuracy"]
    fused = {n: evaluation["fused"][n]["accuracy"] for n in ("fisher-merging", "fedfisher-kfac")}
    base = [b["accuracy"] for b in evaluation["base"]]
    assert min(fused.values()) > min(base) > 0.3, (fused, base)


def test_no_fisher_is_sent_when_no_method_reads_it(files, tmp_path):
    grid, report, _ = run_hospitals(files, tmp_path, 3, methods="fedavg", init="shared")
    assert {
        str(m.content.config_records["config"][SEND_FISHER_KEY]) for m in _train_messages(grid)
    } == {""}
    assert all(c["upload_parts"]["fisher"] == 0 for c in report["clients"])


def test_a_site_whose_policy_keeps_its_fisher_refuses_before_training(files, tmp_path):
    policies = {1: {"allow-statistics": "grams,rounds"}}
    grid, report, _ = run_hospitals(
        files, tmp_path, 3, policies, methods="fedfisher-diag", init="shared"
    )
    sites = {site["site"]: site for site in report["sites"]}
    assert sites["hospital-1"]["status"] == "refused"
    assert "need ['fisher'], not in allow-statistics" in sites["hospital-1"]["reason"]
    assert 101 not in grid.trained()
    assert report["fusions"]["fedfisher-diag"]["status"] == "ok"


def test_a_site_sending_a_broken_fisher_entry_is_named_and_left_out(files, tmp_path):
    from fedfuse.clients.client_app import train_and_upload

    def poisoned(msg, context):
        reply = train_and_upload(msg, context)
        if context.node_config.get("site-name") == "hospital-2":
            record = reply.content.array_records[FISHER_KEY]
            state = record.to_torch_state_dict()
            key = next(k for k in state if k.startswith("kfac."))
            state[key] = torch.full_like(state[key], float("nan"))
            from flwr.app import ArrayRecord

            reply.content[FISHER_KEY] = ArrayRecord(state)
        return reply

    grid, report, _ = run_hospitals(
        files, tmp_path, 3, methods="fedfisher-kfac", init="shared", handler=poisoned
    )
    rejected = " ".join(report["rejected"])
    assert "hospital-2" in rejected and "Fisher entry 'kfac." in rejected and "NaN/Inf" in rejected
    assert report["fusions"]["fedfisher-kfac"]["status"] == "ok"


def test_a_data_free_server_fuses_on_a_fusion_set_made_from_the_uploads(files, tmp_path):
    """fusion-source=synthetic with no fusion-data file: methods that need a fusion set fuse on
    DENSE's generated samples, and the generation is timed in results.json."""
    grid, report, _ = run_hospitals(
        files,
        tmp_path,
        3,
        methods="kf-linear,dense,fedavg",
        fusion_source="synthetic",
        fusion_data="",
        init="shared",
        local_epochs=30,
        fusion_options="dense.epochs=10",
    )
    assert report["data_files"].get("fusion-data") in (None, "", {})
    assert report["phases"]["synthetic_fusion_set"] > 0
    for name in ("kf-linear", "dense", "fedavg"):
        assert report["fusions"][name]["status"] == "ok", report["fusions"][name]
    accuracy = report["accuracy"]
    assert accuracy["fused"]["kf-linear"]["accuracy"] > 0.3
