r"""Neuron interpolation fitted on the sites' own data: HF/KF grouping, RegMean-style fits.

Neuron-interpolation fusion (:mod:`fedfuse.fusion.methods.neuron_interpolation`) groups the base
models' neurons and fits each fused level to the group centres on the server's fusion set, a few
hundred samples that in practice come from one site. Here every level is instead fitted on all
the sites' training data, through the statistics each site computes on its own data
(:mod:`fedfuse.fusion.statistics.rounds`), still zero-shot: sites only run forward passes. The
fused model is built bottom-up, one neuron level per round:

1. The server sends the fused model (levels below ``l`` final); site ``k`` returns, for the fused
   level's design ``X_k`` on its data and its own model's level outputs ``Z_k``, the statistics
   ``G_k = X_k^T X_k``, ``B_k = X_k^T Z_k``, ``C_k = Z_k^T Z_k`` and the translation
   ``H_k = (G_k + lambda_k I)^{-1} B_k`` of its neurons into the fused inputs.
2. *Grouping*: neuron ``i`` of model ``k`` is the column ``h_i`` of ``H_k``, a function of the
   fused inputs; with ``G = sum_k G_k = R^T R`` the pooled design's Gram, ``||R (h_i - h_j)||``
   is the distance of two neurons' outputs over all sites' data. The points ``R h_i`` are
   grouped as in HF (one-to-one Hungarian matching; more than two models: iterative
   re-matching, :func:`~fedfuse.fusion.blocks.matching.one_to_one_labels`) or KF
   (k-means), weighted by the sites' importance scores.
3. *Reading*: fused neuron ``c`` is read, on site ``k``'s data, as model ``k``'s neurons in group
   ``c`` (importance-weighted mean), or model ``k``'s nearest neuron when the group has none of
   its neurons: a matrix ``P_k`` (``fused width x width_k``). The classifier reads each model's
   own logits.
4. *Fit* (RegMean-style, but on the fused inputs): on each site's data the fused level should
   reproduce the site's own model, the expert there,
   ``W = argmin sum_k ||X_k W - Z_k P_k^T||^2 + lambda ||W||^2
   = (G + lambda I)^{-1} sum_k B_k P_k^T``, the ridge chosen by GCV from the same statistics.

Because each level is fitted to what the *fused* prefix actually computes, errors of lower
levels are corrected, as in the paper's bottom-up fit; because each site's data is fitted to
its own model, a sharded site's classes are learned from the site that has them.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from fedfuse.fusion.base import FusionInputs, FusionMethod
from fedfuse.fusion.blocks.attention import attention_logits
from fedfuse.fusion.blocks.kmeans import resolve_variance, weighted_centers, weighted_kmeans
from fedfuse.fusion.blocks.least_squares import RIDGE_GRID, cholesky_upper, ridge_fit
from fedfuse.fusion.blocks.matching import linear_assignment, one_to_one_labels
from fedfuse.fusion.blocks.pieces import LinearPiece, linear_pieces
from fedfuse.fusion.blocks.whitening import WHITEN_RCOND, uses_whitening_cutoff
from fedfuse.fusion.inputs import resolve_scores
from fedfuse.fusion.methods.neuron_interpolation.options import fixed_variant
from fedfuse.fusion.methods.neuron_interpolation.structure import check_one_to_one
from fedfuse.fusion.registry import register_fusion_method
from fedfuse.fusion.statistics.channels import SiteChannel, checked_replies
from fedfuse.fusion.statistics.privacy import (
    GaussianStatistics,
    calibrate_noise,
    check_dp_options,
    fusion_set_mechanism,
    spent_epsilon,
)
from fedfuse.fusion.statistics.readings import (
    fusion_set_readings,
    number_like_the_stream,
    readings_from_groups,
    stream_tensor,
)
from fedfuse.fusion.statistics.rounds import (
    STATISTICS_DTYPES,
    SiteStatistics,
    StatisticsRequest,
    without_intercept,
)
from fedfuse.fusion.statistics.summed_terms import summed_statistics
from fedfuse.models import LeveledModel, ModelSpec, build_model
from fedfuse.models.affine import affine_view, check_fit_bias, fit_intercept

log = logging.getLogger(__name__)


class SiteInterpolation(FusionMethod):
    """Neuron-interpolation fusion fitted on the sites' statistics (one round per level).

    The shared base of :class:`HFSites` and :class:`KFSites`. Needs
    :attr:`FusionInputs.sites`, a :class:`~fedfuse.fusion.statistics.channels.SiteChannel` (in a
    Flower run the strategy provides it; in the library,
    :class:`~fedfuse.fusion.statistics.channels.LocalSites`); no fusion set.

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
        (:mod:`fedfuse.fusion.statistics.privacy`):
            the noise is calibrated so that all rounds spend at most this budget. None: exact;
            ``inf``: clipping only. The uploaded weights and scores are not covered.
        dp_clip: bound on a sample's norm over its rows ``[x, z]``; None: chosen on the fusion
            set (:func:`~fedfuse.fusion.statistics.privacy.fusion_set_mechanism`), which is then
            needed.
        dp_noise_seed: seeds the noise with :class:`LocalSites` (reproducible simulations).
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
        if statistics not in ("per-site", "sums"):
            raise ValueError(f"statistics must be 'per-site' or 'sums', got {statistics!r}")
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

    def requirements(self) -> frozenset[str]:
        on_data = self.statistics == "sums" or (self.dp_epsilon is not None and not self.dp_clip)
        return frozenset(self.requires) | ({"data"} if on_data else set())

    def needs(self) -> frozenset[str]:
        return self.requirements() | ({"scores"} if self.use_scores else set())

    def check_architecture(self, model: LeveledModel) -> None:
        """The statistics rounds fit each linear piece in closed form from the sites' Grams of
        its design rows (:func:`~fedfuse.fusion.blocks.pieces.linear_pieces`): every level with
        neurons must be affine, a ResNet stem or BasicBlock, or a ViT embedding or block."""
        for index in model.neuron_levels:
            if linear_pieces(model.levels[index]) is None:
                raise ValueError(
                    f"{self.name} fits every level in closed form from the sites' statistics, "
                    "which needs affine levels (parameter-free ops then one Linear/Conv2d), "
                    f"ResNet blocks or ViT blocks; {model.spec.arch} level "
                    f"{model.level_name(index)} is none of these; use kf-gradient for it"
                )
            if self.dp_epsilon is not None and any(
                piece.stream is not None for piece in linear_pieces(model.levels[index]) or ()
            ):
                raise ValueError(
                    f"{self.name} with dp_epsilon: {model.spec.arch} level "
                    f"{model.level_name(index)} adds to a residual stream (not covered by DP yet)"
                )
            view = affine_view(model.levels[index])
            if view is None and self.statistics == "sums":
                raise ValueError(
                    f"{self.name} with statistics='sums' fits affine levels only; "
                    f"{model.spec.arch} level {model.level_name(index)} is not affine"
                )
            if view is not None:
                where = f"{self.name}: level {model.level_name(index)}"
                fit_intercept(view.layer, self.fit_bias, where=where)

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

    @uses_whitening_cutoff  # the algorithm
    def _fuse(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec
    ) -> tuple[LeveledModel, dict[str, Any]]:
        levels = self._check_structure(models, target)
        sites = inputs.sites  # None only where _collect reads no sites
        scores = resolve_scores(
            self.name,
            models,
            inputs,
            use_scores=self.use_scores,
            fallback="uniform",
            normalization=self.score_normalization,
            device="cpu",
        )
        fused = build_model(target, seed=self.seed).eval()
        active = list(range(len(models)))
        details: dict[str, Any] = {"variant": f"{self.grouping}-sites", "levels": [], "rounds": []}
        bar = tqdm(levels, desc=self.name, disable=not self.progress, leave=False)
        stream: dict[int, torch.Tensor] = {}  # each site's reading of the residual stream
        self._noise_multiplier, self._clips = None, []
        self._fusion_data, self._sample_counts = inputs.data, inputs.sample_counts
        if self.dp_epsilon is not None:
            rounds = sum(len(linear_pieces(fused.levels[i]) or ()) for i in levels)
            self._noise_multiplier = calibrate_noise(self.dp_epsilon, self.dp_delta, rounds)
            details["privacy"] = {"rounds": rounds, "clips": self._clips}
        for index in bar:
            level_pieces = linear_pieces(fused.levels[index])
            assert level_pieces is not None  # checked by check_architecture
            for number, piece in enumerate(level_pieces):
                privacy = self._mechanism(models, fused, (index, number), inputs)
                active = self._fit_round(
                    models,
                    sites,
                    fused,
                    scores,
                    (index, number, piece),
                    active,
                    details,
                    stream,
                    privacy,
                )
        if self._noise_multiplier is not None:
            rounds = details["privacy"]["rounds"]
            details["privacy"].update(
                noise_multiplier=self._noise_multiplier,
                delta=self.dp_delta,
                epsilon=spent_epsilon(self._noise_multiplier, self.dp_delta, rounds),
                accountant="Opacus RDP",
            )
        details["problems"] = list(sites.problems) if sites is not None else []
        return fused, details

    def _mechanism(
        self, models: list[LeveledModel], fused: LeveledModel, where: tuple[int, int], inputs: Any
    ) -> GaussianStatistics | None:
        """The Gaussian mechanism of the statistics of piece ``where = (level, piece)``."""
        if self._noise_multiplier is None:
            return None
        clip, scale, columns = self.dp_clip, 1.0, None
        if inputs.data is not None:  # a requirement without dp_clip
            chosen, scale, columns = fusion_set_mechanism(models, fused, *where, inputs.data)
            clip = clip or chosen
        assert clip is not None
        self._clips.append(clip)
        return GaussianStatistics(self._noise_multiplier, clip, self.dp_noise_seed, scale, columns)

    def _fit_round(
        self,
        models: list[LeveledModel],
        sites: SiteChannel,
        fused: LeveledModel,
        scores: list[dict[int, torch.Tensor]],
        where: tuple[int, int, LinearPiece],
        active: list[int],
        details: dict[str, Any],
        stream: dict[int, torch.Tensor],
        privacy: GaussianStatistics | None = None,
    ) -> list[int]:
        """One statistics round: gather piece ``number`` of level ``index`` (``where``), fit it
        and load it into ``fused``; returns the sites still active. ``stream`` holds each
        site's reading of the residual stream, which a piece adding to it keeps (and others
        replace); ``privacy`` is the sites' mechanism."""
        index, number, piece = where
        started = time.perf_counter()
        is_head = index == fused.neuron_levels[-1]
        readings, grouping = None, {}
        if self.statistics == "sums" and not is_head:  # grouped before the round
            assert self._fusion_data is not None  # a requirement
            found, grouping = fusion_set_readings(
                [models[m] for m in active],
                index,
                self._fusion_data,
                [scores[m][index] for m in active],
                piece.width(fused.levels[index]),
                lambda points, w, sizes, k: self._group(points, w, sizes, k, index),
            )
            readings = dict(zip(active, found, strict=True))
        request = StatisticsRequest(
            index,
            fused,
            self.max_samples,
            self.statistics_dtype,
            self.seed,
            self.gram_rank,
            piece=number,
            privacy=privacy,
            readings=readings,
        )
        level = fused.levels[index]
        name = fused.level_name(index) + (f" {piece.name}" if piece.name != "affine" else "")
        where = f"{self.name}: level {name}"
        statistics, upload = self._collect(sites, request, models, active, where, stream)
        collected = time.perf_counter() - started
        dropped = [m for m in active if m not in statistics and m not in upload]
        if dropped:
            log.warning("%s: sites %s gave no statistics for %s", self.name, dropped, name)
        active = [m for m in active if m in statistics or m in upload]
        if len(active) < (2 if self.grouping == "hungarian" else 1):
            raise ValueError(
                f"{self.name}: statistics of level {name} came from sites {active} only: "
                + "; ".join(sites.problems)
            )
        intercept, drop_ones = self._intercept(level, piece, name)
        if drop_ones:
            statistics = {m: without_intercept(s) for m, s in statistics.items()}
        weights = {
            m: torch.ones(s.cross.shape[1]) if piece.inner or m < 0 else scores[m][index]
            for m, s in statistics.items()
        }
        if self.statistics == "sums":  # one sum over the sites (statistics[-1])
            width = piece.width(level)
            fitted, gram, info = self._fit_level(index, statistics, {}, True, width)
            info.update(grouping)
            info.pop("readings", None)
        elif piece.kind == "logits":
            fitted, gram, info = self._fit_logits(index, statistics, models, level)
        else:
            fitted, gram, info = self._fit_level(
                index,
                statistics,
                weights,
                is_head,
                piece.width(level),
                stream if piece.stream is not None else None,
            )
            if not (piece.inner or is_head or piece.stream is not None):
                stream.clear()
                stream.update(info.pop("readings"))
            info.pop("readings", None)
        if len(fitted) < piece.fan_in(level):  # fitted without the intercept: bias 0
            fitted = torch.cat([fitted, fitted.new_zeros(1, fitted.shape[1])])
        piece.load(level, fitted, gram)
        info.update(
            level=fused.level_name(index),
            sites=active,
            dropped_sites=dropped,
            collect_seconds=collected,
            seconds=time.perf_counter() - started,
        )
        if piece.name != "affine":
            info["piece"] = piece.name
        else:
            info["intercept"] = intercept
        details["levels"].append(info)
        details["rounds"].append(
            {
                "level": name,
                "upload_bytes": {str(m): size for m, size in upload.items()},
            }
        )
        return active

    def _collect(
        self,
        sites: SiteChannel,
        request: StatisticsRequest,
        models: list[LeveledModel],
        active: list[int],
        where: str,
        inputs_read: dict[int, torch.Tensor],
    ) -> tuple[dict[int, SiteStatistics], dict[int, int]]:
        """The round's statistics by site (key -1: the sum over sites) and each site's upload
        bytes; ``inputs_read``: each site's reading of the fused level's input neurons."""
        if self.statistics == "sums":
            counts = self._sample_counts or [len(self._fusion_data)]
            samples = max(min(c, self.max_samples or c) for c in counts)
            units = (self._fusion_data, samples)
            return summed_statistics(sites, request, models, active, units, where)
        statistics = checked_replies(sites.gather(request), request, models, active, where)
        return statistics, {m: s.payload_bytes() for m, s in statistics.items()}

    def _intercept(self, level: nn.Module, piece: LinearPiece, name: str) -> tuple[bool, bool]:
        """Whether the piece's fit has an intercept (``fit_bias``; a block's pieces always),
        and whether the sites' design has a 1 the fit drops (an affine level fitted without
        intercept although its layer has a bias)."""
        view = affine_view(level) if piece.name == "affine" else None
        if view is None:
            return True, False
        intercept = fit_intercept(view.layer, self.fit_bias, where=f"{self.name}: level {name}")
        return intercept, not intercept and view.layer.bias is not None

    def _fit_level(
        self,
        index: int,
        statistics: dict[int, SiteStatistics],
        weights: dict[int, torch.Tensor],
        is_head: bool,
        width: int,
        stream: dict[int, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """The piece's weights ``(fan_in, width)``, its pooled Gram and what the fit found;
        ``weights``: each
        site's neuron importances; ``stream``: given when the piece's outputs add to the level
        input (the sites sent its stream statistics): each site's reading of the stream, kept
        as this piece's (an identity shortcut adds model ``k``'s channel ``j`` to its own
        output ``j``); when it lacks a site, the groups are numbered like the stream's
        channels. ``info["readings"]`` holds the readings used."""
        order = list(statistics)
        gram = sum(statistics[m].full_gram() for m in order)
        rows = sum(statistics[m].rows for m in order)
        if is_head:
            readings = {m: torch.eye(width, dtype=torch.float64) for m in order}
            info: dict[str, Any] = {}
        elif stream is not None and all(
            m in stream and stream[m].shape == (width, statistics[m].cross.shape[1]) for m in order
        ):
            readings, info = {m: stream[m] for m in order}, {"groups": "the stream's"}
        else:
            readings, info = self._readings(gram, statistics, weights, index, width)
            if stream is not None:
                readings = number_like_the_stream(statistics, readings)
        residual = stream is not None
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
        grid = RIDGE_GRID if self.ridge is None else (self.ridge,)
        fit = ridge_fit(gram, rhs, norms, rows, grid=grid)
        info.update(
            ridge=fit.ridge,
            ridge_criterion="gcv" if self.ridge is None else "fixed",
            gcv=fit.criterion,
            rows=rows,
            fan_in=gram.shape[0],
            translation_ridges={str(m): statistics[m].translation_ridge for m in order},
        )
        info["readings"] = readings
        return fit.weights, gram, info

    def _fit_logits(
        self,
        index: int,
        statistics: dict[int, SiteStatistics],
        models: list[LeveledModel],
        level: nn.Module,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """An attention's queries and keys from each site's translation of its own queries and
        keys (:func:`~fedfuse.fusion.blocks.attention.attention_logits`), the pooled Gram
        measuring the logits; returns the weights, the Gram and what the fit found."""
        order = list(statistics)
        gram = sum(statistics[m].full_gram() for m in order)
        heads = level.attention.heads
        weights, labels = attention_logits(
            [statistics[m].translation.double() for m in order],
            [models[m].levels[index].attention.heads for m in order],
            gram,
            heads,
            level.attention.q.out_features // heads,
            lambda points, w, sizes, k: self._group(points, w, sizes, k, index),
        )
        info = {
            "heads": labels.tolist(),
            "rows": sum(statistics[m].rows for m in order),
            "translation_ridges": {str(m): statistics[m].translation_ridge for m in order},
        }
        return weights, gram, info

    def _group(
        self, points: torch.Tensor, weights: torch.Tensor, sizes: list[int], k: int, index: int
    ) -> torch.Tensor:
        """The group of each point (rows, model by model, ``sizes`` each): one neuron of each
        model per group (Hungarian), or importance-weighted k-means; groups in model 0's order
        (k-means: when ``k`` is its size)."""
        if self.grouping == "hungarian":
            return one_to_one_labels(points, weights, sizes, rounds=self.match_rounds)
        result = weighted_kmeans(
            points.float(),
            weights.float(),
            k,
            n_init=self.n_init,
            max_iter=self.max_iter,
            tol=self.tol,
            seed=self.seed + index,
            variance=self.kmeans_variance,
        )
        labels = result.labels
        if k == sizes[0]:  # fused neurons in model order (identical models: identity)
            centers, _ = weighted_centers(points, weights, labels, k)
            order_of = linear_assignment(torch.cdist(centers, points[: sizes[0]]).pow(2))
            labels = order_of[labels]
        return labels

    def _readings(
        self,
        gram: torch.Tensor,
        statistics: dict[int, SiteStatistics],
        scores: dict[int, torch.Tensor],
        index: int,
        width: int,
    ) -> tuple[dict[int, torch.Tensor], dict[str, Any]]:
        """Group the sites' translated neurons; each model's reading ``(width, width_k)``."""
        order = list(statistics)
        factor = cholesky_upper(gram)
        points = torch.cat([(factor @ statistics[m].translation.double()).T for m in order])
        weights = torch.cat([scores[m].double().cpu() for m in order])
        sizes = [statistics[m].translation.shape[1] for m in order]
        labels = self._group(points, weights, sizes, width, index)
        readings, info = readings_from_groups(points, weights, labels, sizes, width)
        return dict(zip(order, readings, strict=True)), info


@register_fusion_method
@fixed_variant("hungarian", without=("n_init", "max_iter", "tol", "kmeans_variance"))
class HFSites(SiteInterpolation):
    """Hungarian Fusion fitted on the sites' statistics: any number of models of the target's
    width, one neuron of each per group. Two models: exact Hungarian matching. More: iterative
    matching (as :mod:`hf-linear <fedfuse.fusion.methods.neuron_interpolation.variants>`): model 0
    the pivot for the start, then each model's neurons re-matched to the others' groups, every step
    the exact Hungarian minimiser of the groups' importance-weighted k-means cost given the others,
    until a round moves nothing or ``match_rounds`` rounds
    (:func:`~fedfuse.fusion.blocks.matching.one_to_one_labels`)."""

    name = "hf-sites"


@register_fusion_method
@fixed_variant("kmeans", without=("match_rounds",))
class KFSites(SiteInterpolation):
    """K-means Fusion fitted on the sites' statistics: any number of models, any width."""

    name = "kf-sites"


__all__ = ["HFSites", "KFSites", "SiteInterpolation"]
