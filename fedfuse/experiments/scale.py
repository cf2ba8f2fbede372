"""Scale benchmark: real ``fedfuse simulate`` runs at growing site counts, measured from outside.

For every size it starts ``fedfuse simulate`` (a real Flower simulation: a local SuperLink,
Ray, one SuperNode per site) and samples, every half second,

* the resident memory of the whole process tree of the run: the ``fedfuse simulate`` process,
  its descendants, and every process started with the run's own ``FLWR_HOME`` (the SuperLink
  runs detached from the command that started it, with the ServerApp and Ray beneath it);
* the machine's used memory (total minus available) over what was used before the run.

Where the time goes comes from the run's ``results.json``: start-up (until the ServerApp
starts), waiting for the SuperNodes (Ray's start), collecting the uploads (the sites' training,
scoring and upload; the sites report their own phase times), the server's handling of each
upload (validation, writing it to disk), every fusion method, and the evaluation.
``fedfuse scale`` prints a table with the baseline of issue 7 beside it (as a ratio) and
writes ``scale.json`` and ``scale.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from fedfuse.federation.simulation import simulate_command
from fedfuse.settings.bounds import Range

log = logging.getLogger(__name__)

#: MLP 784-512-512-512-10, Dirichlet split, the app's default methods (issues 7 and 21 measured
#: with strategy='kf-linear,fedavg,regmean' added, the config of the baseline below)
DEFAULT_RUN_CONFIG = "partitioner='dirichlet'"
DEFAULT_SITES = (2, 10, 100, 500, 1000)
#: wall seconds and peak GB over idle before the work each row is compared with (2 cores; run
#: config ``partitioner='dirichlet' strategy='kf-linear,fedavg,regmean'``): 10 to 100 sites from
#: the landed main before issue 7, 500 and 1000 sites from issue 7's closing note (main of
#: 2026-11-24, the starting point of issue 21)
BASELINE = {
    10: (64.0, 3.4),
    50: (170.0, 5.0),
    100: (249.0, 6.8),
    500: (438.0, 7.02),
    1000: (842.0, 9.37),
}


class MemorySampler(threading.Thread):
    """Peak RSS of a run's process tree and peak machine memory over idle, sampled."""

    def __init__(self, root: psutil.Process, flwr_home: str, interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.root = root
        self.flwr_home = flwr_home
        self.interval = interval
        self.idle_used = _used_bytes()
        self.peak_tree = 0
        self.peak_used = 0
        #: (seconds since start, used over idle GB, tree RSS GB), every 2 s: where the peak is
        self.timeline: list[tuple[float, float, float]] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        started = time.monotonic()
        while not self._stop_event.is_set():
            tree, used = self.tree_rss(), _used_bytes() - self.idle_used
            self.peak_tree = max(self.peak_tree, tree)
            self.peak_used = max(self.peak_used, used)
            now = time.monotonic() - started
            if not self.timeline or now - self.timeline[-1][0] >= 2.0:
                self.timeline.append(
                    (round(now, 1), round(used / 2**30, 2), round(tree / 2**30, 2))
                )
            self._stop_event.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()

    def tree_rss(self) -> int:
        members: dict[int, psutil.Process] = {}
        try:
            members[self.root.pid] = self.root
            members.update({p.pid: p for p in self.root.children(recursive=True)})
        except psutil.NoSuchProcess:
            pass
        for process in psutil.process_iter(["environ"]):
            try:
                environ = process.info["environ"] or {}
            except psutil.Error:
                continue
            if environ.get("FLWR_HOME") == self.flwr_home:
                members[process.pid] = process
        total = 0
        for process in members.values():
            try:
                total += process.memory_info().rss
            except psutil.Error:
                continue
        return total


def _used_bytes() -> int:
    memory = psutil.virtual_memory()
    return memory.total - memory.available


def run_size(
    sites: int,
    run_config: str,
    output_dir: Path,
    *,
    cpus_per_client: int = 1,
    timeout: float = 3600.0,
    ray_address: str | None = None,
) -> dict[str, Any]:
    """One measured ``fedfuse simulate`` run with ``sites`` sites; its row of the table."""
    out = output_dir / f"sites-{sites}"
    with tempfile.TemporaryDirectory(prefix="fedfuse-scale-") as flwr_home:
        env = {
            **os.environ,
            "FLWR_HOME": flwr_home,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        }
        command = simulate_command(
            sites=sites,
            output_dir=out,
            run_config=run_config,
            cpus_per_client=cpus_per_client,
            timeout=timeout,
            ray_address=ray_address,
        )
        log.info("scale: %d sites: %s", sites, " ".join(command))
        started = time.monotonic()
        with open(output_dir / f"sites-{sites}.log", "w") as log_file:
            process = subprocess.Popen(command, env=env, stdout=log_file, stderr=subprocess.STDOUT)
            sampler = MemorySampler(psutil.Process(process.pid), flwr_home)
            sampler.start()
            try:
                returncode = process.wait(timeout=timeout + 120)
            finally:
                sampler.stop()
        wall = time.monotonic() - started
    row: dict[str, Any] = {
        "sites": sites,
        "returncode": returncode,
        "wall_seconds": wall,
        "peak_tree_rss_gb": sampler.peak_tree / 2**30,
        "peak_used_over_idle_gb": sampler.peak_used / 2**30,
        "memory_timeline": sampler.timeline,
    }
    results = out / "latest" / "results.json"
    stored = list((out / "latest" / "clients").glob("*.safetensors"))
    row["uploads_on_disk_gb"] = sum(path.stat().st_size for path in stored) / 2**30
    if results.is_file():
        report = json.loads(results.read_text())
        row.update(_phases(report, wall))
    return row


def _phases(report: dict[str, Any], wall: float) -> dict[str, Any]:
    """Where the time of one run went, from its results file."""
    phases = report.get("phases", {})
    server = float(report.get("wall_seconds", 0.0))
    clients = report.get("clients", [])
    site_seconds: dict[str, list[float]] = {}
    for client in clients:
        for phase, seconds in (client.get("seconds") or {}).items():
            site_seconds.setdefault(phase, []).append(float(seconds))
    fusions = report.get("fusions", {})
    accuracy = report.get("accuracy", {})
    return {
        "status": report.get("status"),
        "uploads": len(clients),
        "startup_seconds": max(0.0, wall - server),
        "wait_nodes_seconds": phases.get("wait_nodes"),
        "collect_seconds": phases.get("collect"),
        "handle_uploads_seconds": phases.get("handle_uploads"),
        "site_seconds_sum": {k: sum(v) for k, v in site_seconds.items()},
        "site_seconds_median": {k: statistics.median(v) for k, v in site_seconds.items()},
        "fusion_seconds": {
            name: f.get("seconds") for name, f in fusions.items() if f.get("status") == "ok"
        },
        "failed_methods": {
            name: f.get("error") for name, f in fusions.items() if f.get("status") != "ok"
        },
        "evaluate_seconds": phases.get("evaluate"),
        "accuracy": {name: r["accuracy"] for name, r in accuracy.get("fused", {}).items()},
        "ensemble_accuracy": accuracy.get("ensemble", {}).get("accuracy"),
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    """A markdown table of the rows, with the baseline's wall time and memory beside them."""
    methods = sorted({m for r in rows for m in r.get("fusion_seconds", {})})
    header = [
        "sites",
        "wall s",
        "baseline s",
        "speed-up",
        "peak tree RSS GB",
        "peak used over idle GB",
        "baseline GB",
        "start-up s",
        "wait nodes (Ray) s",
        "collect s",
        "site load / train / score s (median)",
        "upload handling s",
        *[f"fuse {m} s" for m in methods],
        "evaluate s",
        "uploads on disk GB",
        *[f"{m} acc %" for m in methods],
        "ensemble acc %",
        "status",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        base_wall, base_memory = BASELINE.get(row["sites"], (None, None))
        median = row.get("site_seconds_median", {})
        site = " / ".join(
            f"{median[k]:.2f}" if k in median else "-" for k in ("load", "train", "score")
        )
        cells = [
            str(row["sites"]),
            f"{row['wall_seconds']:.0f}",
            f"{base_wall:.0f}" if base_wall else "-",
            f"{base_wall / row['wall_seconds']:.2f}x" if base_wall else "-",
            f"{row['peak_tree_rss_gb']:.2f}",
            f"{row['peak_used_over_idle_gb']:.2f}",
            f"{base_memory:.1f}" if base_memory else "-",
            _num(row.get("startup_seconds")),
            _num(row.get("wait_nodes_seconds")),
            _num(row.get("collect_seconds")),
            site,
            _num(row.get("handle_uploads_seconds")),
            *[_num(row.get("fusion_seconds", {}).get(m), 2) for m in methods],
            _num(row.get("evaluate_seconds")),
            _num(row.get("uploads_on_disk_gb"), 2),
            *[_percent(row.get("accuracy", {}).get(m)) for m in methods],
            _percent(row.get("ensemble_accuracy")),
            str(row.get("status", f"exit {row['returncode']}")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _percent(value: Any) -> str:
    return "-" if value is None else f"{100 * float(value):.2f}"


def _num(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{float(value):.{digits}f}"


def check_run_config(run_config: str) -> None:
    """Raise ValueError in one line unless ``run_config`` ("key=value ...") parses into run
    settings: known keys, values in range, known methods."""
    from flwr.common.config import parse_config_args

    from fedfuse.settings.run import RunSettings

    config = parse_config_args([run_config]) if run_config.strip() else {}
    RunSettings.from_config(config).fusion_methods()


def register_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``scale`` subcommand."""
    parser = subparsers.add_parser(
        "scale",
        help="measure real simulations at growing site counts (time, memory, phases)",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument(
        "--sites",
        default=",".join(map(str, DEFAULT_SITES)),
        help="comma-separated site counts (default: %(default)s)",
    )
    parser.add_argument("--run-config", default=DEFAULT_RUN_CONFIG, help="(default: %(default)s)")
    parser.add_argument(
        "--cpus-per-client", type=Range(1, 1_024).argument("--cpus-per-client"), default=1
    )
    parser.add_argument(
        "--timeout",
        type=Range(0, 10**7, integer=False, open_low=True).argument("--timeout"),
        default=3600.0,
        help="seconds per run",
    )
    parser.add_argument(
        "--ray-address",
        default=None,
        help="run the sites on this Ray cluster (head host:port; docs/cluster.md)",
    )
    parser.add_argument("--output-dir", default="bench-results/scale")
    parser.set_defaults(handler=scale_command)
    return parser


def scale_command(args: argparse.Namespace) -> int:
    """Handler of ``fedfuse scale``."""
    try:
        sizes = [int(s) for s in args.sites.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--sites must be comma-separated integers, got {args.sites!r}") from None
    if not sizes or min(sizes) < 2 or max(sizes) > 100_000:
        raise ValueError(f"--sites must list site counts in [2, 100000], got {args.sites!r}")
    check_run_config(args.run_config)  # before the first run starts
    output_dir = Path(args.output_dir).expanduser().resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for sites in sizes:
        row = run_size(
            sites,
            args.run_config,
            output_dir,
            cpus_per_client=args.cpus_per_client,
            timeout=args.timeout,
            ray_address=args.ray_address,
        )
        rows.append(row)
        (output_dir / "scale.json").write_text(json.dumps(rows, indent=2) + "\n")
        print(format_table([row]).splitlines()[-1], flush=True)
    table = format_table(rows)
    command = f'fedfuse scale --sites {args.sites} --run-config "{args.run_config}"'
    (output_dir / "scale.md").write_text(f"`{command}`\n\n{table}\n")
    print(table)
    print(f"written: {output_dir / 'scale.json'}, {output_dir / 'scale.md'}")
    return 0 if all(r["returncode"] == 0 for r in rows) else 1
