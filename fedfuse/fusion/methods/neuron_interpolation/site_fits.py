r"""The server's fit of one linear piece from the sites' statistics, once they are gathered.

``kf-sites`` and its kin (:mod:`.sites`, :mod:`.grams`, :mod:`.trusted`) gather, for the fused
piece's design ``X_k`` on site ``k``'s data and the site model's outputs ``Z_k``, the statistics
``G_k = X_k^T X_k``, ``B_k = X_k^T Z_k``, ``C_k = Z_k^T Z_k`` and the translation
``H_k = (G_k + lambda_k I)^{-1} B_k`` of the site's neurons into the fused inputs
(:mod:`fedfuse.fusion.statistics.rounds`). What follows needs nothing else:

1. *Grouping*: neuron ``i`` of model ``k`` is the column ``h_i`` of ``H_k``, a function of the
   fused inputs; with ``G = sum_k G_k = R^T R`` the pooled design's Gram, ``||R (h_i - h_j)||``
   is the distance of two neurons' outputs over all sites' data. The points ``R h_i`` are
   grouped as in HF (one-to-one Hungarian matching; more than two models: iterative
   re-matching, :func:`~fedfuse.fusion.blocks.matching.one_to_one_labels`) or KF
   (k-means), weighted by the sites' importance scores (:func:`group_readings`).
2. *Reading*: fused neuron ``c`` is read, on site ``k``'s data, as model ``k``'s neurons in group
   ``c`` (importance-weighted mean), or model ``k``'s nearest neuron when the group has none of
   its neurons: a matrix ``P_k`` (``fused width x width_k``). The classifier reads each model's
   own logits.
3. *Fit* (RegMean-style, but on the fused inputs): on each site's data the fused level should
   reproduce the site's own model, the expert there,
   ``W = argmin sum_k ||X_k W - Z_k P_k^T||^2 + lambda ||W||^2
   = (G + lambda I)^{-1} sum_k B_k P_k^T``, the ridge chosen by GCV from the same statistics
   (:func:`fit_to_readings`). A piece that adds to a residual stream fits the readings minus
   the stream.

An attention's queries and keys are fitted through their logits instead
(:func:`fit_attention_logits`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from fedfuse.fusion.blocks.attention import GroupFn, attention_logits
from fedfuse.fusion.blocks.least_squares import RIDGE_GRID, cholesky_upper, ridge_fit
from fedfuse.fusion.statistics.readings import (
    number_like_the_stream,
    readings_from_groups,
    stream_tensor,
)
from fedfuse.fusion.statistics.rounds import SiteStatistics

#: ``readings_of(gram)``: each site's reading of the fused neurons, grouped through the pooled
#: Gram, and what the grouping found
ReadingsFn = Callable[[torch.Tensor], tuple[dict[int, torch.Tensor], dict[str, Any]]]


def pooled_gram(statistics: Mapping[int, SiteStatistics]) -> torch.Tensor:
    """``G = sum_k G_k`` in float64 (compressed Grams reconstructed)."""
    return sum(statistics[m].full_gram() for m in statistics)  # type: ignore[return-value]


def group_readings(
    gram: torch.Tensor,
    statistics: Mapping[int, SiteStatistics],
    scores: Mapping[int, torch.Tensor],
    width: int,
    group: GroupFn,
) -> tuple[dict[int, torch.Tensor], dict[str, Any]]:
    """Group the sites' translated neurons ``R h_i`` (``scores``: each site's importances) into
    ``width`` fused neurons with ``group``; each model's reading ``(width, width_k)`` and what
    the grouping found (module docstring, steps 1 and 2)."""
    order = list(statistics)
    factor = cholesky_upper(gram)
    points = torch.cat([(factor @ statistics[m].translation.double()).T for m in order])
    weights = torch.cat([scores[m].double().cpu() for m in order])
    sizes = [statistics[m].translation.shape[1] for m in order]
    labels = group(points, weights, sizes, width)
    readings, info = readings_from_groups(points, weights, labels, sizes, width)
    return dict(zip(order, readings, strict=True)), info


def fit_to_readings(
    gram: torch.Tensor,
    statistics: Mapping[int, SiteStatistics],
    readings: Mapping[int, torch.Tensor],
    *,
    residual: bool,
    ridge: float | None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The piece's weights ``(fan_in, width)`` fitted to every site's reading of its own model
    (module docstring, step 3), and what the fit found. ``residual``: the targets are the
    readings minus the stream the piece adds to (the sites sent its statistics); ``ridge``:
    relative, None chooses it by GCV over :data:`RIDGE_GRID`."""
    order = list(statistics)
    rows = sum(statistics[m].rows for m in order)
    rhs = sum(statistics[m].cross.double() @ readings[m].T for m in order)
    norms = sum(
        ((readings[m] @ statistics[m].target_gram.double()) * readings[m]).sum(1) for m in order
    )
    if residual:  # the targets are the readings minus the stream S they add to
        rhs = rhs - sum(stream_tensor(statistics[m], "stream_cross") for m in order)
        norms = norms + sum(
            stream_tensor(statistics[m], "stream_norms")
            - 2 * (readings[m] @ stream_tensor(statistics[m], "stream_target")).diagonal()
            for m in order
        )
    grid = RIDGE_GRID if ridge is None else (ridge,)
    fit = ridge_fit(gram, rhs, norms, rows, grid=grid)
    info = {
        "ridge": fit.ridge,
        "ridge_criterion": "gcv" if ridge is None else "fixed",
        "gcv": fit.criterion,
        "rows": rows,
        "fan_in": gram.shape[0],
        "translation_ridges": {str(m): statistics[m].translation_ridge for m in order},
    }
    return fit.weights, info


