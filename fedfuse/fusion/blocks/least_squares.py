r"""Least squares on a level's design matrix, in an orthonormal basis of its column space.

For an affine level with design ``X`` (``N x p``), every reachable output column lies in
``col(X)``. With an orthonormal basis ``Q`` (``N x r``) of that space, a base model's output column
``z`` has *coordinates* ``Q^T z`` and projection ``P z = Q Q^T z``; distances between projected
columns equal distances between coordinates, so grouping works in ``r <= p`` dimensions instead of
``N``. A target given in coordinates ``t`` is fitted exactly by ``W = M t`` with ``X M = Q``.

``Q`` and ``M`` come from the Cholesky factor of the Gram matrix ``X^T X`` (when ``N >= p``) or
the kernel ``X X^T`` (when ``N < p``), in float64. A ridge ``lambda``
replaces the exact fit by ``W = (X^T X + \lambda I)^{-1} X^T Q t``; it is needed when the fusion
set has fewer rows than the level's fan-in, where the exact fit interpolates the fusion set.

**Choosing the ridge.** Ridges are *relative*: the penalty is ``ridge * trace(X^T X) / p`` (the
mean eigenvalue of the Gram matrix; ``trace(X X^T)`` is the same number). When the ridge is not
given, one eigendecomposition per level (:func:`gram_spectrum`, :func:`kernel_spectrum`) serves
the grouping coordinates, the choice over :data:`RIDGE_GRID` and the final fit:

* kernel route (``N < p``), *exact leave-one-out*: with ``A = (K + lambda I)^{-1}``, the residual
  of row ``i`` when the fit omits it is ``(A T)_i / A_ii`` (:func:`loo_scores`);
* gram route (``N >= p``), *generalised cross-validation* (Golub, Heath & Wahba 1979),
  ``GCV(lambda) = n RSS(lambda) / (n - tr H(lambda))^2`` (:func:`gcv_scores`), from the
  eigenvalues, the targets' coordinates and their unprojected squared norms.

Both are mean squared errors per row, summed over output columns (each optionally weighted).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch

#: Relative ridges the automatic choice scans: 0 (the exact fit) and 1e-6 .. 10 in half decades.
#: Below 1e-6 a penalty is within the rounding of float32-accumulated design products (relative
#: error ~1e-6, see :func:`accumulate_normal_equations`), so it cannot be told from 0; at 10 a
#: direction of mean eigenvalue keeps 1/11 of its output, past every optimum measured (MLPs and
#: VGG11 on Fashion-MNIST, docs/ridge.md). Half decades: 16 values, each nearly free once the
#: level's eigendecomposition exists; neighbours differ by a factor 3.2 in penalty.
RIDGE_GRID: tuple[float, ...] = (0.0, *(10.0 ** (k / 2) for k in range(-12, 3)))


@dataclass
class LeastSquaresBasis:
    """``coordinates(Z) = Q^T Z`` and ``weights(T) = M T`` for one design matrix."""

    pivots: torch.Tensor  # squared Cholesky pivots above the cut-off (their count is the rank)
    _coord_left: torch.Tensor  # (p, r): coordinates = _coord_left^T @ (X^T Z)   [gram route]
    _weight_map: torch.Tensor  # (p, r): W = _weight_map @ T
    identity_coordinates: bool = False  # kernel route: the outputs are their own coordinates

    @property
    def rank(self) -> int:
        return len(self.pivots)

    def coordinates(self, xtz: torch.Tensor | None = None, z: torch.Tensor | None = None):
        """Coordinates ``(r, d)`` of output columns, from ``X^T Z`` (gram) or ``Z`` (kernel)."""
        if self.identity_coordinates:
            assert z is not None, "the kernel route needs the outputs Z"
            return z.double()
        assert xtz is not None, "the gram route needs X^T Z"
        return self._coord_left.T @ xtz

    def weights(self, targets: torch.Tensor) -> torch.Tensor:
        """Weights ``(p, k)`` whose outputs are the targets given in coordinates ``(r, k)``."""
        return self._weight_map @ targets

    @property
    def uses_kernel(self) -> bool:
        return self.identity_coordinates


def gram_basis(
    gram: torch.Tensor, *, rcond: float = 1e-10, ridge: float = 0.0
) -> LeastSquaresBasis:
    """Basis from ``G = X^T X`` (``p x p``) by Cholesky, ``G = R^T R``: ``Q = X R^{-1}``.

    Cholesky costs a tenth of an eigendecomposition, which dominates wide convolutional levels.
    Directions of ``G`` below ``rcond`` (relative to its mean diagonal) are regularised by a
    jitter, raised tenfold until the factorisation succeeds. ``ridge`` is relative to the mean
    eigenvalue (``trace(G) / p``).
    """
    g = gram.double()
    p = g.shape[0]
    scale = g.diagonal().mean().clamp_min(torch.finfo(g.dtype).tiny)
    eye = torch.eye(p, dtype=g.dtype, device=g.device)
    jitter = rcond * scale
    for _ in range(12):
        factor, info = torch.linalg.cholesky_ex(g + jitter * eye, upper=True)
        if int(info) == 0:
            break
        jitter *= 10
    else:
        raise ValueError("the level's Gram matrix is not positive semi-definite (NaN inputs?)")
    r_inv = torch.linalg.solve_triangular(factor, eye, upper=True)
    diagonal = factor.diagonal() ** 2
    rank = int((diagonal > max(rcond, 1e-12) * diagonal.max() * 10).sum())
    if ridge > 0:
        penalty = ridge * g.trace() / p
        # W = (G + penalty I)^{-1} X^T Q t with X^T Q = R^T (up to the jitter)
        weight_map = torch.cholesky_solve(factor.T, torch.linalg.cholesky(g + penalty * eye))
    else:
        weight_map = r_inv
    return LeastSquaresBasis(diagonal[:rank], r_inv, weight_map)


def kernel_basis(
    design: torch.Tensor, *, rcond: float = 1e-10, ridge: float = 0.0
) -> LeastSquaresBasis:
    """Basis for designs with fewer rows than columns, from ``K = X X^T`` (``N x N``) by Cholesky.

    With ``N < p`` the design's columns span all of ``R^N`` (up to the jitter that regularises
    a rank-deficient ``K``), so the identity is an orthonormal basis: the coordinates are the
    outputs themselves and the fit is kernel (ridge) regression ``W = X^T (K + lambda I)^{-1} T``.
    """
    x = design.double()
    kernel = x @ x.T
    n = kernel.shape[0]
    eye = torch.eye(n, dtype=x.dtype, device=x.device)
    scale = kernel.diagonal().mean().clamp_min(torch.finfo(x.dtype).tiny)
    penalty = ridge * kernel.trace() / x.shape[1]
    jitter = rcond * scale
    for _ in range(12):
        factor, info = torch.linalg.cholesky_ex(kernel + (penalty + jitter) * eye)
        if int(info) == 0:
            break
        jitter *= 10
    else:
        raise ValueError("the level's kernel matrix is not positive semi-definite (NaN inputs?)")
    weight_map = x.T @ torch.cholesky_inverse(factor)
    pivots = factor.diagonal() ** 2
    return LeastSquaresBasis(pivots, torch.empty(0), weight_map, identity_coordinates=True)


def accumulate_normal_equations(
    design_batches: Iterable[torch.Tensor],
    output_batches: Iterable[torch.Tensor],
    *,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``X^T X``, ``X^T Z`` and the squared norms of Z's columns, summed in float64.

    Each batch's products are computed in ``dtype``: float32 halves the cost of wide
    convolutional levels (the products dominate there) at a relative error of about 1e-6, which
    the Cholesky jitter of :func:`gram_basis` absorbs; the sums across batches stay float64.
    """
    gram = xtz = norms = None
    for x, z in zip(design_batches, output_batches, strict=True):
        x, z = x.to(dtype), z.to(dtype)
        batch_gram, batch_xtz = (x.T @ x).double(), (x.T @ z).double()
        batch_norms = (z.double() ** 2).sum(0)
        gram = batch_gram if gram is None else gram + batch_gram
        xtz = batch_xtz if xtz is None else xtz + batch_xtz
        norms = batch_norms if norms is None else norms + batch_norms
    if gram is None or xtz is None or norms is None:
        raise ValueError("no data to accumulate the normal equations from")
    return gram, xtz, norms


