"""JSON written by someone else (a ``results.json``, a checkpoint's metadata), parsed in bounds.

``json.loads`` holds every value it parses as a Python object: 60 MB of ``{},`` are 20 million
dicts, 1.4 GB and a minute of work, and 100,000 nested brackets end in a ``RecursionError``
that names nothing. Here the text is bounded first (fedfuse writes a few kB to a few MB; the
limit is far above that and keeps the worst case of the parse to a few hundred MB), only
regular files are opened (a FIFO would block, ``/dev/zero`` never ends), and every failure is a
``ValueError`` naming the source.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

from fedfuse.io.limits import format_bytes

#: The most JSON text read from one file or field: a 1,000-site run's results take ~1 MB; the
#: worst parse of 16 MiB (5.6 million empty objects) takes ~400 MB.
MAX_JSON_BYTES = 16 << 20


def parse_json(
    text: str | bytes, source: str, *, what: str = "JSON", max_bytes: int = MAX_JSON_BYTES
) -> Any:
    """``text`` parsed; a ``ValueError`` naming ``source`` (and ``what`` it held) when it is
    larger than ``max_bytes``, not UTF-8, not JSON, or nested too deeply."""
    if len(text) > max_bytes:
        raise ValueError(
            f"{source}: {what} of {format_bytes(len(text))}, larger than fedfuse writes "
            f"({format_bytes(max_bytes)} at most); not parsing it"
        )
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{source}: {what} is nested too deeply") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{source}: {what} is not UTF-8 text ({error})") from None
    except ValueError as error:  # JSONDecodeError, a number of too many digits
        raise ValueError(f"{source}: {what} is not valid JSON ({error})"[:1000]) from None


def read_json_file(
    path: str | Path, *, what: str = "JSON file", max_bytes: int = MAX_JSON_BYTES
) -> Any:
    """The JSON document in ``path``, a regular file of at most ``max_bytes`` (checked before
    reading, and again while reading); a ``ValueError`` or ``OSError`` naming ``path``."""
    path = Path(path)
    info = path.stat()
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{path}: not a regular file; expected a {what}")
    if info.st_size > max_bytes:
        raise ValueError(
            f"{path}: {format_bytes(info.st_size)}, larger than any {what} "
            f"({format_bytes(max_bytes)} at most); not reading it"
        )
    with path.open("rb") as file:
        data = file.read(max_bytes + 1)
    return parse_json(data, str(path), what=what, max_bytes=max_bytes)
