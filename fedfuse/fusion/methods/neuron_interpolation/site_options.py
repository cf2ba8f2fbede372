"""The options of neuron interpolation fitted on the sites' statistics, and what they accept.

``hf-sites`` and ``kf-sites`` (:mod:`.sites`), ``kf-grams`` (:mod:`.grams`) and ``kf-trust``
(:mod:`.trusted`) share one set of options: the grouping, the ridge, the statistics' wire format,
differential privacy. :class:`SiteOptions` holds them, each with its default and its check, and
decides what a fusion needs (:meth:`~SiteOptions.requirements`) and which models and targets it
can fit: every neuron level made of linear pieces the statistics fit in closed form. The fit
itself is :class:`~.sites.SiteInterpolation`'s.
"""

from __future__ import annotations

from fedfuse.fusion.base import FusionMethod
from fedfuse.fusion.blocks.graph_pieces import fold_norm_levels
from fedfuse.fusion.blocks.kmeans import resolve_variance
from fedfuse.fusion.blocks.pieces import check_affine_intercept, linear_pieces
from fedfuse.fusion.blocks.whitening import WHITEN_RCOND
from fedfuse.fusion.methods.neuron_interpolation.blocks import unfit_op
from fedfuse.fusion.methods.neuron_interpolation.structure import (
    check_one_to_one,
    one_to_one_cost,
)
from fedfuse.fusion.statistics.privacy import check_dp_options
from fedfuse.fusion.statistics.rounds import STATISTICS_DTYPES
from fedfuse.fusion.statistics.summed_terms import check_statistics_mode
from fedfuse.models import LeveledModel, ModelSpec, build_model
from fedfuse.models.affine import affine_view, check_fit_bias


