"""Run ``fedfuse`` commands as separate processes without paying PyTorch's import each time.

A test that hands a hostile file to the real command wants it in a process of its own, under a
memory limit, so that an allocation the command failed to refuse ends that process, not the
test run. Starting ``python -m fedfuse.cli.main`` costs 3-5 s, nearly all of it importing
PyTorch, Ray and fedfuse. Here one server process per test worker imports them once and forks a
child per command; the child sets the limits, points its stdout and stderr at files, runs
:func:`fedfuse.cli.main.main` with the command's arguments and exits with its status, as the
real command does (a bare exception: its traceback and status 1, as Python's own).

Run as a script, this module is that server: one JSON request per line on stdin, one JSON reply
per line on stdout.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _serve() -> None:
    """The server's loop: fork a child per request, reply with its exit status and peak memory."""
    import gc
    import resource
    import traceback

    import flwr.common.config  # noqa: F401
    import torch  # noqa: F401  the imports every command would pay for, done once

    from fedfuse.cli import fuse, predict, simulate, status  # noqa: F401
    from fedfuse.cli.main import main
    from fedfuse.deploy import predict as deploy_predict  # noqa: F401
    from fedfuse.federation import offline, scenario  # noqa: F401  fuse's and simulate's

    # the server's objects are out of the children's collections: a child's full collection
    # would otherwise walk (and copy, page by page) the whole inherited heap, costing it time
    # and making its measured peak depend on what the collector touched
    gc.freeze()
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # a stray print must not corrupt the replies
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: the command, as `python -m fedfuse.cli.main` would run it
            code = 1
            try:
                os.chdir(request["cwd"])
                space = request["address_space"]
                resource.setrlimit(resource.RLIMIT_AS, (space, space))
                signal.alarm(int(request["timeout"]))
                os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
                for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
                    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
                sys.argv = ["fedfuse", *request["argv"]]
                try:
                    code = main(request["argv"])
                except SystemExit as stop:
                    if stop.code is None or isinstance(stop.code, int):
                        code = stop.code or 0
                    else:
                        print(stop.code, file=sys.stderr)
                except BaseException:
                    traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, wait_status, usage = os.wait4(pid, 0)
        reply = {
            "returncode": os.waitstatus_to_exitcode(wait_status),
            "peak_bytes": usage.ru_maxrss * 1024,  # the child's peak resident set (Linux: KiB)
        }
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


class Outcome(subprocess.CompletedProcess):
    """A forked command's exit status and output, and ``peak_bytes``: the most memory it held
    resident at once (its ``ru_maxrss``, counting the pages it shares with the server, so a
    command's cost is its peak less that of an idle command, :meth:`ForkedCli.baseline`)."""

    def __init__(self, args: list[str], returncode: int, stdout: str, stderr: str, peak: int):
        super().__init__(args, returncode, stdout, stderr)
        self.peak_bytes = peak


class ForkedCli:
    """A client of one server process (started at the first command, stopped at exit)."""

    def __init__(self) -> None:
        self._server: subprocess.Popen | None = None
        self._baselines: dict[str, int] = {}

    def _started(self) -> subprocess.Popen:
        if self._server is None or self._server.poll() is not None:
            self._server = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve())],
                cwd=REPO,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            atexit.register(self._server.kill)
        return self._server

    def run(self, argv: list[str], *, cwd: Path, timeout: float, address_space: int) -> Outcome:
        """``fedfuse <argv>`` in a forked process limited to ``address_space`` bytes and
        ``timeout`` seconds (SIGALRM ends it: status -14); its exit status, output and peak."""
        server = self._started()
        with tempfile.TemporaryDirectory() as folder:
            out, err = Path(folder, "stdout"), Path(folder, "stderr")
            request = {
                "argv": argv,
                "cwd": str(cwd),
                "timeout": max(1, round(timeout)),
                "address_space": address_space,
                "stdout": str(out),
                "stderr": str(err),
            }
            assert server.stdin is not None and server.stdout is not None
            server.stdin.write(json.dumps(request) + "\n")
            server.stdin.flush()
            reply = server.stdout.readline()
            if not reply:
                raise RuntimeError(f"the forked-CLI server ended (status {server.wait()})")
            answer = json.loads(reply)
            return Outcome(
                ["fedfuse", *argv],
                answer["returncode"],
                out.read_text(errors="backslashreplace"),
                err.read_text(errors="backslashreplace"),
                answer["peak_bytes"],
            )

    def baseline(self, command: str) -> int:
        """The peak memory of ``fedfuse <command> --help`` (the server's pages and the command's
        imports, nothing of its work): what a command's own peak is measured from."""
        if command not in self._baselines:
            idle = self.run([command, "--help"], cwd=REPO, timeout=60, address_space=8 << 30)
            self._baselines[command] = idle.peak_bytes
        return self._baselines[command]


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    _serve()
