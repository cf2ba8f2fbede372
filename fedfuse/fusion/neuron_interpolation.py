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

import copy
import logging
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, ClassVar

import torch
from scipy.optimize import linear_sum_assignment
from torch import nn
from tqdm.auto import tqdm

from ..capture import capture_levels
from ..importance import SCORE_METHODS, Scores, importance_scores, normalize_scores, uniform_scores
from ..models import LeveledModel, ModelSpec, build_model
from ..runtime import resolve_device
from ..validation import validate_scores
from .affine import affine_view, output_rows
from .base import FusionInputs, FusionMethod, register_fusion_method
from .costs import cluster_targets, representation_cost
from .kmeans import point_costs, weighted_centers, weighted_kmeans
from .least_squares import accumulate_normal_equations, gram_basis, kernel_basis

log = logging.getLogger(__name__)

GROUPINGS = ("hungarian", "kmeans")
#: ridge of the Linear variants on under-determined levels (fan-in > rows); chosen by a sweep
#: (0.001 .. 1) on fmnist-sharded-2, flat between 0.03 and 0.3.
AUTO_RIDGE = 0.1
APPROXIMATIONS = ("linear", "gradient")


@dataclass(frozen=True)
class GradientPreset:
    """Hyper-parameters of the Gradient variant (paper Table 9)."""

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