class SiteOptions(FusionMethod):
    """The options of neuron interpolation fitted on the sites' statistics, and what they accept.

    The base of :class:`~.sites.SiteInterpolation` (and so of ``hf-sites``, ``kf-sites``,
    ``kf-grams``, ``kf-trust`` and their kin), which adds the fit itself.

    Args:
        grouping: ``"hungarian"`` (models of the target's width, one neuron of each per
            group) or ``"kmeans"``.
        use_scores: weight neurons by the sites' importance scores (else uniformly).
        score_normalization: per model and level, ``"sum"``, ``"max"`` or ``"none"``.
        ridge: relative ridge of every level's fit; None chooses it per level by GCV over
            :data:`~fedfuse.fusion.blocks.least_squares.RIDGE_GRID` from the sites' statistics.
        whiten_rcond: the cut of the attention fits' whitening; ``1e-3`` for a model to train
            further (:func:`~fedfuse.fusion.blocks.whitening.whitening_cutoff`).
        fit_bias: whether an affine level's fit has an intercept: ``"auto"`` exactly when its
            layer has a bias (a bias-free layer's design has no column of ones), True always (an
            error names a level whose layer has none), False never (the server drops the
            column, :func:`~fedfuse.fusion.statistics.rounds.without_intercept`, and the layer's
            bias is 0). The offsets inside ResNet and ViT blocks are always fitted.
        max_samples: samples of each site used for its statistics (None: all).
        statistics_dtype: wire precision of the statistics, ``"float32"`` or ``"float64"``.
        statistics: ``"per-site"``: the sites' neurons are grouped by their translations and
            each reply is read on its own; ``"sums"``: grouped on the fusion set, each site
            sent its reading, the fit made from the sums over sites alone
            (:mod:`fedfuse.fusion.statistics.readings`; affine levels; needs a fusion set).
        gram_rank: compress each site's Gram of levels wider than this to its top eigenpairs
            plus an isotropic remainder (``fan_in x gram_rank`` floats instead of
            ``fan_in^2``); None sends it in full.
        match_rounds: Hungarian, more than two models: most rounds of re-matching each model's
            neurons to the others' groups (0: each matched once to the models before it).
        n_init, max_iter, tol: K-means restarts, Lloyd iterations and relative tolerance.
        kmeans_variance: K-means on the principal coordinates that keep this share of the
            weighted variance; ``"auto"`` (default) 0.99 from 64 neurons per cluster on
            (:func:`~fedfuse.fusion.blocks.kmeans.resolve_variance`).
        seed: seeds k-means, the fused model's unused parameters and the sites' subsets.
        progress: show a progress bar over levels.
        dp_epsilon, dp_delta: differentially private statistics
            (:mod:`fedfuse.fusion.statistics.privacy`): the noise is calibrated so that all
            rounds spend at most this budget. None: exact;
            ``inf``: clipping only. The uploaded weights and scores are not covered.
        dp_clip: bound on a sample's norm over its rows ``[x, z]``; None: chosen on the fusion
            set (:func:`~fedfuse.fusion.statistics.privacy.fusion_set_mechanism`), which is then
            needed.
        dp_noise_seed: seeds the noise with
            :class:`~fedfuse.fusion.statistics.channels.LocalSites` (reproducible simulations).
    """

    name = "site-interpolation"
    requires = frozenset({"sites"})
    same_spec = False
    retargetable = True
    needs_affine_levels = False  # check_architecture decides: linear pieces in every level

    def __init__(
        self,
        grouping: str = "kmeans",
        *,
        use_scores: bool = True,
        score_normalization: str = "sum",
        ridge: float | None = None,
        whiten_rcond: float = WHITEN_RCOND,
        fit_bias: bool | str = "auto",
        max_samples: int | None = None,
        statistics_dtype: str = "float32",
        gram_rank: int | None = None,
        match_rounds: int = 50,
        statistics: str = "per-site",
        n_init: int = 1,
        kmeans_variance: float | str = "auto",
        max_iter: int = 100,
        tol: float = 1e-4,
        seed: int = 0,
        progress: bool = False,
        dp_epsilon: float | None = None,
        dp_delta: float = 1e-5,
        dp_clip: float | None = None,
        dp_noise_seed: int | None = None,
    ) -> None:
        if grouping not in ("hungarian", "kmeans"):
            raise ValueError(f"grouping must be 'hungarian' or 'kmeans', got {grouping!r}")
        if ridge is not None and not ridge >= 0:
            raise ValueError(f"ridge must be >= 0 or None, got {ridge}")
        if statistics_dtype not in STATISTICS_DTYPES:
            raise ValueError(f"statistics_dtype must be one of {sorted(STATISTICS_DTYPES)}")
        self.grouping = grouping
        self.use_scores = use_scores
        self.score_normalization = score_normalization
        self.ridge, self.whiten_rcond = ridge, whiten_rcond
        check_fit_bias(fit_bias, self.name)
        self.fit_bias = fit_bias
        self.max_samples = max_samples
        self.statistics_dtype = statistics_dtype
        self.gram_rank = gram_rank
        check_statistics_mode("statistics", statistics)
        self.statistics = statistics
        self.match_rounds = match_rounds
        self.n_init = n_init
        resolve_variance(kmeans_variance, 1, 1)  # ValueError now, not at the first level
        self.kmeans_variance = kmeans_variance
        self.max_iter, self.tol = max_iter, tol
        self.seed, self.progress = seed, progress
        self.dp_epsilon = check_dp_options(dp_epsilon, dp_delta, dp_clip, self.name)
        self.dp_delta, self.dp_clip = dp_delta, dp_clip
        self.dp_noise_seed = dp_noise_seed

    def cost_with_many_sites(self, num_models: int) -> str | None:
        return one_to_one_cost(self.grouping, num_models)

    def requirements(self) -> frozenset[str]:
        on_data = self.statistics == "sums" or (self.dp_epsilon is not None and not self.dp_clip)
        return frozenset(self.requires) | ({"data"} if on_data else set())

    def needs(self) -> frozenset[str]:
        return self.requirements() | ({"scores"} if self.use_scores else set())

    def check_architecture(self, model: LeveledModel) -> None:
        """The statistics rounds fit each linear piece in closed form from the sites' Grams of
        its design rows (:func:`~fedfuse.fusion.blocks.pieces.linear_pieces`): every level with
        neurons must be affine, a ResNet stem or BasicBlock, or a ViT embedding or block, or
        in a user's model a graph level read as such pieces (a ``Linear``/``Conv2d`` with its
        BatchNorm, residual blocks of them: :mod:`~fedfuse.fusion.blocks.graph_pieces`)."""
        model, _ = fold_norm_levels(model)  # the levels as the rounds index them
        for index in model.neuron_levels:
            if linear_pieces(model.levels[index]) is None:
                raise ValueError(
                    f"{self.name} fits every level in closed form from the sites' statistics, "
                    "which needs affine levels (parameter-free ops then one Linear/Conv2d), "
                    "ResNet blocks or ViT blocks, or in a model of yours a Linear/Conv2d with "
                    "its BatchNorm and residual blocks of them; "
                    f"{model.spec.arch} level {model.level_name(index)} is none of these"
                    f"{unfit_op(model.levels[index])}; use kf-gradient for it"
                )
            if self.dp_epsilon is not None and any(
                piece.stream is not None for piece in linear_pieces(model.levels[index]) or ()
            ):
                raise ValueError(
                    f"{self.name} with dp_epsilon: {model.spec.arch} level "
                    f"{model.level_name(index)} adds to a residual stream (not covered by DP yet)"
                )
            if affine_view(model.levels[index]) is None and self.statistics == "sums":
                raise ValueError(
                    f"{self.name} with statistics='sums' fits affine levels only; "
                    f"{model.spec.arch} level {model.level_name(index)} is not affine"
                )
            check_affine_intercept(model, index, self.fit_bias, self.name)

    # ------------------------------------------------------------------ checks
    def check_target(self, spec: ModelSpec, target: ModelSpec) -> None:
        check_one_to_one(self.name, self.grouping, [spec.widths, target.widths])

    def _check_structure(self, models: list[LeveledModel], target: ModelSpec) -> list[int]:
        levels = models[0].neuron_levels
        for number, model in enumerate(models):
            try:
                self.check_architecture(model)
            except ValueError as error:
                raise ValueError(f"model {number}: {error}") from None
            if model.neuron_levels != levels:
                raise ValueError(
                    f"{self.name}: model {number} has other neuron levels than model 0"
                )
        reference = build_model(target, device="meta")
        if reference.neuron_levels != levels or target.arch != models[0].spec.arch:
            raise ValueError(
                f"{self.name}: the target {target.arch} {target.widths} does not have the base "
                f"models' levels"
            )
        check_one_to_one(
            self.name, self.grouping, [*(m.spec.widths for m in models), target.widths]
        )
        return levels


__all__ = ["SiteOptions"]
