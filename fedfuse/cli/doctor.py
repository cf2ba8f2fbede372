"""``fedfuse doctor``: what a run would use here (versions, device, data, Flower's state, Ray),
and a one-line reason for every problem found; exits non-zero when there is one."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import socket
import sys
import tempfile
from pathlib import Path

from fedfuse.federation.flower_state import (
    flwr_version,
    inspect_state_db,
    local_superlink_dir,
    simulation_flwr_home,
)

#: distributions a run needs, by the name they are installed under
PACKAGES = {
    "torch": "torch",
    "flwr": "flwr",
    "captum": "captum",
    "pot": "pot",
    "fedfuse": "fedfuse",
}


class Report:
    """Lines to print (``name  value``) and problems (one line each)."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []
        self.problems: list[str] = []

    def add(self, name: str, value: str, problem: str | None = None) -> None:
        self.lines.append((name, value))
        if problem:
            self.problems.append(problem)


def versions(report: Report) -> None:
    report.add("python", f"{platform.python_version()} ({sys.executable})")
    for name, dist in PACKAGES.items():
        try:
            report.add(name, importlib.metadata.version(dist))
        except importlib.metadata.PackageNotFoundError:
            report.add(name, "not installed", f"{name} is not installed (pip install {dist})")


def device(report: Report) -> None:
    try:
        import torch
    except ImportError:
        report.add("device", "unknown (no torch)")
        return
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        report.add("device", f"cuda ({len(names)}: {', '.join(names)})")
    else:
        report.add("device", f"cpu ({os.cpu_count()} cores; CUDA not available)")


def _first_dir(dirs: list[Path], names: list[str]) -> Path | None:
    """The first of ``dirs`` holding every one of ``names`` (each maybe gzipped)."""
    for d in dirs:
        if all((d / n).is_file() or (d / f"{n}.gz").is_file() for n in names):
            return d
    return None


def datasets(report: Report) -> None:
    """Where each dataset would be read from, as ``fedfuse.data``'s loaders search (no data is
    read); Fashion-MNIST, the default, missing is a problem."""
    from fedfuse.data._common import DATA_ENV_VAR, resolve_data_root
    from fedfuse.data.idx import FASHION_MNIST_SYSTEM_DIR

    root = resolve_data_root()
    origin = f"${DATA_ENV_VAR}" if os.environ.get(DATA_ENV_VAR) else f"${DATA_ENV_VAR} unset"
    report.add("data root", f"{root} ({origin})")
    idx = [
        f"{p}-{k}-idx{n}-ubyte"
        for p in ("train", "t10k")
        for k, n in (("images", 3), ("labels", 1))
    ]
    searches = {
        "fashion-mnist": (
            [root / "fashion-mnist", root / "FashionMNIST" / "raw", FASHION_MNIST_SYSTEM_DIR],
            idx,
        ),
        "mnist": ([root / "mnist", root / "MNIST" / "raw"], idx),
        "cifar10": ([root / "cifar-10-batches-py"], ["data_batch_1", "test_batch"]),
        "cifar100": ([root / "cifar-100-python"], ["train", "test"]),
    }
    for name, (dirs, files) in searches.items():
        found = _first_dir(dirs, files)
        problem = None
        if found is None and name == "fashion-mnist":
            problem = (
                f"Fashion-MNIST (the default dataset) is in none of {', '.join(map(str, dirs))}; "
                f"put its idx files in {dirs[0]} or set ${DATA_ENV_VAR}"
            )
        report.add(name, str(found) if found else "not found", problem)
    report.add("digits", "bundled with scikit-learn")
    medmnist(report, root)
    from fedfuse.data.partition_cache import cache_root

    report.add("partition cache", f"{cache_root()} ($FEDFUSE_CACHE; every site's split)")


def medmnist(report: Report, root: Path) -> None:
    """Where each 2D MedMNIST set would be read from (``<root>/medmnist/<flag>.npz``, then
    medmnist's own ``~/.medmnist``), on one line: the found ones by path, how many are not."""
    from fedfuse.data.medmnist import medmnist_flags

    flags = medmnist_flags()
    if not flags:
        report.add("medmnist", "the medmnist package is not installed (its sets are unavailable)")
        return
    places = (root / "medmnist", Path.home() / ".medmnist")
    found = {
        flag: next(str(p / f"{flag}.npz") for p in places if (p / f"{flag}.npz").is_file())
        for flag in flags
        if any((p / f"{flag}.npz").is_file() for p in places)
    }
    where = " or ".join(str(p / "<flag>.npz") for p in places)
    listed = ", ".join(f"{flag}: {path}" for flag, path in found.items())
    report.add(
        "medmnist",
        f"{len(found)} of {len(flags)} sets found ({listed or 'none'}); read from {where}",
    )


def flower_state(report: Report) -> None:
    home, chosen = simulation_flwr_home()
    how = "$FLWR_HOME" if chosen else f"fedfuse's own for flwr {flwr_version()}"
    report.add("FLWR_HOME", f"{home} ({how}; used by fedfuse simulate)")
    database = local_superlink_dir(home) / "state.db"
    state, problem = inspect_state_db(database)
    report.add("state.db", f"{database}: {state}", problem)


def _reachable(address: str, timeout: float = 1.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def ray_status(report: Report) -> None:
    """Ray's version and whether a cluster is reachable ($RAY_ADDRESS, else the one the last
    ``ray start`` recorded), without starting or joining one."""
    try:
        version = importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:
        report.add("ray", "not installed", "ray is not installed (pip install 'flwr[simulation]')")
        return
    given = os.environ.get("RAY_ADDRESS", "")
    if given and given != "auto":
        if given.startswith(("ray://", "http://", "https://")) or not _reachable(given):
            ok = given.startswith(("ray://", "http://", "https://"))
            report.add(
                "ray",
                f"{version}; $RAY_ADDRESS={given} " + ("(not probed)" if ok else "not reachable"),
                None
                if ok
                else f"$RAY_ADDRESS={given} is not reachable; unset it or start Ray there",
            )
        else:
            report.add("ray", f"{version}; cluster at $RAY_ADDRESS={given} reachable")
        return
    temp = os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()
    try:
        recorded = (Path(temp) / "ray" / "ray_current_cluster").read_text().strip()
    except OSError:
        recorded = ""
    if recorded and _reachable(recorded):
        report.add(
            "ray",
            f"{version}; a cluster is running at {recorded} (fedfuse simulate runs on it with "
            f"--ray-address {recorded}; without, it starts its own)",
        )
    else:
        stale = f" (the recorded one at {recorded} is gone)" if recorded else ""
        report.add("ray", f"{version}; no cluster running{stale}: fedfuse simulate starts its own")


def doctor(args: argparse.Namespace) -> int:
    """Print the report; one line on stderr per problem; 1 when there is one."""
    report = Report()
    for check in (versions, device, datasets, flower_state, ray_status):
        try:
            check(report)
        except Exception as error:  # a broken check is a problem, not a crash
            report.add(
                check.__name__, "check failed", f"{check.__name__}: {type(error).__name__}: {error}"
            )
    width = max(len(name) for name, _ in report.lines)
    for name, value in report.lines:
        print(f"{name:<{width}}  {value}")
    for problem in report.problems:
        print(f"fedfuse doctor: problem: {problem}", file=sys.stderr)
    return 1 if report.problems else 0


def register_cli(commands: argparse._SubParsersAction) -> None:
    """Add ``fedfuse doctor`` to the command line."""
    cmd = commands.add_parser(
        "doctor", help="check this machine: versions, device, data, Flower's state, Ray"
    )
    cmd.set_defaults(handler=doctor)
