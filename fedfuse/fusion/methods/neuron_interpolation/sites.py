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
2. The server groups the sites' neurons by their translations, reads each fused neuron on site
   ``k``'s data as model ``k``'s neurons of its group, and fits the fused level, RegMean-style
   but on the fused inputs, to every site's own model on that site's data, the ridge chosen by
   GCV from the same statistics (:mod:`.site_fits`).

The options of this family, and which models it accepts, are in :mod:`.site_options`.

Because each level is fitted to what the *fused* prefix actually computes, errors of lower
levels are corrected, as in the paper's bottom-up fit; because each site's data is fitted to
its own model, a sharded site's classes are learned from the site that has them.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from fedfuse.fusion.base import FusionInputs
from fedfuse.fusion.blocks.graph_pieces import fold_norm_levels
from fedfuse.fusion.blocks.pieces import LinearPiece, linear_pieces
from fedfuse.fusion.blocks.whitening import uses_whitening_cutoff
from fedfuse.fusion.inputs import resolve_scores
from fedfuse.fusion.methods.neuron_interpolation.grouping import group_with_options
from fedfuse.fusion.methods.neuron_interpolation.options import fixed_variant
from fedfuse.fusion.methods.neuron_interpolation.site_fits import (
    ReadingsFn,
    fit_attention_logits,
    fit_piece,
    group_readings,
)
from fedfuse.fusion.methods.neuron_interpolation.site_options import SiteOptions
from fedfuse.fusion.registry import register_fusion_method
from fedfuse.fusion.statistics.budget import PrivacyBudget
from fedfuse.fusion.statistics.channels import SiteChannel, checked_replies
from fedfuse.fusion.statistics.privacy import GaussianStatistics, fusion_set_mechanism
from fedfuse.fusion.statistics.readings import fusion_set_readings
from fedfuse.fusion.statistics.rounds import SiteStatistics, StatisticsRequest, without_intercept
from fedfuse.fusion.statistics.summed_terms import summed_statistics
from fedfuse.models import LeveledModel, ModelSpec, build_model
from fedfuse.models.affine import affine_view, fit_intercept

log = logging.getLogger(__name__)


class SiteInterpolation(SiteOptions):
    """Neuron-interpolation fusion fitted on the sites' statistics (one round per level).

    The shared base of :class:`HFSites` and :class:`KFSites`; its options (Args) and what it
    accepts are :class:`~.site_options.SiteOptions`'. Needs :attr:`FusionInputs.sites`, a
    :class:`~fedfuse.fusion.statistics.channels.SiteChannel` (in a Flower run the strategy
    provides it; in the library, :class:`~fedfuse.fusion.statistics.channels.LocalSites`); no
    fusion set.
    """

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
        result = build_model(target, seed=self.seed).eval()
        # a user's BatchNorm level is fitted with the layer before it: the rounds run on views
        # in which each such pair is one level (sharing the modules; the sites fold theirs)
        fused, at = fold_norm_levels(result)
        views = [fold_norm_levels(m) for m in models]
        models = [view for view, _ in views]
        scores = [
            {where[level]: s[level] for level in sorted(s)}
            for s, (_, where) in zip(scores, views, strict=True)
        ]
        levels = sorted({at[level] for level in levels})
        self._result = result
        active = list(range(len(models)))
        details: dict[str, Any] = {"variant": f"{self.grouping}-sites", "levels": [], "rounds": []}
        bar = tqdm(levels, desc=self.name, disable=not self.progress, leave=False)
        stream: dict[int, torch.Tensor] = {}  # each site's reading of the residual stream
        self._fusion_data, self._sample_counts = inputs.data, inputs.sample_counts
        budget = None
        if self.dp_epsilon is not None:
            rounds = sum(len(linear_pieces(fused.levels[i]) or ()) for i in levels)
            budget = PrivacyBudget(self.dp_epsilon, self.dp_delta, rounds, self.dp_noise_seed)
        for index in bar:
            level_pieces = linear_pieces(fused.levels[index])
            assert level_pieces is not None  # checked by check_architecture
            for number, piece in enumerate(level_pieces):
                privacy = self._mechanism(budget, models, fused, (index, number), inputs)
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
        if budget is not None:
            details["privacy"] = budget.account()
        details["problems"] = list(sites.problems) if sites is not None else []
        return result, details

    def _mechanism(
        self,
        budget: PrivacyBudget | None,
        models: list[LeveledModel],
        fused: LeveledModel,
        where: tuple[int, int],
        inputs: Any,
    ) -> GaussianStatistics | None:
        """The Gaussian mechanism of the statistics of piece ``where = (level, piece)``."""
        if budget is None:
            return None
        clip, scale, columns = self.dp_clip, 1.0, None
        if inputs.data is not None:  # a requirement without dp_clip
            chosen, scale, columns = fusion_set_mechanism(models, fused, *where, inputs.data)
            clip = clip or chosen
        assert clip is not None
        return budget.mechanism(clip, scale, columns)

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
                partial(self._group, index=index),
            )
            readings = dict(zip(active, found, strict=True))
        request = StatisticsRequest(
            index,
            self._result,
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
        width = piece.width(level)
        if self.statistics == "sums":  # one sum over the sites (statistics[-1]), read as sent
            fitted, gram, info = fit_piece(statistics, width, ridge=self.ridge)
            info.update(grouping)
        elif piece.kind == "logits":
            heads = [models[m].levels[index].attention.heads for m in statistics]
            group = partial(self._group, index=index)
            fitted, gram, info = fit_attention_logits(statistics, heads, level, group)
        else:
            fitted, gram, info = fit_piece(
                statistics,
                width,
                None if is_head else self._readings_of(statistics, weights, index, width),
                ridge=self.ridge,
                stream=stream if piece.stream is not None else None,
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

    def _group(
        self, points: torch.Tensor, weights: torch.Tensor, sizes: list[int], k: int, index: int
    ) -> torch.Tensor:
        """The group of each point (rows, model by model, ``sizes`` each): one neuron of each
        model per group (Hungarian), or importance-weighted k-means seeded per level; groups in
        model 0's order (k-means: when ``k`` is its size)."""
        return group_with_options(
            self, points, weights, sizes, k, seed=self.seed + index, local_search_swaps=0
        )

    def _readings_of(
        self,
        statistics: dict[int, SiteStatistics],
        scores: dict[int, torch.Tensor],
        index: int,
        width: int,
    ) -> ReadingsFn:
        """Each model's reading ``(width, width_k)`` of level ``index``'s fused neurons as a
        function of the pooled Gram: the sites' translated neurons grouped
        (:func:`~.site_fits.group_readings`)."""
        group = partial(self._group, index=index)
        return lambda gram: group_readings(gram, statistics, scores, width, group)


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
