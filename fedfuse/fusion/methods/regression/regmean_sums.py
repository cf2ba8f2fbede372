"""RegMean from sums over sites (``grams="sums"``): what each site adds, in which units, noised how.

RegMean needs only ``sum_k G~_k`` and ``sum_k G~_k W_k`` per system (:mod:`.regmean_systems`),
which follow for any ``alpha`` from each site's terms ``G``, ``G W`` and ``diag(G) W``
(:func:`site_terms`). A site computes them on its own Grams when asked by a
:class:`GramTermsRequest`; a secure channel (SecAgg+) sums them in fixed point, whose units
come from a first secure round of the terms' norms (:func:`site_terms` with ``norms``,
:func:`norm_units`) and then the summed norms (:func:`term_units`), so that no site's own terms
reach the server (:mod:`fedfuse.fusion.statistics.summed_terms`). With ``dp_epsilon`` each site
noises its Gram of every affine level first (:func:`level_mechanisms`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from fedfuse.fusion.base import FusionInputs
from fedfuse.fusion.methods.regression.regmean_systems import (
    client_parts,
    client_weights,
    merge_systems,
    system_key,
)
from fedfuse.fusion.statistics.budget import PrivacyBudget
from fedfuse.fusion.statistics.fixed_point import FixedPoint, coarse_norm_scale, norm_bound
from fedfuse.fusion.statistics.grams import level_grams
from fedfuse.fusion.statistics.privacy import GaussianStatistics
from fedfuse.fusion.statistics.summed_terms import (
    NORMS_CLIP,
    SiteSums,
    SummedRequest,
    sum_over_sites,
)
from fedfuse.models import LeveledModel
from fedfuse.models.affine import affine_view, check_fit_bias
from fedfuse.runtime import resolve_device

#: the name RegMean's errors carry
_METHOD = "regmean"


def _site_parts(
    model: LeveledModel, grams: dict[int, torch.Tensor], fit_bias: bool | str, method: str
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(system name, Gram, weights)`` of every system of one site."""
    systems = merge_systems(model, fit_bias, method)
    for key, gram, weights in client_parts(model, grams, 0, systems, method):
        yield system_key(key), gram, weights


def site_terms(
    model: LeveledModel,
    grams: dict[int, torch.Tensor],
    fit_bias: bool | str = "auto",
    method: str = _METHOD,
    *,
    norms: bool = False,
) -> dict[str, torch.Tensor]:
    """What one site adds to the sums RegMean solves from, per system: ``G``
    (``<system>/gram``), ``G W`` (``/rhs``) and ``diag(G) W`` (``/diag_rhs``), from which
    ``sum G~`` and ``sum G~ W`` follow for any ``alpha``. With ``norms``, step 1 of their secure
    sum (:mod:`fedfuse.fusion.statistics.summed_terms`) instead: per system, the norms of the
    design columns (roots of ``G``'s diagonal) and of the outputs ``X W`` (roots of
    ``diag(W^T G W)``)."""
    terms = {}
    for name, gram, weights in _site_parts(model, grams, fit_bias, method):
        rhs = gram @ weights
        if norms:
            terms[f"{name}/gram"] = gram.diagonal().clamp_min(0).sqrt()
            terms[f"{name}/rhs"] = (rhs * weights).sum(0).clamp_min(0).sqrt()
        else:
            terms[f"{name}/gram"] = gram
            terms[f"{name}/rhs"] = rhs
            terms[f"{name}/diag_rhs"] = gram.diagonal()[:, None] * weights
    return terms


@dataclass(frozen=True)
class GramTermsRequest:
    """RegMean's request to each site when it fits from sums (``grams="sums"``): the site's
    terms or their norms (:func:`site_terms`) under the server's
    ``fit_bias``, from Grams noised by ``privacy`` (per level; None: exact)."""

    fit_bias: bool | str = "auto"
    privacy: Mapping[int, GaussianStatistics] | None = None

    def sources(
        self, model: LeveledModel, data: torch.Tensor, *, device: str | torch.device = "auto"
    ) -> dict[str, torch.Tensor]:
        """A site's level Grams on its own ``data`` with its own ``model`` (noised by
        ``privacy``), by level index as a string."""
        on = resolve_device(device)
        own = copy.deepcopy(model).to(on).eval()
        grams = level_grams(own, data.to(on), privacy=self.privacy)
        return {str(level): gram for level, gram in grams.items()}

    def terms(
        self, model: LeveledModel, sources: Mapping[str, torch.Tensor], *, norms: bool = False
    ) -> dict[str, torch.Tensor]:
        """The site's terms (or their norms) from its :meth:`sources`."""
        check_fit_bias(self.fit_bias, _METHOD)
        grams = {int(level): gram for level, gram in sources.items()}
        return site_terms(model, grams, self.fit_bias, norms=norms)


