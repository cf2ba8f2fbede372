"""End to end: a real deployment on 127.0.0.1 refuses SuperNodes it does not know.

Flower's own ``flower-superlink`` (TLS with certificates from ``fedfuse certs``, SuperNode
authentication on), ``flwr supernode register`` and ``flower-supernode`` processes with keys
from ``fedfuse keys``, one of them unregistered and one without a key. Every process is started
in its own session and stopped, with everything it spawned, at the end. The guide's whole
deployment (two sites, one run) is tests/e2e/test_deployment_guide.py.
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

import pytest

from fedfuse.data import load_dataset, save_npz_dataset
from tests.helpers import descendants, free_port, patience

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
CONNECTION = "fedfuse-test"


def _accepts(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


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
            for pid in [process.pid, *descendants(process.pid)]
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
        return self.run(
            [sys.executable, "-m", "fedfuse.cli.main", *args], timeout=patience(120)
        ).stdout

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
            timeout=patience(120),
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
            process.wait(timeout=patience(120))
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
