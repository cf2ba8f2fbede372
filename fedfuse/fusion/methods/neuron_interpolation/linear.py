"""The Linear fit of one affine level, in closed form (paper Sec. 4, Theorem 2).

The base neurons' outputs are projected onto the image of the fused level's design (its inputs
from the fused levels below, as design rows); the neurons are grouped there, and the level's
weights are the least-squares (optionally ridge) fit of the groups' weighted centres. The ridge
is fixed, or chosen per level from the fusion set by leave-one-out (kernel route) or generalised
cross-validation (gram route). On the kernel route the ridge can shrink towards the base models'
own weights instead of towards zero (:mod:`.prior`). The design has a column of ones (an
intercept, the bias) exactly as ``fit_bias`` says (:func:`~fedfuse.models.affine.fit_intercept`;
by default when the layer has a bias).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Protocol

import torch

from fedfuse.fusion.blocks.costs import cluster_targets
from fedfuse.fusion.blocks.kmeans import scatter_around_means, weighted_centers
from fedfuse.fusion.blocks.least_squares import (
    RIDGE_GRID,
    GramSpectrum,
    KernelSpectrum,
    LeastSquaresBasis,
    RidgeChoice,
    accumulate_normal_equations,
    gram_basis,
    gram_spectrum,
    kernel_basis,
    kernel_spectrum,
)
from fedfuse.fusion.methods.neuron_interpolation.costs import level_cost, row_chunk
from fedfuse.fusion.methods.neuron_interpolation.grouping import GroupFn
from fedfuse.fusion.methods.neuron_interpolation.level_fit import LevelFit
from fedfuse.models.affine import affine_view, fit_intercept, output_rows


class LinearOptions(Protocol):
    """The options :func:`fit_linear` reads (:class:`~.interpolation_options.InterpolationOptions`
    has them all)."""

    name: str
    ridge: float | None
    rcond: float
    fit_bias: bool | str
    ridge_prior: str
    batch_size_capture: int

    @property
    def gram_dtype(self) -> torch.dtype: ...


def fit_linear(
    fit: LevelFit,
    weights: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    group: GroupFn,
    options: LinearOptions,
) -> dict[str, Any]:
    """Fit the affine ``fit.level`` (inputs ``fit.x``) in closed form to the weighted centres of
    the base ``fit.outputs``' groups (``labels``, or ``group`` them in the design's basis); return
    the level's details (costs, rank, ridge and how it was chosen, route, intercept) and the
    ``labels``; ``options.fit_bias`` as :func:`~fedfuse.models.affine.fit_intercept`.
    ``fit.columns``, when given, holds the vector outputs side by side (they are its column
    blocks), which spares concatenating them again. ``fit.prior_weights(intercept, weights,
    labels, k)``, when given, are the groups' centres of the base neurons' own weights on this
    level's inputs (:func:`~.prior.aligned_weight_centres`): on the kernel route the fit shrinks
    towards them where ``options.ridge_prior`` says (``"aligned"``; ``"auto"``: where that has
    the lower leave-one-out error; ``"zero"``: never)."""
    level, x, outputs, widths, k = fit.level, fit.x, fit.outputs, fit.widths, fit.k
    columns, prior_weights = fit.columns, fit.prior_weights
    name, ridge, rcond, ridge_prior = (
        options.name,
        options.ridge,
        options.rcond,
        options.ridge_prior,
    )
    batch_size_capture = options.batch_size_capture
    view = affine_view(level)
    if view is None:
        raise ValueError(
            f"{name}: level {type(level).__name__} is not affine (parameter-free ops "
            "then one Linear/Conv2d); use a gradient variant for it"
        )
    where = f"{name}: level {type(level).__name__}"
    view = replace(view, bias=fit_intercept(view.layer, options.fit_bias, where=where))
    chunk = row_chunk(sum(widths), len(x), batch_size_capture)
    positions = output_rows(outputs[0][:1]).shape[0]
    rows = len(x) * positions
    auto = ridge is None  # one eigendecomposition serves grouping, choice and fit
    basis: LeastSquaresBasis | GramSpectrum | KernelSpectrum
    if rows >= view.fan_in:
        base_chunks = (
            columns[s : s + chunk]
            if columns is not None
            else torch.cat([output_rows(o[s : s + chunk]) for o in outputs], 1)
            for s in range(0, len(x), chunk)
        )
        gram, xtz, norms = accumulate_normal_equations(
            view.design_batches(x, chunk), base_chunks, dtype=options.gram_dtype
        )
        if auto:
            basis = gram_spectrum(gram, rows=rows, rcond=rcond)
        else:
            basis = gram_basis(gram, rcond=rcond, ridge=ridge)
        # base neurons as rows, in the basis of the design's column space (float64: the
        # map back to weights amplifies rounding of these coordinates)
        points = basis.coordinates(xtz=xtz).T
        del xtz
    else:
        design = view.design(x)
        if auto or (prior_weights is not None and ridge_prior != "zero"):
            basis = kernel_spectrum(design, rcond=rcond)
        else:
            basis = kernel_basis(design, rcond=rcond, ridge=ridge)
        del design
        # the identity is the basis: the coordinates are the base outputs themselves
        points = (
            columns.T if columns is not None else torch.cat([output_rows(o).T for o in outputs])
        )
        norms = None
    # Kernel-route points are float32 (as captured); every sum is float64 either way.
    w64 = weights.double()
    if labels is None:
        labels = group(points, w64, widths, k)
    centers, mass = weighted_centers(points, w64, labels, k, dtype=torch.float64)
    if isinstance(basis, LeastSquaresBasis):
        fitted = basis.weights(centers.T)
        choice: dict[str, Any] = {"ridge": ridge, "ridge_criterion": "fixed"}
    else:
        # each fused neuron's error counts with its cluster's importance, as in Theorem 1;
        # GCV needs the unprojected targets' norms (with the projected ones it picks 0)
        target_norms = None if basis.uses_kernel else _target_norms(outputs, w64, labels, k, chunk)
        grid = RIDGE_GRID if auto else (float(ridge),)
        selected = basis.select_ridge(
            centers.T, target_norms=target_norms, column_weights=mass, grid=grid
        )
        fitted = basis.weights(centers.T, selected.ridge)
        choice: dict[str, Any] = {}
        if isinstance(basis, KernelSpectrum) and prior_weights and ridge_prior != "zero":
            towards = prior_weights(view.bias, w64, labels, k)
            prior, selected, fitted = _towards_prior(
                basis, towards, centers, mass, grid, ridge_prior, (selected, fitted)
            )
            choice["prior"] = prior
        choice |= {
            "ridge": selected.ridge,
            "ridge_criterion": selected.criterion if auto else "fixed",
            # 6 digits; None where undefined (GCV with as many parameters as rows)
            "ridge_scores": [
                float(f"{v:.6g}") if math.isfinite(v) else None for v in selected.scores
            ],
        }
    view.set_weights(fitted.float())
    grouping = scatter_around_means(points, w64, centers, mass)
    residual = 0.0  # the kernel route reaches every output exactly
    if norms is not None:
        reached = torch.cat(
            [(points[s : s + 65536].double() ** 2).sum(1) for s in range(0, len(points), 65536)]
        )
        residual = float((w64 * (norms - reached).clamp_min(0)).sum())
    return {
        **level_cost(level, x, outputs, labels, weights, batch_size_capture),
        "projected_grouping_error": grouping / rows,
        "unreachable_error": residual / rows,
        "rank": basis.rank,
        **choice,
        "fan_in": view.fan_in,
        "intercept": view.bias,
        "rows": rows,
        "route": "kernel" if basis.uses_kernel else "gram",
        "labels": labels,
    }


def _towards_prior(
    basis: KernelSpectrum,
    prior: torch.Tensor | None,
    centers: torch.Tensor,
    mass: torch.Tensor,
    grid: tuple[float, ...],
    ridge_prior: str,
    towards_zero: tuple[RidgeChoice, torch.Tensor],
) -> tuple[str, RidgeChoice, torch.Tensor]:
    """The kernel fit shrunk towards ``prior`` (``W0``, ``(k, p)``: the targets less ``X W0``,
    fitted, plus ``W0``), kept where ``ridge_prior`` says: which prior, the ridge choice and the
    weights ``(p, k)``; the fit towards zero without a prior."""
    if prior is None:
        return "zero", *towards_zero
    shifted = centers.T - basis.design @ prior.T
    selected = basis.select_ridge(shifted, column_weights=mass, grid=grid)
    if ridge_prior == "auto" and min(selected.scores) >= min(towards_zero[0].scores):
        return "zero", *towards_zero
    return "aligned", selected, prior.T + basis.weights(shifted, selected.ridge)


@torch.no_grad()
def _target_norms(
    outputs: list[torch.Tensor],
    weights: torch.Tensor,
    labels: torch.Tensor,
    k: int,
    chunk: int,
) -> torch.Tensor:
    """``||t_c||^2`` of each cluster's target over the fusion set's rows (unprojected),
    summed chunk by chunk in float64 (rows x base neurons per chunk)."""
    norms = torch.zeros(k, dtype=torch.float64, device=weights.device)
    for s in range(0, len(outputs[0]), chunk):
        z = torch.cat([output_rows(o[s : s + chunk]) for o in outputs], 1).double()
        norms += (cluster_targets(z, labels, weights, k) ** 2).sum(0)
    return norms
