"""What a site does in its one round, without Flower: load data, train, score, package; and
what it does in the rounds that may follow (statistics for site-fitted fusion, fine-tuning the
fused model on its data).

``clients/client_app.py`` is only the Flower glue around :func:`train_site`,
:func:`answer_statistics_request` and :func:`finetune_site`; ``fedfuse compare``'s library
runner, tests and benchmarks call them directly.

What a site sends besides its weights and scores is what the server's message asks, an
:class:`~fedfuse.federation.upload_request.UploadRequest`: the site computes exactly that and
never rebuilds the server's methods to learn it.

A site may keep its trained model between runs in a cache that the caller passes in its
:class:`SiteSetup` (any :class:`TrainedSiteCache`: the experiments' site-set cache,
:meth:`fedfuse.federation.site_cache.SiteCache.site`); the site's own path knows nothing of
where or how it is kept.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

import numpy as np
import torch

from fedfuse.data import ImageDataset
from fedfuse.federation.contract import DataContract
from fedfuse.federation.policy import SitePolicy
from fedfuse.federation.ray_cluster import site_ray_node
from fedfuse.federation.site_data import load_site_data
from fedfuse.federation.upload_request import UploadRequest
from fedfuse.federation.uploads import ClientUpload
from fedfuse.fusion.methods.regression.regmean import level_grams
from fedfuse.fusion.statistics.class_gaussians import fit_class_gaussians
from fedfuse.fusion.statistics.fisher import site_fisher
from fedfuse.fusion.statistics.on_site import site_statistics
from fedfuse.fusion.statistics.rounds import SiteStatistics, StatisticsRequest
from fedfuse.fusion.statistics.summed_terms import SummedRequest, site_sources, terms_from_sources
from fedfuse.io.grams import is_gram_factor
from fedfuse.io.validation import load_validated_state
from fedfuse.models import LeveledModel, build_model
from fedfuse.models.importance import Scores, importance_scores
from fedfuse.runtime import capped_threads, seed_everything
from fedfuse.settings.run import RunSettings, client_seed, finetune_seed
from fedfuse.training.finetune import finetune
from fedfuse.training.loop import train

log = logging.getLogger(__name__)


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _on_site_threads(
    entry: Callable[Concatenate[RunSettings, _P], _R],
) -> Callable[Concatenate[RunSettings, _P], _R]:
    """Run a site's entry point with torch capped to the run's ``threads`` (each simulated
    site's share of the cores), restoring the caller's thread count after it."""

    @functools.wraps(entry)
    def on_site_threads(settings: RunSettings, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with capped_threads(settings.threads):
            return entry(settings, *args, **kwargs)

    return on_site_threads


@dataclass
class TrainedSite:
    """A site's trained model, the facts it reports about its training, its importance scores
    by score method, and its Gram matrices once computed (what a :class:`TrainedSiteCache`
    keeps)."""

    model: LeveledModel
    facts: dict[str, Any]
    scores: dict[str, Scores] = field(default_factory=dict)
    grams: dict[int, torch.Tensor] | None = None


class TrainedSiteCache(Protocol):
    """Where one site's :class:`TrainedSite` is kept between runs (e.g.
    :meth:`fedfuse.federation.site_cache.SiteCache.site`)."""

    def load(self) -> TrainedSite | None:
        """The kept site, or None when there is none (or it is unusable)."""

    def save(self, site: TrainedSite) -> None:
        """Keep ``site`` (replacing what was kept)."""


@dataclass(frozen=True)
class SiteIdentity:
    """Who a site is: its id (its partition in a simulation; any distinct id otherwise), the
    sites in the simulated split (0 in a deployment), its name and its own ``.npz`` data file
    (a deployment; None: its simulated partition)."""

    partition_id: int
    num_partitions: int = 0
    name: str = ""
    data_path: str | None = None

    @property
    def label(self) -> str:
        """The site's name in its logs and refusals (``client <id>`` when it has none)."""
        return self.name or f"client {self.partition_id}"

    @property
    def data_source(self) -> str:
        """Where the site's data comes from, as a contract refusal names it."""
        return f"{self.label}'s data" + (f" ({self.data_path})" if self.data_path else "")


