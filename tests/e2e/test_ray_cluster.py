"""A simulation on a Ray cluster that is already up: two real Ray nodes on 127.0.0.1 (``ray start
--head`` and ``ray start --address``), each with its own CPU, and ``fedfuse simulate
--ray-address`` running its sites on both, until the second node is killed mid-run."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest

from fedfuse.federation.flower_state import stop_process_tree, superlink_pids
from fedfuse.federation.ray_cluster import RayClusterError, connect
from fedfuse.io.checkpoint import load_checkpoint
from tests.helpers import (
    accuracy_tables,
    assert_same_table,
    flower_test_env,
    free_port,
    patience,
)
from tests.shown_outputs import assert_shows, fenced_blocks, without_tables

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
#: a small run whose sites still train long enough for a node to die while one trains there
SMALL = (
    "train-samples=1000 local-epochs=1 score-samples=32 score-steps=4 test-samples=500 "
    "mlp-widths='64,64'"
)
#: the run of docs/cluster.md section 5
RUN_CONFIG = f"{SMALL} strategy='fedavg' min-nodes=3"


def _cluster_processes(temp_dir: str, port: int) -> list[int]:
    """The processes of the cluster under ``temp_dir`` with its head at ``port`` (never
    another Ray on the machine, so ``ray stop``, which stops every Ray, is not used)."""
    marks = (temp_dir, f"127.0.0.1:{port}", f":{port} ")
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        command = " ".join(process.info["cmdline"] or []) + " "
        if process.pid != os.getpid() and any(mark in command for mark in marks):
            found.append(process.pid)
    return found


#: the processes of the worker node of the running :func:`two_node_cluster` (its raylet ...)
worker_processes: list[int] = []
#: the Ray node ids of the running :func:`two_node_cluster`: ``head`` and ``worker``
cluster_nodes: dict[str, str] = {}


@pytest.fixture
def two_node_cluster():
    """A head node and a worker node on 127.0.0.1, one CPU each; yields the head's address
    (the worker node's processes are in :data:`worker_processes`)."""
    worker_processes.clear()
    cluster_nodes.clear()
    ray = str(Path(sys.executable).parent / "ray")
    # a short path of its own: Ray's sockets live under it, and no other Ray finds this cluster
    temp_dir = tempfile.mkdtemp(prefix="ffray-", dir="/tmp")
    port = free_port()
    address = f"127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "FLWR_HOME")}
    common = ["--node-ip-address=127.0.0.1", "--num-cpus=1", "--disable-usage-stats"]
    head = [ray, "start", "--head", f"--port={port}", f"--temp-dir={temp_dir}", *common]
    head += ["--include-dashboard=false", f"--dashboard-port={free_port()}"]
    head += [f"--ray-client-server-port={free_port()}"]
    worker = [ray, "start", f"--address={address}", *common]
    try:
        subprocess.run(head, env=env, check=True, capture_output=True, timeout=patience(180))
        head_processes = set(_cluster_processes(temp_dir, port))
        cluster_nodes["head"] = connect(address).nodes[0].node_id
        subprocess.run(worker, env=env, check=True, capture_output=True, timeout=patience(180))
        deadline = time.monotonic() + patience(60)
        while len(connect(address).nodes) < 2:
            assert time.monotonic() < deadline, "the worker node never joined the cluster"
            time.sleep(1)
        worker_processes.extend(sorted(set(_cluster_processes(temp_dir, port)) - head_processes))
        (cluster_nodes["worker"],) = {n.node_id for n in connect(address).nodes} - {
            cluster_nodes["head"]
        }
        yield address
    finally:
        stop_process_tree(_cluster_processes(temp_dir, port))
        shutil.rmtree(temp_dir, ignore_errors=True)


def _ran_on(upload: Path) -> str | None:
    """The Ray node a stored upload says its site ran on (None while it is being written)."""
    try:
        return load_checkpoint(upload).metadata.get("ray_node", "")
    except Exception:  # noqa: BLE001 - not complete yet: read it on the next look
        return None


def test_sites_run_on_both_nodes_and_a_node_killed_mid_run_costs_no_site_its_name(
    two_node_cluster, tmp_path
):
    """One run of 8 sites on the cluster: they run on both nodes, and once the worker node's
    first upload is stored the worker node is killed (SIGKILL, every process it had), as
    docs/cluster.md section 5 tells. The site its worker was running is sent again (at most
    twice; Ray runs it on the node left), and any site that still fails is named by its
    partition, as it named itself in the data check; the run fuses what arrived."""
    env, control_port = flower_test_env(tmp_path)
    out = tmp_path / "outputs"
    command = [
        *(sys.executable, "-m", "fedfuse.cli.main", "simulate", "--app", str(REPO)),
        *("--num-clients", "8", "--ray-address", two_node_cluster, "--output-dir", str(out)),
        *("--timeout", str(round(patience(600))), "--run-config"),
        RUN_CONFIG,
    ]
    log_file, read = tmp_path / "simulate.log", set()
    with open(log_file, "w") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + patience(600)
            while process.poll() is None and time.monotonic() < deadline:
                for upload in set(out.glob("*/clients/client_*.safetensors")) - read:
                    node = _ran_on(upload)
                    if node is not None:
                        read.add(upload)
                    if node == cluster_nodes["worker"] and worker_processes:
                        for pid in worker_processes:  # the node dies: its raylet and all it ran
                            with contextlib.suppress(ProcessLookupError):
                                os.kill(pid, signal.SIGKILL)
                        worker_processes.clear()
                time.sleep(0.1)
        finally:
            if process.poll() is None:
                process.kill()
            stop_process_tree(superlink_pids(control_port))
    output = log_file.read_text()
    assert not worker_processes, "the worker node ran no site:\n" + output[-3000:]
    report = json.loads((out / "latest" / "results.json").read_text())
    assert report["status"] in ("ok", "partial"), output[-3000:]
    sites = report["sites"]
    ran_on = Counter(site.get("ray_node") for site in sites if site["status"] == "uploaded")
    assert set(ran_on) == set(cluster_nodes.values()), ran_on  # both nodes ran sites
    assert "sites ran on 2 Ray node(s)" in output
    # every site named by its partition, whether it uploaded or failed
    assert sorted(s["partition_id"] for s in sites) == list(range(8)), sites
    lost = [s for s in sites if s["status"] != "uploaded"]
    for site in lost:  # each a site whose worker was lost on every try, with Ray's reason
        assert site["status"] == "failed" and "ray.exceptions" in site["reason"], site
    assert report["status"] == ("partial" if lost else "ok")
    resent = output.count("sending its message again")
    assert resent <= 2 * len(sites)  # at most twice per site
    assert report["fusions"]["fedavg"]["status"] == "ok"
    print(f"killed mid-run: {len(sites) - len(lost)} of 8 sites uploaded, {resent} sent again")
    if report["status"] == "ok":  # what docs/cluster.md section 5 shows (an ok run)
        _assert_shown_in_the_guide(output, out, env)


def _guide_section_5() -> tuple[list[str], str, str]:
    """docs/cluster.md section 5: its ``fedfuse simulate`` command's words, what the command
    printed, and what ``fedfuse status`` printed."""
    blocks = fenced_blocks((REPO / "docs" / "cluster.md").read_text())
    (index,) = [
        i
        for i, (lang, body) in enumerate(blocks)
        if lang == "bash" and body.startswith("fedfuse simulate --ray-address 127.0.0.1:")
    ]
    command, printed, status_command, status = (body for _, body in blocks[index : index + 4])
    assert status_command == "fedfuse status outputs"
    return shlex.split(command), printed, status


def test_the_guide_shows_the_command_this_test_runs():
    command, _, _ = _guide_section_5()
    assert command[command.index("--run-config") + 1] == RUN_CONFIG
    assert command[command.index("--num-clients") + 1] == "8"


def _assert_shown_in_the_guide(output: str, out: Path, env: dict[str, str]) -> None:
    """What the run and ``fedfuse status`` printed is what docs/cluster.md shows: every line
    (run-to-run values aside, tests/shown_outputs.py), the accuracies within 3 points."""
    _, shown, shown_status = _guide_section_5()
    assert_shows(output, without_tables(shown))
    assert_same_table(accuracy_tables(output)[-1], accuracy_tables(shown)[0])
    status = subprocess.run(
        [sys.executable, "-m", "fedfuse.cli.main", "status", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=patience(60),
    )
    assert status.returncode == 0, status
    assert_shows(status.stdout, shown_status, [(str(out), "outputs")])


def test_a_cluster_that_does_not_answer_is_named_before_flower_starts(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(RayClusterError, match=f"no Ray cluster answers at {address}"):
        connect(address)
    env, _ = flower_test_env(tmp_path)
    completed = subprocess.run(
        [sys.executable, "-m", "fedfuse.cli.main", "simulate", "--ray-address", address],
        env=env,
        capture_output=True,
        text=True,
        timeout=patience(120),
    )
    assert completed.returncode != 0
    # as docs/cluster.md section 2 quotes it
    assert f"no Ray cluster answers at {address} (Connection refused)" in completed.stderr
    assert not (tmp_path / "flwr-home").exists()  # Flower never started
