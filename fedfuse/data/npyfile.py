"""Bounded reading of ``.npy`` files and ``.npz`` archives: sizes are checked before allocation.

``np.load`` trusts an array's header: a 2 kB file that declares 100 million images makes it
allocate the 73 GiB those images would take. Here every header is read first and its claim,
``prod(shape) * itemsize`` bytes, is held against what the file can really hold:

- a ``.npy`` file: its size on disk;
- a stored (uncompressed) ``.npz`` member: its size in the archive;
- a compressed member: its declared uncompressed size, and, because that too is written by
  whoever made the file, a deflate ceiling (deflate expands at most ~1032x) and ``max_bytes``.

The data is then read in chunks into an array of the declared size, so a member that ends
early fails with "truncated" instead of after a huge read. Arrays of Python objects are
refused at the header (nothing is unpickled), and so is any one array of more than
``max_bytes``. Errors are :class:`DataFormatError` naming the file and the key.
"""

from __future__ import annotations

import io
import math
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

from fedfuse.data._common import DataFormatError
from fedfuse.io.atomic import require_file
from fedfuse.io.limits import DEFAULT_MAX_BYTES, format_bytes

__all__ = [
    "DEFAULT_MAX_BYTES",
    "ArrayHeader",
    "NpzReader",
    "format_bytes",
    "read_npy",
]

#: Deflate never expands more than ~1032:1; a member claiming more is forged.
_DEFLATE_RATIO = 1032
_CHUNK_BYTES = 16 << 20
_ZIP_MAGIC = b"PK\x03\x04"
#: numpy's own bound on an .npy header (``max_header_size``): a dict of a few fields
_MAX_HEADER_BYTES = 10_000
#: how numpy writes .npz members; bzip2 and LZMA expand far beyond deflate's ~1032:1
_COMPRESSIONS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflated"}
_READ_ERRORS = (OSError, ValueError, zipfile.BadZipFile, EOFError)
_PICKLES = "it holds Python objects (pickles are refused)"


def _limit_hint(max_bytes: int) -> str:
    return f"the limit is {format_bytes(max_bytes)} (max_bytes, option --max-bytes)"


