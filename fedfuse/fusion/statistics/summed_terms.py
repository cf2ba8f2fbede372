r"""Fits that need only sums over sites, and how the sums pass through secure aggregation.

Two fits read nothing of a site but its share of a sum over sites:

* ``kf-sites`` / ``hf-sites`` with ``statistics="sums"``
  (:mod:`fedfuse.fusion.statistics.readings`): per round, ``X_k^T X_k``, ``X_k^T Z_k P_k^T``, ``P_k
  Z_k^T Z_k P_k^T`` and the row count (:func:`statistics_terms`);
* RegMean with ``grams="sums"`` (:mod:`fedfuse.fusion.methods.regression.regmean`): per merged
  system, the site's Gram ``G_k``, ``G_k W_k`` and ``diag(G_k) W_k``, from which the server forms
  ``sum_k G~_k`` and ``sum_k G~_k W_k`` for any shrinkage ``alpha``.

A channel that aggregates securely (Flower's SecAgg+, ``fedfuse.strategies.secure_sums``)
hands the server these sums and nothing per site. SecAgg+ clips each value to ``[-c, c]`` and
rounds it to one of ``Q`` levels (:mod:`fedfuse.fusion.statistics.fixed_point`), so each sum takes
two secure rounds, both of sums only:

1. **Norms.** Each site sends the norms of the columns its terms multiply (the roots of a
   Gram's diagonal, ``||z_j||``, the root of its row count), in coarse units the server chose
   on its fusion set (a wide range, ``c = 2^16``: a column may be 65536 times as strong on a
   site as on the fusion set).
2. **Terms**, in units made of the summed norms ``R_i = sum_k ||a_ki||`` (raised by their
   rounding error, so they bound the true sums): entry ``(i, j)`` of ``A_k^T B_k`` is divided by
   ``R_i R_j``. By Cauchy-Schwarz, ``|a_ki^T b_kj| <= ||a_ki|| ||b_kj|| <= R_i R_j``, so every
   site's entry lies in ``[-1, 1]`` whatever its data, and ``c = 1`` clips nothing. The rounding
   step ``2 / Q`` (``Q`` near ``2^32 / (K + 1)`` for ``K`` sites) is then at most
   ``2 K / Q`` of ``sqrt(sum_k ||a_ki||^2) sqrt(sum_k ||b_kj||^2)``: about ``3 10^-8`` for
   8 sites.

What the norms reveal, sums of the sites' column norms, is less than the pooled diagonal the
terms hand over anyway for a single site, and is a sum over sites like the rest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from fedfuse.fusion.blocks.pieces import linear_pieces
from fedfuse.fusion.statistics.channels import LocalSites
from fedfuse.fusion.statistics.fixed_point import FixedPoint, coarse_norm_scale, norm_bound
from fedfuse.fusion.statistics.on_site import site_statistics
from fedfuse.fusion.statistics.rounds import SiteStatistics, StatisticsRequest
from fedfuse.models import LeveledModel

#: the clipping range of the norms round, in its coarse units
NORMS_CLIP = float(1 << 16)

#: how a fit reads the sites' statistics: each site's reply on its own, or only sums over sites
STATISTICS_MODES = ("per-site", "sums")


def check_statistics_mode(option: str, mode: str) -> None:
    """Raise ValueError, naming ``option``, unless ``mode`` is one of :data:`STATISTICS_MODES`
    (the two fits of the module docstring take ``"sums"``)."""
    if mode not in STATISTICS_MODES:
        raise ValueError(f"{option} must be 'per-site' or 'sums', got {mode!r}")


@dataclass(frozen=True)
class SummedRequest:
    """One secure or plain round summed over sites: the method's ``request`` (a statistics
    request, or RegMean's
    :class:`~fedfuse.fusion.methods.regression.regmean_sums.GramTermsRequest`), the fixed
    ``units`` of a secure sum (None: summed in the clear), and whether the round asks the squared
    norms of step 1 (``norms``) instead of the terms."""

    request: Any
    units: FixedPoint | None = None
    norms: bool = False

    def key(self) -> str:
        """Which sum this round belongs to (both steps of one sum share it)."""
        request = self.request
        if isinstance(request, StatisticsRequest):
            return f"statistics/{request.level}/{request.piece}"
        return "regmean"

    def for_site(self, index: int) -> SummedRequest:
        """The round as site ``index`` receives it (a statistics request: its own reading)."""
        if isinstance(self.request, StatisticsRequest):
            return replace(self, request=self.request.for_site(index))
        return self


@dataclass
class SiteSums:
    """The sums over sites of one round: ``terms`` by name, the model indices of the sites whose
    terms they hold, the bytes each sent, and (secure sums) each entry's largest rounding
    error."""

    terms: dict[str, torch.Tensor]
    sites: list[int]
    upload_bytes: dict[int, int] = field(default_factory=dict)
    error: dict[str, torch.Tensor] = field(default_factory=dict)


# ---------------------------------------------------------------- kf-sites / hf-sites: statistics
def statistics_terms(statistics: SiteStatistics) -> dict[str, torch.Tensor]:
    """What a site adds to the sum of one statistics round: ``gram`` (in full), ``cross``,
    ``target_gram`` and ``rows`` (a 1-vector)."""
    return {
        "gram": statistics.full_gram(),
        "cross": statistics.cross.double(),
        "target_gram": statistics.target_gram.double(),
        "rows": torch.tensor([float(statistics.rows)], dtype=torch.float64),
    }


def statistics_norms(terms: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Step 1 of a secure statistics round: the column norms of ``X`` and ``Z`` (the roots of
    the Grams' diagonals) and the root of the row count."""
    return {
        "gram": terms["gram"].diagonal().clamp_min(0).sqrt(),
        "target_gram": terms["target_gram"].diagonal().clamp_min(0).sqrt(),
        "rows": terms["rows"].sqrt(),
    }