def fit_piece(
    statistics: Mapping[int, SiteStatistics],
    width: int,
    readings_of: ReadingsFn | None = None,
    *,
    ridge: float | None,
    stream: Mapping[int, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """The piece's weights ``(fan_in, width)``, its pooled Gram and what the fit found.

    ``readings_of`` groups the sites' neurons into the fused ones; None reads each site's own
    neurons as they are (the classifier's logits, or targets the sites mapped already).
    ``stream``: given when the piece's outputs add to the level input (the sites sent its
    stream statistics): each site's reading of the stream, kept as this piece's (an identity
    shortcut adds model ``k``'s channel ``j`` to its own output ``j``); when it lacks a site,
    the groups are numbered like the stream's channels. ``info["readings"]`` holds the
    readings used."""
    order = list(statistics)
    gram = pooled_gram(statistics)
    if readings_of is None:
        readings = {m: torch.eye(width, dtype=torch.float64) for m in order}
        info: dict[str, Any] = {}
    elif stream is not None and all(
        m in stream and stream[m].shape == (width, statistics[m].cross.shape[1]) for m in order
    ):
        readings, info = {m: stream[m] for m in order}, {"groups": "the stream's"}
    else:
        readings, info = readings_of(gram)
        if stream is not None:
            readings = number_like_the_stream(statistics, readings)
    weights, fitted = fit_to_readings(
        gram, statistics, readings, residual=stream is not None, ridge=ridge
    )
    info.update(fitted)
    info["readings"] = readings
    return weights, gram, info


def fit_attention_logits(
    statistics: Mapping[int, SiteStatistics],
    base_heads: list[int],
    level: nn.Module,
    group: GroupFn,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """An attention's queries and keys from each site's translation of its own queries and
    keys (``base_heads``: each site model's head count;
    :func:`~fedfuse.fusion.blocks.attention.attention_logits`), the pooled Gram measuring the
    logits; returns the weights, the Gram and what the fit found."""
    order = list(statistics)
    gram = pooled_gram(statistics)
    heads = level.attention.heads
    weights, labels = attention_logits(
        [statistics[m].translation.double() for m in order],
        base_heads,
        gram,
        heads,
        level.attention.q.out_features // heads,
        group,
    )
    info = {
        "heads": labels.tolist(),
        "rows": sum(statistics[m].rows for m in order),
        "translation_ridges": {str(m): statistics[m].translation_ridge for m in order},
    }
    return weights, gram, info


__all__ = [
    "ReadingsFn",
    "fit_attention_logits",
    "fit_piece",
    "fit_to_readings",
    "group_readings",
    "pooled_gram",
]