@dataclass(frozen=True)
class ArrayHeader:
    """What an ``.npy`` header declares: shape, dtype, memory order, and the data's size."""

    shape: tuple[int, ...]
    dtype: np.dtype
    fortran_order: bool

    @property
    def count(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize

    def describe(self) -> str:
        return f"{self.dtype} {self.shape} ({format_bytes(self.nbytes)})"


def _read_header(handle: IO[bytes], where: str) -> ArrayHeader:
    """The header at ``handle``'s position; refuses object arrays before any data is read."""
    try:
        version = np.lib.format.read_magic(handle)
        if version not in ((1, 0), (2, 0)):
            raise ValueError(f"unsupported .npy format version {version}")
        # the header's length, bounded before it is read (a 4-byte one may claim 4 GiB)
        size_bytes = handle.read(2 if version == (1, 0) else 4)
        length = int.from_bytes(size_bytes, "little")
        if length > _MAX_HEADER_BYTES:
            raise ValueError(f"header of {length} bytes; at most {_MAX_HEADER_BYTES}")
        header = io.BytesIO(size_bytes + handle.read(length))
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(header)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(header)
    except _READ_ERRORS as error:
        raise DataFormatError(f"{where}: not a valid .npy header ({error})") from None
    if dtype.hasobject:
        raise DataFormatError(f"{where}: {_PICKLES}")
    if any(n < 0 for n in shape):
        raise DataFormatError(f"{where}: negative axis in shape {shape}")
    if dtype.itemsize == 0 and math.prod(shape):
        raise DataFormatError(f"{where}: items of dtype {dtype} hold no bytes")
    return ArrayHeader(tuple(int(n) for n in shape), dtype, bool(fortran))


def _fill(handle: IO[bytes], header: ArrayHeader, where: str) -> np.ndarray:
    """Read ``header``'s data from ``handle`` in chunks into a new array of its shape."""
    try:
        flat = np.empty(header.count, dtype=header.dtype)
    except MemoryError:
        raise DataFormatError(
            f"{where}: cannot allocate {header.describe()}; lower max_bytes (--max-bytes) or "
            "free memory"
        ) from None
    buffer = memoryview(flat.view(np.uint8)) if header.nbytes else memoryview(b"")
    done = 0
    while done < header.nbytes:
        step = min(_CHUNK_BYTES, header.nbytes - done)
        chunk = handle.read(step)
        if not chunk:
            raise DataFormatError(
                f"{where}: truncated: the header declares {header.describe()}, the data ends "
                f"after {format_bytes(done)}"
            )
        buffer[done : done + len(chunk)] = chunk
        done += len(chunk)
    if header.fortran_order:
        return flat.reshape(header.shape[::-1]).transpose()
    return flat.reshape(header.shape)


def read_npy(path: str | Path, what: str = "array", *, max_bytes: int = DEFAULT_MAX_BYTES):
    """One ``.npy`` file, its header checked against the file's size and ``max_bytes``."""
    path = require_file(path, what)
    size = path.stat().st_size
    where = f"{path}: not a readable .npy {what} array"
    try:
        with path.open("rb") as handle:
            if handle.read(len(_ZIP_MAGIC)) == _ZIP_MAGIC:
                raise DataFormatError(f"{path}: is an .npz archive, expected one .npy {what} array")
            handle.seek(0)
            header = _read_header(handle, where)
            available = size - handle.tell()
            if header.nbytes > available:
                raise DataFormatError(
                    f"{path}: the header declares {header.describe()} but the file holds "
                    f"{format_bytes(max(available, 0))} of data (truncated or forged)"
                )
            if header.nbytes > max_bytes:
                raise DataFormatError(
                    f"{path}: the {what} array, {header.describe()}, is too large; "
                    + _limit_hint(max_bytes)
                )
            return _fill(handle, header, str(path))
    except OSError as error:
        raise DataFormatError(f"{where} ({error})") from None


class NpzReader:
    """An ``.npz`` archive read key by key, each header checked before its data is allocated.

    ``max_bytes`` bounds each array (a file holds a few: images, labels, ...). Use as
    a context manager; :meth:`header` costs a few hundred bytes, :meth:`read` reads a key and
    :meth:`chunks` yields a C-order array's leading-axis slices without holding it whole.
    """

    def __init__(self, path: str | Path, *, max_bytes: int = DEFAULT_MAX_BYTES):
        self.path = Path(path)
        self.max_bytes = max_bytes
        self._headers: dict[str, tuple[ArrayHeader, int]] = {}
        try:
            with self.path.open("rb") as handle:
                magic = handle.read(len(_ZIP_MAGIC))
            self._zip = zipfile.ZipFile(self.path)
        except _READ_ERRORS as error:
            if isinstance(error, FileNotFoundError):
                raise
            raise DataFormatError(f"{self.path}: not a readable .npz archive ({error})") from None
        if magic != _ZIP_MAGIC:  # zipfile also accepts a zip appended to other bytes
            self._zip.close()
            raise DataFormatError(f"{self.path}: not a readable .npz archive (no zip signature)")
        members = [info for info in self._zip.infolist() if not info.is_dir()]
        self._members = {info.filename.removesuffix(".npy"): info for info in members}
        problem = None
        if len(self._members) < len(members):  # tools differ on which of two copies is read
            names = [info.filename for info in members]
            twice = sorted({n for n in names if names.count(n) > 1})
            problem = f"holds {twice} more than once (which copy counts is ambiguous)"
        for info in members:
            if info.compress_type not in _COMPRESSIONS:
                kind = {zipfile.ZIP_BZIP2: "bzip2", zipfile.ZIP_LZMA: "lzma"}.get(
                    info.compress_type, f"method {info.compress_type}"
                )
                problem = (
                    f"member {info.filename!r} is compressed with {kind}; numpy writes "
                    "stored or deflated members only"
                )
        if problem is not None:
            self._zip.close()
            raise DataFormatError(f"{self.path}: not a readable .npz archive ({problem})")

    def __enter__(self) -> NpzReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._zip.close()

    @property
    def files(self) -> list[str]:
        return list(self._members)

    def _where(self, key: str) -> str:
        return f"{self.path}: key {key!r}"

    def header(self, key: str) -> ArrayHeader:
        """``key``'s header, checked against what the archive can hold and ``max_bytes``."""
        if key in self._headers:
            return self._headers[key][0]
        info = self._members[key]
        where = self._where(key)
        try:
            with self._zip.open(info) as handle:
                header = _read_header(handle, f"{self.path}: cannot read key {key!r}")
                offset = handle.tell()
        except DataFormatError:
            raise
        except _READ_ERRORS as error:
            raise DataFormatError(f"{where}: cannot be read ({error})") from None
        available = info.file_size - offset
        if header.nbytes > available:
            raise DataFormatError(
                f"{where}: the header declares {header.describe()} but the member holds "
                f"{format_bytes(max(available, 0))} of data (truncated or forged)"
            )
        if info.compress_type == zipfile.ZIP_DEFLATED:
            ceiling = info.compress_size * _DEFLATE_RATIO + (1 << 16)
            if header.nbytes > ceiling:
                raise DataFormatError(
                    f"{where}: the header declares {header.describe()} but "
                    f"{format_bytes(info.compress_size)} of deflated data cannot hold more than "
                    f"{format_bytes(ceiling)} (forged size)"
                )
        if header.nbytes > self.max_bytes:
            raise DataFormatError(
                f"{where}: {header.describe()} is too large; {_limit_hint(self.max_bytes)}"
            )
        self._headers[key] = (header, offset)
        return header

    def _open_data(self, key: str) -> tuple[ArrayHeader, IO[bytes]]:
        header = self.header(key)
        handle = self._zip.open(self._members[key])
        handle.read(self._headers[key][1])
        return header, handle

    def read(self, key: str) -> np.ndarray:
        """All of ``key``'s array."""
        where = self._where(key)
        try:
            header, handle = self._open_data(key)
            with handle:
                return _fill(handle, header, where)
        except DataFormatError:
            raise
        except _READ_ERRORS as error:
            raise DataFormatError(f"{where}: cannot be read ({error})") from None

    def chunks(self, key: str, chunk_bytes: int = _CHUNK_BYTES) -> Iterator[np.ndarray]:
        """``key``'s array in slices along its first axis, about ``chunk_bytes`` each.

        Fortran-order arrays cannot be sliced that way from the stream; they are read whole.
        """
        header = self.header(key)
        if header.fortran_order or len(header.shape) == 0:
            yield self.read(key)
            return
        where = self._where(key)
        row = math.prod(header.shape[1:]) * header.dtype.itemsize
        rows = max(1, chunk_bytes // max(row, 1))
        try:
            header, handle = self._open_data(key)
            with handle:
                for start in range(0, header.shape[0], rows):
                    n = min(rows, header.shape[0] - start)
                    part = ArrayHeader((n, *header.shape[1:]), header.dtype, False)
                    yield _fill(handle, part, where)
        except DataFormatError:
            raise
        except _READ_ERRORS as error:
            raise DataFormatError(f"{where}: cannot be read ({error})") from None


def peek_magic(path: Path) -> bytes:
    """The first bytes of ``path`` (to tell an ``.npy`` from an ``.npz``)."""
    with path.open("rb") as handle:
        return handle.read(len(_ZIP_MAGIC))


def is_npy(path: Path) -> bool:
    """Whether ``path`` starts like an ``.npy`` file."""
    return peek_magic(path).startswith(b"\x93NUM")