def statistics_from_terms(
    terms: Mapping[str, torch.Tensor], level: int, piece: int, *, source: str
) -> SiteStatistics:
    """The summed statistics of a round from its summed terms, checked (ValueError naming
    ``source``): finite, the row count positive; the translation is not a sum (zeros)."""
    missing = sorted({"gram", "cross", "target_gram", "rows"} - set(terms))
    if missing:
        raise ValueError(f"{source}: the sum lacks {missing}")
    for name, term in terms.items():
        if not bool(torch.isfinite(term).all()):
            raise ValueError(f"{source}: the summed {name!r} has NaN/Inf values")
    rows = round(float(terms["rows"].reshape(-1)[0]))
    if rows < 1:
        raise ValueError(f"{source}: the summed statistics count {rows} rows")
    translation = torch.zeros_like(terms["cross"])
    return SiteStatistics.from_tensors(
        {**terms, "translation": translation}, level=level, rows=rows, piece=piece
    )


@torch.no_grad()
def statistics_norm_units(
    models: Mapping[int, LeveledModel], request: StatisticsRequest, data: torch.Tensor, samples: int
) -> FixedPoint:
    """The coarse units of step 1, from the server's fusion set ``data``: the column norms of a
    site of ``samples`` samples whose design columns and (read) targets had the fusion set's
    mean squares per sample, averaged over ``models`` (by model index, each read through
    ``request.readings`` when given)."""
    index, piece, fused = request.level, request.linear_piece, request.view
    level = request.fused_level
    design = piece.design(level, fused.forward_levels(data, 0, index)).double()
    per_sample = len(design) / len(data)
    design_energy = design.pow(2).sum(0) / len(data)
    target_energy = torch.zeros((), dtype=torch.float64)
    for number, model in models.items():
        own = model.levels[index]
        own_pieces = linear_pieces(own)
        assert own_pieces is not None
        z = own_pieces[request.piece].target(own, model.forward_levels(data, 0, index)).double()
        if request.readings is not None:
            z = z @ request.readings[number].double().T
        target_energy = target_energy + z.pow(2).sum(0) / len(data) / len(models)
    return FixedPoint(
        {
            "gram": (coarse_norm_scale(design_energy, samples), None),
            "target_gram": (coarse_norm_scale(target_energy, samples), None),
            "rows": (torch.tensor([per_sample * samples], dtype=torch.float64).sqrt(), None),
        },
        clip=NORMS_CLIP,
    )


def statistics_units(norms: SiteSums) -> FixedPoint:
    """The units of step 2 from the summed norms of step 1 (module docstring)."""
    x = norm_bound(norms.terms["gram"], norms.error.get("gram"))
    z = norm_bound(norms.terms["target_gram"], norms.error.get("target_gram"))
    rows = norm_bound(norms.terms["rows"], norms.error.get("rows")) ** 2
    return FixedPoint(
        {"gram": (x, x), "cross": (x, z), "target_gram": (z, z), "rows": (rows.clamp_min(1), None)}
    )