def weighted_least_squares(
    x: torch.Tensor, y: torch.Tensor, sample_weights: torch.Tensor | None = None, ridge: float = 0.0
) -> torch.Tensor:
    r"""``argmin_W sum_i a_i ||x_i W - y_i||^2 + ridge ||W||^2`` in float64 (via lstsq).

    The reference solver for the normal-equation route above, and the fit used where each row
    carries its own weight.
    """
    x, y = x.double(), y.double()
    if sample_weights is not None:
        root = sample_weights.double().clamp_min(0).sqrt()[:, None]
        x, y = x * root, y * root
    if ridge > 0:
        p = x.shape[1]
        x = torch.cat([x, torch.eye(p, dtype=x.dtype, device=x.device) * ridge**0.5])
        y = torch.cat([y, y.new_zeros(p, y.shape[1])])
    driver = "gelsd" if x.device.type == "cpu" else None
    return torch.linalg.lstsq(x, y, driver=driver).solution


# --------------------------------------------------------------------------- ridge selection
@dataclass(frozen=True)
class RidgeChoice:
    """The relative ridge a criterion chose over a grid, and the criterion along the grid.

    ``scores`` are mean squared errors per row, ``inf`` where undefined (GCV of a fit with as
    many effective parameters as rows); ties go to the smaller ridge.
    """

    ridge: float  # relative: the penalty is ridge * trace(X^T X) / p
    penalty: float  # the absolute penalty of ``ridge``
    criterion: str  # "loo" (kernel route) or "gcv" (gram route)
    grid: tuple[float, ...]
    scores: tuple[float, ...]


