"""End to end: a real deployment on 127.0.0.1, as docs/deployment.md describes it.

Flower's own ``flower-superlink`` (TLS with certificates from ``fedfuse certs``, SuperNode
authentication on), two ``flower-supernode`` processes that authenticate with keys from
``fedfuse keys`` and read Fashion-MNIST site files, ``flwr supernode register`` and
``flwr run <repo> <connection>``; the server's fusion and test sets are files given by path.
Every process is started in its own session and stopped, with everything it spawned, at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fedfuse.data import load_dataset, load_npz_dataset, save_npz_dataset
from fedfuse.io.checkpoint import load_checkpoint
from fedfuse.training.loop import evaluate
from tests.helpers import free_port

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
CONNECTION = "fedfuse-test"
SITE_SAMPLES = 1000
RUN_CONFIG = (
    "local-epochs=2 score-samples=64 score-steps=4 test-samples=1000 mlp-widths='64,64' "
    "strategy='kf-linear,fedavg' node-wait-timeout=240.0 reply-timeout=600.0"
)


def _accepts(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


def _descendants(pid: int) -> list[int]:
    """PIDs of every live descendant of ``pid`` (from /proc; Linux)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _tail(path: Path, lines: int = 40) -> str:
    text = path.read_text(errors="replace") if path.exists() else "(no log)"
    return "\n".join(text.splitlines()[-lines:])


class Deployment:
    """The processes of one test: started in new sessions, logs in files, all stopped at the end.

    Flower's SuperLink starts its ServerApp runner in a session of its own, so stopping a
    process group is not enough: :meth:`stop_all` also signals every descendant it finds.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.home = root / "flwr-home"
        self.home.mkdir()
        self.env = {
            **os.environ,
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "FLWR_HOME": str(self.home),
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "PYTHONUNBUFFERED": "1",
        }
        self.processes: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = self.root / f"{name}.log"
        with log.open("wb") as handle:
            process = subprocess.Popen(
                argv,
                env=self.env,
                cwd=self.root,
                stdout=handle,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.processes[name], self.logs[name] = process, log
        return process

    def run(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
        """A short command, its output captured; a failure reports every process's log."""
        try:
            completed = subprocess.run(
                argv, env=self.env, cwd=self.root, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired as error:
            pytest.fail(
                f"{argv[:3]} did not finish in {timeout} s\n{error.output}\n{self.report()}"
            )
        if completed.returncode != 0:
            pytest.fail(
                f"{' '.join(argv)} exited {completed.returncode}\n{completed.stdout[-3000:]}\n"
                f"{completed.stderr[-3000:]}\n{self.report()}"
            )
        return completed

    def report(self) -> str:
        """The state and log tail of every process, for failure messages."""
        parts = []
        for name, process in self.processes.items():
            state = "running" if process.poll() is None else f"exited {process.returncode}"
            parts.append(
                f"----- {name} ({state}), {self.logs[name]} -----\n{_tail(self.logs[name])}"
            )
        return "\n".join(parts)

    def stop_all(self) -> None:
        pids = {
            pid
            for process in self.processes.values()
            for pid in [process.pid, *_descendants(process.pid)]
        }
        for process in self.processes.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for process in self.processes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
            time.sleep(0.2)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for process in self.processes.values():
            process.wait(timeout=10)

    # ------------------------------------------------------------------------ the walkthrough
    def fedfuse(self, *args: str) -> str:
        return self.run([sys.executable, "-m", "fedfuse.cli.main", *args], timeout=120).stdout

    def start_superlink(self) -> int:
        """``fedfuse certs``, then ``flower-superlink`` with TLS and SuperNode auth; its port."""
        self.fedfuse("certs", "--out", str(self.root / "certs"), "--host", "127.0.0.1")
        port = free_port()
        certs = self.root / "certs"
        link = self.start(
            "superlink",
            [
                str(BIN / "flower-superlink"),
                "--ssl-ca-certfile", str(certs / "ca.crt"),
                "--ssl-certfile", str(certs / "server.pem"),
                "--ssl-keyfile", str(certs / "server.key"),
                "--enable-supernode-auth",
                "--host", "127.0.0.1",
                "--port", str(port),
            ],
        )  # fmt: skip
        deadline = time.monotonic() + 90
        while not _accepts(port):
            if link.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the SuperLink did not start on port {port}\n{self.report()}")
            time.sleep(0.3)
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
            f'address = "127.0.0.1:{port}"\nroot-certificates = "{certs / "ca.crt"}"\n'
        )
        return port

    def register(self, public_key: Path) -> int:
        out = self.run(
            [str(BIN / "flwr"), "supernode", "register", str(public_key), CONNECTION]
            + ["--format", "json"],
            timeout=120,
        ).stdout
        return int(json.loads(out[out.index("{") :])["node-id"])

    def start_supernode(self, name: str, port: int, key: Path | None, node_config: str):
        argv = [
            str(BIN / "flower-supernode"),
            "--superlink", f"127.0.0.1:{port}",
            "--root-certificates", str(self.root / "certs" / "ca.crt"),
            "--node-config", node_config,
            "--port", str(free_port()),
        ]  # fmt: skip
        if key is not None:
            argv += ["--auth-supernode-private-key", str(key)]
        return self.start(name, argv)


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    deployment = Deployment(tmp_path)
    try:
        yield deployment
    finally:
        deployment.stop_all()
    leftover = [p for p in deployment.processes.values() if p.poll() is None]
    assert not leftover, f"processes still running: {[p.args[0] for p in leftover]}"


