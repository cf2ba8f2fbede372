"""What a site does in its one round, without Flower: load data, train, score, package; and
what it does in the rounds that may follow (statistics for site-fitted fusion, fine-tuning the
fused model on its data).

``clients/client_app.py`` is only the Flower glue around :func:`train_site`,
:func:`answer_statistics_request` and :func:`finetune_site`; ``fedfuse compare``'s library
runner, tests and benchmarks call them directly.

A site may keep its trained model between runs in a cache that the caller passes (any
:class:`TrainedSiteCache`: the experiments' site-set cache,
:meth:`fedfuse.federation.site_cache.SiteCache.site`); the site's own path knows nothing of
where or how it is kept.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

import numpy as np
import torch

from fedfuse.data import ImageDataset, load_npz_dataset
from fedfuse.federation.contract import DataContract
from fedfuse.federation.policy import SitePolicy, requested_statistics
from fedfuse.federation.ray_cluster import site_ray_node
from fedfuse.federation.scenario import Scenario
from fedfuse.federation.uploads import ClientUpload, needs_grams
from fedfuse.fusion.methods.averaging.fisher import fisher_kinds, site_fisher
from fedfuse.fusion.methods.regression.regmean import level_grams
from fedfuse.fusion.statistics.class_gaussians import fit_class_gaussians
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


@_on_site_threads
def train_site(
    settings: RunSettings,
    partition_id: int,
    num_partitions: int,
    initial_state: dict[str, torch.Tensor] | None = None,
    *,
    data_path: str | None = None,
    send_grams: bool | None = None,
    send_fisher: Sequence[str] | None = None,
    send_gaussians: int | None = None,
    cache: TrainedSiteCache | None = None,
    contract: DataContract | None = None,
    site_name: str = "",
    policy: SitePolicy | None = None,
) -> ClientUpload:
    """Train the site's model and score its neurons on the site's own data.

    Args:
        settings: the run's settings (the Flower run config).
        partition_id: the site's id (its partition in a simulation; any distinct id otherwise).
        num_partitions: sites in the simulated split (0 in a deployment).
        initial_state: the server's initial weights (required when ``settings.init == "shared"``).
        data_path: the site's own ``.npz`` data file (a deployment); else its simulated partition.
        send_grams: upload the level Gram matrices (the server's train message says whether a
            method of the run reads them); None: whether one of the run's methods
            (:meth:`~fedfuse.settings.run.RunSettings.fusion_methods`) reads them.
        send_fisher: the Fisher kinds to upload (``"diagonal"``, ``"kfac"``: what the run's
            methods read, as the train message says); None: as the run's methods read.
        send_gaussians: upload the site's class Gaussians of this rank (0: none; the train
            message says); None: as the run's ``fusion-gaussian-samples`` / ``-rank`` say.
        cache: where the trained site is kept between runs (None: it is not kept); a kept
            model and its scores and Grams are reused instead of computed again.
        contract: the run's data contract: the site's data is checked against it before
            anything is trained (None: no check).
        site_name: the site's name, for its logs and its upload ("": ``client <id>``).
        policy: what the site agrees to send (its node config; None: everything asked).

    Raises:
        SiteRefusal: the site's data breaks ``contract``, or the run asks for more than
            ``policy`` allows (nothing was trained), or a Gram breaks ``policy``.
    """
    seed = client_seed(settings, partition_id)
    seed_everything(seed)
    clock = _PhaseClock()
    name = site_name or f"client {partition_id}"
    if send_grams is None:
        send_grams = needs_grams(settings.fusion_methods())
    if send_fisher is None:
        send_fisher = fisher_kinds(settings.fusion_methods())
    if send_gaussians is None:
        send_gaussians = settings.gaussian_rank(settings.fusion_methods())
    send_gaussians = max(int(send_gaussians), 0)
    cached = cache.load() if cache is not None else None
    data: ImageDataset | None = None

    def site_data() -> ImageDataset:
        nonlocal data
        if data is None:
            data = load_site_data(settings, partition_id, num_partitions, data_path)
            clock.lap("load")
        return data

    if contract is not None and (data_path or cached is None):
        where = f" ({data_path})" if data_path else ""
        contract.check(site_data(), source=f"{name}'s data{where}")
    if policy is not None:
        check_site_policy(
            settings,
            policy,
            len(site_data()),
            send_grams=send_grams,
            send_fisher=send_fisher,
            send_gaussians=bool(send_gaussians),
        )
        if send_gaussians:  # each class's mean must sum over enough of the site's samples
            check_class_rows(policy, site_data())
    if cached is not None:
        log.info("%s: trained model loaded from %s", name, cache)
        model, facts = cached.model, cached.facts
    else:
        model, facts = _train(settings, site_data(), seed, initial_state, name, clock)
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
    grams = None  # sent only when a method of the run reads them (they are large)
    if send_grams:
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
    fisher = None  # sent only when a method of the run reads it (the size of the model, or more)
    if send_fisher:
        fisher = site_fisher(
            model, site_data().inputs(), send_fisher, seed=seed, device=settings.device
        )
        model.cpu()
        clock.lap("fisher")
    gaussians = None  # sent only when the run completes its fusion set from them
    if send_gaussians:
        labels = torch.as_tensor(site_data().labels).long()
        gaussians = fit_class_gaussians(
            site_data().inputs(), labels, site_data().num_classes, rank=send_gaussians
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
        partition_id=partition_id,
        num_partitions=num_partitions,
        score_method=settings.score_method,
        init=settings.init,
        train_loss=float(facts["train_loss"]),
        grams=grams,
        fisher=fisher,
        class_gaussians=gaussians,
        seconds={**facts.get("seconds", {}), **clock.laps} if cached else clock.laps,
        site_name=site_name,
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


def check_site_policy(
    settings: RunSettings,
    policy: SitePolicy,
    samples: int,
    *,
    send_grams: bool | None = None,
    send_fisher: Sequence[str] | None = None,
    send_gaussians: bool | None = None,
) -> None:
    """Refuse (:class:`~fedfuse.federation.contract.SiteRefusal`) a run whose methods or
    statistics the site's ``policy`` does not allow, before anything is trained. ``send_grams``,
    ``send_fisher`` and ``send_gaussians`` are what the server's train message asks (None: what
    the run's methods and settings read)."""
    methods = settings.fusion_methods()
    statistics = requested_statistics(methods, secure=settings.secure_aggregation)
    if send_grams is not None:
        statistics = (statistics - {"grams"}) | ({"grams"} if send_grams else set())
    if send_fisher is not None:
        statistics = (statistics - {"fisher"}) | ({"fisher"} if send_fisher else set())
    if send_gaussians is None:
        send_gaussians = bool(settings.gaussian_rank(methods))
    if send_gaussians:
        statistics.add("class-gaussians")
    policy.check_run(settings.method_names(), statistics, samples)


