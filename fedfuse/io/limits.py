"""How much a data file may hold unless the user raises the limit, and sizes as people read them.

Light to import (no NumPy, no PyTorch): the command line shows these as argument defaults. They
are written once, here; :mod:`fedfuse.data.npyfile` (:data:`DEFAULT_MAX_BYTES`,
:func:`format_bytes`), :mod:`fedfuse.data.arrays` (:data:`DEFAULT_MAX_CLASSES`) and
:mod:`fedfuse.data.images` (:data:`DEFAULT_MAX_SIDE`) import them and keep their names.
"""

from __future__ import annotations

#: Most bytes of array data one file may hold (and so make us allocate), unless raised.
DEFAULT_MAX_BYTES = 4 << 30
#: Most classes a file (or a converter) may declare unless raised: 1e8 classes would make a
#: model's last layer, and every per-class count, take gigabytes.
DEFAULT_MAX_CLASSES = 10_000
#: Largest image height or width a converter makes unless raised.
DEFAULT_MAX_SIDE = 2048


def format_bytes(n: int) -> str:
    """``n`` bytes in a short human form (``1.9 kB``, ``73.0 GiB``)."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("kB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
