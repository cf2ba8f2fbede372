"""End to end: a real `flwr run` simulation (local SuperLink, Ray, 2 SuperNodes), Fashion-MNIST."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from fedfuse.clients.secure import FAULT_VARIABLE
from fedfuse.data import load_dataset
from fedfuse.federation.flower_state import superlink_pids
from fedfuse.io.checkpoint import load_checkpoint
from fedfuse.training.loop import evaluate
from tests.helpers import accuracy_tables, assert_same_table, flower_test_env, patience

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
#: how long the faulty app's healthy sites may take to reply (its hanging site sleeps 600 s)
REPLY_TIMEOUT = round(min(patience(45), 400))
SMALL = "train-samples=1500 local-epochs=1 score-samples=64 score-steps=4 test-samples=2000"
#: the hidden width of the MLP that every fusion method fuses in one simulation
WIDTH = 128
#: every fusion method, each fusing the same uploads of one simulation (kf-linear is primary)
STRATEGIES = [
    "kf-linear",
    "fedavg",
    "vanilla",
    "hf-linear",
    "hf-gradient",
    "kf-gradient",
    "otfusion",
    "git-rebasin",
    "fedma",
    "regmean",
    "kf-sites",
    "hf-sites",
    "fs-merge",
    "kd",
    "linear-probe",
]
FAST_OPTIONS = " ".join(
    ["n_init=2", "otfusion.use_scores=true", "git-rebasin.repair=true", "fs-merge.epochs=20"]
    + [f"{m}.epochs=2" for m in ("hf-gradient", "kf-gradient", "kd", "linear-probe")]
    + [f"{m}.last_epochs=2" for m in ("hf-gradient", "kf-gradient")]
)


def _simulate(
    tmp_path: Path, run_config: str, *, app: Path = REPO, num_clients: int = 2, grace: float = 20
) -> tuple[subprocess.CompletedProcess, Path, str]:
    env, control_port = flower_test_env(tmp_path)
    out = tmp_path / "outputs"
    command = [
        sys.executable,
        "-m",
        "fedfuse.cli.main",
        "simulate",
        "--app",
        str(app),
        "--num-clients",
        str(num_clients),
        "--grace",
        str(grace),
        "--output-dir",
        str(out),
        "--timeout",
        str(round(patience(600))),
        "--run-config",
        run_config,
    ]
    try:
        completed = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=patience(660), cwd=tmp_path
        )
    finally:
        leftover = superlink_pids(control_port)
        for pid in leftover:  # never leak a SuperLink, even if the CLI was killed
            os.kill(pid, 9)
    assert not leftover, "fedfuse simulate left its local SuperLink running"
    # Ray's last workers may still be exiting when the command returns: wait for them, bounded
    deadline = time.monotonic() + patience(30)
    while stray := [
        p.info["pid"] for p in psutil.process_iter(["pid", "environ"]) if _ours(p, env)
    ]:
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not stray, f"fedfuse simulate left processes of its run behind: {stray}"
    return completed, out, control_port


def _ours(process: psutil.Process, env: dict[str, str]) -> bool:
    """Whether ``process`` belongs to the simulation that ``env`` started (its FLWR_HOME)."""
    try:
        environ = process.info["environ"] or {}
    except psutil.Error:
        return False
    return process.pid != os.getpid() and environ.get("FLWR_HOME") == env["FLWR_HOME"]


def test_simulation_trains_uploads_fuses_and_reports(tmp_path):
    completed, out, _ = _simulate(
        tmp_path,
        f"{SMALL} mlp-widths='{WIDTH},{WIDTH},{WIDTH}' strategy='{','.join(STRATEGIES)}' "
        "score-method='deeplift' "
        f"fusion-options='{FAST_OPTIONS}'",
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    assert "fused: kf-linear" in completed.stdout and "ensemble" in completed.stdout

    report = json.loads((out / "latest" / "results.json").read_text())
    assert report["status"] == "ok" and report["rejected"] == []
    assert report["init"] == "independent" and report["settings"]["partitioner"] == "sharded"
    clients = report["clients"]
    assert [c["partition_id"] for c in clients] == [0, 1]
    assert all(c["num_examples"] == 1500 and c["score_method"] == "deeplift" for c in clients)
    # sharded split: the two sites hold disjoint classes
    held = [{k for k, n in enumerate(c["class_counts"]) if n} for c in clients]
    assert held[0].isdisjoint(held[1]) and len(held[0] | held[1]) == 10
    accuracy = report["accuracy"]
    assert all(
        0.25 < b["accuracy"] <= 0.55 for b in accuracy["base"]
    )  # each knows ~half the classes
    assert accuracy["ensemble"]["accuracy"] > max(b["accuracy"] for b in accuracy["base"])

    # every listed strategy fused the same uploads; the first one is fused.safetensors
    fusions = report["fusions"]
    assert list(fusions) == STRATEGIES
    assert fusions["kf-linear"]["options"]["n_init"] == 2
    assert fusions["otfusion"]["options"]["use_scores"] is True
    assert [level["level"] for level in fusions["kf-linear"]["details"]["levels"]] == [
        "0:Linear",
        "2:Linear",
        "4:Linear",
        "6:Linear",
    ]
    for name in fusions:
        assert f"fused: {name}" in completed.stdout
        assert 0.0 <= accuracy["fused"][name]["accuracy"] <= 1.0
    # far above chance: the one-shot neuron-interpolation fusion worked
    assert accuracy["fused"]["kf-linear"]["accuracy"] > 0.35
    # the site-statistics methods ran one query round per level after the train round, each
    # site uploading its statistics; fitted on the sites' own data they beat the ensemble here
    for name in ("kf-sites", "hf-sites"):
        rounds = fusions[name]["details"]["rounds"]
        assert [r["level"] for r in rounds] == ["0:Linear", "2:Linear", "4:Linear", "6:Linear"]
        assert all(sorted(r["upload_bytes"]) == ["0", "1"] for r in rounds)
        assert rounds[0]["upload_bytes"]["0"] == 4 * (785 * 785 + 2 * 785 * WIDTH + WIDTH**2)
        assert accuracy["fused"][name]["accuracy"] > accuracy["ensemble"]["accuracy"]

    # the fused checkpoint is the model that was evaluated
    fused = load_checkpoint(fusions["kf-linear"]["checkpoint"])
    assert fused.metadata["strategy"] == "kf-linear"
    assert fused.metadata["class_names"][9] == "Ankle boot"  # `fedfuse predict` names them
    assert fusions["kf-linear"]["checkpoint"].endswith("/fused.safetensors")
    test = load_dataset("fashion-mnist", "test")
    reported = accuracy["fused"]["kf-linear"]["accuracy"]
    full = evaluate(fused.model, test, device="cpu").accuracy
    assert abs(full - reported) < 0.05  # reported on a 2000-sample subset of the same test set
    other = load_checkpoint(fusions["otfusion"]["checkpoint"])
    assert other.metadata["strategy"] == "otfusion"
    client = load_checkpoint(
        out / "latest" / "clients" / "client_1.safetensors", require_scores=True
    )
    assert client.metadata["class_counts"] == clients[1]["class_counts"]


def test_a_missing_server_file_ends_simulate_before_flower_starts(tmp_path):
    """A run whose test set file is missing is refused by `fedfuse simulate` in one line naming
    the key and the file, before Flower starts (the ServerApp's own check of its files, which
    a deployment relies on, is tests/flower/test_run_outcomes.py's)."""
    missing = tmp_path / "no-such-test-file.npz"
    env, _ = flower_test_env(tmp_path)
    started = time.monotonic()
    completed = subprocess.run(
        [sys.executable, "-m", "fedfuse.cli.main", "simulate", "--output-dir", str(tmp_path)]
        + ["--run-config", f"{SMALL} test-data='{missing}'"],
        env=env,
        capture_output=True,
        text=True,
        timeout=patience(120),
        cwd=REPO,
    )
    assert completed.returncode != 0
    (line,) = completed.stderr.strip().splitlines()
    assert f"run config test-data='{missing}': no such file" in line
    assert not (tmp_path / "flwr-home").exists() and not (tmp_path / "latest").exists()
    assert time.monotonic() - started < patience(60)  # no Flower, no Ray


def test_faulty_sites_are_named_and_the_run_goes_on_in_every_round(tmp_path):
    """Real ClientApps (tests/apps/faulty), one run for every round a site can fail in: site 1
    raises mid-round and site 2 sleeps far past the reply timeout, so sites 0 and 3 are fused
    and both faulty sites are named. kf-sites then asks the sites for statistics: site 3 answers
    the first round and crashes in the next, is named, and site 0 carries on. Last, each fused
    model is fine-tuned on the sites in one more round, where site 3 crashes again: it is named,
    and the round averages site 0's model alone."""
    started = time.monotonic()
    completed, out, _ = _simulate(
        tmp_path,
        f"min-nodes=2 reply-timeout={REPLY_TIMEOUT} strategy='kf-linear,fedavg,kf-sites' "
        "finetune-epochs=1 finetune-data='sites'",
        app=REPO / "tests" / "apps" / "faulty",
        num_clients=4,
        grace=5,
    )
    # two sites were left out: the run fused, but it is not "ok", and simulate says so
    assert completed.returncode == 1, completed.stdout[-3000:] + completed.stderr[-3000:]
    # the hung site (it sleeps 600 s) did not hold the run
    assert time.monotonic() - started < min(patience(400), 590)
    report = json.loads((out / "latest" / "results.json").read_text())
    assert report["status"] == "partial"
    assert sorted(s["status"] for s in report["sites"])[:2] == ["failed", "silent"]
    assert [c["partition_id"] for c in report["clients"]] == [0, 3]
    rejected = report["rejected"]
    assert any(
        "the client failed: site 1 crashed mid-round (fault injected by the test app)" in r
        for r in rejected
    )
    assert any("no reply before the reply timeout" in r for r in rejected)
    assert report["phases"]["collect"] >= REPLY_TIMEOUT
    assert sorted(p.name for p in (out / "latest" / "clients").iterdir()) == [
        "client_0.safetensors",
        "client_3.safetensors",
    ]
    assert "fused: kf-linear" in completed.stdout

    # the statistics rounds: site 3 named where it crashed, the fusion went on with site 0
    levels = report["fusions"]["kf-sites"]["details"]["levels"]
    assert levels[0]["sites"] == [0, 1] and levels[1]["dropped_sites"] == [1]
    assert all(level["sites"] == [0] for level in levels[1:])
    assert any(
        r.startswith("client 3 (node")
        and "statistics round: the client failed: site 3 crashed in a statistics round" in r
        for r in rejected
    ), rejected
    assert report["accuracy"]["fused"]["kf-sites"]["accuracy"] > 0.3  # chance: 0.1

    # the fine-tuning round: reported apart from the zero-shot results, site 3 named
    assert set(report["accuracy"]["fused"]) == {"kf-linear", "fedavg", "kf-sites"}
    tuned = report["finetuned"]["kf-linear"]
    assert tuned["status"] == "ok" and tuned["label"] == "kf-linear +ft(sites,1ep)"
    assert tuned["details"]["sites"] == [0] and list(tuned["upload_bytes"]) == ["0"]
    assert any(
        p.startswith("client 3 (node")
        and "fine-tuning round: the client failed: site 3 crashed in the fine-tuning round" in p
        for p in tuned["problems"]
    ), tuned["problems"]
    assert 0.0 <= tuned["accuracy"]["accuracy"] <= 1.0
    assert Path(tuned["checkpoint"]).name == "finetuned-kf-linear.safetensors"
    assert "kf-linear +ft(sites,1ep)" in completed.stdout


def test_ten_sites_with_the_default_strategy(tmp_path):
    completed, out, _ = _simulate(
        tmp_path,
        "train-samples=300 local-epochs=1 score-samples=32 score-steps=4 "
        "test-samples=1000 fusion-samples=100 mlp-widths='64,64'",
        num_clients=10,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    report = json.loads((out / "latest" / "results.json").read_text())
    assert report["status"] == "ok" and report["rejected"] == []
    assert [c["partition_id"] for c in report["clients"]] == list(range(10))
    assert list(report["fusions"]) == ["auto", "fedavg"]  # the default list
    assert len(list((out / "latest" / "clients").glob("client_*.safetensors"))) == 10
    # auto: past 5 sites without the hf-* and *-trust candidates, every other one scored by
    # all 10 sites; its choice of 10 sharded sites well above a single site (each holds 1 class)
    chose = report["fusions"]["auto"]["details"]["auto"]
    assert chose["scored_by_sites"] == list(range(10))
    skipped = {n for n, c in chose["candidates"].items() if "skipped" in c}
    assert skipped == {"hf-sites", "hf-linear", "kf-trust", "hf-trust"}
    accuracy = report["accuracy"]
    best_site = max(b["accuracy"] for b in accuracy["base"])
    assert accuracy["fused"]["auto"]["accuracy"] > best_site
    assert f"auto chose {chose['chosen']}: " in completed.stdout


README_TABLE_START = "<!-- readme-table: the output of the main command, checked by a test -->"


def test_the_readme_table_is_what_the_main_command_prints(tmp_path):
    """The README's example output is a run of its main command (`fedfuse simulate`, all
    defaults), so a change of a default or a method that moves the numbers fails here: run the
    command and paste its table into the README."""
    readme = (REPO / "README.md").read_text()
    assert "./setup.sh && .venv/bin/fedfuse simulate " in readme  # the command run below
    shown = readme.split(README_TABLE_START, 1)[1].split("```", 2)[1]
    completed, _, _ = _simulate(tmp_path, "")
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    printed = accuracy_tables(completed.stdout)[0]  # the ServerApp's (simulate repeats it)
    (expected,) = accuracy_tables(shown)
    assert_same_table(printed, expected)
    pointer = next(line for line in shown.splitlines() if "docs/privacy.md" in line)
    assert pointer in completed.stdout


def test_secure_kf_sites_and_regmean_complete_when_a_site_drops_out_mid_protocol(
    tmp_path, monkeypatch
):
    """A real `flwr run` of 4 sites with Flower's SecAgg+ on the rounds summed over sites; site
    2 fails in SecAgg+'s unmask stage of every round, after its masked terms arrived."""
    monkeypatch.setenv(FAULT_VARIABLE, "2:unmask")
    completed, out, _ = _simulate(  # a 64x64 MLP: 3 levels, 3 summed rounds of kf-sites
        tmp_path,
        f"{SMALL} mlp-widths='64,64' strategy='kf-sites,regmean' secure-aggregation=true "
        "fusion-options='kf-sites.statistics=sums regmean.grams=sums'",
        num_clients=4,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    report = json.loads((out / "latest" / "results.json").read_text())
    fusions = report["fusions"]
    assert fusions["kf-sites"]["status"] == "ok" and fusions["regmean"]["status"] == "ok"
    # each sum holds all 4 sites: SecAgg+ rebuilt the dropped site's masks from its shares
    levels = fusions["kf-sites"]["details"]["levels"]
    assert [level["sites"] for level in levels] == [[0, 1, 2, 3]] * 3
    assert fusions["regmean"]["details"]["sites"] == [0, 1, 2, 3]
    dropped = [p for p in report["rejected"] if "dropped out of the secure" in p]
    assert len(dropped) == 2 * 3 + 2 and all("stage unmask" in p for p in dropped), dropped
    # nothing per site was stored: the uploads hold no Grams
    assert all("grams" not in c for c in report["clients"])
    assert report["accuracy"]["fused"]["kf-sites"]["accuracy"] > 0.3  # chance is 0.1
