"""Neuron-interpolation fusion (paper Sec. 4, App. B, F): Hungarian/K-means x Linear/Gradient.

The fused model is built bottom-up, one level at a time, always from its **own** inputs (the
outputs of the fused levels below), so errors of earlier levels are accounted for:

1. *Grouping*: the neurons of all base models at this level (their outputs over the fusion set,
   and spatial positions, are their features) are grouped into as many clusters as the fused
   level has neurons: one-to-one Hungarian matching of two equal-width models (HF) or
   importance-weighted k-means (KF). The cluster centres ``T`` are the targets.
2. *Approximation*: the fused level's weights are fitted to produce ``T`` from its own inputs:
   in closed form for affine levels (Linear), where the base outputs are first projected onto
   the image of the fused level's design (Theorem 2), or by gradient descent on the MSE (Gradient).

The last level (the classifier) is fitted to the mean of the base models' logits, optionally
weighted per class by each model's share of that class's training samples (``head_weights``).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from fedfuse.fusion.base import FusionInputs, FusionMethod, register_fusion_method
from fedfuse.fusion.blocks.batchnorm import refold_batchnorm_statistics
from fedfuse.fusion.blocks.costs import cluster_targets, representation_cost
from fedfuse.fusion.blocks.kmeans import point_costs, weighted_centers, weighted_kmeans
from fedfuse.fusion.blocks.least_squares import (
    RIDGE_GRID,
    GramSpectrum,
    KernelSpectrum,
    LeastSquaresBasis,
    accumulate_normal_equations,
    gram_basis,
    gram_spectrum,
    kernel_basis,
    kernel_spectrum,
)
from fedfuse.fusion.blocks.matching import linear_assignment, pair_labels
from fedfuse.fusion.inputs import head_weights as resolve_head_weights
from fedfuse.fusion.inputs import resolve_scores
from fedfuse.models import LeveledModel, ModelSpec, build_model, corresponding_levels
from fedfuse.models.affine import affine_view, output_rows
from fedfuse.models.capture import capture_levels
from fedfuse.models.importance import SCORE_METHODS
from fedfuse.runtime import resolve_device
from fedfuse.training.loop import FitResult, fit_with_early_stopping, holdout_split, make_optimizer

log = logging.getLogger(__name__)

GROUPINGS = ("hungarian", "kmeans")
APPROXIMATIONS = ("linear", "gradient")


@dataclass(frozen=True)
class GradientPreset:
    """Hyper-parameters of the Gradient variant (paper Table 9).

    ``optimizer``/``last_optimizer`` (hidden levels / the classifier) are
    :func:`~fedfuse.training.loop.make_optimizer` names; ``"sgd"`` here is classical momentum 0.9.
    """

    optimizer: str
    lr: float
    epochs: int
    last_optimizer: str
    last_lr: float
    last_epochs: int
    weight_decay: float
    epsilon: float
    batch_size: int
    val_split: float
    patience: int


#: Table 9: Setting 1 moves far from the initialisation, Setting 2 stays near a base model.
GRADIENT_PRESETS = {
    "setting1": GradientPreset("adamw", 1e-3, 100, "adamw", 1e-3, 100, 1e-4, 1.0, 32, 0.1, 10),
    "setting2": GradientPreset("sgd", 1e-4, 50, "adam", 1e-3, 100, 1e-4, 0.1, 32, 0.1, 10),
}


class NeuronInterpolation(FusionMethod):
    """Neuron-interpolation fusion with a choice of grouping and approximation.

    The shared base of :class:`HFLinear`, :class:`HFGradient`, :class:`KFLinear` and
    :class:`KFGradient` (the registered methods, each taking only the options below that apply
    to it).

    Args:
        grouping: ``"hungarian"`` (HF: two models of equal width, one-to-one) or ``"kmeans"``
            (KF: any number of models, any target width).
        approximation: ``"linear"`` (closed form; affine levels) or ``"gradient"``.
        use_scores: weight neurons by importance (else uniformly).
        score_normalization: per model and level, ``"sum"`` (each model counts equally),
            ``"max"`` or ``"none"``.
        fallback_scores: score method on the fusion set when no scores were given.
        head_weights: weight each model's logit of class c by its share of class c's samples.
        ridge: Linear: ridge penalty relative to the mean eigenvalue of the level's Gram matrix.
            0 fits exactly, a number is used on every level; None (auto) chooses it per level
            from the fusion set over :data:`~fedfuse.fusion.blocks.least_squares.RIDGE_GRID`: by
            exact leave-one-out where the fan-in exceeds the rows (kernel route), by generalised
            cross-validation elsewhere (gram route), each fused neuron's error weighted by its
            cluster's importance. The details of each level record ``ridge``,
            ``ridge_criterion`` (``"loo"``, ``"gcv"`` or ``"fixed"``) and, when chosen,
            ``ridge_scores`` (the criterion along the grid, details' ``ridge_grid``; None where
            undefined).
        rcond: Linear: relative eigenvalue cut-off of the design's basis.
        n_init, max_iter, tol, local_search_swaps: K-means restarts, Lloyd iterations, relative
            tolerance, and accepted swaps of the Kanungo local search (0: off).
        preset: Gradient: ``"setting1"`` or ``"setting2"`` of Table 9; the options below
            (None: the preset's value) override it.
        epochs, last_epochs, lr, last_lr, epsilon, batch_size, patience: Gradient overrides;
            ``epsilon`` interpolates the initial level weights from model 0's level (0) to a
            fresh initialisation (1); ``patience`` 0 never stops early.
        weighted_loss: Gradient: weight each fused neuron's MSE by its cluster's importance.
        seed: seeds k-means, fresh initialisations and the validation split.
        device: ``"auto"``, ``"cpu"`` or ``"cuda"``.
        batch_size_capture: samples per forward pass when capturing level outputs.
        gram_precision: Linear: precision of the per-batch products ``X^T X`` (the sums and the
            factorisation are float64 either way); float32 halves wide convolutional levels.
        progress: show a progress bar over levels.
    """

    name = "neuron-interpolation"
    requires = frozenset({"data"})
    same_spec = False
    retargetable = True

    def __init__(
        self,
        grouping: str = "kmeans",
        approximation: str = "linear",
        *,
        use_scores: bool = True,
        score_normalization: str = "sum",
        fallback_scores: str = "uniform",
        head_weights: bool = False,
        ridge: float | None = None,
        rcond: float = 1e-10,
        n_init: int = 1,
        max_iter: int = 100,
        tol: float = 1e-4,
        local_search_swaps: int = 0,
        preset: str = "setting1",
        epochs: int | None = None,
        last_epochs: int | None = None,
        lr: float | None = None,
        last_lr: float | None = None,
        epsilon: float | None = None,
        batch_size: int | None = None,
        patience: int | None = None,
        weighted_loss: bool = False,
        seed: int = 0,
        device: str = "auto",
        batch_size_capture: int = 256,
        gram_precision: str = "float32",
        progress: bool = False,
    ) -> None:
        if grouping not in GROUPINGS:
            raise ValueError(f"grouping must be one of {GROUPINGS}, got {grouping!r}")
        if approximation not in APPROXIMATIONS:
            raise ValueError(
                f"approximation must be one of {APPROXIMATIONS}, got {approximation!r}"
            )
        if preset not in GRADIENT_PRESETS:
            raise ValueError(f"preset must be one of {sorted(GRADIENT_PRESETS)}, got {preset!r}")
        if fallback_scores not in SCORE_METHODS:
            raise ValueError(f"fallback_scores must be one of {SCORE_METHODS}")
        if (ridge is not None and ridge < 0) or rcond <= 0:
            raise ValueError(f"ridge must be >= 0 and rcond > 0, got {ridge} and {rcond}")
        if patience is not None and patience < 0:
            raise ValueError(f"patience must be >= 0 (0: never stop early), got {patience}")
        self.grouping = grouping
        self.approximation = approximation
        self.use_scores = use_scores
        self.score_normalization = score_normalization
        self.fallback_scores = fallback_scores
        self.head_weights = head_weights
        self.ridge = ridge
        self.rcond = rcond
        self.n_init = n_init
        self.max_iter = max_iter
        self.tol = tol
        self.local_search_swaps = local_search_swaps
        self.preset = preset
        self.epochs = epochs
        self.last_epochs = last_epochs
        self.lr = lr
        self.last_lr = last_lr
        self.epsilon = epsilon
        self.batch_size = batch_size
        self.patience = patience
        self.weighted_loss = weighted_loss
        self.seed = seed
        self.device = device
        self.batch_size_capture = batch_size_capture
        if gram_precision not in ("float32", "float64"):
            raise ValueError(f"gram_precision must be float32 or float64, got {gram_precision!r}")
        self.gram_precision = gram_precision
        self.progress = progress

    @property
    def gram_dtype(self) -> torch.dtype:
        return torch.float32 if self.gram_precision == "float32" else torch.float64

    # ------------------------------------------------------------------ configuration
    def requirements(self) -> frozenset[str]:
        return self.requires | ({"class_counts"} if self.head_weights else set())

    def needs(self) -> frozenset[str]:
        needed = set(self.requirements())
        if self.use_scores:
            needed.add("scores")
            if self.fallback_scores != "uniform":
                needed.add("labels")
        return frozenset(needed)

    def gradient_settings(self) -> GradientPreset:
        """The preset with this instance's overrides applied."""
        overrides = {
            "epochs": self.epochs,
            "last_epochs": self.last_epochs,
            "lr": self.lr,
            "last_lr": self.last_lr,
            "epsilon": self.epsilon,
            "batch_size": self.batch_size,
            "patience": self.patience,
        }
        return replace(
            GRADIENT_PRESETS[self.preset], **{k: v for k, v in overrides.items() if v is not None}
        )

    # ------------------------------------------------------------------ checks and scores
    def _check_structure(
        self, models: list[LeveledModel], target: ModelSpec
    ) -> list[dict[int, int]]:
        """Check the models against the target; return, per model, the base level that each
        fused neuron level fits (level by level, or stage by stage for other depths)."""
        reference = build_model(target, device="meta")
        mappings = []
        for index, model in enumerate(models):
            if (model.spec.input_shape, model.spec.num_classes) != (
                target.input_shape,
                target.num_classes,
            ):
                raise ValueError(
                    f"{self.name}: model {index} maps {model.spec.input_shape} to "
                    f"{model.spec.num_classes} classes, the target {target.input_shape} to "
                    f"{target.num_classes}"
                )
            if model.spec.arch != target.arch:
                raise ValueError(
                    f"{self.name}: model {index} is a {model.spec.arch}, the target a {target.arch}"
                )
            try:
                mapping = corresponding_levels(model, reference)
            except ValueError as error:
                raise ValueError(f"{self.name}: model {index}: {error}") from None
            if self.grouping == "hungarian" and model.num_levels != reference.num_levels:
                raise ValueError(
                    f"{self.name}: model {index} has {model.num_levels} levels, the target "
                    f"{reference.num_levels}; Hungarian Fusion pairs equal models (use kf-*)"
                )
            if self.approximation == "linear" and model.neuron_levels != reference.neuron_levels:
                raise ValueError(f"{self.name}: model {index} has other neuron levels")
            mappings.append(mapping)
        if self.grouping == "hungarian":
            widths = {m.spec.widths for m in models} | {target.widths}
            if len(models) != 2 or len(widths) != 1:
                raise ValueError(
                    f"{self.name}: Hungarian Fusion needs exactly 2 models of the target's width "
                    f"(got {len(models)} models, widths {sorted(widths)}); use K-means Fusion"
                )
        return mappings

    # ------------------------------------------------------------------ grouping
    def _group(
        self, points: torch.Tensor, weights: torch.Tensor, widths: list[int], k: int
    ) -> torch.Tensor:
        """Fused neuron of each base neuron; ``points`` are base neurons as rows."""
        if self.grouping == "hungarian":
            split = widths[0]
            return pair_labels(points[:split], points[split:], weights[:split], weights[split:])
        result = weighted_kmeans(
            points.float(),
            weights,
            k,
            n_init=self.n_init,
            max_iter=self.max_iter,
            tol=self.tol,
            seed=self.seed,
            local_search_swaps=self.local_search_swaps,
        )
        labels = result.labels
        if k == widths[0]:  # order clusters like model 0's neurons (for base-weight initialisation)
            centers, _ = weighted_centers(points, weights, labels, k)
            order = linear_assignment(torch.cdist(centers, points[: widths[0]]).pow(2))
            labels = order.to(labels.device)[labels]
        return labels

    # ------------------------------------------------------------------ the algorithm
    def _fuse(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec
    ) -> tuple[LeveledModel, dict[str, Any]]:
        mappings = self._check_structure(models, target)
        device = resolve_device(self.device)
        data = inputs.data
        assert data is not None
        scores = resolve_scores(
            self.name,
            models,
            inputs,
            use_scores=self.use_scores,
            fallback=self.fallback_scores,
            normalization=self.score_normalization,
            device=self.device,
        )
        fused = build_model(target, seed=self.seed).to(device).eval()
        neuron_levels = fused.neuron_levels
        captured = [
            {level: io for level, base_level in mapping.items() for io in [capture[base_level]]}
            for m, mapping in zip(models, mappings, strict=True)
            for capture in [
                capture_levels(
                    m,
                    data,
                    sorted(mapping.values()),
                    batch_size=self.batch_size_capture,
                    device=device,
                    store_device=device,
                    keep_inputs=False,
                )
            ]
        ]
        scores = [
            {level: model_scores[base_level] for level, base_level in mapping.items()}
            for model_scores, mapping in zip(scores, mappings, strict=True)
        ]
        head = resolve_head_weights(
            self.name,
            inputs.class_counts if self.head_weights else None,
            len(models),
            models[0].spec.num_classes,
        )
        details: dict[str, Any] = {
            "variant": f"{self.grouping}-{self.approximation}",
            "levels": [],
        }
        if self.approximation == "linear" and self.ridge is None:
            details["ridge_grid"] = list(RIDGE_GRID)
        if self.approximation == "gradient":
            details["gradient"] = asdict(self.gradient_settings())
        x = data.to(device)
        bar = tqdm(range(fused.num_levels), desc=self.name, disable=not self.progress, leave=False)
        for index in bar:
            level = fused.levels[index]
            if index not in neuron_levels:
                with torch.no_grad():
                    x = level(x)
                continue
            started = time.perf_counter()
            outputs = [c[index].outputs for c in captured]
            widths = [o.shape[1] for o in outputs]
            is_head = index == neuron_levels[-1]
            if is_head:
                weights = head.reshape(-1).to(device)  # (model, class), model-major like labels
                labels = torch.arange(target.num_classes, device=device).repeat(len(models))
            else:
                weights = torch.cat([scores[m][index] for m in range(len(models))]).to(device)
                labels = None
            k = fused.level_width(index)
            if labels is None and fused.is_residual(index):
                labels = self._residual_labels(x, outputs, weights, widths, k)
            if self.approximation == "linear":
                info = self._fit_linear(level, x, outputs, weights, widths, k, labels)
            else:
                info = self._fit_gradient(
                    level,
                    x,
                    outputs,
                    weights,
                    widths,
                    k,
                    labels,
                    models[0].levels[mappings[0][index]],
                    is_head,
                    index,
                )
            for capture in captured:  # this level's base outputs are not needed again
                del capture[index]
            del outputs
            with torch.no_grad():
                x = level(x)
            info.update(level=fused.level_name(index), seconds=time.perf_counter() - started)
            if fused.is_residual(index):
                info["residual"] = True
            details["levels"].append(info)
            log.debug("%s level %s: %s", self.name, index, info)
        folded = refold_batchnorm_statistics(fused, data, batch_size=self.batch_size_capture)
        if folded:
            details["batchnorm_refolded"] = folded
        return fused.cpu(), details

    @torch.no_grad()
    def _residual_labels(
        self,
        x: torch.Tensor,
        outputs: list[torch.Tensor],
        weights: torch.Tensor,
        widths: list[int],
        k: int,
    ) -> torch.Tensor:
        """Group a residual level's neurons, then number the groups like the fused input's
        channels they add to: fused neuron ``j`` is ``F(x)_j + x_j``, so its target should be
        the cluster closest to input channel ``j`` (the residual stream stays aligned)."""
        z = torch.cat([output_rows(o) for o in outputs], 1)
        labels = self._group(z.T.contiguous(), weights.to(z.dtype), widths, k)
        stream = output_rows(x)
        if stream.shape != (len(z), k):
            return labels  # a shape change (no identity shortcut after all): nothing to keep
        targets = cluster_targets(z, labels, weights.to(z.dtype), k)
        cost = torch.cdist(stream.T.double(), targets.T.double()).pow(2)
        order = linear_assignment(cost)  # input channel j takes cluster order[j]
        rename = torch.empty_like(order)
        rename[order] = torch.arange(k)
        return rename.to(labels.device)[labels]

    def _fit_linear(
        self,
        level: nn.Module,
        x: torch.Tensor,
        outputs: list[torch.Tensor],
        weights: torch.Tensor,
        widths: list[int],
        k: int,
        labels: torch.Tensor | None,
    ) -> dict[str, Any]:
        view = affine_view(level)
        if view is None:
            raise ValueError(
                f"{self.name}: level {type(level).__name__} is not affine (parameter-free ops "
                "then one Linear/Conv2d); use a gradient variant for it"
            )
        chunk = self._row_chunk(sum(widths), len(x))
        positions = output_rows(outputs[0][:1]).shape[0]
        rows = len(x) * positions
        auto = self.ridge is None  # one eigendecomposition serves grouping, choice and fit
        basis: LeastSquaresBasis | GramSpectrum | KernelSpectrum
        if rows >= view.fan_in:
            base_chunks = (
                torch.cat([output_rows(o[s : s + chunk]) for o in outputs], 1)
                for s in range(0, len(x), chunk)
            )
            gram, xtz, norms = accumulate_normal_equations(
                view.design_batches(x, chunk), base_chunks, dtype=self.gram_dtype
            )
            if auto:
                basis = gram_spectrum(gram, rows=rows, rcond=self.rcond)
            else:
                basis = gram_basis(gram, rcond=self.rcond, ridge=self.ridge)
            # base neurons as rows, in the basis of the design's column space (float64: the
            # map back to weights amplifies rounding of these coordinates)
            points = basis.coordinates(xtz=xtz).T
            del xtz
        else:
            design = view.design(x)
            if auto:
                basis = kernel_spectrum(design, rcond=self.rcond)
            else:
                basis = kernel_basis(design, rcond=self.rcond, ridge=self.ridge)
            del design
            # the identity is the basis: the coordinates are the base outputs themselves
            points = torch.cat([output_rows(o).T for o in outputs])
            norms = None
        # Kernel-route points are float32 (as captured); every sum is float64 either way.
        w64 = weights.double()
        if labels is None:
            labels = self._group(points, w64, widths, k)
        centers, mass = weighted_centers(points, w64, labels, k, dtype=torch.float64)
        if isinstance(basis, LeastSquaresBasis):
            fitted = basis.weights(centers.T)
            choice: dict[str, Any] = {"ridge": self.ridge, "ridge_criterion": "fixed"}
        else:
            # each fused neuron's error counts with its cluster's importance, as in Theorem 1;
            # GCV needs the unprojected targets' norms (with the projected ones it picks 0)
            target_norms = (
                None if basis.uses_kernel else self._target_norms(outputs, w64, labels, k, chunk)
            )
            selected = basis.select_ridge(centers.T, target_norms=target_norms, column_weights=mass)
            fitted = basis.weights(centers.T, selected.ridge)
            choice = {
                "ridge": selected.ridge,
                "ridge_criterion": selected.criterion,
                # 6 digits; None where undefined (GCV with as many parameters as rows)
                "ridge_scores": [
                    float(f"{v:.6g}") if math.isfinite(v) else None for v in selected.scores
                ],
            }
        view.set_weights(fitted.float())
        grouping = float(point_costs(points, w64, labels, centers, dtype=torch.float64).sum())
        residual = 0.0  # the kernel route reaches every output exactly
        if norms is not None:
            reached = torch.cat(
                [(points[s : s + 65536].double() ** 2).sum(1) for s in range(0, len(points), 65536)]
            )
            residual = float((w64 * (norms - reached).clamp_min(0)).sum())
        return {
            **self._level_cost(level, x, outputs, labels, weights),
            "projected_grouping_error": grouping / rows,
            "unreachable_error": residual / rows,
            "rank": basis.rank,
            **choice,
            "fan_in": view.fan_in,
            "rows": rows,
            "route": "kernel" if basis.uses_kernel else "gram",
        }

    @torch.no_grad()
    def _target_norms(
        self,
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

    def _fit_gradient(
        self,
        level: nn.Module,
        x: torch.Tensor,
        outputs: list[torch.Tensor],
        weights: torch.Tensor,
        widths: list[int],
        k: int,
        labels: torch.Tensor | None,
        base_level: nn.Module,
        is_head: bool,
        index: int,
    ) -> dict[str, Any]:
        settings = self.gradient_settings()
        z = torch.cat([output_rows(o) for o in outputs], 1)
        if labels is None:
            labels = self._group(z.T.contiguous(), weights.to(z.dtype), widths, k)
        targets_rows = cluster_targets(z, labels, weights.to(z.dtype), k).float()
        shape = outputs[0].shape
        targets = (
            targets_rows
            if len(shape) == 2
            else targets_rows.reshape(shape[0], *shape[2:], k).movedim(-1, 1)
        )
        mass = torch.zeros(k, device=z.device, dtype=z.dtype).index_add_(
            0, labels, weights.to(z.dtype)
        )
        neuron_weights = (mass / mass.mean()).float() if self.weighted_loss else None
        self._initialise(level, base_level, settings.epsilon, index)
        fit = _fit_level(
            level,
            x,
            targets,
            neuron_weights,
            optimizer=settings.last_optimizer if is_head else settings.optimizer,
            lr=settings.last_lr if is_head else settings.lr,
            epochs=settings.last_epochs if is_head else settings.epochs,
            weight_decay=settings.weight_decay,
            batch_size=settings.batch_size,
            val_split=settings.val_split,
            patience=settings.patience,
            generator=torch.Generator().manual_seed(self.seed + index),
        )
        return {
            **self._level_cost(level, x, outputs, labels, weights),
            "validation_mse": fit.best_loss,
            "epochs_run": float(fit.epochs_run),
        }

    @torch.no_grad()
    def _level_cost(
        self,
        level: nn.Module,
        x: torch.Tensor,
        outputs: list[torch.Tensor],
        labels: torch.Tensor,
        weights: torch.Tensor,
    ) -> dict[str, float]:
        """Theorem 1 terms of the fitted level on the fusion set (per row)."""
        chunk = self._row_chunk(sum(o.shape[1] for o in outputs), len(x))
        starts = range(0, len(x), chunk)
        cost = representation_cost(
            (output_rows(level(x[s : s + chunk])) for s in starts),
            (torch.cat([output_rows(o[s : s + chunk]) for o in outputs], 1) for s in starts),
            labels,
            weights,
        )
        return {
            "representation_cost": cost.total,
            "approximation_error": cost.approximation,
            "grouping_error": cost.grouping,
        }

    def _row_chunk(self, columns: int, samples: int) -> int:
        """Fusion-set samples per chunk when all models' outputs are concatenated: at most
        ``batch_size_capture``, and few enough that a float64 chunk of ``columns`` base neurons
        stays near 128 MB (a thousand 512-wide models need chunks of 32 samples)."""
        return max(1, min(self.batch_size_capture, samples, (1 << 24) // max(columns, 1)))

    @torch.no_grad()
    def _initialise(
        self, level: nn.Module, base_level: nn.Module, epsilon: float, index: int
    ) -> None:
        """Level weights ``(1 - eps) * base + eps * fresh`` (fresh alone if shapes differ)."""
        fresh = [p.detach().clone() for p in level.parameters()]  # the fused model's own init
        base = list(base_level.parameters())
        same = len(base) == len(fresh) and all(
            a.shape == b.shape for a, b in zip(base, fresh, strict=False)
        )
        for param, new, old in zip(level.parameters(), fresh, base if same else fresh, strict=True):
            param.copy_((1 - epsilon) * old.to(param.device) + epsilon * new if same else new)


def _fit_level(
    level: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    neuron_weights: torch.Tensor | None,
    *,
    optimizer: str,
    lr: float,
    epochs: int,
    weight_decay: float,
    batch_size: int,
    val_split: float,
    patience: int,
    generator: torch.Generator,
) -> FitResult:
    """Minimise the (optionally neuron-weighted) MSE of ``level(inputs)`` to ``targets``.

    :func:`~fedfuse.training.loop.fit_with_early_stopping` with ``val_split`` held out,
    ``patience``, the best weights restored; the starting weights never count as the best (Table
    9's fit always takes a trained state); ``"sgd"`` is classical momentum 0.9, no schedule.
    """
    shape = [1, -1] + [1] * (targets.dim() - 2)
    w = None if neuron_weights is None else neuron_weights.view(*shape).to(targets.device)

    def mse(rows: torch.Tensor) -> torch.Tensor:
        err = (level(inputs[rows]) - targets[rows]) ** 2
        return (err * w).mean() if w is not None else err.mean()

    train, val = holdout_split(len(inputs), val_split, generator)
    return fit_with_early_stopping(
        _EvalModeNorms(level),
        mse,
        (train.to(inputs.device), val.to(inputs.device)),
        make_optimizer(optimizer, level.parameters(), lr, weight_decay, momentum=0.9),
        epochs=epochs,
        batch_size=batch_size,
        patience=patience,
        generator=generator,
        keep_initial=False,
    )


class _EvalModeNorms(nn.Module):
    """``level`` whose BatchNorms stay in eval mode while it trains: a fused level is fitted as
    the fixed function it computes at test time (a BatchNorm is then an affine map); its running
    statistics are set afterwards by
    :func:`~fedfuse.fusion.blocks.batchnorm.refold_batchnorm_statistics`.
    """

    def __init__(self, level: nn.Module) -> None:
        super().__init__()
        self.level = level

    def train(self, mode: bool = True) -> _EvalModeNorms:
        super().train(mode)
        for module in self.level.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.eval()
        return self


@register_fusion_method
class HFLinear(NeuronInterpolation):
    """Hungarian Fusion, Linear variant (paper Sec. 4): pairs two models' neurons one-to-one
    (Hungarian matching of their importance-weighted outputs), then refits each affine level in
    closed form to the pairs' weighted means, bottom-up from the fused levels below.

    Two models of the target's width. Args as :class:`NeuronInterpolation`: ``use_scores``,
    ``score_normalization``, ``fallback_scores``, ``head_weights`` (inputs); ``ridge``, ``rcond``,
    ``gram_precision`` (the closed-form fit); ``seed``, ``device``, ``batch_size_capture``,
    ``progress``.
    """

    name = "hf-linear"
    max_models = 2  # one-to-one matching (Sec. 4)
    needs_affine_levels = True

    def __init__(
        self,
        *,
        use_scores: bool = True,
        score_normalization: str = "sum",
        fallback_scores: str = "uniform",
        head_weights: bool = False,
        ridge: float | None = None,
        rcond: float = 1e-10,
        seed: int = 0,
        device: str = "auto",
        batch_size_capture: int = 256,
        gram_precision: str = "float32",
        progress: bool = False,
    ) -> None:
        super().__init__(
            "hungarian",
            "linear",
            use_scores=use_scores,
            score_normalization=score_normalization,
            fallback_scores=fallback_scores,
            head_weights=head_weights,
            ridge=ridge,
            rcond=rcond,
            seed=seed,
            device=device,
            batch_size_capture=batch_size_capture,
            gram_precision=gram_precision,
            progress=progress,
        )


@register_fusion_method
class KFLinear(NeuronInterpolation):
    """K-means Fusion, Linear variant (paper Sec. 4): clusters all models' neurons by
    importance-weighted K-means into the fused level's width, then refits each affine level in
    closed form to the cluster centres, bottom-up from the fused levels below.

    Any number of models, any target widths. Args as :class:`NeuronInterpolation`:
    ``use_scores``, ``score_normalization``, ``fallback_scores``, ``head_weights`` (inputs);
    ``ridge``, ``rcond``, ``gram_precision`` (the closed-form fit); ``n_init``, ``max_iter``,
    ``tol``, ``local_search_swaps`` (K-means); ``seed``, ``device``, ``batch_size_capture``,
    ``progress``.
    """

    name = "kf-linear"
    needs_affine_levels = True

    def __init__(
        self,
        *,
        use_scores: bool = True,
        score_normalization: str = "sum",
        fallback_scores: str = "uniform",
        head_weights: bool = False,
        ridge: float | None = None,
        rcond: float = 1e-10,
        n_init: int = 1,
        max_iter: int = 100,
        tol: float = 1e-4,
        local_search_swaps: int = 0,
        seed: int = 0,
        device: str = "auto",
        batch_size_capture: int = 256,
        gram_precision: str = "float32",
        progress: bool = False,
    ) -> None:
        super().__init__(
            "kmeans",
            "linear",
            use_scores=use_scores,
            score_normalization=score_normalization,
            fallback_scores=fallback_scores,
            head_weights=head_weights,
            ridge=ridge,
            rcond=rcond,
            n_init=n_init,
            max_iter=max_iter,
            tol=tol,
            local_search_swaps=local_search_swaps,
            seed=seed,
            device=device,
            batch_size_capture=batch_size_capture,
            gram_precision=gram_precision,
            progress=progress,
        )


@register_fusion_method
class HFGradient(NeuronInterpolation):
    """Hungarian Fusion, Gradient variant (paper Sec. 4, Table 9): pairs two models' neurons
    one-to-one (Hungarian), then fits each level by gradient descent on the MSE to the pairs'
    weighted means, with early stopping, bottom-up from the fused levels below.

    Two models of the target's width; any levels (not only affine ones). Args as
    :class:`NeuronInterpolation`: ``use_scores``, ``score_normalization``, ``fallback_scores``,
    ``head_weights`` (inputs); ``preset`` and its overrides ``epochs``, ``last_epochs``, ``lr``,
    ``last_lr``, ``epsilon``, ``batch_size``, ``patience``, and ``weighted_loss`` (the fit);
    ``seed``, ``device``, ``batch_size_capture``, ``progress``.
    """

    name = "hf-gradient"
    max_models = 2  # one-to-one matching (Sec. 4)

    def __init__(
        self,
        *,
        use_scores: bool = True,
        score_normalization: str = "sum",
        fallback_scores: str = "uniform",
        head_weights: bool = False,
        preset: str = "setting1",
        epochs: int | None = None,
        last_epochs: int | None = None,
        lr: float | None = None,
        last_lr: float | None = None,
        epsilon: float | None = None,
        batch_size: int | None = None,
        patience: int | None = None,
        weighted_loss: bool = False,
        seed: int = 0,
        device: str = "auto",
        batch_size_capture: int = 256,
        progress: bool = False,
    ) -> None:
        super().__init__(
            "hungarian",
            "gradient",
            use_scores=use_scores,
            score_normalization=score_normalization,
            fallback_scores=fallback_scores,
            head_weights=head_weights,
            preset=preset,
            epochs=epochs,
            last_epochs=last_epochs,
            lr=lr,
            last_lr=last_lr,
            epsilon=epsilon,
            batch_size=batch_size,
            patience=patience,
            weighted_loss=weighted_loss,
            seed=seed,
            device=device,
            batch_size_capture=batch_size_capture,
            progress=progress,
        )


@register_fusion_method
class KFGradient(NeuronInterpolation):
    """K-means Fusion, Gradient variant (paper Sec. 4, Table 9): clusters all models' neurons by
    importance-weighted K-means, then fits each level by gradient descent on the MSE to the
    cluster centres, with early stopping, bottom-up from the fused levels below.

    Any number of models, any target widths, any levels. Args as :class:`NeuronInterpolation`:
    ``use_scores``, ``score_normalization``, ``fallback_scores``, ``head_weights`` (inputs);
    ``n_init``, ``max_iter``, ``tol``, ``local_search_swaps`` (K-means); ``preset`` and its
    overrides ``epochs``, ``last_epochs``, ``lr``, ``last_lr``, ``epsilon``, ``batch_size``,
    ``patience``, and ``weighted_loss`` (the fit); ``seed``, ``device``, ``batch_size_capture``,
    ``progress``.
    """

    name = "kf-gradient"

    def __init__(
        self,
        *,
        use_scores: bool = True,
        score_normalization: str = "sum",
        fallback_scores: str = "uniform",
        head_weights: bool = False,
        n_init: int = 1,
        max_iter: int = 100,
        tol: float = 1e-4,
        local_search_swaps: int = 0,
        preset: str = "setting1",
        epochs: int | None = None,
        last_epochs: int | None = None,
        lr: float | None = None,
        last_lr: float | None = None,
        epsilon: float | None = None,
        batch_size: int | None = None,
        patience: int | None = None,
        weighted_loss: bool = False,
        seed: int = 0,
        device: str = "auto",
        batch_size_capture: int = 256,
        progress: bool = False,
    ) -> None:
        super().__init__(
            "kmeans",
            "gradient",
            use_scores=use_scores,
            score_normalization=score_normalization,
            fallback_scores=fallback_scores,
            head_weights=head_weights,
            n_init=n_init,
            max_iter=max_iter,
            tol=tol,
            local_search_swaps=local_search_swaps,
            preset=preset,
            epochs=epochs,
            last_epochs=last_epochs,
            lr=lr,
            last_lr=last_lr,
            epsilon=epsilon,
            batch_size=batch_size,
            patience=patience,
            weighted_loss=weighted_loss,
            seed=seed,
            device=device,
            batch_size_capture=batch_size_capture,
            progress=progress,
        )
