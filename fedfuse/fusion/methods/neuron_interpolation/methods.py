"""The neuron-interpolation method: the bottom-up fit of the fused model, level by level.

:class:`NeuronInterpolation` owns the options (each written once, with its default), checks the
models, captures their level outputs on the fusion set, and for each fused level groups the base
neurons (:mod:`.grouping`) and fits the level to the groups' targets (:mod:`.linear` or
:mod:`.gradient`) from the fused levels below; then it refolds BatchNorm statistics.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from fedfuse.fusion.base import FusionInputs, FusionMethod
from fedfuse.fusion.blocks.batchnorm import refold_batchnorm_statistics
from fedfuse.fusion.blocks.kmeans import resolve_variance
from fedfuse.fusion.blocks.least_squares import RIDGE_GRID
from fedfuse.fusion.blocks.whitening import WHITEN_RCOND, uses_whitening_cutoff
from fedfuse.fusion.inputs import head_weights as resolve_head_weights
from fedfuse.fusion.inputs import resolve_scores
from fedfuse.fusion.methods.neuron_interpolation import prior
from fedfuse.fusion.methods.neuron_interpolation.blocks import (
    check_block_levels,
    fit_block_linear,
    is_block_level,
)
from fedfuse.fusion.methods.neuron_interpolation.costs import level_cost
from fedfuse.fusion.methods.neuron_interpolation.gradient import (
    GRADIENT_PRESETS,
    GradientPreset,
    fit_gradient,
    preset_with_overrides,
)
from fedfuse.fusion.methods.neuron_interpolation.grouping import (
    GROUPINGS,
    group_neurons,
    residual_labels,
)
from fedfuse.fusion.methods.neuron_interpolation.linear import fit_linear
from fedfuse.fusion.methods.neuron_interpolation.options import APPROXIMATIONS, STARTS
from fedfuse.fusion.methods.neuron_interpolation.structure import check_one_to_one, check_structure
from fedfuse.models import LeveledModel, ModelSpec, build_model
from fedfuse.models.affine import affine_view, check_fit_bias, fit_intercept
from fedfuse.models.capture import LevelIO, LevelStream
from fedfuse.models.importance import SCORE_METHODS
from fedfuse.runtime import release_free_memory, resolve_device

log = logging.getLogger(__name__)


@dataclass
class _LevelFit:
    """What fitting one fused level reads: its index and module, its input ``x`` on the
    fusion set, the base models' outputs there (``widths`` neurons each), its width ``k``,
    and the captures and level mappings of the base models."""

    index: int
    level: nn.Module
    x: torch.Tensor
    outputs: list[torch.Tensor]
    widths: list[int]
    k: int
    captured: list[dict[int, Any]]
    mappings: list[dict[int, int]]
    #: every model's outputs side by side (``samples x sum(widths)``; ``outputs`` are its
    #: column blocks) when the level is a linear one of many models, else None
    columns: torch.Tensor | None = None
    #: the groups' centres of the base weights on the level's inputs (:mod:`.prior`), on demand
    prior_weights: Callable[..., torch.Tensor | None] | None = None


class NeuronInterpolation(FusionMethod):
    """Neuron-interpolation fusion with a choice of grouping and approximation.

    The shared base of :class:`HFLinear`, :class:`HFGradient`, :class:`KFLinear` and
    :class:`KFGradient` (the registered methods, each taking only the options below that apply
    to it).

    Args:
        grouping: ``"hungarian"`` (HF: models of the target's width, one neuron of each per
            group) or ``"kmeans"`` (KF: any number of models, any target width).
        approximation: ``"linear"`` (closed form; affine levels) or ``"gradient"``.
        use_scores: weight neurons by importance (else uniformly).
        score_normalization: per model and level, ``"sum"`` (each model counts equally),
            ``"max"`` or ``"none"``.
        fallback_scores: score method on the fusion set when no scores were given.
        head_weights: the classifier's target, the models' logits of class c averaged with
            weights: ``False`` uniform (the paper's); ``True`` each model's share of class c's
            training samples (FedMA's class-count mix for its last layer), so that sites that
            never saw a class do not vote on it; ``"auto"`` (default): the head is fitted to
            both targets and the one whose fused model has the lower cross-entropy on the
            labelled fusion set is kept (``details["head"]``). Without labels, the class
            shares; without class counts, uniform. On label-skewed sites the uniform target is
            a weak ensemble (see ``docs/results.md``, LeNet-5 at 5 Dirichlet(0.1) sites).
        ridge: Linear: ridge penalty relative to the mean eigenvalue of the level's Gram matrix.
            0 fits exactly, a number is used on every level; None (auto) chooses it per level
            from the fusion set over :data:`~fedfuse.fusion.blocks.least_squares.RIDGE_GRID`: by
            exact leave-one-out where the fan-in exceeds the rows (kernel route), by generalised
            cross-validation elsewhere (gram route), each fused neuron's error weighted by its
            cluster's importance. The details of each level record ``ridge``,
            ``ridge_criterion`` (``"loo"``, ``"gcv"`` or ``"fixed"``) and, when chosen,
            ``ridge_scores`` (the criterion along the grid, details' ``ridge_grid``; None where
            undefined).
        ridge_prior: Linear, where a level has more inputs than fusion rows: what the ridge
            shrinks towards, ``"zero"`` (the paper's fit) or ``"aligned"``, the base models' own
            weights on the fused inputs (plain stacks; :mod:`.prior`); ``"auto"`` (default): per
            level, the one of lower leave-one-out error on the fusion set.
        rcond: Linear: relative eigenvalue cut-off of the design's basis.
        whiten_rcond: Linear: the attention fits' whitening cut (``1e-3``: to train further).
        fit_bias: Linear: whether an affine level's fit has an intercept (its design a column of
            ones): ``"auto"`` exactly when its layer has a bias (a bias-free layer is fitted
            without one, not fitted with one that is then dropped), True always (an error names
            a level whose layer has no bias), False never (a layer's bias is set to 0). The
            offsets inside ResNet and ViT blocks (BatchNorm shifts, position embeddings) are
            always fitted.
        match_rounds: Hungarian, more than two models: most rounds of re-matching each model's
            neurons to the groups of the others
            (:func:`~fedfuse.fusion.blocks.matching.one_to_one_labels`; 0: only the start, each
            model matched in turn to the groups of the models before it).
        n_init, max_iter, tol, local_search_swaps: K-means restarts, Lloyd iterations, relative
            tolerance, and accepted swaps of the Kanungo local search (0: off).
        kmeans_variance: K-means runs on the neurons' principal coordinates that keep this
            share of their weighted variance (1: on every feature); ``"auto"`` (default) keeps
            0.99 from 64 neurons per cluster on (a thousand 512-wide models), every feature
            below (:func:`~fedfuse.fusion.blocks.kmeans.resolve_variance`).
        preset: Gradient: ``"setting1"`` or ``"setting2"`` of Table 9; the options below
            (None: the preset's value) override it.
        epochs, last_epochs, lr, last_lr, epsilon, batch_size, patience: Gradient overrides;
            ``epsilon`` interpolates the initial level weights from model 0's level (0) to a
            fresh initialisation (1); ``patience`` 0 never stops early.
        weighted_loss: Gradient: weight each fused neuron's MSE by its cluster's importance.
        start: Gradient: where each level's descent starts: ``"base"`` (Table 9: model 0's level
            blended with a fresh one by ``epsilon``) or ``"closed-form"`` (the Linear fit, for
            affine levels and ResNet stems and blocks; other levels start from ``"base"``),
            which is kept when descent does not improve it on the held-out slice; the
            ``"refine"`` preset suits it.
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
        head_weights: bool | str = "auto",
        ridge: float | None = None,
        ridge_prior: str = "auto",
        rcond: float = 1e-10,
        whiten_rcond: float = WHITEN_RCOND,
        fit_bias: bool | str = "auto",
        n_init: int = 1,
        max_iter: int = 100,
        tol: float = 1e-4,
        local_search_swaps: int = 0,
        kmeans_variance: float | str = "auto",
        match_rounds: int = 50,
        preset: str = "setting1",
        epochs: int | None = None,
        last_epochs: int | None = None,
        lr: float | None = None,
        last_lr: float | None = None,
        epsilon: float | None = None,
        batch_size: int | None = None,
        patience: int | None = None,
        weighted_loss: bool = False,
        start: str = "base",
        seed: int = 0,
        device: str = "auto",
        batch_size_capture: int = 256,
        gram_precision: str = "float32",
        progress: bool = False,
    ) -> None:
        if grouping not in GROUPINGS:
            raise ValueError(f"grouping must be one of {GROUPINGS}, got {grouping!r}")
        if approximation not in APPROXIMATIONS:
            raise ValueError(f"approximation must be one of {APPROXIMATIONS}: {approximation!r}")
        if preset not in GRADIENT_PRESETS:
            raise ValueError(f"preset must be one of {sorted(GRADIENT_PRESETS)}, got {preset!r}")
        if fallback_scores not in SCORE_METHODS:
            raise ValueError(f"fallback_scores must be one of {SCORE_METHODS}")
        if not (isinstance(head_weights, bool) or head_weights == "auto"):
            raise ValueError(
                f"{self.name}: head_weights must be true, false or 'auto', got {head_weights!r}"
            )
        if (ridge is not None and ridge < 0) or rcond <= 0:
            raise ValueError(f"ridge must be >= 0 and rcond > 0, got {ridge} and {rcond}")
        self.grouping, self.approximation = grouping, approximation
        self.use_scores = use_scores
        self.score_normalization = score_normalization
        self.fallback_scores = fallback_scores
        self.head_weights = head_weights
        self.ridge = ridge
        self.ridge_prior = prior.check_ridge_prior(ridge_prior)
        self.rcond, self.whiten_rcond = rcond, whiten_rcond
        check_fit_bias(fit_bias, self.name)
        self.fit_bias = fit_bias
        self.n_init, self.max_iter, self.tol = n_init, max_iter, tol
        self.local_search_swaps = local_search_swaps
        resolve_variance(kmeans_variance, 1, 1)  # ValueError now, not at the first level
        self.kmeans_variance = kmeans_variance
        self.match_rounds = match_rounds
        self.preset = preset
        self.epochs = epochs
        self.last_epochs = last_epochs
        self.lr = lr
        self.last_lr = last_lr
        self.epsilon = epsilon
        self.batch_size = batch_size
        self.patience = patience
        self.weighted_loss = weighted_loss
        if start not in STARTS:
            raise ValueError(f"start must be one of {STARTS}, got {start!r}")
        self.start = start
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
    def check_target(self, spec: ModelSpec, target: ModelSpec) -> None:
        check_one_to_one(self.name, self.grouping, [spec.widths, target.widths])

    def check_architecture(self, model: LeveledModel) -> None:
        """Linear fits affine levels and ResNet blocks in closed form; Gradient trains any."""
        if self.approximation == "linear":
            check_block_levels(model, affine_view)
            for index in model.neuron_levels:
                view = affine_view(model.levels[index])
                if view is not None:
                    where = f"{self.name}: level {model.level_name(index)}"
                    fit_intercept(view.layer, self.fit_bias, where=where)

    def requirements(self) -> frozenset[str]:
        return self.requires | ({"class_counts"} if self.head_weights is True else set())

    def needs(self) -> frozenset[str]:
        needed = set(self.requirements())
        if self.head_weights == "auto":
            needed |= {"class_counts", "labels"}  # optional: the fallbacks
        if self.use_scores:
            needed.add("scores")
            if self.fallback_scores != "uniform":
                needed.add("labels")
        return frozenset(needed)

    def gradient_settings(self) -> GradientPreset:
        """The preset with this instance's overrides applied."""
        return preset_with_overrides(
            self.preset,
            epochs=self.epochs,
            last_epochs=self.last_epochs,
            lr=self.lr,
            last_lr=self.last_lr,
            epsilon=self.epsilon,
            batch_size=self.batch_size,
            patience=self.patience,
        )

    # ------------------------------------------------------------------ grouping
    def _group(
        self, points: torch.Tensor, weights: torch.Tensor, widths: list[int], k: int
    ) -> torch.Tensor:
        """Fused neuron of each base neuron; ``points`` are base neurons as rows."""
        return group_neurons(
            points,
            weights,
            widths,
            k,
            grouping=self.grouping,
            n_init=self.n_init,
            max_iter=self.max_iter,
            tol=self.tol,
            seed=self.seed,
            local_search_swaps=self.local_search_swaps,
            match_rounds=self.match_rounds,
            kmeans_variance=self.kmeans_variance,
        )

    def _residual_labels(
        self,
        x: torch.Tensor,
        outputs: list[torch.Tensor],
        weights: torch.Tensor,
        widths: list[int],
        k: int,
    ) -> torch.Tensor:
        """:func:`~fedfuse.fusion.methods.neuron_interpolation.grouping.residual_labels` with this
        instance's grouping."""
        return residual_labels(x, outputs, weights, widths, k, self._group)

    # ------------------------------------------------------------------ one level's fit
    def _head_candidates(
        self, inputs: FusionInputs, count: int, classes: int
    ) -> dict[str, torch.Tensor]:
        """The classifier targets' model weights ``(models, classes)`` to fit, by name
        (``"uniform"``, ``"classes"``): one, or both for ``head_weights="auto"`` when the
        class counts and the labelled fusion set are given and the two differ."""
        uniform = resolve_head_weights(self.name, None, count, classes)
        if self.head_weights is False or inputs.class_counts is None:
            if self.head_weights is True:  # requirements() made fuse() refuse this already
                raise ValueError(f"{self.name}: head_weights=true needs class_counts")
            return {"uniform": uniform}
        shares = resolve_head_weights(self.name, inputs.class_counts, count, classes)
        if self.head_weights is True or inputs.labels is None or torch.equal(shares, uniform):
            return {"classes": shares}
        return {"uniform": uniform, "classes": shares}

    def _fit_level(
        self,
        fit: _LevelFit,
        models: list[LeveledModel],
        weights: torch.Tensor,
        labels: torch.Tensor | None,
        *,
        is_head: bool,
    ) -> dict[str, Any]:
        """Fit ``fit.level`` in place: closed form (Linear, or the Gradient variant's start),
        then gradient steps for the Gradient variant. Returns the level's details."""
        level, x, outputs, widths, k = fit.level, fit.x, fit.outputs, fit.widths, fit.k
        index, captured, mappings = fit.index, fit.captured, fit.mappings
        closed_form = self.approximation == "linear" or (
            self.start == "closed-form"
            and (is_block_level(level) or affine_view(level) is not None)
        )
        info: dict[str, Any] = {}
        if closed_form and is_block_level(level):
            info = fit_block_linear(
                level,
                x,
                [m.levels[mp[index]] for m, mp in zip(models, mappings, strict=True)],
                [c[index].inputs for c in captured],
                weights,
                k,
                labels,
                group=self._group,
                batch_size=self.batch_size_capture,
            )
            info.update(
                level_cost(level, x, outputs, info["labels"], weights, self.batch_size_capture)
            )
        elif closed_form:
            info = fit_linear(
                level,
                x,
                outputs,
                weights,
                widths,
                k,
                labels,
                group=self._group,
                ridge=self.ridge,
                rcond=self.rcond,
                gram_dtype=self.gram_dtype,
                batch_size_capture=self.batch_size_capture,
                name=self.name,
                fit_bias=self.fit_bias,
                columns=fit.columns,
                prior_weights=fit.prior_weights,
                ridge_prior=self.ridge_prior,
            )
        if self.approximation == "gradient":
            start = {key: info[key] for key in ("representation_cost",) if key in info}
            info = fit_gradient(
                level,
                x,
                outputs,
                weights,
                widths,
                k,
                info.get("labels", labels),
                models[0].levels[mappings[0][index]],
                is_head,
                index,
                settings=self.gradient_settings(),
                group=self._group,
                weighted_loss=self.weighted_loss,
                seed=self.seed,
                batch_size_capture=self.batch_size_capture,
                started=closed_form,
            )
            if start:
                info["closed_form_cost"] = start["representation_cost"]
        return info

    def _fit_head(
        self,
        fit: _LevelFit,
        models: list[LeveledModel],
        heads: dict[str, torch.Tensor],
        fused: LeveledModel,
        inputs: FusionInputs,
        device: torch.device,
    ) -> dict[str, Any]:
        """Fit the classifier to each candidate target (:meth:`_head_candidates`); of several,
        keep the one whose fused model has the lower fusion-set cross-entropy."""
        classes = fit.k
        labels = torch.arange(classes, device=device).repeat(len(models))
        fitted: dict[str, tuple[dict[str, Any], dict[str, torch.Tensor]]] = {}
        initial = {key: v.detach().clone() for key, v in fit.level.state_dict().items()}
        for name, mix in heads.items():
            fit.level.load_state_dict(initial)
            weights = mix.reshape(-1).to(device)  # (model, class), model-major like labels
            info = self._fit_level(fit, models, weights, labels, is_head=True)
            state = {key: v.detach().clone() for key, v in fit.level.state_dict().items()}
            fitted[name] = (info, state)
        if len(fitted) == 1:
            name, (info, _) = next(iter(fitted.items()))
            info["head"] = name
            return info
        assert inputs.labels is not None
        losses = {}
        after = nn.Sequential(*fused.levels[fit.index + 1 :]).eval()
        with torch.no_grad():
            for name, (_, state) in fitted.items():
                fit.level.load_state_dict(state)
                logits = torch.cat(
                    [after(fit.level(chunk)) for chunk in fit.x.split(self.batch_size_capture)]
                )
                target = inputs.labels.to(logits.device)
                losses[name] = float(nn.functional.cross_entropy(logits.float(), target))
        chosen = min(losses, key=losses.__getitem__)
        info, state = fitted[chosen]
        fit.level.load_state_dict(state)
        info.update(head=chosen, head_fusion_set_losses=losses)
        log.info(
            "%s: classifier fitted to the %s target (fusion-set losses %s)",
            self.name,
            chosen,
            losses,
        )
        return info

    def _stream_level(
        self,
        streams: list[LevelStream],
        captured: list[dict[int, Any]],
        mappings: list[dict[int, int]],
        index: int,
        fused: LeveledModel,
        previous: tuple[torch.Tensor, list[int]] | None = None,
    ) -> torch.Tensor | None:
        """Every base model's level ``index`` into ``captured``. When K-means will cluster the
        level's neurons on principal coordinates (many models) and its outputs are vectors,
        they are written side by side into one tensor, returned, whose transpose is the
        neurons as points (the kernel route's points).

        ``previous``: the last level's such tensor and widths. With the same widths again, each
        model's block is overwritten once its stream read it (never two levels at once)."""
        first = streams[0].level(mappings[0][index])
        widths = [s.model.level_width(mp[index]) for s, mp in zip(streams, mappings, strict=True)]
        many = first.outputs.dim() == 2 and self.grouping == "kmeans"
        if not many or not resolve_variance(
            self.kmeans_variance, sum(widths), fused.level_width(index)
        ):
            captured[0][index] = first
            rest = zip(streams[1:], captured[1:], mappings[1:], strict=True)
            for stream, capture, mapping in rest:
                capture[index] = stream.level(mapping[index])
            return None
        shape = (len(first.outputs), sum(widths))
        reuse = (
            previous is not None
            and previous[1] == widths
            and previous[0].shape == shape
            and not any(s.keep_inputs for s in streams)  # kept inputs are views of previous
        )
        columns = previous[0] if reuse and previous else first.outputs.new_empty(shape)
        offsets = [0, *torch.tensor(widths).cumsum(0).tolist()]
        blocks = [columns[:, offsets[n] : offsets[n + 1]] for n in range(len(streams))]
        blocks[0].copy_(first.outputs)
        streams[0].keep(blocks[0])
        captured[0][index] = LevelIO(first.inputs, blocks[0])
        del first
        for number in range(1, len(streams)):
            level = streams[number].level(mappings[number][index], out=blocks[number])
            captured[number][index] = level
        return columns

    @uses_whitening_cutoff  # the algorithm
    def _fuse(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec
    ) -> tuple[LeveledModel, dict[str, Any]]:
        mappings = check_structure(self.name, models, target, self.grouping, self.approximation)
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
        # each model's levels are computed as the fit reaches them: one level in memory at a time
        streams = [
            LevelStream(
                m,
                data,
                batch_size=self.batch_size_capture,
                device=device,
                store_device=device,
                keep_inputs=(self.approximation == "linear" or self.start == "closed-form")
                and any(is_block_level(level) for level in m.levels),
            )
            for m in models
        ]
        captured: list[dict[int, Any]] = [{} for _ in models]
        scores = [
            {level: model_scores[base_level] for level, base_level in mapping.items()}
            for model_scores, mapping in zip(scores, mappings, strict=True)
        ]
        heads = self._head_candidates(inputs, len(models), models[0].spec.num_classes)
        details: dict[str, Any] = {
            "variant": f"{self.grouping}-{self.approximation}",
            "levels": [],
        }
        if self.approximation == "linear" and self.ridge is None:
            details["ridge_grid"] = list(RIDGE_GRID)
        if self.approximation == "gradient":
            details["gradient"] = asdict(self.gradient_settings())
        x = data.to(device)
        previous: tuple[torch.Tensor, list[int]] | None = None
        plain = self.ridge_prior != "zero" and prior.has_plain_levels(fused)
        below: tuple[torch.Tensor, list[int], int] | None = None  # the last level's groups
        bar = tqdm(range(fused.num_levels), desc=self.name, disable=not self.progress, leave=False)
        for index in bar:
            level = fused.levels[index]
            if index not in neuron_levels:
                with torch.no_grad():
                    x = level(x)
                continue
            started = time.perf_counter()
            columns = self._stream_level(streams, captured, mappings, index, fused, previous)
            outputs = [c[index].outputs for c in captured]
            widths = [o.shape[1] for o in outputs]
            is_head = index == neuron_levels[-1]
            k = fused.level_width(index)
            fit = _LevelFit(index, level, x, outputs, widths, k, captured, mappings, columns)
            if plain:
                bases = [m.levels[mp[index]] for m, mp in zip(models, mappings, strict=True)]
                fit.prior_weights = partial(prior.aligned_weight_centres, bases, below, level)
            if is_head:
                info = self._fit_head(fit, models, heads, fused, inputs, device)
            else:
                weights = torch.cat([scores[m][index] for m in range(len(models))]).to(device)
                labels = None
                if fused.is_residual(index):
                    labels = self._residual_labels(x, outputs, weights, widths, k)
                info = self._fit_level(fit, models, weights, labels, is_head=False)
            grouped = info.pop("labels", None)
            below = None if grouped is None else (grouped, widths, k)
            for capture in captured:  # this level's base outputs are not needed again
                del capture[index]
            previous = None if columns is None else (columns, widths)
            del outputs, fit, columns
            release_free_memory()
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
