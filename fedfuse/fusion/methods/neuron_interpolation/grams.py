r"""Neuron interpolation fitted on the sites' Gram matrices: site statistics in one upload.

``kf-sites`` (:mod:`fedfuse.fusion.methods.neuron_interpolation.sites`) fits each fused level on the
sites' own data, one statistics round per level, because a site's statistics are taken under the
*fused* prefix, which exists only once the levels below are fitted. Here each site uploads, once and
with its model, the Gram ``G_k = X_k^T X_k`` of every level's design rows under its *own* model
(what RegMean reads, :func:`~fedfuse.fusion.statistics.grams.level_grams`), and the server answers
every round itself by mapping those Grams through the alignment it has found so far.

Derivation. Let ``X_k`` be site ``k``'s design rows of level ``l`` under its own model (inputs,
flattened or unfolded, with a trailing 1) and ``Z_k = X_k W_k`` its level outputs, ``W_k``
(``d_k x w_k``) the level's weights with the bias as last row. The round of level ``l`` needs
the statistics of the fused design ``F_k`` on the same rows. The fit of level ``l - 1`` made
the fused neurons reproduce, on site ``k``'s data, the site's neurons read through its reading
``P_k`` (``w x w_k^{l-1}``, :mod:`fedfuse.fusion.statistics.readings`): fused pre-activations
``~ Z_k^{l-1} P_k^T``. The readings are non-negative with rows summing to 1 (an
importance-weighted mean of a group's neurons, a single neuron where the group has one of the
site's), so the parameter-free operations between levels (ReLU, max pooling, flattening) carry
the map over to the next design: ``F_k ~ X_k A_k`` with

    ``A_k = [[P_k^T (x) I_m, 0], [0, 1]]``  (``d_k x d``),

``m`` the design columns per input channel (1 for a dense layer after a dense one, the pooled
positions after flattening a feature map, ``kh kw`` for a convolution's patches, channel-major
like the weights), the 1 kept where the fused layer has a bias. The first neuron level reads
the data itself: ``A_k = I``, exactly. The site's statistics of the round follow from ``G_k``
and ``W_k`` alone:

    ``gram = A_k^T G_k A_k``, ``cross = A_k^T G_k W_k``, ``target_gram = W_k^T G_k W_k``,

its row count is ``G_k``'s last diagonal entry (the trailing 1's squares), and its translation
the same GCV ridge fit a site computes. The grouping, readings and fit are then ``kf-sites``'
unchanged: ``W = (sum_k A_k^T G_k A_k + lambda I)^{-1} sum_k A_k^T G_k W_k P_k'^T``.

Exact where it should be: identical sites give back their model (every reading is the
identity); a site's permuted copy has the permutation as its reading, which ``A_k`` undoes, so
the fused model keeps its function; the first level's statistics are the sites' own
statistics under the fused prefix, equal to those ``kf-sites`` collects; and the fit is a
function of ``sum_k`` of the mapped Grams, so sites sharing a model give the fit on their
pooled data. Where a group holds several of a site's neurons, ``relu(mean) <= mean(relu)``,
and the map is an approximation; the statistics rounds of ``kf-sites`` remove it, at the cost
of one round per level.

No fusion set and no statistics round: one upload per site (the model, its scores and its
Grams, whose bytes the result tables list). Affine levels only (MLPs, plain CNNs, VGG): a
ResNet block or a ViT encoder has no per-level Gram that maps through a reading.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from fedfuse.fusion.base import FusionInputs
from fedfuse.fusion.blocks.least_squares import ridge_fit
from fedfuse.fusion.methods.neuron_interpolation.options import fixed_variant
from fedfuse.fusion.methods.neuron_interpolation.sites import SiteInterpolation
from fedfuse.fusion.registry import register_fusion_method
from fedfuse.fusion.statistics.channels import check_reply
from fedfuse.fusion.statistics.rounds import SiteStatistics, StatisticsRequest
from fedfuse.io.grams import full_gram, gram_size
from fedfuse.models import LeveledModel, ModelSpec
from fedfuse.models.affine import AffineLevel, affine_view, channel_blocks

#: the site-interpolation options that do not apply without statistics rounds
ROUND_OPTIONS = (
    "max_samples",
    "statistics_dtype",
    "gram_rank",
    "statistics",
    "dp_epsilon",
    "dp_delta",
    "dp_clip",
    "dp_noise_seed",
)


def _site_view(model: LeveledModel, index: int, where: str) -> AffineLevel:
    """Level ``index`` of ``model`` as an affine view with its 1 (the design of its Gram)."""
    view = affine_view(model.levels[index])
    if view is None:
        raise ValueError(
            f"{where}: level {model.level_name(index)} of {model.spec.arch} is not affine "
            "(parameter-free ops then one Linear/Conv2d), so it has no Gram to map"
        )
    return view


def design_map(
    reading: torch.Tensor | None, site_columns: int, fused_columns: int, *, where: str
) -> torch.Tensor:
    """``A`` (``site_columns x fused_columns``, float64): the fused design rows as a linear map
    of the site's (module docstring). ``reading``: the site's reading of the fused input
    neurons (``fused channels x site channels``); None: both designs read the same inputs.
    The site's design ends with its 1; the fused one does where it has ``fused_columns`` not a
    multiple of its channels."""
    site_inputs = site_columns - 1
    if reading is None:
        if fused_columns not in (site_inputs, site_columns):
            raise ValueError(
                f"{where}: the site's design has {site_columns} columns with its 1, the fused "
                f"{fused_columns}; they read the same inputs"
            )
        return torch.eye(site_columns, fused_columns, dtype=torch.float64)
    fused_channels, site_channels = reading.shape
    per_channel, remainder = divmod(site_inputs, site_channels)
    fused_inputs = fused_channels * per_channel
    if remainder or fused_columns not in (fused_inputs, fused_inputs + 1):
        raise ValueError(
            f"{where}: a design of {site_columns} columns over {site_channels} site channels "
            f"does not map onto {fused_columns} columns over {fused_channels} fused ones"
        )
    core = channel_blocks(reading.T, per_channel)
    mapped = torch.zeros(site_columns, fused_columns, dtype=torch.float64)
    mapped[:site_inputs, :fused_inputs] = core
    if fused_columns > fused_inputs:
        mapped[-1, -1] = 1.0
    return mapped


def gram_statistics(
    model: LeveledModel,
    gram: torch.Tensor,
    request: StatisticsRequest,
    reading: torch.Tensor | None,
    *,
    where: str = "site",
) -> SiteStatistics:
    """The statistics :func:`~fedfuse.fusion.statistics.on_site.site_statistics` would return for
    an affine level, from the site's uploaded level Gram (full or factor) and its ``model``;
    ``reading``: the site's reading of the fused level's input neurons (None on the first
    neuron level). The fused design is approximated as the site's mapped by
    :func:`design_map`."""
    index = request.level
    view = _site_view(model, index, where)
    weights = view.weights().double().cpu()
    matrix = full_gram(gram).cpu()
    if gram_size(gram) != len(weights):
        raise ValueError(
            f"{where}: the Gram of level {model.level_name(index)} has side {gram_size(gram)}, "
            f"the level's design {len(weights)} columns"
        )
    mapped = design_map(
        reading, len(weights), request.linear_piece.fan_in(request.fused.levels[index]), where=where
    )
    moments = matrix @ weights
    fused_gram = mapped.T @ matrix @ mapped
    cross = mapped.T @ moments
    target_gram = weights.T @ moments
    rows = max(1, round(float(matrix[-1, -1])))
    fit = ridge_fit(fused_gram, cross, target_gram.diagonal(), rows)
    return SiteStatistics(
        level=index,
        rows=rows,
        gram=fused_gram,
        cross=cross,
        target_gram=target_gram,
        translation=fit.weights,
        translation_ridge=fit.ridge,
    )


class GramInterpolation(SiteInterpolation):
    """Neuron interpolation fitted on the sites' uploaded Grams, no statistics rounds (module
    docstring): the base of :class:`KFGrams` and :class:`HFGrams`. Needs
    :attr:`FusionInputs.grams`; no fusion set, no sites to reach after the upload. The options
    are :class:`~fedfuse.fusion.methods.neuron_interpolation.sites.SiteInterpolation`'s, less those
    of its rounds."""

    name = "gram-interpolation"
    requires = frozenset({"grams"})
    needs_affine_levels = True

    def requirements(self) -> frozenset[str]:
        return frozenset(self.requires)

    def needs(self) -> frozenset[str]:
        return self.requirements() | ({"scores"} if self.use_scores else set())

    def check_architecture(self, model: LeveledModel) -> None:
        """Every neuron level affine: a site's Gram is one level's, mapped through readings."""
        for index in model.neuron_levels:
            try:
                _site_view(model, index, self.name)
            except ValueError as error:
                raise ValueError(f"{error}; kf-sites fits ResNet and ViT blocks") from None
        super().check_architecture(model)

    def _fuse(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec
    ) -> tuple[LeveledModel, dict[str, Any]]:
        assert inputs.grams is not None  # a requirement
        self._grams = inputs.grams
        fused, details = super()._fuse(models, replace(inputs, sites=None), target)
        details["variant"] = f"{self.grouping}-grams"
        details.pop("rounds", None)  # answered on the server: no round, no upload
        return fused, details

    def _collect(
        self,
        sites: Any,
        request: StatisticsRequest,
        models: list[LeveledModel],
        active: list[int],
        where: str,
        inputs_read: dict[int, torch.Tensor],
    ) -> tuple[dict[int, SiteStatistics], dict[int, int]]:
        """Each site's statistics from its uploaded Gram (:func:`gram_statistics`), read through
        its reading of the fused level's inputs (none on the first neuron level)."""
        statistics = {}
        for m in active:
            source = f"{where}: site {m}"
            grams = self._grams[m]
            if request.level not in grams:
                raise ValueError(f"{source} uploaded no Gram for this level")
            reading = inputs_read.get(m)
            if reading is None and request.level != models[m].neuron_levels[0]:
                raise ValueError(f"{source}: no reading of the fused level's input neurons")
            reply = gram_statistics(models[m], grams[request.level], request, reading, where=source)
            check_reply(reply, request, models[m], source)
            statistics[m] = reply
        return statistics, {}


@register_fusion_method
@fixed_variant("kmeans", without=("match_rounds", *ROUND_OPTIONS))
class KFGrams(GramInterpolation):
    """K-means Fusion fitted on the sites' uploaded Grams: ``kf-sites`` in one upload per
    site, any number of models, any width (module docstring)."""

    name = "kf-grams"


@register_fusion_method
@fixed_variant(
    "hungarian", without=("n_init", "max_iter", "tol", "kmeans_variance", *ROUND_OPTIONS)
)
class HFGrams(GramInterpolation):
    """Hungarian Fusion fitted on the sites' uploaded Grams: ``hf-sites`` in one upload per
    site, models of the target's width (module docstring)."""

    name = "hf-grams"


__all__ = ["GramInterpolation", "HFGrams", "KFGrams", "design_map", "gram_statistics"]
