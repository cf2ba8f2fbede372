"""Atomic file writes (a file is its old content or its complete new content); JSON documents."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temp path beside ``path``; on success it replaces ``path``, else it is removed."""
    path = Path(path)
    if path.is_dir():  # else os.replace fails naming the temporary file
        raise IsADirectoryError(f"{path}: is a folder; give a file name to write")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def require_file(path: str | Path, what: str) -> Path:
    """``path`` when it is a regular file (or a link to one); else ``FileNotFoundError`` (nothing
    there, a broken or looping link) or ``ValueError`` (a folder, device or FIFO: reading
    ``/dev/zero`` never ends, a FIFO blocks), naming ``path`` (and ``what`` file was wanted)."""
    path = Path(path)
    if path.is_file():
        return path
    if path.exists():
        kind = "a folder" if path.is_dir() else "a device, FIFO or socket"
        raise ValueError(f"{path}: is {kind}, not a regular file")
    raise FileNotFoundError(f"{path}: no such {what} file")


def refuse_overwriting_inputs(
    output: str | Path, inputs: Iterable[str | Path], option: str
) -> None:
    """A ``ValueError`` when ``output`` is (a link to, or another name of) one of the files a
    command reads, ``inputs``: writing it would replace what it was made from."""
    output = Path(output).expanduser()
    if not output.exists():
        return
    for source in inputs:
        source = Path(source).expanduser()
        if source.is_file() and output.samefile(source):
            raise ValueError(f"{option} {output} is one of the inputs; it would be overwritten")


def write_json(path: str | Path, document: dict[str, Any]) -> Path:
    """Write ``document`` as JSON atomically (a crash never leaves a half-written file)."""
    path = Path(path)
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(document, indent=2, default=str) + "\n")
    return path


def json_safe(value: Any) -> Any:
    """``value`` as plain JSON types: tensors and arrays become lists, other objects strings."""
    return json.loads(
        json.dumps(value, default=lambda v: v.tolist() if hasattr(v, "tolist") else str(v))
    )
