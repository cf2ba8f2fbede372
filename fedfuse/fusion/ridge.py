r"""Ridge regression from normal equations, the ridge chosen by generalised cross-validation.

Given only ``G = X^T X`` (``p x p``), ``B = X^T T`` (``p x k``), the squared norms of the
target columns ``||t_j||^2`` and the number of rows ``n`` (what sites can send without their
data), one eigendecomposition ``G = V diag(e) V^T`` gives, for every ridge ``lambda`` at once,

* the fit ``W_lambda = V diag(1 / (e + lambda)) V^T B``,
* its residual ``RSS(lambda) = sum_j ||t_j||^2 - 2 tr(W^T B) + tr(W^T G W)``, and
* the effective degrees of freedom ``df(lambda) = sum_i e_i / (e_i + lambda)``,

so GCV, ``n RSS(lambda) / (n - df(lambda))^2`` (Golub, Heath & Wahba 1979), is scanned over a
grid from that single factorisation. Ridges are *relative*: the penalty is
``ridge * trace(G) / p``, the mean eigenvalue, so one grid fits levels of any scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: relative ridges scanned by GCV: 0 (least squares) and 1e-8 .. 10 in half decades, wide enough
#: that the chosen value sits inside the grid on every level measured (MLP and VGG11)
RIDGE_GRID: tuple[float, ...] = (0.0, *(10.0 ** (k / 2) for k in range(-16, 3)))


@dataclass
class RidgeFit:
    """The weights at the chosen ridge, the ridge (relative) and the GCV value of every grid
    ridge (``inf`` where the fit interpolates, ``n <= df``)."""

    weights: torch.Tensor
    ridge: float
    grid: tuple[float, ...]
    criterion: list[float]


def ridge_fit(
    gram: torch.Tensor,
    cross: torch.Tensor,
    target_norms: torch.Tensor,
    rows: int,
    *,
    grid: tuple[float, ...] = RIDGE_GRID,
    column_weights: torch.Tensor | None = None,
    rcond: float = 1e-12,
) -> RidgeFit:
    """The ridge fit of targets ``T`` on design ``X`` from ``X^T X``, ``X^T T`` and ``||t_j||^2``.

    The ridge is the grid value minimising GCV, the residuals summed over target columns
    (weighted by ``column_weights`` when given). A one-value grid fits that ridge. Eigenvalues
    below ``rcond`` times the largest are treated as zero (a minimum-norm fit at ridge 0).
    """
    g = gram.double()
    b = cross.double()
    norms = target_norms.double().reshape(-1)
    if g.shape[0] != g.shape[1] or b.shape[0] != g.shape[0] or norms.shape[0] != b.shape[1]:
        raise ValueError(
            f"ridge_fit: gram {tuple(g.shape)}, cross {tuple(b.shape)} and {len(norms)} target "
            "norms do not fit together"
        )
    if not grid:
        raise ValueError("ridge_fit: the ridge grid is empty")
    eigenvalues, vectors = symmetric_eigh(g)
    top = float(eigenvalues.max()) if len(eigenvalues) else 0.0
    kept = eigenvalues > rcond * top
    rotated = vectors.T @ b  # (p, k)
    energy = rotated**2  # per eigen-direction and column
    weights = (
        torch.ones(b.shape[1], dtype=g.dtype, device=g.device)
        if column_weights is None
        else column_weights.double().reshape(-1).to(g.device)
    )
    scale = float(eigenvalues.sum()) / max(len(eigenvalues), 1)
    criterion: list[float] = []
    for relative in grid:
        inverse = _shrunk_inverse(eigenvalues, kept, relative * scale)
        explained = (energy * (2 * inverse - eigenvalues * inverse**2)[:, None]).sum(0)
        rss = float((weights * (norms - explained).clamp_min(0)).sum())
        dof = float((eigenvalues * inverse).sum())
        criterion.append(rows * rss / (rows - dof) ** 2 if rows - dof > 1e-9 * rows else math.inf)
    best = min(range(len(grid)), key=lambda i: (criterion[i], grid[i]))  # ties: less bias
    if criterion[best] == math.inf:  # every ridge interpolates: take the largest
        best = max(range(len(grid)), key=lambda i: grid[i])
    inverse = _shrunk_inverse(eigenvalues, kept, grid[best] * scale)
    fitted = vectors @ (inverse[:, None] * rotated)
    return RidgeFit(fitted, float(grid[best]), tuple(grid), criterion)


def symmetric_eigh(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (clamped at 0) and eigenvectors of a PSD matrix, in float64.

    LAPACK's divide-and-conquer ``eigh`` fails to converge on some Gram matrices of
    convolutional levels (many exactly repeated zero eigenvalues: channels dead on every row).
    The matrix is scaled to unit mean diagonal, and on failure a jitter (1e-12, raised tenfold)
    separates the repeated eigenvalues; it is subtracted again from the result.
    """
    m = matrix.double()
    m = (m + m.T) / 2
    scale = float(m.diagonal().mean()) if len(m) else 1.0
    scale = scale if scale > 0 else 1.0
    m = m / scale
    eye = torch.eye(len(m), dtype=m.dtype, device=m.device)
    jitter = 0.0
    for _ in range(8):
        try:
            values, vectors = torch.linalg.eigh(m + jitter * eye)
            return ((values - jitter) * scale).clamp_min(0), vectors
        except torch.linalg.LinAlgError:
            jitter = 1e-12 if jitter == 0 else jitter * 10
    raise ValueError("eigendecomposition of a Gram matrix failed (NaN/Inf statistics?)")


def _shrunk_inverse(eigenvalues: torch.Tensor, kept: torch.Tensor, penalty: float) -> torch.Tensor:
    """``1 / (e + penalty)``, with the dropped directions 0 when there is no penalty."""
    if penalty > 0:
        return 1.0 / (eigenvalues + penalty)
    return torch.where(kept, 1.0 / eigenvalues.clamp_min(1e-300), torch.zeros_like(eigenvalues))
