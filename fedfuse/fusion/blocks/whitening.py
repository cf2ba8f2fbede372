"""Whitening a design's Gram, and the cut that bounds what it amplifies.

The closed-form attention fits (:mod:`fedfuse.fusion.blocks.attention`) cut maps to a rank
where the data measures them, through a whitener of the design's Gram. How far down the
spectrum the whitener reaches is one setting of the fusion in progress (a method's
``whiten_rcond``), held here in a context variable so that every fit of that fusion reads it
without passing it through each piece.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

import torch

from fedfuse.fusion.blocks.least_squares import gram_spectrum

_Fused = TypeVar("_Fused")

#: :func:`whitener`'s default cut: eigenvalues below it times the Gram's mean eigenvalue are
#: dropped (the zero-shot fit; ``whiten_rcond`` of the closed-form methods)
WHITEN_RCOND = 1e-8
_whiten_rcond: ContextVar[float] = ContextVar("whiten_rcond", default=WHITEN_RCOND)


@contextmanager
def whitening_cutoff(rcond: float) -> Iterator[None]:
    """Within the block, :func:`whitener` drops eigen-directions below ``rcond`` times the
    mean eigenvalue. Whitening gives every kept direction of a design equal weight, so the
    factors fitted through it (attention's queries, keys and values) grow large along
    directions the data barely excites; they leave the function on the data alone but turn a
    training step into a large change. A cut near ``1e-3`` keeps them small at a small cost in
    the zero-shot fit (``docs/results.md``)."""
    token = _whiten_rcond.set(rcond)
    try:
        yield
    finally:
        _whiten_rcond.reset(token)


def uses_whitening_cutoff(fuse: Callable[..., _Fused]) -> Callable[..., _Fused]:
    """Decorate a fusion method's ``_fuse``: the pieces it fits whiten with the method's own
    ``whiten_rcond`` (:func:`whitening_cutoff`)."""

    @functools.wraps(fuse)
    def fuse_with_cutoff(self: Any, *args: Any, **kwargs: Any) -> _Fused:
        with whitening_cutoff(self.whiten_rcond):
            return fuse(self, *args, **kwargs)

    return fuse_with_cutoff


def whitener(gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(H, H^+)``: ``H H^T = gram`` on its range and ``H^+`` its pseudo-inverse transposed; a
    map ``M`` cut as ``H^T M`` is cut where the data measures its error (``||X M||``). The
    range is cut at :func:`whitening_cutoff`'s ``rcond``."""
    spectrum = gram_spectrum(gram, rows=1, rcond=_whiten_rcond.get())
    root = spectrum.values.sqrt()
    return spectrum.vectors * root, spectrum.vectors / root


__all__ = ["WHITEN_RCOND", "uses_whitening_cutoff", "whitener", "whitening_cutoff"]
