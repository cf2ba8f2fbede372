"""Running Flower apps as local simulations in a subprocess: fedfuse's own (``fedfuse simulate``,
experiments) or any other (``fedfuse run-app``).

A simulation owns its process tree (the local SuperLink that ``flwr run`` starts, the simulation
and its Ray workers), so each runs as its own process and is stopped as a tree. ``flwr run``
exits 0 even when the ServerApp raised; :func:`run_flower_app` reads the run's final status from
the SuperLink (``flwr list``) instead.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from fedfuse.federation.flower_state import (
    StateDatabaseError,
    inspect_state_db,
    local_superlink_dir,
    simulation_flwr_home,
    stop_process_tree,
    superlink_pids,
)
from fedfuse.federation.ray_cluster import ray_environment, requested_address

log = logging.getLogger(__name__)

#: Environment for Flower in a closed network: no per-run dependency install, no telemetry.
FLOWER_ENV = {
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
}
#: the local SuperLink's Control API port, unless FLWR_LOCAL_CONTROL_API_PORT says another
DEFAULT_CONTROL_PORT = "39093"


def flower_environment() -> tuple[dict[str, str], str]:
    """The environment for Flower's commands (:data:`FLOWER_ENV` unless set, this
    interpreter's scripts first on PATH: Flower starts ``flower-superlink`` by name, and the
    ``FLWR_HOME`` of :func:`~fedfuse.federation.flower_state.simulation_flwr_home`) and the path
    of ``flwr``; SystemExit when Flower is not installed, StateDatabaseError when the local
    SuperLink's state.db there was written by another Flower version."""
    scripts = str(Path(sys.executable).parent)
    path = os.pathsep.join([scripts, os.environ.get("PATH", "")])
    env = {**os.environ, **{k: os.environ.get(k, v) for k, v in FLOWER_ENV.items()}, "PATH": path}
    flwr = shutil.which("flwr", path=path)
    if flwr is None:
        raise SystemExit("the `flwr` command is not installed (pip install flwr)")
    flwr_home, _ = simulation_flwr_home()
    env["FLWR_HOME"] = str(flwr_home)  # the local SuperLink keeps its state.db there
    _, problem = inspect_state_db(local_superlink_dir(flwr_home) / "state.db")
    if problem:
        raise StateDatabaseError(problem)
    return env, flwr


def simulate_command(
    *,
    sites: int,
    output_dir: str | Path,
    run_config: str,
    cpus_per_client: int = 1,
    timeout: float = 3600.0,
    ray_address: str | None = None,
) -> list[str]:
    """The ``fedfuse simulate`` command line, run in this interpreter, that experiments launch
    as a subprocess (on the Ray cluster at ``ray_address`` when given)."""
    cluster = ["--ray-address", ray_address] if ray_address else []
    return [
        sys.executable,
        "-m",
        "fedfuse.cli.main",
        "simulate",
        "--num-clients",
        str(sites),
        "--cpus-per-client",
        str(cpus_per_client),
        "--timeout",
        str(timeout),
        "--output-dir",
        str(output_dir),
        "--run-config",
        run_config,
        *cluster,
    ]


#: what ``flwr run`` prints when its local SuperLink missed Flower's start-up limit
_SUPERLINK_SLOW = "Failed to start local SuperLink within"


@dataclass
class AppRun:
    """How a ``flwr run`` of an app ended: Flower's exit code, the run id and the run's final
    status on the SuperLink (``finished:completed``, ``finished:failed``, ...; "" if unknown)."""

    returncode: int
    run_id: str
    status: str
    output: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.status == "finished:completed"


_STARTED = re.compile(r"Successfully started run (\d+)")


def run_flower_app(
    app: str | Path,
    *,
    num_supernodes: int = 2,
    run_config: str = "",
    cpus_per_client: int = 1,
    timeout: float = 3600.0,
    echo: bool = True,
    ray_address: str | None = None,
) -> AppRun:
    """``flwr run <app> --stream`` as a local simulation of ``num_supernodes`` sites, then the
    run's final status from the SuperLink; the SuperLink it started is stopped afterwards.

    ``run_config`` is ``flwr run --run-config``'s ``"key=value ..."``; ``echo`` copies Flower's
    output to this process's stdout as it comes; ``ray_address`` (default ``$RAY_ADDRESS``)
    runs the sites on that Ray cluster (:mod:`~fedfuse.federation.ray_cluster`).
    """
    ray_env, _ = ray_environment(requested_address(ray_address), cpus_per_client, 0.0)
    env, flwr = flower_environment()
    env.update(ray_env)
    control_port = env.get("FLWR_LOCAL_CONTROL_API_PORT", DEFAULT_CONTROL_PORT)
    running_before = set(superlink_pids(control_port))
    command = [flwr, "run", str(app), "--stream", "--federation-config"]
    command.append(f"num-supernodes={num_supernodes} client-resources-num-cpus={cpus_per_client}")
    if run_config.strip():
        command += ["--run-config", run_config]
    log.info("running %s", " ".join(command))
    deadline = time.monotonic() + timeout
    try:
        for attempt in (1, 2):
            returncode, output = _stream(command, env, deadline, echo)
            match = _STARTED.search(output)
            if match or attempt == 2 or _SUPERLINK_SLOW not in output:
                break
            # Flower gives its local SuperLink a fixed 15 s to start, which a loaded machine
            # can miss; no run was submitted, so it is started once more
            log.warning("Flower's local SuperLink did not start within its 15 s; again")
            stop_process_tree(sorted(set(superlink_pids(control_port)) - running_before))
        run_id = match.group(1) if match else ""
        status = _run_status(flwr, env, run_id) if run_id else ""
    finally:
        stop_process_tree(sorted(set(superlink_pids(control_port)) - running_before))
    return AppRun(returncode, run_id, status, output)


def _stream(
    command: list[str], env: dict[str, str], deadline: float, echo: bool
) -> tuple[int, str]:
    """Run ``command`` until ``deadline``, its output copied to stdout when ``echo``: the exit
    code (124 when stopped at the deadline) and the output."""
    lines: list[str] = []
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if echo:
                sys.stdout.write(line)
            if time.monotonic() > deadline:
                log.error("the run did not finish within its time limit")
                break
        returncode = process.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        returncode = 124
    finally:
        if process.poll() is None:
            stop_process_tree([process.pid])
            returncode = 124
    return returncode, "".join(lines)


def _run_status(flwr: str, env: dict[str, str], run_id: str, wait: float = 15.0) -> str:
    """The run's status on the local SuperLink (``flwr list --run-id``), "" when unreadable;
    polled for up to ``wait`` seconds until the run is finished."""
    deadline = time.monotonic() + wait
    while not (status := _read_status(flwr, env, run_id)).startswith("finished"):
        if not status or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    return status


def _read_status(flwr: str, env: dict[str, str], run_id: str) -> str:
    try:
        listed = subprocess.run(
            [flwr, "list", "--run-id", run_id, "--format", "json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        runs = json.loads(listed.stdout).get("runs", [])
    except (subprocess.TimeoutExpired, ValueError, AttributeError) as error:
        log.warning("could not read the status of run %s: %s", run_id, error)
        return ""
    return str(runs[0].get("status", "")) if runs else ""
