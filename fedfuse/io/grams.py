r"""A site's level Gram matrix as it is sent and stored: in full, or as an exact factor.

The Gram of a level is :math:`G = X^\top X` over the level's design rows :math:`X` (``n x d``).
A site with fewer rows than columns (``n < d``: a thousand small sites, each with tens of
samples, on a 785-wide first layer) has a Gram of rank at most ``n``, and it is sent as the
triangular factor :math:`R` of :math:`X = QR` (``n x d``, :math:`G = R^\top R`) instead of the
``d x d`` matrix: ``n d`` numbers for ``d^2``, exact up to rounding, and positive semi-definite
by construction. :math:`R` says no more than :math:`G` does: for ``X`` of full row rank it is
fixed by :math:`G` up to the signs of its rows, while ``Q``, the rotation that would give back
the rows themselves, stays with the site.

A stored Gram of shape ``(d, d)`` is the matrix itself; one of shape ``(r, d)`` with ``r < d``
is a factor. :func:`full_gram` gives the matrix either way.
"""

from __future__ import annotations

import torch


def gram_factor(rows: torch.Tensor) -> torch.Tensor:
    """The upper-triangular factor ``R`` of ``rows = QR`` (float64), with
    ``R.T @ R == rows.T @ rows``; for ``rows`` with fewer rows than columns."""
    if rows.dim() != 2 or rows.shape[0] >= rows.shape[1]:
        raise ValueError(f"a Gram factor needs fewer rows than columns, got {tuple(rows.shape)}")
    return torch.linalg.qr(rows.double(), mode="r").R


def is_gram_factor(stored: torch.Tensor) -> bool:
    """Whether a stored Gram is a factor (``r x d``, ``r < d``) rather than the matrix."""
    return stored.dim() == 2 and stored.shape[0] < stored.shape[1]


def full_gram(stored: torch.Tensor) -> torch.Tensor:
    """The ``d x d`` Gram matrix (float64) of a stored Gram, full or factor."""
    stored = stored.double()
    return stored.T @ stored if is_gram_factor(stored) else stored


def gram_size(stored: torch.Tensor) -> int:
    """``d``, the side of the Gram matrix a stored Gram stands for."""
    return int(stored.shape[-1])
