"""End to end: a real deployment on 127.0.0.1 refuses SuperNodes it does not know, and a run
that loses a site's SuperNode mid-run ends ``partial``, naming that site.

Flower's own ``flower-superlink`` (TLS with certificates from ``fedfuse certs``, SuperNode
authentication on), ``flwr supernode register``, ``flwr run`` and ``flower-supernode``
processes with keys from ``fedfuse keys``: three registered sites, one unregistered SuperNode
and one without a key, in one deployment (one SuperLink start, one run). Every process is
started in its own session and stopped, with everything it spawned, at the end. The guide's
whole deployment (two sites, one run) is tests/e2e/test_deployment_guide.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fedfuse.io.checkpoint import load_checkpoint
from tests.fakes import hospital_files
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

    def start_supernode(
        self, name: str, port: int, key: Path | None, node_config: str, heartbeat: int = 0
    ):
        """``flower-supernode`` for the SuperLink at ``port``. With ``heartbeat``, its node
        heartbeat to the SuperLink comes every ``heartbeat`` seconds (at least Flower's minimum
        of 10) instead of Flower's fixed 30, so that the SuperLink declares it offline 2
        intervals after it dies: 20 s rather than 60. Only the node's heartbeat: the SuperNode's
        own timeouts for its ClientApp processes stay Flower's."""
        launcher = [str(BIN / "flower-supernode")]
        if heartbeat:
            launcher = [
                sys.executable,
                "-c",
                "import sys, flwr.supercore.heartbeat as h, flwr.supernode.fleet_http_connection "
                f"as f; h.HEARTBEAT_DEFAULT_INTERVAL = f.HEARTBEAT_DEFAULT_INTERVAL = {heartbeat}; "
                "from flwr.supernode.cli import flower_supernode; sys.exit(flower_supernode())",
            ]
        argv = [
            *launcher,
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


def _app_copy(folder: Path) -> Path:
    """The checkout's files that Git does not ignore, copied: the app ``flwr run`` packs is the
    same (Flower leaves out what ``.gitignore`` lists), and Flower does not walk the checkout's
    ``.venv`` (50,000 files, 10-15 s of every ``flwr run .``). The checkout itself without Git."""
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
    )
    if listed.returncode != 0:
        return REPO
    for name in filter(None, listed.stdout.decode().split("\0")):
        if (REPO / name).is_file() and not (REPO / name).is_symlink():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(REPO / name, folder / name)
    return folder


def _wait_for(deployment: Deployment, what: str, found, seconds: float):
    """``found()``'s value once it is truthy; fails, with every process's log, after
    ``seconds``."""
    deadline = time.monotonic() + patience(seconds)
    while not (value := found()):
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {seconds:.0f} s\n{deployment.report()}")
        time.sleep(0.2)
    return value


def _logged(deployment: Deployment, name: str, text: str) -> bool:
    log = deployment.logs[name]
    return log.exists() and text in log.read_text(errors="replace")


def _finished(results: Path) -> dict | None:
    """The run's report once it has ended, else None."""
    with contextlib.suppress(OSError, ValueError):
        report = json.loads(results.read_text())
        if report.get("status") != "running":
            return report
    return None