@torch.no_grad()
def norm_units(
    models: list[LeveledModel], data: torch.Tensor, samples: int, fit_bias: bool | str
) -> FixedPoint:
    """The coarse units of step 1: the norms of a site of ``samples`` samples whose design
    columns and outputs had the fusion set's (``data``) mean squares per sample, averaged
    over the models."""
    energies: dict[str, torch.Tensor] = {}
    for model in models:
        for name, norm in site_terms(model, level_grams(model, data), fit_bias, norms=True).items():
            share = norm**2 / (len(data) * len(models))
            energies[name] = energies[name] + share if name in energies else share
    scales = {name: (coarse_norm_scale(e, samples), None) for name, e in energies.items()}
    return FixedPoint(scales, clip=NORMS_CLIP)


def term_units(norms: SiteSums, models: list[LeveledModel], fit_bias: bool | str) -> FixedPoint:
    """The units of step 2: the summed norms, and for ``diag(G) W`` the design's squared
    summed norms times the largest ``|W|`` of each output over the sites (the server holds
    the W)."""
    systems = merge_systems(models[0], fit_bias, _METHOD)
    largest: dict[tuple[int, int], torch.Tensor] = {}
    for model in models:
        for key, weights in client_weights(model, systems).items():
            top = weights.abs().amax(0)
            largest[key] = torch.maximum(largest[key], top) if key in largest else top
    scales = {}
    for key in systems:
        name = system_key(key)
        inputs = norm_bound(norms.terms[f"{name}/gram"], norms.error.get(f"{name}/gram"))
        outputs = norm_bound(norms.terms[f"{name}/rhs"], norms.error.get(f"{name}/rhs"))
        scales[f"{name}/gram"] = (inputs, inputs)
        scales[f"{name}/rhs"] = (inputs, outputs)
        floor = max(float(largest[key].max()) * 1e-12, 1e-300)
        scales[f"{name}/diag_rhs"] = (inputs**2, largest[key].clamp_min(floor))
    return FixedPoint(scales)


@torch.no_grad()
def level_mechanisms(
    models: list[LeveledModel],
    data: torch.Tensor | None,
    budget: PrivacyBudget,
    clip: float | None,
) -> dict[int, GaussianStatistics]:
    """Each level's Gaussian mechanism, one release each of ``budget``: per design column, the
    scale that gives it a root mean square of 1 on the fusion set (averaged over the models),
    and the clip, the largest over the models of the median norm of a sample's scaled rows
    (or ``clip`` when given)."""
    mechanisms = {}
    for index in models[0].neuron_levels:
        chosen, columns = clip, None
        if data is not None:
            rows = []
            for model in models:
                inputs = model.forward_levels(data, 0, index)
                rows.append(affine_view(model.levels[index]).design(inputs).double())
            rms = torch.stack([r.pow(2).mean(0) for r in rows]).mean(0).sqrt()
            columns = torch.where(rms > 1e-12, 1 / rms.clamp_min(1e-12), torch.ones_like(rms))
            norms = [
                float((r * columns).pow(2).reshape(len(data), -1).sum(1).median().sqrt())
                for r in rows
            ]
            chosen = chosen or max(norms)
        assert chosen is not None
        mechanisms[index] = budget.mechanism(chosen, design_scale=columns)
    return mechanisms


def summed_terms(
    models: list[LeveledModel], inputs: FusionInputs, request: GramTermsRequest, method: str
) -> tuple[SiteSums, dict[int, int]]:
    """The sums of :func:`site_terms` over the sites and each site's upload bytes: two secure
    rounds on a secure channel (norms, then terms), else one."""
    if not getattr(inputs.sites, "secure", False):
        sums = sum_over_sites(inputs.sites, SummedRequest(request))
        return sums, dict(sums.upload_bytes)
    if inputs.data is None:
        raise ValueError(f"{method}: a secure sum needs the fusion set for its first units")
    samples = max(inputs.sample_counts or [len(inputs.data)])
    coarse = norm_units(models, inputs.data, samples, request.fit_bias)
    norms = sum_over_sites(inputs.sites, SummedRequest(request, coarse, norms=True))
    units = term_units(norms, models, request.fit_bias)
    sums = sum_over_sites(inputs.sites, SummedRequest(request, units))
    sent = {m: norms.upload_bytes.get(m, 0) + sums.upload_bytes.get(m, 0) for m in sums.sites}
    return sums, sent


__all__ = [
    "GramTermsRequest",
    "level_mechanisms",
    "norm_units",
    "site_terms",
    "summed_terms",
    "term_units",
]
