r"""Fisher merging (Matena & Raffel, NeurIPS 2022) and FedFisher (Jhunjhunwala et al.,
AISTATS 2024): one-shot merges weighted by each site's Fisher information.

What a site computes and uploads once, its diagonal Fisher or its K-FAC factors ``A`` and ``G``
per ``Linear``/``Conv2d``, is in :mod:`fedfuse.fusion.statistics.fisher`; this module is the
server side.

**What the server solves.** With ``p_k`` the site weights (uniform, or by sample counts), the
merged parameters minimise the Laplace-approximated sum of the sites' log-posteriors,

    ``theta* = argmin sum_k p_k (theta - theta_k)^T F_k (theta - theta_k)``.

*Diagonal* (Fisher merging; FedFisher(Diag)): per entry ``theta* = sum_k p_k F_k theta_k /
sum_k p_k F_k``. Each ``F_k`` gets ``damping`` times its tensor's mean Fisher added, a pull
towards the plain weighted average where no site's Fisher measures an entry (Matena & Raffel's
Fisher floor, made relative).

*K-FAC* (FedFisher(K-FAC)): per layer with weights ``W`` (``fan_out x fan_in``, the bias its
last column), ``vec(W)^T (A (x) G) vec(W) = tr(G W A W^T)``, so the minimiser solves the
generalised Sylvester equation

    ``sum_k p_k G_k W A_k = sum_k p_k G_k W_k A_k``,

whose operator ``W -> sum_k p_k G_k W A_k`` is symmetric positive definite once each factor
gets its damping (``damping`` times its mean eigenvalue on the diagonal). fedfuse solves it by
conjugate gradients on the matrices (each step ``2K`` small matrix products; started from the
weighted average, preconditioned by ``(sum_k p_k G_k)^{-1} R (sum_k p_k A_k)^{-1}``, the exact
inverse for one site, and run to a relative residual of 1e-6), where the paper runs Adam from FedAvg
on the same objective: the same minimiser, without a learning rate or a step count to tune.
Parameters outside ``Linear``/``Conv2d`` (normalisations, embeddings, tokens) and buffers are
the weighted average.

Neither aligns neurons: like FedAvg and RegMean they merge models that share an
initialisation (``init="shared"``), the setting of both papers. ``damping="auto"`` merges with
every damping of :data:`DAMPING_GRID` and keeps :data:`UNLABELLED_DAMPING` (the damping without
a labelled fusion set) unless another is significantly more accurate on the server's labelled
fusion set (:func:`~fedfuse.fusion.blocks.selection.best_on_fusion_set`). It chose by the
fusion-set loss before issue 52: on LeNets trained with SGD and momentum the loss picked 1.0,
the least accurate damping (a flatter merged model scores a lower loss on confident sites).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fedfuse.fusion.base import FusionInputs, FusionMethod
from fedfuse.fusion.blocks.selection import fuse_with_option
from fedfuse.fusion.inputs import averaging_weights
from fedfuse.fusion.registry import register_fusion_method
from fedfuse.fusion.statistics.fisher import (
    DIAGONAL_PREFIX,
    KFAC_PREFIX,
    check_fisher,
    kfac_layers,
)
from fedfuse.models import LeveledModel, ModelSpec
from fedfuse.runtime import resolve_device

#: the dampings ``damping="auto"`` chooses from, by the merged model's fusion-set accuracy
DAMPING_GRID = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)
#: the damping ``"auto"`` takes without a labelled fusion set
UNLABELLED_DAMPING = 1e-2
_CG_TOLERANCE = 1e-6
_CG_MAX_STEPS = 1000


def _damped(factor: torch.Tensor, damping: float) -> torch.Tensor:
    scale = float(torch.diagonal(factor).mean().clamp_min(1e-12))
    return factor + damping * scale * torch.eye(
        len(factor), dtype=factor.dtype, device=factor.device
    )


def solve_kfac_layer(
    weights: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    shares: Sequence[float],
    damping: float,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, int]:
    """``W`` solving ``sum_k p_k G_k W A_k = sum_k p_k G_k W_k A_k`` (damped factors) by
    conjugate gradients from the weighted average, preconditioned by the inverse of the
    averaged factors' Kronecker product (exact for one site, so a few steps for sites alike);
    float64 on ``device``, returned on the CPU with the steps taken."""
    device = resolve_device(device)
    a = [_damped(x.to(device, torch.float64), damping) for x in inputs]
    g = [_damped(x.to(device, torch.float64), damping) for x in outputs]
    weights = [wk.to(device, torch.float64) for wk in weights]

    def operator(w: torch.Tensor) -> torch.Tensor:
        return sum(p * (gk @ w @ ak) for p, gk, ak in zip(shares, g, a, strict=True))

    mean_g = torch.linalg.cholesky(sum(p * gk for p, gk in zip(shares, g, strict=True)))
    mean_a = torch.linalg.cholesky(sum(p * ak for p, ak in zip(shares, a, strict=True)))

    def precondition(r: torch.Tensor) -> torch.Tensor:
        left = torch.cholesky_solve(r, mean_g)
        return torch.cholesky_solve(left.T, mean_a).T

    target = sum(p * (gk @ wk @ ak) for p, gk, wk, ak in zip(shares, g, weights, a, strict=True))
    w = sum(p * wk for p, wk in zip(shares, weights, strict=True))
    residual = target - operator(w)
    limit = _CG_TOLERANCE**2 * max(float((target * target).sum()), 1e-300)
    z = precondition(residual)
    direction = z.clone()
    rz = float((residual * z).sum())
    steps = 0
    while float((residual * residual).sum()) > limit and steps < _CG_MAX_STEPS:
        image = operator(direction)
        step = rz / float((direction * image).sum())
        w = w + step * direction
        residual = residual - step * image
        z = precondition(residual)
        rz, previous = float((residual * z).sum()), rz
        direction = z + (rz / previous) * direction
        steps += 1
    return w.cpu(), steps


def _layer_matrix(layer: nn.Module, state: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    weight = state[f"{name}.weight"].reshape(len(state[f"{name}.weight"]), -1)
    if layer.bias is None:
        return weight
    return torch.cat([weight, state[f"{name}.bias"].reshape(-1, 1)], dim=1)


class _FisherFusion(FusionMethod):
    """The shared solve of the Fisher-weighted merges (module docstring)."""

    requires = frozenset({"fisher"})
    #: the Fisher kinds this method reads
    #: (:func:`~fedfuse.fusion.statistics.fisher.fisher_kinds`)
    fisher_kinds: tuple[str, ...] = ("diagonal",)

    def __init__(self, weighting: str = "uniform", damping: float | str = "auto") -> None:
        if weighting not in ("uniform", "samples"):
            raise ValueError(
                f"{self.name}: weighting must be 'uniform' or 'samples', got {weighting!r}"
            )
        if damping != "auto" and not (isinstance(damping, int | float) and damping >= 0):
            raise ValueError(f"{self.name}: damping must be 'auto' or >= 0, got {damping!r}")
        self.weighting = weighting
        self.damping = damping
        #: where the K-FAC solve runs (the diagonal merges are elementwise, on the CPU)
        self.device = "cpu"

    def requirements(self) -> frozenset[str]:
        extra = {"sample_counts"} if self.weighting == "samples" else set()
        return frozenset(self.requires | extra)

    def needs(self) -> frozenset[str]:
        auto = {"data", "labels"} if self.damping == "auto" else set()
        return self.requirements() | auto

    def _fuse(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec
    ) -> tuple[LeveledModel, dict[str, Any]]:
        assert inputs.fisher is not None  # a requirement
        fishers = list(inputs.fisher)
        for index, (model, fisher) in enumerate(zip(models, fishers, strict=True)):
            check_fisher(model, fisher, self.fisher_kinds, source=f"{self.name}: site {index}")
        shares = averaging_weights(self.name, inputs, len(models), self.weighting == "samples")
        return fuse_with_option(
            self.name,
            "damping",
            self.damping,
            lambda damping: self._merge(models, fishers, shares, damping),
            grid=DAMPING_GRID,
            unlabelled=UNLABELLED_DAMPING,
            inputs=inputs,
        )

    def _merge(
        self,
        models: list[LeveledModel],
        fishers: list[Mapping[str, torch.Tensor]],
        shares: list[float],
        damping: float,
    ) -> tuple[LeveledModel, dict[str, Any]]:
        states = [m.state_dict() for m in models]
        merged = {
            name: sum(p * s[name].double() for p, s in zip(shares, states, strict=True))
            if tensor.is_floating_point()
            else tensor.clone()
            for name, tensor in states[0].items()
        }
        details: dict[str, Any] = {"damping": damping, "shares": shares}
        if "kfac" in self.fisher_kinds:
            steps = {}
            for name, layer in kfac_layers(models[0]).items():
                key = f"{KFAC_PREFIX}{name}"
                solved, steps[name] = solve_kfac_layer(
                    [_layer_matrix(layer, s, name) for s in states],
                    [f[f"{key}.inputs"] for f in fishers],
                    [f[f"{key}.outputs"] for f in fishers],
                    shares,
                    damping,
                    device=self.device,
                )
                weight = merged[f"{name}.weight"]
                merged[f"{name}.weight"] = solved[:, : weight[0].numel()].reshape(weight.shape)
                if layer.bias is not None:
                    merged[f"{name}.bias"] = solved[:, -1]
            details["cg_steps"] = steps
        else:
            for name, _ in models[0].named_parameters():
                key = f"{DIAGONAL_PREFIX}{name}"
                floor = damping * sum(float(f[key].double().mean()) for f in fishers) / len(fishers)
                weights = [
                    p * (f[key].double() + floor) for p, f in zip(shares, fishers, strict=True)
                ]
                total = sum(weights)
                numerator = sum(w * s[name].double() for w, s in zip(weights, states, strict=True))
                merged[name] = torch.where(
                    total > 0, numerator / total.clamp_min(1e-300), merged[name]
                )
        return _copy_with(models[0], merged), details


def _copy_with(model: LeveledModel, state: Mapping[str, torch.Tensor]) -> LeveledModel:
    """A copy of ``model`` (on the CPU) holding ``state``."""
    fused = copy.deepcopy(model).cpu()
    own = fused.state_dict()
    fused.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()})
    return fused


@register_fusion_method
class FisherMerging(_FisherFusion):
    """Fisher merging (Matena & Raffel 2022): each parameter the average of the sites' values
    weighted by their diagonal Fisher (module docstring); merging coefficients uniform, as the
    paper's default, or by sample counts.

    Args:
        weighting: ``"uniform"`` site coefficients, or ``"samples"`` (by training samples).
        damping: added to each site's Fisher, relative to the tensor's mean Fisher (a pull
            towards the plain average); ``"auto"``: chosen on the labelled fusion set among
            :data:`DAMPING_GRID` (:data:`UNLABELLED_DAMPING` without one).
    """

    name = "fisher-merging"
    fisher_kinds = ("diagonal",)


@register_fusion_method
class FedFisherDiagonal(_FisherFusion):
    """FedFisher(Diag) (Jhunjhunwala et al. 2024): the Fisher-weighted merge with sites
    weighted by their sample counts (the paper's data-size weights); its minimiser is Fisher
    merging's, solved in closed form here (module docstring).

    Args:
        weighting: ``"samples"`` (the paper's) or ``"uniform"``.
        damping: as :class:`FisherMerging`'s.
    """

    name = "fedfisher-diag"
    fisher_kinds = ("diagonal",)

    def __init__(self, weighting: str = "samples", damping: float | str = "auto") -> None:
        super().__init__(weighting, damping)


@register_fusion_method
class FedFisherKFAC(_FisherFusion):
    """FedFisher(K-FAC) (Jhunjhunwala et al. 2024): each ``Linear``/``Conv2d`` the minimiser of
    the sites' K-FAC-approximated quadratic, by conjugate gradients on the generalised
    Sylvester equation (module docstring); other parameters the weighted average.

    Args:
        weighting: ``"samples"`` (the paper's) or ``"uniform"``.
        damping: each K-FAC factor's ridge relative to its mean eigenvalue; ``"auto"`` as
            :class:`FisherMerging`'s.
        device: where the conjugate-gradient solve runs (float64); ``"auto"``: CUDA when
            available. A ResNet-18's factors are up to 4609 x 4609 per layer.
    """

    name = "fedfisher-kfac"
    fisher_kinds = ("kfac",)

    def __init__(
        self, weighting: str = "samples", damping: float | str = "auto", device: str = "auto"
    ) -> None:
        super().__init__(weighting, damping)
        self.device = device


__all__ = [
    "DAMPING_GRID",
    "UNLABELLED_DAMPING",
    "FedFisherDiagonal",
    "FedFisherKFAC",
    "FisherMerging",
    "solve_kfac_layer",
]