def _write_site_files(root: Path) -> dict[str, Path]:
    """Two class-disjoint hospital sites, the server's fusion set and test set (Fashion-MNIST)."""
    train = load_dataset("fashion-mnist", "train")
    test = load_dataset("fashion-mnist", "test")
    rng = np.random.default_rng(0)
    labels = train.labels.numpy()
    files = {}
    for site, classes in ((0, range(0, 5)), (1, range(5, 10))):
        pool = np.flatnonzero(np.isin(labels, list(classes)))
        index = np.sort(rng.choice(pool, SITE_SAMPLES, replace=False))
        files[f"site-{site}"] = save_npz_dataset(root / f"site-{site}.npz", train.subset(index))
    fusion = np.sort(rng.choice(len(train), 300, replace=False))
    files["fusion"] = save_npz_dataset(root / "fusion.npz", train.subset(fusion))
    files["test"] = save_npz_dataset(root / "test.npz", test.subset(np.arange(1000)))
    return files


def test_two_hospitals_over_tls_with_supernode_auth(deployment: Deployment, tmp_path: Path):
    data = _write_site_files(tmp_path / "data")
    port = deployment.start_superlink()
    keys = tmp_path / "keys"
    deployment.fedfuse("keys", "--out", str(keys), "site-0", "site-1")
    node_ids = [deployment.register(keys / f"site-{i}.pub") for i in range(2)]
    assert len(set(node_ids)) == 2
    for i in range(2):
        deployment.start_supernode(
            f"supernode-{i}",
            port,
            keys / f"site-{i}.key",
            f"partition-id={i} data-path='{data[f'site-{i}']}'",
        )
    out = tmp_path / "outputs"
    run_config = (
        f"{RUN_CONFIG} fusion-data='{data['fusion']}' test-data='{data['test']}' output-dir='{out}'"
    )
    # `flwr run` exits 0 even when the run failed: the result file tells
    flwr_run = deployment.run(
        [str(BIN / "flwr"), "run", str(REPO), CONNECTION, "--stream", "--run-config", run_config],
        timeout=600,
    )
    results = out / "latest" / "results.json"
    deadline = time.monotonic() + 60
    while not results.is_file() and time.monotonic() < deadline:
        time.sleep(0.5)
    context = f"\n----- flwr run -----\n{flwr_run.stdout[-4000:]}\n{deployment.report()}"
    assert results.is_file(), f"no {results}{context}"
    report = json.loads(results.read_text())
    assert report["status"] == "ok", f"{report.get('error')}{context}"
    for name in ("supernode-0", "supernode-1"):
        assert deployment.processes[name].poll() is None, f"{name} stopped{context}"

    # the uploads: one per site, each from its own file (deployment: no simulated partitions)
    assert report["rejected"] == []
    clients = sorted(report["clients"], key=lambda c: c["partition_id"])
    assert [c["partition_id"] for c in clients] == [0, 1]
    assert all(c["num_examples"] == SITE_SAMPLES for c in clients)
    held = [{k for k, n in enumerate(c["class_counts"]) if n} for c in clients]
    assert held == [set(range(5)), set(range(5, 10))]
    assert report["settings"]["fusion-data"] == str(data["fusion"])
    assert report["settings"]["test-data"] == str(data["test"])

    # the fused model: a checkpoint that loads and is the model that was evaluated
    assert list(report["fusions"]) == ["kf-linear", "fedavg"]
    accuracy = report["accuracy"]
    assert all(b["accuracy"] <= 0.55 for b in accuracy["base"])  # each site knows 5 classes
    assert accuracy["fused"]["kf-linear"]["accuracy"] > 0.3, accuracy
    fused = load_checkpoint(report["fusions"]["kf-linear"]["checkpoint"])
    assert fused.metadata["strategy"] == "kf-linear"
    assert fused.model.spec.input_shape == (1, 28, 28) and fused.model.spec.num_classes == 10
    measured = evaluate(fused.model, load_npz_dataset(data["test"]), device="cpu").accuracy
    assert abs(measured - accuracy["fused"]["kf-linear"]["accuracy"]) < 0.002

    # the SuperLink saw the run finish
    runs = json.loads(
        deployment.run([str(BIN / "flwr"), "list", CONNECTION, "--format", "json"], 120).stdout
    )
    assert [r["status"] for r in runs["runs"]] == ["finished:completed"]


def test_an_unregistered_supernode_is_refused(deployment: Deployment, tmp_path: Path):
    port = deployment.start_superlink()
    keys = tmp_path / "keys"
    deployment.fedfuse("keys", "--out", str(keys), "site-0", "intruder")
    deployment.register(keys / "site-0.pub")
    site = save_npz_dataset(
        tmp_path / "site.npz", load_dataset("digits", "train").subset(range(50))
    )
    config = f"partition-id=0 data-path='{site}'"
    intruder = deployment.start_supernode("intruder", port, keys / "intruder.key", config)
    anonymous = deployment.start_supernode("anonymous", port, None, config)
    for name, process, reason in (
        ("intruder", intruder, "Failed to activate SuperNode"),
        ("anonymous", anonymous, "All SuperNodes must be registered"),
    ):
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the {name} SuperNode was not refused\n{deployment.report()}")
        log = deployment.logs[name].read_text()
        assert process.returncode != 0 and reason in log, deployment.report()
    nodes = json.loads(
        deployment.run(
            [str(BIN / "flwr"), "supernode", "ls", CONNECTION, "--format", "json"], 120
        ).stdout
    )
    assert [n["status"] for n in nodes["nodes"]] == ["registered"], nodes
