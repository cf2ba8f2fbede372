"""Allowed ranges of configured numbers, and the size a configured model may reach.

A :class:`Range` checks one value and names the key and the range in its error; the same range
serves as an ``argparse`` type (:meth:`Range.argument`), so a command-line option and a run-config
key fail alike, in one line, before anything starts. :func:`check_model_size` bounds a model that
the configuration describes (each width, and its parameter count) on the meta device, before any
memory is allocated. :func:`closest` names the nearest valid keys of a misspelt one.
"""

from __future__ import annotations

import argparse
import difflib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the command line parses with these ranges: no PyTorch at import
    from fedfuse.models import ModelSpec

#: the widest hidden level (neurons or channels) a configured model may have
MAX_WIDTH = 65_536
#: the most parameters a fused model may have unless the user raises the limit
#: (``fedfuse fuse --max-parameters``): 2e8 float32 parameters are 800 MB
DEFAULT_MAX_FUSED_PARAMETERS = 200_000_000


@dataclass(frozen=True)
class Range:
    """Numbers from ``low`` to ``high`` (inclusive, unless ``open_low``); integers only when
    ``integer``."""

    low: float
    high: float
    integer: bool = True
    open_low: bool = False

    def __str__(self) -> str:
        kind = "an integer" if self.integer else "a number"
        low, high = (int(x) if float(x).is_integer() else x for x in (self.low, self.high))
        return f"{kind} in {'(' if self.open_low else '['}{low}, {high}]"

    def contains(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if self.integer and not isinstance(value, int):
            return False
        if not math.isfinite(value):
            return False
        above = value > self.low if self.open_low else value >= self.low
        return above and value <= self.high

    def check(self, name: str, value: Any) -> Any:
        """``value``, or a ValueError naming ``name``, the value and the range."""
        if not self.contains(value):
            raise ValueError(f"{name}={value!r} is out of range; allowed: {self}")
        return value

    def argument(self, name: str) -> Callable[[str], int | float]:
        """An ``argparse`` type for option ``name`` (its error names the range)."""

        def parse(text: str) -> int | float:
            try:
                value: int | float = int(text) if self.integer else float(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{text!r} is not {self}") from None
            if not self.contains(value):
                raise argparse.ArgumentTypeError(f"{text} is out of range; allowed: {self}")
            return value

        parse.__name__ = name
        return parse


def closest(name: str, known: Iterable[str], *, listed: int = 3) -> str:
    """``"closest: 'a', 'b'"`` (the known names nearest ``name``), or every known name when
    none is near."""
    known = sorted(set(known))
    near = difflib.get_close_matches(name, known, n=listed, cutoff=0.6)
    if near:
        return "closest: " + ", ".join(repr(k) for k in near)
    return "known: " + ", ".join(known)


def parse_widths(text: str, what: str) -> list[int]:
    """``"512,512"`` as widths, each an integer in [1, :data:`MAX_WIDTH`]; errors name
    ``what``."""
    try:
        widths = [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        raise ValueError(f"{what} {text!r} must be comma-separated integers") from None
    width = Range(1, MAX_WIDTH)
    for w in widths:
        if not width.contains(w):
            raise ValueError(f"{what} {text!r}: width {w} is out of range; allowed: {width}")
    return widths


def parameter_count(spec: ModelSpec) -> int:
    """Parameters of a model of ``spec``, counted on the meta device (nothing allocated)."""
    from fedfuse.models import build_model

    return sum(p.numel() for p in build_model(spec, device="meta").parameters())


def check_model_size(spec: ModelSpec, max_parameters: int, what: str, limit: str) -> int:
    """Raise ValueError unless a model of ``spec`` has widths up to :data:`MAX_WIDTH` and at
    most ``max_parameters`` parameters; ``what`` names the model, ``limit`` how to raise the
    limit. Returns the parameter count."""
    wide = [w for w in spec.widths if w > MAX_WIDTH]
    if wide:
        raise ValueError(f"{what}: width {wide[0]} is over the limit of {MAX_WIDTH} ({limit})")
    count = parameter_count(spec)
    if count > max_parameters:
        raise ValueError(
            f"{what} would have {count:.3g} parameters, over the limit of {max_parameters:.3g} "
            f"({limit})"
        )
    return count
