"""Devices and seeding: the two pieces of global state every entry point must set the same way.

Light to import: PyTorch and NumPy are imported by the functions that use them, so that the
command line can configure logging (:func:`configure_logging`) without loading them.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """Return the torch device for ``device``; ``"auto"`` picks CUDA when present, else the CPU."""
    import torch

    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was requested but CUDA is not available here")
    return resolved


def check_device(device: object) -> str:
    """``device`` if it names a device (``auto``, ``cpu``, ``cuda``, ``cuda:1``, ...), else a
    ValueError saying what is accepted; whether CUDA is present is checked when it is used."""
    import torch

    if isinstance(device, str) and device == "auto":
        return device
    try:
        torch.device(device)  # type: ignore[call-overload]
    except (RuntimeError, TypeError):
        raise ValueError(
            f"device {device!r} is not a device; use auto, cpu, cuda or cuda:<index>"
        ) from None
    return str(device)


def seed_everything(seed: int) -> torch.Generator:
    """Seed Python, NumPy and torch, and return a CPU generator seeded the same way.

    Prefer passing the returned generator (or the seed) explicitly; the global seeding only
    guards third-party code that draws from the global streams.
    """
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    os.environ.setdefault("PYTHONHASHSEED", str(seed))
    return torch.Generator().manual_seed(seed)


def row_major(x: torch.Tensor) -> torch.Tensor:
    """``x`` if its strides are plain row-major (NCHW for images), else a row-major copy.

    ``Tensor.is_contiguous()`` is not enough: it ignores the stride of a size-1 axis, which
    NumPy slicing leaves at any value, and PyTorch then reads a one-channel batch as
    channels-last and runs every convolution in NHWC. PyTorch 2.14.1's oneDNN backward of a 1x1
    stride-2 convolution on channels-last batches with 3-4 input channels corrupts the heap on
    one CPU thread (``tests/unit/test_data.py``), so data entering fedfuse is kept NCHW.
    """
    import torch

    strides, step = [], 1
    for size in reversed(x.shape):
        strides.append(step)
        step *= max(int(size), 1)
    if x.stride() == tuple(reversed(strides)):
        return x
    return x.clone(memory_format=torch.contiguous_format)


@contextmanager
def capped_threads(num_threads: int | None) -> Iterator[None]:
    """Cap torch's intra-op threads to ``num_threads`` for the block (several simulated sites
    share a few cores), then restore the count found: a site run in the caller's process (a
    test, ``fedfuse compare``, a library user) leaves the process as it was. None or 0: no cap."""
    import torch

    found = torch.get_num_threads()
    if num_threads is not None and num_threads > 0:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != found:
            torch.set_num_threads(found)


def configure_logging(level: int = logging.INFO) -> None:
    """Send fedfuse's log records to stderr at ``level`` (once; keeps existing handlers)."""
    logger = logging.getLogger("fedfuse")
    logger.setLevel(level)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


class PeakMemory:
    """Peak resident memory of this process while a block runs, sampled every ``interval`` s.

    ``with PeakMemory() as peak: ...`` then ``peak.rss_mib`` (the highest RSS seen, MiB),
    ``peak.extra_mib`` (that peak over the RSS at the start: what the block itself needed) and,
    on CUDA, ``peak.cuda_mib`` (``torch.cuda.max_memory_allocated`` during the block).
    """

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self.rss_mib = self.extra_mib = 0.0
        self.cuda_mib: float | None = None

    def __enter__(self) -> PeakMemory:
        import threading

        import psutil
        import torch

        process = psutil.Process()
        self._start = process.memory_info().rss
        self._peak = self._start
        self._done = threading.Event()

        def sample() -> None:
            while not self._done.wait(self.interval):
                self._peak = max(self._peak, process.memory_info().rss)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc: object) -> None:
        import psutil
        import torch

        self._done.set()
        self._thread.join()
        self._peak = max(self._peak, psutil.Process().memory_info().rss)
        self.rss_mib = self._peak / 2**20
        self.extra_mib = (self._peak - self._start) / 2**20
        if torch.cuda.is_available():
            self.cuda_mib = torch.cuda.max_memory_allocated() / 2**20


def release_free_memory() -> None:
    """Hand the memory this process freed back to the system (glibc's ``malloc_trim``).

    glibc raises its mmap threshold after large blocks are freed, so later tensors of a few
    hundred KB come from the heap, and freeing them leaves the heap as large as it grew. A fusion
    of many models frees gigabytes of level outputs; without this the process keeps them until it
    ends. A no-op where the C library is not glibc.
    """
    import contextlib
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
