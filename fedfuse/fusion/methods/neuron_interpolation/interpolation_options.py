"""The options of neuron interpolation on the fusion set, and what they configure.

:class:`InterpolationOptions` holds every option of the ``hf-*``/``kf-*`` fusion-set methods, each
written once with its default and its check, decides what a fusion needs and which models and
targets it can fit, and turns the options into what the fit calls: the grouping of a level's
neurons (:mod:`.grouping`) and the Gradient variant's settings (:mod:`.gradient`). The
level-by-level fit itself is :class:`~.methods.NeuronInterpolation`'s.
"""

from __future__ import annotations

import torch

from fedfuse.fusion.base import FusionMethod
from fedfuse.fusion.blocks.kmeans import resolve_variance
from fedfuse.fusion.blocks.pieces import check_affine_intercept
from fedfuse.fusion.blocks.whitening import WHITEN_RCOND
from fedfuse.fusion.methods.neuron_interpolation import prior
from fedfuse.fusion.methods.neuron_interpolation.blocks import check_block_levels
from fedfuse.fusion.methods.neuron_interpolation.gradient import (
    GRADIENT_OVERRIDES,
    GRADIENT_PRESETS,
    GradientPreset,
    preset_with_overrides,
)
from fedfuse.fusion.methods.neuron_interpolation.grouping import (
    GROUPINGS,
    group_with_options,
    residual_labels,
)
from fedfuse.fusion.methods.neuron_interpolation.options import APPROXIMATIONS, STARTS
from fedfuse.fusion.methods.neuron_interpolation.structure import (
    check_one_to_one,
    one_to_one_cost,
)
from fedfuse.models import LeveledModel, ModelSpec
from fedfuse.models.affine import affine_view, check_fit_bias
from fedfuse.models.importance import SCORE_METHODS


class InterpolationOptions(FusionMethod):
    """The options of neuron interpolation on the fusion set, and what they configure.

    The base of :class:`~.methods.NeuronInterpolation`, which adds the fit itself, and so of
    :class:`~.variants.HFLinear`, :class:`~.variants.HFGradient`, :class:`~.variants.KFLinear`
    and :class:`~.variants.KFGradient` (the registered methods, each taking only the options
    below that apply to it).

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
        """Linear fits affine levels and ResNet and ViT blocks in closed form (fedfuse's own, or
        read off a user's graph: torchvision's ResNets and VisionTransformer); Gradient trains
        any."""
        if self.approximation == "linear":
            check_block_levels(model, affine_view)
            for index in model.neuron_levels:
                check_affine_intercept(model, index, self.fit_bias, self.name)

    def cost_with_many_sites(self, num_models: int) -> str | None:
        return one_to_one_cost(self.grouping, num_models)

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
        overrides = {name: getattr(self, name) for name in GRADIENT_OVERRIDES}
        return preset_with_overrides(self.preset, **overrides)

    # ------------------------------------------------------------------ grouping
    def _group(
        self, points: torch.Tensor, weights: torch.Tensor, widths: list[int], k: int
    ) -> torch.Tensor:
        """Fused neuron of each base neuron; ``points`` are base neurons as rows."""
        return group_with_options(
            self,
            points,
            weights,
            widths,
            k,
            seed=self.seed,
            local_search_swaps=self.local_search_swaps,
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


__all__ = ["InterpolationOptions"]
