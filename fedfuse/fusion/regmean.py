r"""RegMean: merge each affine level by the least-squares fit of all clients' outputs (Jin et al.).

For a neuron level with client weights ``W_i`` (``(fan_in + 1, out)``, bias row included, see
:mod:`fedfuse.fusion.affine`) and client ``i``'s design matrix ``X_i`` (the level's inputs on
its own training data, with a trailing 1; unfolded patches for convolutions), RegMean picks the
weights whose outputs are closest to every client's own outputs on that client's inputs:

.. math::

    W^* = \arg\min_W \sum_i \lVert X_i W - X_i W_i \rVert_F^2
        = \Big(\sum_i G_i\Big)^{-1} \sum_i G_i W_i, \qquad G_i = X_i^\top X_i .

Only the Gram matrices ``G_i`` are needed, so the server needs no data and each client sends,
per level, a ``(fan_in + 1)^2`` matrix (:func:`level_grams` computes them client-side). The paper
regularises by shrinking the non-diagonal entries,
``\tilde G_i = \alpha G_i + (1 - \alpha)\,\mathrm{diag}(G_i)``, which interpolates between the
exact fit (``alpha = 1``) and a per-input-coordinate weighted average (``alpha = 0``). Clients
with more data have larger Grams and so weigh more, with no need for sample counts.

RegMean merges every level independently, coordinate by coordinate of the neurons, so like
FedAvg it assumes the clients' neurons already correspond (a shared initialisation, as in
FedAvg-style training); it does not align them. With independently initialised clients neuron
``k`` of one client is merged with the unrelated neuron ``k`` of another: on IID clients (alike
Grams) the first level then outputs roughly the average of the clients' outputs, exactly as
weight averaging does, and deeper levels see features no client produced. It is a
(Gram-weighted) averaging baseline in that case, though empirically a much better one than
plain weight averaging (4 IID Fashion-MNIST MLP clients, independent init: 0.76 test accuracy
against 0.37 for weight averaging and 0.79 for the ensemble; its logits were 0.57 (relative)
from the clients' mean logits, weight averaging's 0.99). Align the models first to merge
matching neurons.

Reference:
    X. Jin, X. Ren, D. Preotiuc-Pietro, P. Cheng. *Dataless Knowledge Fusion by Merging Weights
    of Language Models*, ICLR 2023.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..models import LeveledModel, ModelSpec, build_model
from .affine import output_rows
from .alignment import affine_levels
from .base import FusionInputs, FusionMethod, register_fusion_method

log = logging.getLogger(__name__)

#: rows of the design matrix multiplied at once in :func:`level_grams` (bounds memory for convs)
_ROW_BUDGET = 1 << 14


@torch.no_grad()
def level_grams(
    model: LeveledModel, data: torch.Tensor, *, batch_size: int = 256
) -> dict[int, torch.Tensor]:
    """Client side of RegMean: each neuron level's design Gram ``X^T X`` over ``data``, float64.

    ``X`` holds the level's design rows (:meth:`AffineLevel.design`: the level's inputs computed
    by ``model`` itself, flattened or unfolded into patches, with a trailing 1 for the bias), so
    the Gram has shape ``(fan_in + 1, fan_in + 1)``. The model runs in eval mode on its current
    device and is restored afterwards.

    Args:
        model: the client's model.
        data: the client's training inputs ``(N, ...)``, normalised like the training data.
        batch_size: samples per forward pass; design rows are further chunked to bound memory.

    Returns:
        ``{neuron level index: Gram}`` on the CPU, as :attr:`FusionInputs.grams` expects.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if len(data) == 0:
        raise ValueError("level_grams needs at least one sample")
    views = affine_levels(model)
    device = next(model.parameters()).device
    grams: dict[int, torch.Tensor] = {
        index: torch.zeros(view.fan_in, view.fan_in, dtype=torch.float64)
        for index, view in views.items()
    }
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(data), batch_size):
            x = data[start : start + batch_size].to(device)
            for index, level in enumerate(model.levels):
                y = level(x)
                view = views.get(index)
                if view is not None:
                    rows_per_sample = max(1, len(output_rows(y[:1])))
                    step = max(1, _ROW_BUDGET // rows_per_sample)
                    for chunk in range(0, len(x), step):
                        design = view.design(x[chunk : chunk + step]).double()
                        grams[index] += (design.T @ design).cpu()
                x = y
    finally:
        model.train(was_training)
    return grams


@register_fusion_method
class RegMean(FusionMethod):
    r"""RegMean (Jin et al., 2023) as a one-shot federated method: per neuron level,
    ``W* = (sum_i G~_i + lambda I)^{-1} (sum_i G~_i W_i + lambda mean_i W_i)`` from the clients'
    Grams (:attr:`FusionInputs.grams`, see :func:`level_grams`); no fusion set.

    Args:
        alpha: non-diagonal shrinkage, ``G~ = alpha G + (1 - alpha) diag(G)``, in ``[0, 1]``.
            Default 0.9, the paper's recommended value (1: the exact least-squares fit of all
            clients' outputs; 0: a per-coordinate weighted average).
        jitter: the ridge ``lambda`` relative to the mean diagonal of ``sum_i G~_i``; tiny, it
            only fixes directions no client's data reaches (e.g. dead ReLU inputs, or a constant
            input collinear with the bias), which it sets to the plain average instead of leaving
            them undetermined. Raised tenfold while the solve reports a singular system.

    The system is solved in float64 with :func:`torch.linalg.solve_ex` (LU).
    """

    name = "regmean"
    requires = frozenset({"grams"})
    needs_affine_levels = True

    def __init__(self, alpha: float = 0.9, jitter: float = 1e-9) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"regmean: alpha must be in [0, 1], got {alpha}")
        if not jitter >= 0:
            raise ValueError(f"regmean: jitter must be >= 0, got {jitter}")
        self.alpha = float(alpha)
        self.jitter = float(jitter)

    def _gram(
        self, grams: dict[int, torch.Tensor], client: int, level: int, name: str, size: int
    ) -> torch.Tensor:
        if level not in grams:
            raise ValueError(
                f"{self.name}: FusionInputs.grams[{client}] has no Gram for level {name} "
                f"(has levels {sorted(grams)}); compute them with "
                "fedfuse.fusion.regmean.level_grams"
            )
        gram = torch.as_tensor(grams[level]).to(torch.float64)
        if gram.shape != (size, size) or not torch.isfinite(gram).all():
            raise ValueError(
                f"{self.name}: FusionInputs.grams[{client}][{level}] must be a finite "
                f"({size}, {size}) matrix for level {name}, got shape {tuple(gram.shape)}"
            )
        return gram

    def _fuse(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec
    ) -> tuple[LeveledModel, dict[str, Any]]:
        fused = build_model(target)
        fused.load_state_dict(models[0].state_dict())  # parameter-free state, if any
        fused_views = affine_levels(fused)
        names = {level: models[0].level_name(level) for level in fused_views}
        # Stream over the clients: one client's Grams in memory at a time (they may be
        # memory-mapped files of a thousand sites), the per-level sums accumulated.
        totals, rhs, means = {}, {}, {}
        for level, view in fused_views.items():
            size, out = view.fan_in, view.layer.weight.shape[0]
            totals[level] = torch.zeros(size, size, dtype=torch.float64)
            rhs[level] = torch.zeros(size, out, dtype=torch.float64)
            means[level] = torch.zeros(size, out, dtype=torch.float64)
        assert inputs.grams is not None
        for client, (model, grams) in enumerate(zip(models, inputs.grams, strict=True)):
            client_views = affine_levels(model)
            for level, view in fused_views.items():
                gram = self._gram(grams, client, level, names[level], view.fan_in)
                shrunk = self.alpha * gram
                shrunk.diagonal().add_((1.0 - self.alpha) * gram.diagonal())
                weights = client_views[level].weights().double().cpu()
                totals[level] += shrunk
                rhs[level] += shrunk @ weights
                means[level] += weights / len(models)
            del grams
        ridges: dict[str, float] = {}
        for level, view in fused_views.items():
            name = names[level]
            merged, relative = _solve_regularised(
                totals[level], rhs[level], means[level], self.jitter, name
            )
            view.set_weights(merged)
            ridges[name] = relative
            log.debug("regmean level %s: ridge %.1e (relative)", name, relative)
        return fused, {"alpha": self.alpha, "ridge": ridges}


def _solve_regularised(
    total: torch.Tensor, rhs: torch.Tensor, mean: torch.Tensor, jitter: float, name: str
) -> tuple[torch.Tensor, float]:
    """``(total + lambda I)^{-1} (rhs + lambda mean)``, lambda relative to the mean diagonal,
    raised tenfold (from at least 1e-12) while the solve fails or returns non-finite values."""
    scale = float(total.diagonal().mean())
    if not scale > 0:
        raise ValueError(
            f"regmean: the clients' Grams of level {name} are all zero (no data reached it?)"
        )
    eye = torch.eye(len(total), dtype=total.dtype)
    relative = jitter
    for _ in range(14):
        penalty = relative * scale
        solution, info = torch.linalg.solve_ex(total + penalty * eye, rhs + penalty * mean)
        if int(info) == 0 and bool(torch.isfinite(solution).all()):
            return solution, relative
        relative = max(relative * 10, 1e-12)
    raise ValueError(f"regmean: the Gram system of level {name} stays singular (NaN inputs?)")


__all__ = ["RegMean", "level_grams"]