def loo_scores(
    values: torch.Tensor,
    vectors: torch.Tensor,
    targets: torch.Tensor,
    penalties: Sequence[float],
    column_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    r"""Exact leave-one-out error of kernel ridge regression, for each penalty.

    With ``K = X X^T = U diag(e) U^T`` and ``A = (K + lambda I)^{-1}``, the hat matrix is
    ``H = K A = I - lambda A``, so the fit without row ``i`` leaves it the residual
    ``(T - H T)_i / (1 - H_ii) = (A T)_i / A_ii`` (finite at ``lambda = 0`` too, where the full
    fit interpolates). Returns, per penalty,
    ``sum_c w_c sum_i ((A T)_ic / A_ii)^2 / N``.

    Args:
        values: eigenvalues ``e`` (``N``) of ``K``, positive (a jitter included).
        vectors: its eigenvectors ``U`` (``N x N``), orthonormal columns.
        targets: ``T`` (``N x k``).
        penalties: absolute penalties ``lambda >= 0``.
        column_weights: ``w_c`` (``k``), the weight of each target column; default 1.
    """
    e, u, t = values.double(), vectors.double(), targets.double()
    weights = _column_weights(column_weights, t)
    rotated = u.T @ t
    squared = u**2
    scores = []
    for penalty in penalties:
        inverse = 1.0 / (e + penalty)
        residuals = (u @ (inverse[:, None] * rotated)) / (squared @ inverse)[:, None]
        scores.append(float((residuals**2 @ weights).sum()) / max(len(t), 1))
    return torch.tensor(scores, dtype=torch.float64)


def gcv_scores(
    values: torch.Tensor,
    coordinates: torch.Tensor,
    target_norms: torch.Tensor,
    rows: int,
    penalties: Sequence[float],
    column_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    r"""Generalised cross-validation of ridge regression, for each penalty, from ``X^T X``'s
    eigendecomposition ``V diag(e) V^T``.

    With ``B = X^T T`` and the targets' coordinates ``u = diag(e)^{-1/2} V^T B`` (those of their
    projection onto ``col(X)``), the fit ``W = V diag(1 / (e + lambda)) V^T B`` leaves

    .. math::
        RSS(\lambda) = \|T\|^2 - 2 \operatorname{tr}(W^T B) + \operatorname{tr}(W^T G W)
        = \big(\|T\|^2 - \|u\|^2\big) + \sum_i \|u_i\|^2 \Big(\frac{\lambda}{e_i + \lambda}\Big)^2,

    the unreachable part plus the shrinkage of the reachable one; ``tr H = sum_i e_i/(e_i +
    lambda)`` and ``GCV = n RSS / (n - tr H)^2`` (``inf`` where ``tr H >= n``). Column sums are
    weighted by ``w_c``; the result is per row, like :func:`loo_scores`.

    Args:
        values: the eigenvalues ``e`` (``r``) kept, positive.
        coordinates: ``u`` (``r x k``).
        target_norms: ``||t_c||^2`` (``k``) of the *unprojected* targets: with projected ones
            ``RSS(0) = 0`` and GCV always picks 0.
        rows: ``n``, the design's rows.
        penalties: absolute penalties ``lambda >= 0``.
        column_weights: ``w_c`` (``k``); default 1.
    """
    e, u = values.double(), coordinates.double()
    weights = _column_weights(column_weights, u)
    energy = u**2 @ weights  # weighted ||u_i||^2 of each direction
    total = float(target_norms.double().to(weights.device) @ weights)
    unreachable = max(total - float(energy.sum()), 0.0)
    scores = []
    for penalty in penalties:
        rss = unreachable + float((penalty / (e + penalty)) ** 2 @ energy)
        freedom = float((e / (e + penalty)).sum())
        spare = rows - freedom
        scores.append(rows * rss / spare**2 if spare > 1e-9 * rows else math.inf)
    return torch.tensor(scores, dtype=torch.float64)


RidgeScores = Callable[[Sequence[float], torch.Tensor | None], torch.Tensor]


class _RidgeSelection:
    """The ridge choice both routes share: a grid of ridges relative to ``scale``, scored by the
    route's :attr:`criterion` (:func:`gcv_scores`, :func:`loo_scores`) that each route's
    ``_scores_of(targets, target_norms)`` binds to the targets."""

    criterion: ClassVar[str]
    scale: float

    def select_ridge(
        self,
        targets: torch.Tensor,
        *,
        target_norms: torch.Tensor | None = None,
        column_weights: torch.Tensor | None = None,
        grid: Sequence[float] = RIDGE_GRID,
    ) -> RidgeChoice:
        """The grid's ridge of least :attr:`criterion` (ties: the smaller; all undefined: the
        largest): GCV of targets in coordinates ``(r, k)`` whose unprojected squared norms are
        ``target_norms`` (``k``) on the gram route, exact leave-one-out error of targets ``(N, k)``
        on the kernel route (no ``target_norms``: the targets are not projected)."""
        penalties = [r * self.scale for r in grid]
        scores = self._scores_of(targets, target_norms)(penalties, column_weights)
        if len(grid) == 0:
            raise ValueError("the ridge grid is empty")
        values = [s if math.isfinite(s) else math.inf for s in scores.tolist()]
        best = min(range(len(grid)), key=lambda i: (values[i], grid[i]))
        if values[best] == math.inf:
            best = max(range(len(grid)), key=lambda i: grid[i])
        ridge = float(grid[best])
        return RidgeChoice(
            ridge, ridge * self.scale, self.criterion, tuple(grid), tuple(scores.tolist())
        )


@dataclass
class GramSpectrum(_RidgeSelection):
    r"""``G = X^T X = V diag(e) V^T`` (directions above the cut-off): one factorisation that
    gives the grouping coordinates (``Q = X V diag(e)^{-1/2}``), the GCV over a ridge grid and the
    fit ``W = V diag(sqrt(e) / (e + lambda)) t`` of targets given in coordinates ``t``."""

    values: torch.Tensor  # (r,) eigenvalues kept
    vectors: torch.Tensor  # (p, r)
    scale: float  # trace(G) / p: the unit of a relative ridge
    rows: int  # n, the design's rows

    uses_kernel = False
    criterion = "gcv"

    @property
    def rank(self) -> int:
        return len(self.values)

    def coordinates(self, xtz: torch.Tensor | None = None, z: torch.Tensor | None = None):
        """Coordinates ``(r, d)`` of output columns from ``X^T Z``."""
        assert xtz is not None, "the gram route needs X^T Z"
        return (self.vectors.T @ xtz.double()) / self.values.sqrt()[:, None]

    def weights(self, targets: torch.Tensor, ridge: float = 0.0) -> torch.Tensor:
        """Weights ``(p, k)`` of the ridge fit (``ridge`` relative) to targets in coordinates."""
        e = self.values
        return self.vectors @ ((e.sqrt() / (e + ridge * self.scale))[:, None] * targets.double())

    def _scores_of(self, targets: torch.Tensor, target_norms: torch.Tensor | None) -> RidgeScores:
        if target_norms is None:
            raise ValueError("GCV needs target_norms, the squared norms of the unprojected targets")
        return partial(gcv_scores, self.values, targets, target_norms, self.rows)


@dataclass
class KernelSpectrum(_RidgeSelection):
    r"""``K = X X^T = U diag(e) U^T`` for designs with fewer rows than columns: the outputs are
    their own coordinates, the exact leave-one-out error is scanned over a ridge grid and the fit
    is ``W = X^T U diag(1 / (e + lambda)) U^T T``."""

    values: torch.Tensor  # (N,) eigenvalues, clamped at 0, plus the jitter
    vectors: torch.Tensor  # (N, N)
    design: torch.Tensor  # X (N, p), float64
    scale: float  # trace(K) / p: the unit of a relative ridge
    rank: int  # eigenvalues above the jitter

    uses_kernel = True
    criterion = "loo"

    def coordinates(self, xtz: torch.Tensor | None = None, z: torch.Tensor | None = None):
        """The outputs ``Z`` themselves (the identity is the basis)."""
        assert z is not None, "the kernel route needs the outputs Z"
        return z.double()

    def weights(self, targets: torch.Tensor, ridge: float = 0.0) -> torch.Tensor:
        """Weights ``(p, k)`` of the kernel ridge fit (``ridge`` relative) to targets ``(N, k)``."""
        u = self.vectors
        inverse = 1.0 / (self.values + ridge * self.scale)
        return self.design.T @ (u @ (inverse[:, None] * (u.T @ targets.double())))

    def _scores_of(self, targets: torch.Tensor, target_norms: torch.Tensor | None) -> RidgeScores:
        return partial(loo_scores, self.values, self.vectors, targets)


def gram_spectrum(gram: torch.Tensor, *, rows: int, rcond: float = 1e-10) -> GramSpectrum:
    """:class:`GramSpectrum` of ``G = X^T X`` (``p x p``) from ``rows`` design rows, in float64.

    Columns of ``X`` that are 0 on every row (a zero diagonal entry: dead input channels) get
    weight 0 under any ridge, so only the others are decomposed (the cost grows as their count
    cubed). Eigenvalues up to ``rcond`` times the mean eigenvalue (or the rounding of the
    largest) are dropped: their directions are not in the basis, as for a minimum-norm fit.
    """
    g = gram.double()
    if not torch.isfinite(g).all():
        raise ValueError("the level's Gram matrix has NaN/Inf entries (NaN inputs?)")
    p = g.shape[0]
    live = (g.diagonal() > 0).nonzero().squeeze(1)
    values, live_vectors = symmetric_eigh(g[live][:, live])
    scale = float(g.trace()) / p
    top = float(values.max()) if len(values) else 0.0
    keep = values > max(rcond * scale, top * len(live) * torch.finfo(g.dtype).eps, 0.0)
    vectors = g.new_zeros(p, int(keep.sum()))
    vectors[live] = live_vectors[:, keep]
    return GramSpectrum(values[keep], vectors, scale, rows)


def kernel_spectrum(design: torch.Tensor, *, rcond: float = 1e-10) -> KernelSpectrum:
    """:class:`KernelSpectrum` of a design ``X`` (``N x p``, ``N < p``), in float64.

    As :func:`kernel_basis`, a jitter of ``rcond`` times the mean diagonal of ``K`` keeps a
    rank-deficient kernel invertible.
    """
    x = design.double()
    if not torch.isfinite(x).all():
        raise ValueError("the level's design has NaN/Inf entries (NaN inputs?)")
    kernel = x @ x.T
    values, vectors = symmetric_eigh(kernel)
    mean = float(kernel.diagonal().mean()) if len(kernel) else 0.0
    jitter = max(rcond * mean, torch.finfo(x.dtype).tiny)
    rank = int((values > jitter).sum())
    return KernelSpectrum(
        values.clamp_min(0) + jitter, vectors, x, mean * len(x) / x.shape[1], rank
    )


def symmetric_eigh(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.linalg.eigh`` of a symmetric PSD matrix, robust to LAPACK's rare failures.

    Divide and conquer can fail to converge on Gram matrices with many repeated eigenvalues
    (linearly dependent columns); it is then retried on the matrix scaled to unit mean diagonal
    plus a jitter (1e-12, raised tenfold) that is subtracted from the eigenvalues again.
    """
    try:
        return torch.linalg.eigh(matrix)
    except torch.linalg.LinAlgError:
        pass
    scale = float(matrix.diagonal().mean()) if len(matrix) else 1.0
    scale = scale if scale > 0 else 1.0
    eye = torch.eye(len(matrix), dtype=matrix.dtype, device=matrix.device)
    jitter = 1e-12
    for _ in range(8):
        try:
            values, vectors = torch.linalg.eigh(matrix / scale + jitter * eye)
            return (values - jitter) * scale, vectors
        except torch.linalg.LinAlgError:
            jitter *= 10
    raise ValueError("the eigendecomposition of the level's Gram or kernel matrix failed")


def _column_weights(weights: torch.Tensor | None, targets: torch.Tensor) -> torch.Tensor:
    """Column weights as float64 on the targets' device (ones when None), checked."""
    k = targets.shape[1]
    if weights is None:
        return torch.ones(k, dtype=torch.float64, device=targets.device)
    w = weights.double().reshape(-1).to(targets.device)
    if len(w) != k:
        raise ValueError(f"column_weights has {len(w)} entries for {k} target columns")
    return w


@dataclass
class RidgeFit:
    """A ridge fit from normal equations: the weights at the chosen ridge (relative), the grid
    and its GCV scores (``inf`` where the fit interpolates)."""

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
    grid: Sequence[float] = RIDGE_GRID,
    column_weights: torch.Tensor | None = None,
) -> RidgeFit:
    """The ridge fit of targets ``T`` on a design ``X`` known only through ``X^T X``, ``X^T T``,
    the targets' squared column norms and the row count (what a site can send without its
    data), the ridge chosen by GCV over ``grid`` from one eigendecomposition
    (:func:`gram_spectrum`); a one-value grid fits that ridge."""
    spectrum = gram_spectrum(gram, rows=rows)
    coordinates = spectrum.coordinates(xtz=cross)
    choice = spectrum.select_ridge(
        coordinates, target_norms=target_norms, column_weights=column_weights, grid=grid
    )
    weights = spectrum.weights(coordinates, choice.ridge)
    return RidgeFit(weights, choice.ridge, tuple(grid), list(choice.scores))


def cholesky_upper(gram: torch.Tensor) -> torch.Tensor:
    """``R`` with ``gram + jitter I = R^T R``, the jitter raised until the factorisation holds."""
    scale = float(gram.diagonal().mean().clamp_min(1e-300))
    eye = torch.eye(len(gram), dtype=gram.dtype)
    jitter = 1e-10 * scale
    for _ in range(12):
        factor, info = torch.linalg.cholesky_ex(gram + jitter * eye, upper=True)
        if int(info) == 0:
            return factor
        jitter *= 10
    raise ValueError("the pooled Gram matrix is not positive semi-definite (NaN statistics?)")