@dataclass(frozen=True)
class SiteSetup:
    """How a site goes about its round, besides what the server asks: the run's data
    ``contract`` its data is checked against before anything is trained, its own ``policy`` on
    what it sends, and the ``cache`` that keeps its trained model between runs (None: no
    check, everything asked is allowed, nothing is kept)."""

    contract: DataContract | None = None
    policy: SitePolicy | None = None
    cache: TrainedSiteCache | None = None


@_on_site_threads
def train_site(
    settings: RunSettings,
    site: SiteIdentity,
    request: UploadRequest,
    initial_state: dict[str, torch.Tensor] | None = None,
    setup: SiteSetup | None = None,
) -> ClientUpload:
    """Train the site's model, score its neurons on the site's own data, and compute exactly
    what the server's ``request`` asks besides (Grams, Fisher kinds, class Gaussians).

    Args:
        settings: the run's settings (the Flower run config): data, model, training, scores.
        site: who the site is and where its data lies.
        request: what the server's message asks the site to send besides its weights and
            scores; the site's policy judges it before anything is trained.
        initial_state: the server's initial weights (required when ``settings.init == "shared"``).
        setup: the contract, policy and cache of the site's round (None: none of them); a
            kept model and its scores and Grams are reused instead of computed again.

    Raises:
        SiteRefusal: the site's data breaks the contract, or the request asks for more than the
            policy allows (nothing was trained), or a Gram breaks the policy.
    """
    setup = setup or SiteSetup()
    seed = client_seed(settings, site.partition_id)
    seed_everything(seed)
    clock = _PhaseClock()
    cache, policy = setup.cache, setup.policy
    cached = cache.load() if cache is not None else None
    data: ImageDataset | None = None

    def site_data() -> ImageDataset:
        nonlocal data
        if data is None:
            data = load_site_data(settings, site.partition_id, site.num_partitions, site.data_path)
            clock.lap("load")
        return data

    if setup.contract is not None and (site.data_path or cached is None):
        setup.contract.check(site_data(), source=site.data_source)
    if policy is not None:
        policy.check_request(settings.method_names(), request, len(site_data()))
        if request.gaussian_rank:  # each class's mean must sum over enough of the site's samples
            check_class_rows(policy, site_data())
    if cached is not None:
        log.info("%s: trained model loaded from %s", site.label, cache)
        model, facts = cached.model, cached.facts
    else:
        model, facts = _train(settings, site_data(), seed, initial_state, site.label, clock)
    scores = cached.scores.get(settings.score_method) if cached else None
    if scores is None:
        scores = score_site(
            model,
            site_data(),
            method=settings.score_method,
            samples=settings.score_samples,
            steps=settings.score_steps,
            seed=seed,
            device=settings.device,
        )
        clock.lap("score")
    grams = None  # sent only when asked (they are large)
    if request.grams:
        grams = cached.grams if cached else None
        if grams is None:
            grams = level_grams(model, site_data().inputs(), factor=True)
            clock.lap("grams")
        if policy is not None:
            for level, gram in grams.items():
                rows = gram.shape[0] if is_gram_factor(gram) else gram.shape[1]
                policy.check_statistic(
                    f"the Gram of level {level}", int(facts["num_examples"]), rows, gram.shape[1]
                )
    fisher = None  # sent only when asked (the size of the model, or more)
    if request.fisher:
        fisher = site_fisher(
            model, site_data().inputs(), request.fisher, seed=seed, device=settings.device
        )
        model.cpu()
        clock.lap("fisher")
    gaussians = None  # sent only when asked (the server completes its fusion set from them)
    if request.gaussian_rank:
        labels = torch.as_tensor(site_data().labels).long()
        gaussians = fit_class_gaussians(
            site_data().inputs(), labels, site_data().num_classes, rank=request.gaussian_rank
        )
        clock.lap("class_gaussians")
    if cache is not None and (cached is None or data is not None):
        kept = grams if grams is not None else (cached.grams if cached else None)
        entry = TrainedSite(model, facts, dict(cached.scores) if cached else {}, kept)
        entry.scores[settings.score_method] = scores
        cache.save(entry)
    return ClientUpload(
        model=model.cpu(),
        scores=scores,
        num_examples=int(facts["num_examples"]),
        class_counts=[int(c) for c in facts["class_counts"]]
        if policy is None or policy.send_class_counts
        else None,
        partition_id=site.partition_id,
        num_partitions=site.num_partitions,
        score_method=settings.score_method,
        init=settings.init,
        train_loss=float(facts["train_loss"]),
        grams=grams,
        fisher=fisher,
        class_gaussians=gaussians,
        seconds={**facts.get("seconds", {}), **clock.laps} if cached else clock.laps,
        site_name=site.name,
        ray_node=site_ray_node(),
    )


