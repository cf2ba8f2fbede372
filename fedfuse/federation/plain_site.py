"""What a site running its *own* ClientApp can send besides its weights, computed without Flower.

A Flower app's ClientApp replies with its model's weights and ``num-examples``; that is all
FedAvg, OTFusion, Git Re-Basin, KF/HF Linear and the other fusion-set methods need. Some methods
read more from the sites (``fedfuse methods`` lists which): importance scores of every neuron
(neuron interpolation weighs neurons by them; it scores on the fusion set without them), the
site's class counts (head weighting), the Gram matrices of each level's inputs (RegMean) and
the Fisher information (Fisher merging, FedFisher), and its class Gaussians (the server completes
its fusion set from them, :mod:`fedfuse.fusion.statistics.class_gaussians`).
:func:`compute_site_extras` computes whichever of these the server asked for, on the site's own
data in the app's own normalisation, from the user's own ``nn.Module``
(:class:`~fedfuse.models.ModelAdapter` gives it fedfuse's levels); :func:`site_fusion_inputs`
computes, for sites in one process (the library), all that a list of methods reads from them.
Both are public as ``fedfuse.federation.compute_site_extras`` and
``fedfuse.federation.site_fusion_inputs``.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from fedfuse.data.tensors import SampleSource, collect_samples
from fedfuse.federation.method_needs import upload_request_for
from fedfuse.fusion import FusionInputs, FusionMethod, LocalSites, as_fusion_methods
from fedfuse.fusion.base import reads_sites
from fedfuse.fusion.methods.regression.regmean import level_grams
from fedfuse.fusion.statistics.class_gaussians import ClassGaussians, fit_class_gaussians
from fedfuse.fusion.statistics.fisher import FISHER_KINDS, site_fisher
from fedfuse.models import LeveledModel, ModelAdapter
from fedfuse.models.importance import SCORE_METHODS, Scores, importance_scores

log = logging.getLogger(__name__)

#: the extras a server may ask a plain ClientApp for, as the train message names them, and
#: the :class:`~fedfuse.fusion.FusionInputs` field each provides
EXTRA_FIELDS = {
    "scores": "scores",
    "class-counts": "class_counts",
    "grams": "grams",
    "fisher-diagonal": "fisher",
    "fisher-kfac": "fisher",
}
EXTRAS = tuple(EXTRA_FIELDS)


def extras_for(methods: Iterable[FusionMethod]) -> list[str]:
    """The extras a plain ClientApp must send for ``methods``: the scores and class counts they
    read, and the Grams and Fisher kinds of their
    :func:`~fedfuse.federation.method_needs.upload_request_for`."""
    methods = list(methods)
    needed = set().union(*(method.needs() for method in methods))
    request = upload_request_for(methods)
    asked = {
        "scores": "scores" in needed,
        "class-counts": "class_counts" in needed,
        "grams": request.grams,
        **{f"fisher-{kind}": kind in request.fisher for kind in FISHER_KINDS},
    }
    return [name for name in EXTRAS if asked[name]]


@dataclass
class SiteExtras:
    """The extras one site computed (None: not asked for)."""

    scores: Scores | None = None
    class_counts: list[int] | None = None
    grams: dict[int, torch.Tensor] | None = None
    fisher: dict[str, torch.Tensor] | None = None
    class_gaussians: ClassGaussians | None = None
    score_method: str = ""
    seconds: dict[str, float] = field(default_factory=dict)


def compute_site_extras(
    model: nn.Module,
    data: SampleSource,
    wanted: Iterable[str],
    *,
    score_method: str = "conductance",
    score_samples: int = 512,
    score_steps: int = 16,
    keys: tuple[str, str] | None = None,
    gaussian_rank: int = 0,
) -> SiteExtras:
    """The ``wanted`` extras (names in :data:`EXTRAS`) of the site's trained ``model`` (a plain
    ``nn.Module`` or a leveled model) on its training ``data`` (a ``DataLoader``, an
    ``(inputs, labels)`` pair; see :func:`~fedfuse.data.tensors.collect_samples`), and with
    ``gaussian_rank`` > 0 its class Gaussians of that rank
    (:func:`~fedfuse.fusion.statistics.class_gaussians.fit_class_gaussians`).

    Scores use the first ``score_samples`` inputs, each explaining its own label's logit; class
    counts, Grams and class Gaussians read all of ``data``. The model is left as it was (mode,
    device, weights).
    """
    wanted = set(wanted)
    unknown = sorted(wanted - set(EXTRAS))
    if unknown:
        raise ValueError(f"unknown site extras {unknown}; known: {list(EXTRAS)}")
    if score_method not in SCORE_METHODS:
        raise ValueError(f"unknown score method {score_method!r}; choose one of {SCORE_METHODS}")
    extras = SiteExtras()
    if not wanted and gaussian_rank <= 0:
        return extras
    started = time.monotonic()
    kinds = [kind for kind in FISHER_KINDS if f"fisher-{kind}" in wanted]
    limit = None if "grams" in wanted or kinds or gaussian_rank > 0 else score_samples
    inputs, labels = collect_samples(data, limit=limit, keys=keys, what="the site's data")
    leveled = (
        model
        if isinstance(model, LeveledModel)
        else ModelAdapter.of(model, tuple(inputs.shape[1:])).adapt(model)
    )
    device = next(model.parameters()).device
    extras.seconds["collect"] = time.monotonic() - started
    classes = leveled.spec.num_classes
    if ("class-counts" in wanted or gaussian_rank > 0) and labels is None:
        raise ValueError("the site's data has no labels, so it cannot count its classes")
    if "class-counts" in wanted:
        if len(labels) and (int(labels.min()) < 0 or int(labels.max()) >= classes):
            raise ValueError(
                f"the site's labels span [{int(labels.min())}, {int(labels.max())}], the "
                f"model has {classes} classes"
            )
        extras.class_counts = torch.bincount(labels, minlength=classes).tolist()
    if "scores" in wanted:
        started = time.monotonic()
        sample = inputs[:score_samples]
        targets = None if labels is None else labels[: len(sample)]
        extras.scores = importance_scores(
            leveled, sample, targets, method=score_method, n_steps=score_steps, device=device
        )
        extras.score_method = score_method
        extras.seconds["score"] = time.monotonic() - started
    if "grams" in wanted:
        started = time.monotonic()
        extras.grams = level_grams(leveled, inputs, factor=True)
        extras.seconds["grams"] = time.monotonic() - started
    if kinds:  # on a copy: the user's model keeps its mode and device
        started = time.monotonic()
        extras.fisher = site_fisher(copy.deepcopy(leveled), inputs, kinds, device=device)
        extras.seconds["fisher"] = time.monotonic() - started
    if gaussian_rank > 0:
        started = time.monotonic()
        extras.class_gaussians = fit_class_gaussians(inputs, labels, classes, rank=gaussian_rank)
        extras.seconds["class_gaussians"] = time.monotonic() - started
    log.info("site extras %s computed on %d samples", sorted(wanted), len(inputs))
    return extras


def site_fusion_inputs(
    models: Sequence[nn.Module],
    site_data: Sequence[SampleSource],
    methods: str | FusionMethod | Sequence[str | FusionMethod],
    *,
    data: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    score_method: str = "conductance",
    keys: tuple[str, str] | None = None,
) -> FusionInputs:
    """The :class:`~fedfuse.fusion.FusionInputs` that ``methods`` read from the sites, computed
    in-process: each trained model (the user's own ``nn.Module`` s, or leveled models) with its
    own site's data (a ``DataLoader`` or an ``(inputs, labels)`` pair, in model order).

    Gives what the methods need and nothing else: each site's sample count, the extras of
    :func:`compute_site_extras` (importance scores, class counts, Gram matrices, Fisher), and
    :class:`~fedfuse.fusion.LocalSites` for statistics rounds (``kf-sites``, ``hf-sites``) and
    for scoring ``auto``'s candidates on each site's labelled rows;
    ``data``/``labels`` are the server's fusion set, passed through. The library's counterpart of
    what a Flower site sends (:func:`fedfuse.clients.add_fusion_extras`), without Flower.
    """
    methods = as_fusion_methods(methods)
    if len(models) != len(site_data):
        raise ValueError(f"{len(models)} models but data of {len(site_data)} sites")
    needed = set().union(*(method.needs() for method in methods))
    wanted = extras_for(methods)
    samples = [
        collect_samples(d, keys=keys, what=f"site {i}'s data") for i, d in enumerate(site_data)
    ]
    extras = [
        compute_site_extras(model, pair, wanted, score_method=score_method)
        for model, pair in zip(models, samples, strict=True)
    ]

    def field_of(name: str, attribute: str) -> list | None:
        return [getattr(e, attribute) for e in extras] if name in wanted else None

    return FusionInputs(
        data=data,
        labels=labels,
        scores=field_of("scores", "scores"),
        sample_counts=[len(x) for x, _ in samples] if "sample_counts" in needed else None,
        class_counts=field_of("class-counts", "class_counts"),
        grams=field_of("grams", "grams"),
        fisher=[e.fisher for e in extras] if any(e.fisher for e in extras) else None,
        sites=LocalSites(models, [x for x, _ in samples], validation=samples)
        if reads_sites(needed)
        else None,
    )
