"""A table of hostile inputs run through the real ``fedfuse`` command, and what each must give.

Each :class:`Case` builds its files in a fresh folder and names the command to run on them; the
command runs in a process forked from a warm server (:mod:`tests.forked_cli`) under an address
space and time limit. :func:`check_case` then holds it to issue 50's rules:

- it fails (exit status not 0, not killed by its time limit), unless the case documents that
  succeeding is right;
- stderr ends in one line, ``fedfuse <command>[ <sub-command>]: error: ...``, naming what the
  case names (the file, key or option); no traceback;
- nothing printed holds a control character (escape sequences from file names or contents are
  shown escaped, never obeyed);
- its peak resident memory is under 1 GiB above that of the same command's ``--help`` (the
  server's pages and the command's imports);
- every file that was there before is there after, byte for byte, and a refused command leaves
  no new file behind.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import struct
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tests.forked_cli import ForkedCli, Outcome
from tests.helpers import patience

ADDRESS_SPACE = 6 << 30
TIMEOUT_S = 60
#: most memory a hostile input may cost a command above its idle peak
MEMORY_LIMIT = 1 << 30
#: one server for every table of a test process (started at the first case)
COMMANDS = ForkedCli()

Argv = list[str | Path]


@dataclass(frozen=True)
class Case:
    """One hostile input: ``build(folder)`` makes its files and returns the command's argv."""

    name: str
    build: Callable[[Path], Argv]
    #: text the error line must hold (the file, key or option at fault); ``{tmp}`` is the folder
    named: tuple[str, ...] = ()
    #: the command succeeds, and rightly (a documented zero)
    succeeds: bool = False
    #: files the command may write (relative to the folder), when it succeeds
    writes: tuple[str, ...] = field(default_factory=tuple)
    #: text its standard output must hold, when it succeeds
    printed: tuple[str, ...] = ()


def table(cases: list[Case]) -> dict:
    """``pytest.mark.parametrize`` arguments of a table, each case with its name as id."""
    return {"argvalues": cases, "ids": [c.name for c in cases]}


def control_characters(text: str) -> list[str]:
    """The control and format characters in ``text`` (line breaks and tabs allowed)."""
    return sorted({c for c in text if c not in "\n\t" and unicodedata.category(c)[0] == "C"})


def snapshot(folder: Path) -> dict[str, str]:
    """Every entry under ``folder`` (not following links) and a digest of what it holds."""
    found = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(root, name)
            key = str(path.relative_to(folder))
            if path.is_symlink():
                found[key] = "link " + os.readlink(path)
            elif path.is_dir():
                found[key] = "dir"
            elif path.is_file():
                found[key] = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                found[key] = "special"
    return found


def run_case(case: Case, folder: Path, commands: ForkedCli = COMMANDS) -> Outcome:
    """Build ``case`` in ``folder``, run its command there and check it (:func:`check_case`)."""
    folder.mkdir(parents=True, exist_ok=True)
    argv = [str(a) for a in case.build(folder)]
    before = snapshot(folder)
    result = commands.run(
        argv, cwd=folder, timeout=patience(TIMEOUT_S), address_space=ADDRESS_SPACE
    )
    check_case(case, result, folder, before, commands.baseline(argv[0]))
    return result


def check_case(
    case: Case, result: Outcome, folder: Path, before: dict[str, str], baseline: int
) -> None:
    command = result.args[1]
    report = f"{case.name}: status {result.returncode}\n{result.stderr[-3000:]}"
    assert result.returncode not in (-14, -9), f"ran out of time: {report}"
    assert "Traceback" not in result.stderr, report
    assert not control_characters(result.stdout + result.stderr), (
        control_characters(result.stdout + result.stderr),
        report,
    )
    cost = result.peak_bytes - baseline
    assert cost < MEMORY_LIMIT, (
        f"{case.name}: {cost / 2**20:.0f} MiB over the idle peak "
        f"(peak {result.peak_bytes >> 20} MiB, idle {baseline >> 20} MiB)"
    )
    after = snapshot(folder)
    changed = sorted(k for k, v in before.items() if after.get(k) != v)
    assert not changed, f"{case.name}: changed or removed {changed}"
    new = sorted(set(after) - set(before))
    if case.succeeds:
        assert result.returncode == 0, report
        assert set(new) <= set(case.writes), (new, report)
        for text in case.printed:
            assert text in result.stdout, (text, result.stdout[-2000:])
        return
    assert result.returncode != 0, report
    assert not new, f"{case.name}: a refused command left {new}"
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines, report
    last = lines[-1]
    assert last.startswith(f"fedfuse {command}") and ": error: " in last, report
    for text in case.named:
        assert text.format(tmp=folder) in last, (text, report)


# ---------------------------------------------------------------------------- file builders
def npy_bytes(
    array: np.ndarray | None = None, *, header: dict | None = None, data: bytes = b""
) -> bytes:
    """An ``.npy`` file: ``array`` saved, or ``header`` (as written) followed by ``data``."""
    buffer = io.BytesIO()
    if array is not None:
        np.save(buffer, array, allow_pickle=False)
        return buffer.getvalue()
    np.lib.format.write_array_header_1_0(buffer, header)
    return buffer.getvalue() + data


def npy_with_raw_header(text: str, data: bytes = b"") -> bytes:
    """An ``.npy`` (version 1.0) whose header dictionary is ``text`` verbatim."""
    body = text.encode("latin1")
    pad = (-(10 + len(body) + 1)) % 64
    body += b" " * pad + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(body)) + body + data


def safetensors_bytes(header: dict | str, data: bytes = b"", *, length: int | None = None) -> bytes:
    """A safetensors file: an 8-byte header length (``length`` or the true one), the JSON
    header (a dict, or text written verbatim) and ``data``."""
    text = header if isinstance(header, str) else json.dumps(header)
    raw = text.encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def write(path: Path, content: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, str):
        content = content.encode()
    path.write_bytes(content)
    return path