def score_site(
    model: LeveledModel,
    data: ImageDataset,
    *,
    method: str,
    samples: int,
    steps: int,
    seed: int,
    device: str,
) -> Scores:
    """The importance scores (score method ``method``, ``steps`` integration steps) of
    ``model``'s neurons on up to ``samples`` of the site's ``data`` (drawn with ``seed``)."""
    inputs, labels = scores_sample(data, samples, seed)
    return importance_scores(model, inputs, labels, method=method, n_steps=steps, device=device)


def scores_sample(dataset: ImageDataset, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``n`` samples of ``dataset`` (inputs, labels) for computing importance scores."""
    index = np.arange(len(dataset))
    if 0 < n < len(dataset):
        index = np.sort(np.random.default_rng(seed).choice(len(dataset), n, replace=False))
    return dataset.inputs(index), dataset.labels[index]


def check_class_rows(policy: SitePolicy, data: ImageDataset) -> None:
    """Refuse, before training, to send class Gaussians when a class the site holds has fewer
    samples than ``policy``'s ``min-statistic-rows`` (its mean would say too much of each)."""
    counts = torch.bincount(torch.as_tensor(data.labels).long(), minlength=data.num_classes)
    for label, count in enumerate(counts.tolist()):
        if count:
            policy.check_statistic(f"the Gaussian of class {label}", count, count, 0)


def check_site_data(
    settings: RunSettings, contract: DataContract, site: SiteIdentity
) -> ImageDataset:
    """The site's data, checked against the run's ``contract`` (the check before training);
    raises :class:`~fedfuse.federation.contract.SiteRefusal` naming every mismatch."""
    data = load_site_data(settings, site.partition_id, site.num_partitions, site.data_path)
    contract.check(data, source=site.data_source)
    return data


def _check_fits_model(inputs: torch.Tensor, model: LeveledModel, who: str) -> None:
    """Refuse to compute on ``inputs`` (the data of the site ``who``) whose samples are not of
    the model's input shape."""
    shape, expected = tuple(inputs.shape[1:]), tuple(model.spec.input_shape)
    if shape != expected:
        raise ValueError(
            f"{who}: its data has samples of shape {shape}, the model takes {expected}"
        )


@_on_site_threads
def answer_statistics_request(
    settings: RunSettings,
    request: StatisticsRequest,
    model: LeveledModel,
    site: SiteIdentity,
    *,
    policy: SitePolicy | None = None,
) -> SiteStatistics:
    """One statistics round of a site: :func:`statistics_on_data` on the site's own training
    data, loaded as the run's settings say."""
    data = load_site_data(settings, site.partition_id, site.num_partitions, site.data_path)
    return statistics_on_data(
        request,
        model,
        data.inputs(),
        who=f"client {site.partition_id}",
        policy=policy,
        device=settings.device,
    )


def statistics_on_data(
    request: StatisticsRequest,
    model: LeveledModel,
    inputs: torch.Tensor,
    *,
    who: str,
    policy: SitePolicy | None = None,
    device: str | torch.device = "auto",
) -> SiteStatistics:
    """A site's answer to one statistics round: the statistics of its own ``model`` and the
    fused prefix on its training ``inputs``
    (:func:`~fedfuse.fusion.statistics.on_site.site_statistics`); ``who`` names the site in
    logs and errors. A statistic that breaks the site's ``policy`` is refused
    (:class:`~fedfuse.federation.contract.SiteRefusal`) and not sent; samples of another shape
    than the model's are a ValueError."""
    samples = min(len(inputs), request.max_samples or len(inputs))
    what = f"the statistics of level {request.level} piece {request.piece}"
    if policy is not None:  # before anything is computed; the rows after
        policy.check_statistic(what, samples, rows=samples, columns=0)
    _check_fits_model(inputs, model, who)
    statistics = site_statistics(model, inputs, request, device=device)
    if policy is not None:
        columns = request.linear_piece.fan_in(request.fused_level)
        policy.check_statistic(what, samples, statistics.rows, columns)
    log.info(
        "%s: statistics of level %d on %d rows in %.1f s",
        who,
        request.level,
        statistics.rows,
        statistics.seconds,
    )
    return statistics


@_on_site_threads
def answer_sum_request(
    settings: RunSettings,
    summed: SummedRequest,
    model: LeveledModel,
    site: SiteIdentity,
    *,
    policy: SitePolicy | None = None,
    sources: Mapping[str, torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], Mapping[str, torch.Tensor]]:
    """A site's part of a round summed over sites (:mod:`fedfuse.fusion.statistics.summed_terms`):
    its terms, or their norms, in the round's fixed units when it has them (a secure sum), and the
    numbers they were read from (:func:`~fedfuse.fusion.statistics.summed_terms.site_sources`; given
    ``sources`` of the same round's first step, they are read again, not recomputed). A statistic
    that breaks the site's ``policy`` is refused, as in a statistics round."""
    request = summed.request
    if sources is None:
        data = load_site_data(settings, site.partition_id, site.num_partitions, site.data_path)
        _check_fits_model(data.inputs(), model, f"client {site.partition_id}")
        if isinstance(request, StatisticsRequest):
            samples = min(len(data), request.max_samples or len(data))
            what = f"the statistics of level {request.level} piece {request.piece}"
        else:
            samples, what = len(data), "RegMean's Grams"
        if policy is not None:
            policy.check_statistic(what, samples, rows=samples, columns=0)
        sources = site_sources(request, model, data.inputs(), device=settings.device)
    terms = terms_from_sources(summed, model, sources)
    log.info(
        "client %d: %s of a summed round", site.partition_id, "norms" if summed.norms else "terms"
    )
    return terms, sources


@dataclass
class SiteFinetune:
    """A site's answer to the fine-tuning round: the fused model trained on its data."""

    model: LeveledModel
    num_examples: int
    details: dict[str, Any]


@_on_site_threads
def finetune_site(
    settings: RunSettings,
    model: LeveledModel,
    partition_id: int,
    num_partitions: int,
    *,
    data_path: str | None = None,
) -> SiteFinetune:
    """The fine-tuning round of a site: a copy of the fused ``model`` trained on the site's own
    data for ``finetune-epochs`` (:func:`fedfuse.training.finetune.finetune` with the run's
    settings and the site's own seed); ``model`` is left as it was."""
    data = load_site_data(settings, partition_id, num_partitions, data_path)
    if tuple(data.input_shape) != tuple(model.spec.input_shape):
        raise ValueError(
            f"client {partition_id}: its data has samples of shape {data.input_shape}, the "
            f"fused model takes {tuple(model.spec.input_shape)}"
        )
    tuned, details = finetune(
        model,
        data.inputs(),
        data.labels,
        seed=finetune_seed(settings, partition_id),
        description=f"client {partition_id} fine-tune",
        **settings.finetune_kwargs(),
    )
    return SiteFinetune(tuned.cpu(), len(data), details)


def _train(
    settings: RunSettings,
    data: ImageDataset,
    seed: int,
    initial_state: dict[str, torch.Tensor] | None,
    name: str,
    clock: _PhaseClock,
) -> tuple[LeveledModel, dict[str, Any]]:
    """The site's model trained on ``data``, and the facts it reports about its training."""
    spec = settings.model_spec_for(data)
    if settings.init == "shared":
        if not initial_state:
            raise ValueError(f"{name}: init='shared' but the server sent no initial model")
        model = load_validated_state(build_model(spec), initial_state, source="initial model")
    else:
        model = build_model(spec, seed=seed)
    losses = train(
        model, data, settings.train_config(), seed=seed, device=settings.device, description=name
    )
    clock.lap("train")
    train_loss = float(losses[-1]) if losses else float("nan")
    log.info("%s: trained on %d samples, final loss %.4f", name, len(data), train_loss)
    facts = {
        "num_examples": len(data),
        "class_counts": torch.bincount(data.labels, minlength=data.num_classes).tolist(),
        "train_loss": train_loss,
        "seconds": dict(clock.laps),
    }
    return model, facts


class _PhaseClock:
    """Wall time of each phase of a site's round (reported to the server with the upload)."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.laps[phase] = now - self._last
        self._last = now