def test_unknown_supernodes_are_refused_and_a_site_killed_mid_run_is_named(
    deployment: Deployment, tmp_path: Path
):
    """Three registered sites, an unregistered SuperNode and one without a key. The two
    unknown ones are refused. Then a run starts, and the third site's SuperNode is killed
    (SIGKILL, with the ClientApp it started: the site's machine dies) the moment it has the
    train message. The SuperLink declares it offline after two missed heartbeats; the run goes
    on without it and ends ``partial`` (docs/deployment.md section 10): the two uploads are
    kept and fused, and ``fedfuse status`` names the lost site by its site-name and its real
    node id."""
    port = deployment.start_superlink()
    keys = tmp_path / "keys"
    names = [f"hospital-{i}" for i in range(3)]
    deployment.fedfuse("keys", "--out", str(keys), *names, "intruder")
    with ThreadPoolExecutor(len(names)) as pool:  # each `flwr` command takes seconds to start
        node_ids = list(pool.map(lambda name: deployment.register(keys / f"{name}.pub"), names))
    files = hospital_files(tmp_path, 3, test_samples=100)
    for i, name in enumerate(names):
        config = f"partition-id={i} site-name='{name}' data-path='{files[i]}'"
        deployment.start_supernode(name, port, keys / f"{name}.key", config, heartbeat=10)
    config = f"partition-id=0 data-path='{files[0]}'"
    intruder = deployment.start_supernode("intruder", port, keys / "intruder.key", config)
    anonymous = deployment.start_supernode("anonymous", port, None, config)
    app = _app_copy(tmp_path / "app")
    for name, process, reason in (
        ("intruder", intruder, "Failed to activate SuperNode"),
        ("anonymous", anonymous, "All SuperNodes must be registered"),
    ):
        try:
            process.wait(timeout=patience(120))
        except subprocess.TimeoutExpired:
            pytest.fail(f"the {name} SuperNode was not refused\n{deployment.report()}")
        assert process.returncode != 0 and _logged(deployment, name, reason), deployment.report()
    for name in names:
        _wait_for(
            deployment,
            f"{name} connected",
            lambda n=name: _logged(deployment, n, "SuperNode ID"),
            120,
        )

    out = tmp_path / "outputs"
    run_config = (
        f"fusion-data='{files['fusion']}' test-data='{files['test']}' output-dir='{out}' "
        "strategy='kf-linear,fedavg' mlp-widths='16' local-epochs=1 score-samples=32 "
        "score-steps=4 fusion-samples=40 device='cpu' min-nodes=2"
    )
    deployment.run(
        [str(BIN / "flwr"), "run", str(app), CONNECTION, "--run-config", run_config],
        timeout=patience(120),
    )
    victim = deployment.processes[names[2]]
    _wait_for(
        deployment,
        f"{names[2]} received the train message",
        lambda: _logged(deployment, names[2], "Receiving: train message"),
        180,
    )
    for pid in [victim.pid, *descendants(victim.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    victim.wait(timeout=10)
    assert not _logged(deployment, names[2], "Sending: train message")  # it never answered

    report = _wait_for(
        deployment, "the run ended", lambda: _finished(out / "latest" / "results.json"), 180
    )
    assert report["status"] == "partial", report
    sites = {site["site"]: site for site in report["sites"]}
    assert sorted(sites) == names, report["sites"]
    for i, name in enumerate(names[:2]):
        assert sites[name]["status"] == "uploaded" and sites[name]["node_id"] == node_ids[i]
        assert (out / "latest" / "clients" / f"client_{i}.safetensors").is_file()
    lost = sites[names[2]]
    assert (lost["status"], lost["partition_id"], lost["node_id"]) == ("failed", 2, node_ids[2])
    assert not (out / "latest" / "clients" / "client_2.safetensors").exists()
    assert report["fusions"]["kf-linear"]["status"] == "ok", report["fusions"]
    fused = load_checkpoint(out / "latest" / "fused.safetensors").metadata
    assert [s["name"] for s in fused["sites"]] == names[:2]

    status = subprocess.run(
        [sys.executable, "-m", "fedfuse.cli.main", "status", str(out)],
        env=deployment.env,
        capture_output=True,
        text=True,
        timeout=patience(60),
    )
    assert status.returncode == 3 and status.stdout.startswith("partial\n"), status
    (line,) = [s for s in status.stdout.splitlines() if s.startswith(f"  site {names[2]} ")]
    assert line.endswith(
        f"node {node_ids[2]}  failed: {names[2]} (client 2, node {node_ids[2]}): its SuperNode "
        "went offline: Error: Node Unavailable — The destination node failed to report a "
        "heartbeat within 2 × its expected interval."
    ), status.stdout
    nodes = json.loads(
        deployment.run(
            [str(BIN / "flwr"), "supernode", "ls", CONNECTION, "--format", "json"], 120
        ).stdout
    )
    listed = {int(node["node-id"]): node["status"] for node in nodes["nodes"]}
    # the registered sites only (never the intruder), the killed one offline
    assert listed == dict(zip(node_ids, ["online", "online", "offline"], strict=True)), nodes