def summed_statistics(
    sites: Any,
    request: StatisticsRequest,
    models: Sequence[LeveledModel],
    active: Sequence[int],
    units: tuple[torch.Tensor | None, int],
    where: str,
) -> tuple[dict[int, SiteStatistics], dict[int, int]]:
    """One statistics round as a sum over the sites: ``({-1: the summed statistics}, {model
    index: bytes sent})`` for the sites that contributed, checked (ValueError naming
    ``where``). A secure channel takes the two steps of the module docstring, the first in
    units from ``units`` = (the fusion set, the bound on the samples a site uses)."""
    request = replace(request, gram_rank=None)  # a compressed Gram does not add up
    if getattr(sites, "secure", False):
        data, samples = units
        if data is None:
            raise ValueError(f"{where}: a secure sum needs the fusion set for its first units")
        coarse = statistics_norm_units({m: models[m] for m in active}, request, data, samples)
        norms = sum_over_sites(sites, SummedRequest(request, coarse, norms=True))
        sums = sum_over_sites(sites, SummedRequest(request, statistics_units(norms)))
        sent = {m: norms.upload_bytes.get(m, 0) + sums.upload_bytes.get(m, 0) for m in sums.sites}
    else:
        sums = sum_over_sites(sites, SummedRequest(request))
        sent = {m: sums.upload_bytes.get(m, 0) for m in sums.sites}
    where = f"{where}: the sum over sites"
    total = statistics_from_terms(sums.terms, request.level, request.piece, source=where)
    level, piece = request.fused_level, request.linear_piece
    total.check(piece.fan_in(level), piece.width(level), source=where)
    return {-1: total}, sent


# ---------------------------------------------------------------- channels and sites
def site_sources(
    request: Any,
    model: LeveledModel,
    data: torch.Tensor,
    *,
    batch_size: int = 256,
    device: str | torch.device = "auto",
) -> dict[str, torch.Tensor]:
    """What a site computes on its own ``data`` for a summed round, before norms or units: a
    statistics round's terms, or RegMean's level Grams (noised where the request says). Both
    steps of a secure sum are read from these same numbers (:func:`terms_from_sources`), so
    that a noised release is made once."""
    if isinstance(request, StatisticsRequest):
        statistics = site_statistics(model, data, request, batch_size=batch_size, device=device)
        return statistics_terms(statistics)
    return request.sources(model, data, device=device)


def terms_from_sources(
    summed: SummedRequest, model: LeveledModel, sources: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """A site's part of a summed round from its :func:`site_sources`: its terms, or their norms
    (step 1), in the round's units when it has them."""
    request = summed.request
    if isinstance(request, StatisticsRequest):
        terms = statistics_norms(sources) if summed.norms else dict(sources)
    else:
        terms = request.terms(model, sources, norms=summed.norms)
    return summed.units.encode(terms) if summed.units is not None else terms


def site_sum_terms(
    summed: SummedRequest, model: LeveledModel, data: torch.Tensor, **options: Any
) -> dict[str, torch.Tensor]:
    """A site's part of a summed round on its own ``data`` with its own ``model`` (``options``:
    :func:`site_sources`' ``batch_size`` and ``device``)."""
    sources = site_sources(summed.request, model, data, **options)
    return terms_from_sources(summed, model, sources)


def add_terms(parts: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The sum of terms over sites (float64), name by name."""
    total: dict[str, torch.Tensor] = {}
    for part in parts:
        for name, term in part.items():
            total[name] = total[name] + term.double() if name in total else term.double().clone()
    return total


def sum_over_sites(sites: Any, summed: SummedRequest) -> SiteSums:
    """The sums of one round over the sites of ``sites``: a channel that sums itself (the
    Flower channel, securely or not) does; :class:`~fedfuse.fusion.statistics.channels.LocalSites`
    computes each site's terms in-process and adds them (its bytes: the terms in float32)."""
    if hasattr(sites, "sum_terms"):
        return sites.sum_terms(summed)
    if not isinstance(sites, LocalSites):
        raise ValueError(
            f"{type(sites).__name__} cannot sum over sites: give LocalSites or a channel with "
            "sum_terms"
        )
    parts = [
        site_sum_terms(
            summed.for_site(index), model, data, batch_size=sites.batch_size, device=sites.device
        )
        for index, (model, data) in enumerate(zip(sites.models, sites.data, strict=True))
    ]
    if summed.units is not None:  # in-process, in the clear: back to the terms' own units
        parts = [summed.units.decode(part) for part in parts]
    return SiteSums(
        add_terms(parts),
        list(range(len(parts))),
        {index: sum(t.numel() * 4 for t in part.values()) for index, part in enumerate(parts)},
    )


__all__ = [
    "NORMS_CLIP",
    "STATISTICS_MODES",
    "SiteSums",
    "SummedRequest",
    "add_terms",
    "check_statistics_mode",
    "site_sources",
    "site_sum_terms",
    "statistics_from_terms",
    "statistics_norm_units",
    "statistics_norms",
    "statistics_terms",
    "statistics_units",
    "sum_over_sites",
    "summed_statistics",
    "terms_from_sources",
]
