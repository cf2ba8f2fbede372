"""Flower's local state and failures as ``fedfuse simulate`` and ``fedfuse doctor`` see them.

* Where the local SuperLink keeps its state (``FLWR_HOME``): fedfuse's own folder per installed
  flwr version unless the user set ``FLWR_HOME``, so that no other tool or Flower version
  migrates the ``state.db`` under it; and a check of a ``state.db``'s alembic revision against
  the installed flwr's migrations (a database another Flower version wrote is named in one line).
* Flower's local processes: the SuperLinks serving a control port, and stopping a process tree.
* Why Flower failed: the reason lines of its output and logs, and of a SuperLink started by hand
  when Flower's own start discards them.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import re
import sqlite3
import subprocess
from collections.abc import Iterable
from contextlib import closing
from pathlib import Path


# ------------------------------------------------------------- Flower's processes
def superlink_pids(control_port: str) -> list[int]:
    """PIDs of local ``flower-superlink`` processes serving ``control_port``."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        joined = b" ".join(argv)
        if b"flower-superlink" in joined and f"127.0.0.1:{control_port}".encode() in joined:
            pids.append(int(proc.name))
    return pids


def stop_process_tree(pids: list[int]) -> None:
    """Terminate ``pids`` and every process they started (the SuperLink runs the simulation and
    its Ray workers as descendants); kill what is left after 10 s."""
    import psutil

    processes = []
    for pid in pids:
        try:
            root = psutil.Process(pid)
            processes += [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
    _, alive = psutil.wait_procs(processes, timeout=10)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


# ------------------------------------------------------------- Flower's home and state database
class StateDatabaseError(ValueError):
    """The local SuperLink's state.db cannot be used by the installed Flower (one line)."""


def flwr_version() -> str:
    """The installed flwr's version ("not installed" when it is not)."""
    try:
        return importlib.metadata.version("flwr")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def simulation_flwr_home(environ: dict[str, str] | None = None) -> tuple[Path, bool]:
    """The FLWR_HOME of ``fedfuse simulate`` and whether the user chose it: ``$FLWR_HOME`` when
    set, else fedfuse's own per flwr version (``$XDG_STATE_HOME/fedfuse/flwr-<version>``,
    ``~/.local/state`` by default), where no other tool or Flower version writes its state.db."""
    environ = os.environ if environ is None else environ
    if environ.get("FLWR_HOME"):
        return Path(environ["FLWR_HOME"]).expanduser(), True
    state = Path(environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    return state.expanduser() / "fedfuse" / f"flwr-{flwr_version()}", False


def local_superlink_dir(flwr_home: Path) -> Path:
    """Where Flower's local SuperLink keeps ``state.db`` and ``superlink.log`` (as
    ``flwr.cli.local_superlink`` does: ``$FLWR_HOME/local-superlink``)."""
    return flwr_home / "local-superlink"


_REVISION = re.compile(r"""^revision(?:\s*:\s*[\w\[\] |]+)?\s*=\s*["']([0-9A-Za-z_]+)["']""", re.M)


def state_revisions() -> set[str]:
    """The alembic revisions of the installed flwr's state migrations (empty when not found)."""
    spec = importlib.util.find_spec("flwr")
    if spec is None or not spec.submodule_search_locations:
        return set()
    revisions: set[str] = set()
    for location in spec.submodule_search_locations:
        for script in (Path(location) / "supercore" / "state" / "alembic" / "versions").glob(
            "*.py"
        ):
            revisions.update(_REVISION.findall(script.read_text(errors="replace")))
    return revisions


def inspect_state_db(path: Path) -> tuple[str, str | None]:
    """What ``path`` (a local SuperLink's state.db) holds, and a one-line problem (None if none):
    a revision the installed flwr does not know (another Flower version migrated it) or a file
    that is no SQLite database."""
    if not path.is_file() or path.stat().st_size == 0:
        return "not created yet", None
    fix = "delete it (or its folder) or set FLWR_HOME to another directory"
    try:
        uri = f"{path.resolve().as_uri()}?mode=ro"
        with closing(sqlite3.connect(uri, uri=True)) as db:
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master")}
            if "alembic_version" not in tables:
                return "no alembic revision (Flower migrates or stamps it)", None
            found = sorted(row[0] for row in db.execute("SELECT version_num FROM alembic_version"))
    except sqlite3.Error as error:
        return "unreadable", f"{path} is not a readable SQLite database ({error}); {fix}"
    known = state_revisions()
    unknown = [revision for revision in found if known and revision not in known]
    if unknown:
        return (
            f"revision {', '.join(found)} (unknown)",
            f"{path} was written by another Flower version: alembic revision "
            f"{', '.join(repr(r) for r in unknown)} is not one of the installed flwr "
            f"{flwr_version()}'s; {fix}",
        )
    return f"revision {', '.join(found) or 'none'} (known to flwr {flwr_version()})", None


# ---------------------------------------------------------------- why Flower failed, from its logs
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_LEVEL = re.compile(r"^(?:ERROR|CRITICAL)\b\s*:?\s*(?:\S+ \d{4}-\d\d-\d\d[^|]*\|[^|]*\|\s*)?")
_EXCEPTION = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception|Exit)\b:\s*\S")
_CLICK_ERROR = re.compile(r"^(?:Error|FAILED|Failed)\b\s*:?\s*")


def _unboxed(lines: Iterable[str]) -> Iterable[str]:
    """``lines`` with each of Flower's boxed errors (``╭─ Error ─╮ │ text │ ╰─╯``, wrapped over
    several lines) as one line ``Error: text``."""
    box: list[str] | None = None
    for raw in lines:
        line = _ANSI.sub("", raw).strip()
        if line.startswith("╭") and "Error" in line:
            box = []
        elif box is not None and line.startswith("│"):
            box.append(line.strip("│ "))
        elif box is not None:
            yield "Error: " + " ".join(box)
            box = None
        else:
            yield line
    if box:
        yield "Error: " + " ".join(box)


def failure_reason(text: str, limit: int = 5) -> list[str]:
    """The last ``limit`` lines of Flower's output or log that say why it failed: its ERROR and
    CRITICAL records (their message only; an ``Exit Code: N`` record with the line after it, as
    Flower prints the reason there), error lines (``Error: ...``, boxed ones joined) and the
    final line of each traceback (``SomeError: ...``), each at most 300 characters, repeats
    dropped."""
    reasons: list[str] = []
    exit_code = False  # the last reason is an ``Exit Code: N`` awaiting its explanation
    for line in _unboxed(text.splitlines()):
        if not line or line.startswith("Traceback"):
            continue
        if _LEVEL.match(line):
            message = _LEVEL.sub("", line, count=1)
        elif _EXCEPTION.match(line) or _CLICK_ERROR.match(line):
            message = line
        elif exit_code and not re.match(r"^(DEBUG|INFO|WARNING)\b", line):
            reasons[-1] = f"{reasons[-1]}: {line}"[:300]
            exit_code = False
            continue
        else:
            exit_code = False
            continue
        message = message.strip()[:300]
        exit_code = bool(re.fullmatch(r"Exit Code: \d+", message))
        if exit_code or (message and message not in reasons[-limit:]):
            reasons.append(message)
    return reasons[-limit:]


def read_from(path: Path, offset: int, most: int = 256_000) -> str:
    """``path``'s text written after ``offset`` (all of it when it was rotated), at most the
    last ``most`` bytes; "" when unreadable."""
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(max(offset if size >= offset else 0, size - most))
            return handle.read().decode(errors="replace")
    except OSError:
        return ""


def superlink_startup_error(env: dict[str, str], database: Path, wait: float = 20.0) -> list[str]:
    """Why the local SuperLink does not start: Flower starts it with its output discarded, so
    start it the same way (its state.db, free of other runs' ports) with the output kept for at
    most ``wait`` seconds; the reason lines of a failed start, [] if it started (then stopped)."""
    command = ["flower-superlink", "--insecure", "--simulation", "--isolation", "subprocess"]
    command += [
        "--host",
        "127.0.0.1",
        "--port",
        env.get("FLWR_LOCAL_SUPERLINK_HTTP_API_PORT", "39091"),
    ]
    command += [
        "--control-api-address",
        f"127.0.0.1:{env.get('FLWR_LOCAL_CONTROL_API_PORT', '39093')}",
    ]
    command += ["--database", str(database)]
    try:
        process = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    except OSError as error:
        return [f"cannot run flower-superlink: {error}"]
    try:
        output, _ = process.communicate(timeout=wait)
    except subprocess.TimeoutExpired:
        stop_process_tree([process.pid])
        return []
    return failure_reason(output, limit=3) if process.returncode else []