def check_class_rows(policy: SitePolicy, data: ImageDataset) -> None:
    """Refuse, before training, to send class Gaussians when a class the site holds has fewer
    samples than ``policy``'s ``min-statistic-rows`` (its mean would say too much of each)."""
    counts = torch.bincount(torch.as_tensor(data.labels).long(), minlength=data.num_classes)
    for label, count in enumerate(counts.tolist()):
        if count:
            policy.check_statistic(f"the Gaussian of class {label}", count, count, 0)


def check_site_data(
    settings: RunSettings,
    contract: DataContract,
    partition_id: int,
    num_partitions: int,
    *,
    data_path: str | None = None,
    site_name: str = "",
) -> ImageDataset:
    """The site's data, checked against the run's ``contract`` (the check before training);
    raises :class:`~fedfuse.federation.contract.SiteRefusal` naming every mismatch."""
    data = load_site_data(settings, partition_id, num_partitions, data_path)
    where = f" ({data_path})" if data_path else ""
    contract.check(data, source=f"{site_name or f'client {partition_id}'}'s data{where}")
    return data


def load_site_data(
    settings: RunSettings, partition_id: int, num_partitions: int, data_path: str | None = None
) -> ImageDataset:
    """The site's own training data: its ``.npz`` file (a deployment) or its partition."""
    if data_path:
        return load_npz_dataset(data_path)
    return Scenario(settings, num_partitions).client_data(partition_id)


@_on_site_threads
def answer_statistics_request(
    settings: RunSettings,
    request: StatisticsRequest,
    model: LeveledModel,
    partition_id: int,
    num_partitions: int,
    *,
    data_path: str | None = None,
    policy: SitePolicy | None = None,
) -> SiteStatistics:
    """One statistics round of a site: the statistics of its own model and the fused prefix on
    its own training data (:func:`~fedfuse.fusion.statistics.on_site.site_statistics`). A
    statistic that breaks the site's ``policy`` is refused
    (:class:`~fedfuse.federation.contract.SiteRefusal`) and not sent."""
    data = load_site_data(settings, partition_id, num_partitions, data_path)
    samples = min(len(data), request.max_samples or len(data))
    what = f"the statistics of level {request.level} piece {request.piece}"
    if policy is not None:  # before anything is computed; the rows after
        policy.check_statistic(what, samples, rows=samples, columns=0)
    if tuple(data.inputs().shape[1:]) != tuple(model.spec.input_shape):
        raise ValueError(
            f"client {partition_id}: its data has samples of shape "
            f"{tuple(data.inputs().shape[1:])}, the model takes {tuple(model.spec.input_shape)}"
        )
    statistics = site_statistics(model, data.inputs(), request, device=settings.device)
    if policy is not None:
        columns = request.linear_piece.fan_in(request.fused.levels[request.level])
        policy.check_statistic(what, samples, statistics.rows, columns)
    log.info(
        "client %d: statistics of level %d on %d rows in %.1f s",
        partition_id,
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
    partition_id: int,
    num_partitions: int,
    *,
    data_path: str | None = None,
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
        data = load_site_data(settings, partition_id, num_partitions, data_path)
        if tuple(data.inputs().shape[1:]) != tuple(model.spec.input_shape):
            raise ValueError(
                f"client {partition_id}: its data has samples of shape "
                f"{tuple(data.inputs().shape[1:])}, the model takes "
                f"{tuple(model.spec.input_shape)}"
            )
        if isinstance(request, StatisticsRequest):
            samples = min(len(data), request.max_samples or len(data))
            what = f"the statistics of level {request.level} piece {request.piece}"
        else:
            samples, what = len(data), "RegMean's Grams"
        if policy is not None:
            policy.check_statistic(what, samples, rows=samples, columns=0)
        sources = site_sources(request, model, data.inputs(), device=settings.device)
    terms = terms_from_sources(summed, model, sources)
    log.info("client %d: %s of a summed round", partition_id, "norms" if summed.norms else "terms")
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