def _optimizer(name: str, params, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; choose adamw, adam or sgd")


class NeuronInterpolation(FusionMethod):
    """Neuron-interpolation fusion with a choice of grouping and approximation.

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
            0 fits exactly; None (auto) uses :data:`AUTO_RIDGE` on levels whose fan-in exceeds
            the fusion set's rows (where an exact fit would interpolate the fusion set) and 0
            elsewhere.
        rcond: Linear: relative eigenvalue cut-off of the design's basis.
        n_init, max_iter, tol, local_search_swaps: K-means restarts, Lloyd iterations, relative
            tolerance, and accepted swaps of the Kanungo local search (0: off).
        preset: Gradient: ``"setting1"`` or ``"setting2"`` of Table 9; the options below
            (None: the preset's value) override it.
        epochs, last_epochs, lr, last_lr, epsilon, batch_size, patience: Gradient overrides;
            ``epsilon`` interpolates the initial level weights from model 0's level (0) to a
            fresh initialisation (1).
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
    #: options that only some variants use (see :meth:`accepted_options`)
    _LINEAR_ONLY: ClassVar[frozenset[str]] = frozenset({"ridge", "rcond", "gram_precision"})
    _GRADIENT_ONLY: ClassVar[frozenset[str]] = frozenset(
        {
            "preset",
            "epochs",
            "last_epochs",
            "lr",
            "last_lr",
            "epsilon",
            "batch_size",
            "patience",
            "weighted_loss",
        }
    )
    _KMEANS_ONLY: ClassVar[frozenset[str]] = frozenset(
        {"n_init", "max_iter", "tol", "local_search_swaps"}
    )

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
    @classmethod
    def option_defaults(cls) -> dict[str, Any]:
        options = super().option_defaults()
        fixed = getattr(cls, "fixed", {})
        drop = set(fixed)
        if fixed.get("approximation") == "linear":
            drop |= cls._GRADIENT_ONLY
        if fixed.get("approximation") == "gradient":
            drop |= cls._LINEAR_ONLY
        if fixed.get("grouping") == "hungarian":
            drop |= cls._KMEANS_ONLY
        return {name: default for name, default in options.items() if name not in drop}

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
    def _check_structure(self, models: list[LeveledModel], target: ModelSpec) -> None:
        reference = build_model(target)
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
            if model.spec.arch != target.arch or model.num_levels != reference.num_levels:
                raise ValueError(
                    f"{self.name}: model {index} ({model.spec.arch}, {model.num_levels} levels) "
                    f"does not match the target ({target.arch}, {reference.num_levels} levels)"
                )
            if model.neuron_levels != reference.neuron_levels:
                raise ValueError(f"{self.name}: model {index} has other neuron levels")
        if self.grouping == "hungarian":
            widths = {m.spec.widths for m in models} | {target.widths}
            if len(models) != 2 or len(widths) != 1:
                raise ValueError(
                    f"{self.name}: Hungarian Fusion needs exactly 2 models of the target's width "
                    f"(got {len(models)} models, widths {sorted(widths)}); use K-means Fusion"
                )

    def _scores(self, models: list[LeveledModel], inputs: FusionInputs) -> list[Scores]:
        if not self.use_scores:
            raw = [uniform_scores(m) for m in models]
        elif inputs.scores is not None:
            raw = list(inputs.scores)
            for index, (model, scores) in enumerate(zip(models, raw, strict=True)):
                validate_scores(model, scores, source=f"{self.name}: scores of model {index}")
        else:
            log.info(
                "%s: no scores given; computing %s scores on the fusion set",
                self.name,
                self.fallback_scores,
            )
            raw = [
                importance_scores(
                    m, inputs.data, inputs.labels, method=self.fallback_scores, device=self.device
                )
                for m in models
            ]
        return [normalize_scores(s, self.score_normalization) for s in raw]

    def _head_weights(self, models: list[LeveledModel], inputs: FusionInputs) -> torch.Tensor:
        """``(models, classes)`` weights of each model's logits, summing to 1 per class."""
        classes = models[0].spec.num_classes
        weights = torch.ones(len(models), classes, dtype=torch.float64)
        if self.head_weights:
            if inputs.class_counts is None:
                raise ValueError(f"{self.name}: head_weights needs FusionInputs.class_counts")
            counts = torch.tensor([list(c) for c in inputs.class_counts], dtype=torch.float64)
            if counts.shape != weights.shape:
                raise ValueError(
                    f"{self.name}: class_counts has shape {tuple(counts.shape)}, "
                    f"expected {tuple(weights.shape)}"
                )
            seen = counts.sum(0) > 0
            weights[:, seen] = counts[:, seen]
        return weights / weights.sum(0, keepdim=True)

    # ------------------------------------------------------------------ grouping
    def _group(
        self, points: torch.Tensor, weights: torch.Tensor, widths: list[int], k: int
    ) -> torch.Tensor:
        """Fused neuron of each base neuron; ``points`` are base neurons as rows."""
        if self.grouping == "hungarian":
            a, b = points[: widths[0]], points[widths[0] :]
            wa, wb = weights[: widths[0]], weights[widths[0] :]
            pair = (wa[:, None] * wb[None]) / (wa[:, None] + wb[None]).clamp_min(1e-30)
            cost = pair * torch.cdist(a, b).pow(2)
            rows, cols = linear_sum_assignment(cost.cpu().numpy())
            labels = torch.empty(len(points), dtype=torch.long, device=points.device)
            labels[: widths[0]] = torch.arange(widths[0], device=points.device)
            labels[widths[0] + torch.as_tensor(cols, device=points.device)] = torch.as_tensor(
                rows, device=points.device
            )
            return labels
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
            cost = torch.cdist(centers, points[: widths[0]]).pow(2)
            rows, cols = linear_sum_assignment(cost.cpu().numpy())
            order = torch.empty(k, dtype=torch.long)
            order[torch.as_tensor(rows)] = torch.as_tensor(cols)
            labels = order.to(labels.device)[labels]
        return labels

    # ------------------------------------------------------------------ the algorithm
    def _fuse(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec
    ) -> tuple[LeveledModel, dict[str, Any]]:
        self._check_structure(models, target)
        device = resolve_device(self.device)
        data = inputs.data
        assert data is not None
        scores = self._scores(models, inputs)
        fused = build_model(target, seed=self.seed).to(device).eval()
        neuron_levels = fused.neuron_levels
        captured = [
            capture_levels(
                m,
                data,
                neuron_levels,
                batch_size=self.batch_size_capture,
                device=device,
                store_device=device,
                keep_inputs=False,
            )
            for m in models
        ]
        head = self._head_weights(models, inputs)
        details: dict[str, Any] = {
            "variant": f"{self.grouping}-{self.approximation}",
            "levels": [],
        }
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
                    models[0].levels[index],
                    is_head,
                    index,
                )
            for capture in captured:  # this level's base outputs are not needed again
                del capture[index]
            del outputs
            with torch.no_grad():
                x = level(x)
            info.update(level=fused.level_name(index), seconds=time.perf_counter() - started)
            details["levels"].append(info)
            log.debug("%s level %s: %s", self.name, index, info)
        return fused.cpu(), details

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
        ridge = self.ridge
        if ridge is None:
            ridge = AUTO_RIDGE if rows < view.fan_in else 0.0
        if rows >= view.fan_in:
            base_chunks = (
                torch.cat([output_rows(o[s : s + chunk]) for o in outputs], 1)
                for s in range(0, len(x), chunk)
            )
            gram, xtz, norms = accumulate_normal_equations(
                view.design_batches(x, chunk), base_chunks, dtype=self.gram_dtype
            )
            basis = gram_basis(gram, rcond=self.rcond, ridge=ridge)
            # base neurons as rows, in the basis of the design's column space (float64: the
            # map back to weights amplifies rounding of these coordinates)
            points = basis.coordinates(xtz=xtz).T
            del xtz
        else:
            basis = kernel_basis(view.design(x), rcond=self.rcond, ridge=ridge)
            # the identity is the basis: the coordinates are the base outputs themselves
            points = torch.cat([output_rows(o).T for o in outputs])
            norms = None
        # Kernel-route points are float32 (as captured); every sum is float64 either way.
        w64 = weights.double()
        if labels is None:
            labels = self._group(points, w64, widths, k)
        centers, _ = weighted_centers(points, w64, labels, k, dtype=torch.float64)
        view.set_weights(basis.weights(centers.T).float())
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
            "ridge": ridge,
            "fan_in": view.fan_in,
            "rows": rows,
            "route": "kernel" if basis.uses_kernel else "gram",
        }

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
        loss = _fit_level(
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
            "validation_mse": loss["best_val"],
            "epochs_run": loss["epochs"],
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
) -> dict[str, float]:
    """Minimise the (optionally neuron-weighted) MSE of ``level(inputs)`` to ``targets``.

    Holds out ``val_split`` of the samples, stops after ``patience`` epochs without a better
    validation loss, and restores the best weights.
    """
    n = len(inputs)
    order = torch.randperm(n, generator=generator)
    n_val = int(round(val_split * n)) if n >= 10 else 0
    val, train = order[:n_val], order[n_val:]
    shape = [1, -1] + [1] * (targets.dim() - 2)
    w = None if neuron_weights is None else neuron_weights.view(*shape).to(targets.device)

    def mse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        err = (pred - target) ** 2
        return (err * w).mean() if w is not None else err.mean()

    opt = _optimizer(optimizer, level.parameters(), lr, weight_decay)
    best, best_state, stale, epoch = float("inf"), copy.deepcopy(level.state_dict()), 0, 0
    level.train()
    while epoch < epochs:
        epoch += 1
        shuffled = train[torch.randperm(len(train), generator=generator)]
        for start in range(0, len(shuffled), batch_size):
            idx = shuffled[start : start + batch_size].to(inputs.device)
            opt.zero_grad(set_to_none=True)
            loss = mse(level(inputs[idx]), targets[idx])
            loss.backward()
            opt.step()
        with torch.no_grad():
            check = val if n_val else train
            idx = check.to(inputs.device)
            current = float(mse(level(inputs[idx]), targets[idx]))
        if current < best - 1e-12:
            best, best_state, stale = current, copy.deepcopy(level.state_dict()), 0
        else:
            stale += 1
            if stale >= patience:
                break
    level.load_state_dict(best_state)
    level.eval()
    return {"best_val": best, "epochs": float(epoch)}


def _variant(name: str, grouping: str, approximation: str) -> type[NeuronInterpolation]:
    doc = (
        f"{'Hungarian' if grouping == 'hungarian' else 'K-means'} Fusion, {approximation} variant."
    )

    def __init__(self, **options: Any) -> None:  # noqa: N807
        NeuronInterpolation.__init__(self, grouping, approximation, **options)

    cls = type(
        name.replace("-", "_").title().replace("_", ""),
        (NeuronInterpolation,),
        {
            "name": name,
            "fixed": {"grouping": grouping, "approximation": approximation},
            "max_models": 2 if grouping == "hungarian" else None,  # one-to-one matching (Sec. 4)
            "needs_affine_levels": approximation == "linear",
            "__init__": __init__,
            "__doc__": doc,
        },
    )
    return register_fusion_method(cls)


HFLinear = _variant("hf-linear", "hungarian", "linear")
KFLinear = _variant("kf-linear", "kmeans", "linear")
HFGradient = _variant("hf-gradient", "hungarian", "gradient")
KFGradient = _variant("kf-gradient", "kmeans", "gradient")
