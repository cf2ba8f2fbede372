"""``OneShotFusion``: a Flower strategy with one round of local training and one fusion.

Methods fitted on the sites' own data (``kf-sites``, ``hf-sites``) add statistics rounds
after the train round, one per level, through ``statistics_rounds.FlowerSites`` (query
messages; the same flow control, timeout and validation as the train round). Fine-tuning on the
sites after fusion is one more round, ``finetune_round.SiteFinetuneRound``
(:meth:`OneShotFusion.finetune_round`), run by the ServerApp once the zero-shot results stand.

The server checks that every listed fusion method can fuse this run (number of sites, architecture,
inputs) before any site trains, sends every connected site one train message, and takes the replies
**as they arrive** (:mod:`.intake`): each is validated (naming a bad client) and written at once
to the run's :class:`~fedfuse.federation.uploads.UploadStore`, so the server never holds every
upload in memory and nothing a site computed is lost if a later step fails. Once all sites
replied, or the reply timeout passed, the accepted uploads are fused by each method of the
Flower-free library; a method that fails is recorded with its error and the others go on
(:mod:`.method_runs`; no federated evaluation round: the server evaluates the fused models
itself).

**Any Flower app.** With ``model_fn`` (the app's own model class) the strategy takes the replies
of a plain ClientApp, as Flower's templates write it: the trained weights as an ``ArrayRecord``
under the app's own parameter names and ``num-examples`` in a ``MetricRecord``. The model is
traced once (:mod:`.plain_apps`); the fusion set is the app's own samples (tensors or a
``DataLoader``, in its normalisation); the result's arrays and every ``results[method].model``
are the app's model again::

    strategy = OneShotFusion("kf-linear,regmean", model_fn=Net, fusion_set=fusion_loader,
                             client_extras=True)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(Net().state_dict()))

Methods that read more than weights from the sites (``fedfuse methods``) get it when the ClientApp
calls :func:`fedfuse.clients.add_fusion_extras` and the strategy is told so
(``client_extras=True``); methods with statistics rounds (``kf-sites``, ``hf-sites``) when its
``@app.query("statistics")`` handler returns :func:`fedfuse.clients.answer_statistics` and the
strategy is told so (``client_statistics=True``); otherwise they are refused when the strategy
is built, before any site trains.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from torch import nn

from fedfuse.clients.records import pack_train_request
from fedfuse.data import ImageDataset
from fedfuse.data.tensors import collect_samples
from fedfuse.federation.contract import DataContract
from fedfuse.federation.method_needs import upload_request_for
from fedfuse.federation.upload_inputs import complete_fusion_set, fusion_inputs
from fedfuse.federation.uploads import StoredUpload, UploadStore
from fedfuse.fusion import FusionMethod, FusionResult, as_fusion_methods
from fedfuse.fusion.base import reads_sites
from fedfuse.fusion.inversion import InvertedFusionSet
from fedfuse.fusion.methods.trained.dense import SyntheticFusionSet
from fedfuse.fusion.statistics.class_gaussians import GaussianFusionSet
from fedfuse.models import LeveledModel, ModelAdapter, ModelSpec
from fedfuse.runtime import configure_logging

from .finetune_round import SiteFinetuneRound
from .intake import UploadIntake
from .messaging import stream_replies, wait_for_nodes
from .method_runs import MethodFailure, format_method_results, fuse_each_method
from .plain_apps import PLAIN_APP_NEEDS, plain_app
from .preflight import CONTRACT_TIMEOUT, FusionAborted, check_methods, check_site_data
from .roster import SiteRoster
from .secure_sums import SecureSettings, check_secure_methods
from .statistics_rounds import FlowerSites

log = logging.getLogger(__name__)


class OneShotFusion(UploadIntake, Strategy):
    """One round: every site trains and uploads once; the server fuses the uploads.

    Args:
        methods: the fusion methods: a comma list of registry names (``"kf-linear,regmean"``),
            names or :class:`fedfuse.fusion.FusionMethod` instances; all fuse the same uploads,
            and the first one that succeeds gives the round's result arrays.
        model_fn: the app's own model class (or a function building one): the sites are plain
            ClientApps that reply with its weights (module docstring). None: the sites run
            fedfuse's ClientApp.
        fusion_set: the server's fusion set: samples in the model's normalisation (a tensor, an
            ``(inputs, labels)`` pair, a ``DataLoader``), an ``ImageDataset``, a function of the
            sites' ``num-partitions`` (0 deployed) that returns one, or a ``SyntheticFusionSet``
            (:mod:`fedfuse.fusion.methods.trained.dense`: made from the uploads). None: the methods
            need none.
        input_shape: one input's shape, for tracing ``model_fn`` when no fusion set says it.
        client_extras: the plain ClientApp calls :func:`fedfuse.clients.add_fusion_extras`, so
            the methods' scores, class counts and Gram matrices are asked for and required.
        client_statistics: the plain ClientApp answers statistics rounds with
            :func:`fedfuse.clients.answer_statistics`, so ``kf-sites`` and ``hf-sites`` run.
        store: where each accepted upload is written as it arrives: an :class:`UploadStore`
            (its ``expected_spec``, when set, is the architecture every upload must have), or a
            folder in which each run gets a new subfolder (None: a new temporary folder).
        min_nodes: SuperNodes to wait for, and the fewest valid uploads to fuse.
        node_wait_timeout: seconds to wait for ``min_nodes`` SuperNodes.
        require_scores: reject uploads without importance scores (None: fedfuse's ClientApp
            must send them; a plain one only with ``client_extras`` and a method that reads
            them).
        available_inputs: the :class:`FusionInputs` fields this run provides, for the check
            before training (None: all of fedfuse's ClientApp, or what a plain one sends).
        before_training: called with the number of connected sites before the train message
            goes out: the place for any check that would otherwise fail after training (e.g.
            building the fusion set).
        on_upload: called with each stored upload (progress reports, result files).
        max_in_flight: train messages out at once (0: all; see :func:`stream_replies`).
        target: given the sites' spec, the fused model's (None: the sites').
        score_method: the importance scores a plain ClientApp computes (``client_extras``).
        contract: the data contract sent with the train message: fedfuse's ClientApp checks
            its data against it and refuses, at once and by name, when they differ.
        check_contract: before the train message, ask every site to check its data against
            ``contract`` (:mod:`.preflight`): a site that refuses trains nothing, and too few
            sites left end the run before any site trains (for sites with their own files).
        on_fused: called with each method's name and result as soon as it has fused (e.g. to
            save the model before anything else can fail).
        secure: aggregate the rounds summed over sites with Flower's SecAgg+
            (:mod:`.secure_sums`); a method that would read anything per site is refused now.
        inversion: complete the fusion set from the uploads' BatchNorm statistics (None: not).
        gaussians: complete it from the class Gaussians every site uploads (None: not; a plain
            ClientApp sends them from its ``add_fusion_extras`` call, with ``client_extras``).

    Raises:
        MethodsUnfit: for a plain ClientApp, when a method needs what the sites will not send.
        ValueError: when ``model_fn``'s model cannot be traced (the node is named).
    """

    def __init__(
        self,
        methods: str | FusionMethod | Sequence[str | FusionMethod],
        *,
        model_fn: Callable[[], nn.Module] | None = None,
        fusion_set: Any = None,
        input_shape: Sequence[int] | None = None,
        client_extras: bool = False,
        client_statistics: bool = False,
        store: UploadStore | str | Path | None = None,
        min_nodes: int = 2,
        node_wait_timeout: float = 120.0,
        require_scores: bool | None = None,
        available_inputs: Iterable[str] | None = None,
        before_training: Callable[[int], None] | None = None,
        on_upload: Callable[[StoredUpload], None] | None = None,
        max_in_flight: int = 0,
        target: Callable[[ModelSpec], ModelSpec | None] | None = None,
        score_method: str = "conductance",
        contract: DataContract | None = None,
        check_contract: bool = False,
        on_fused: Callable[[str, FusionResult], None] | None = None,
        secure: SecureSettings | None = None,
        inversion: InvertedFusionSet | None = None,
        gaussians: GaussianFusionSet | None = None,
    ) -> None:
        self.methods = as_fusion_methods(methods)
        self.inversion, self.gaussians = inversion, gaussians
        if gaussians is not None and secure is not None:
            raise ValueError(
                "class Gaussians are sent site by site, not under secure aggregation (the server "
                "sees only sums)"
            )
        if gaussians is not None and model_fn is not None and not client_extras:
            raise ValueError(
                "class Gaussians from a plain ClientApp: its add_fusion_extras call sends them; "
                "pass client_extras=True"
            )
        if secure is not None:
            check_secure_methods(self.methods)
        self.secure = secure
        #: what every site sends besides its weights and scores, from the methods' needs
        self.upload_request = upload_request_for(self.methods, gaussians, secure=secure is not None)
        if not self.methods:
            raise ValueError("OneShotFusion needs at least one fusion method")
        synthetic = isinstance(fusion_set, SyntheticFusionSet)
        self.fusion_set = fusion_set if callable(fusion_set) or synthetic else None
        self._fixed_fusion_set = None
        if fusion_set is not None and self.fusion_set is None:
            self._fixed_fusion_set = (
                (fusion_set.inputs(), fusion_set.labels)
                if isinstance(fusion_set, ImageDataset)
                else collect_samples(fusion_set, what="the fusion set")
            )
        self.adapter: ModelAdapter | None = None
        self.client_extras = client_extras
        self.score_method = score_method
        self._extras: list[str] = []
        if model_fn is not None:
            plain = plain_app(
                model_fn,
                self.methods,
                input_shape=input_shape,
                fixed_fusion_set=self._fixed_fusion_set,
                has_fusion_set=self._fixed_fusion_set is not None or self.fusion_set is not None,
                client_extras=client_extras,
                available=available_inputs,
                min_nodes=min_nodes,
                client_statistics=client_statistics,
            )
            self.adapter, self._extras = plain.adapter, plain.extras
            self.available_inputs = plain.available_inputs
        elif client_extras or client_statistics:
            what = "client_extras" if client_extras else "client_statistics"
            raise ValueError(f"{what} is for a plain ClientApp: give model_fn too")
        else:
            self.available_inputs = available_inputs
        self.store = UploadStore.for_run(store, self.adapter.spec if self.adapter else None)
        self.min_nodes = min_nodes
        self.node_wait_timeout = node_wait_timeout
        self.require_scores = (
            require_scores if require_scores is not None else model_fn is None
        ) or "scores" in self._extras
        self.before_training, self.on_upload = before_training, on_upload
        self.max_in_flight, self.target = max_in_flight, target
        self.contract = contract
        self.check_contract = check_contract and contract is not None and model_fn is None
        self.on_fused = on_fused
        self.problems: list[str] = []
        #: the sites left out of the fusion, and why
        self.roster = SiteRoster()
        self.results: dict[str, FusionResult] = {}
        self.failures: dict[str, MethodFailure] = {}
        #: each method's metrics from ``start``'s ``evaluate_fn``
        self.evaluations: dict[str, MetricRecord] = {}
        self.num_partitions = 0
        self._sent: list[int] = []
        self.timings: dict[str, float] = {}
        self._grid: Grid | None = None
        self._reply_timeout = 3600.0
        self._node_of: dict[int, int] = {}  # partition id -> node id of its accepted upload

    def summary(self) -> None:
        log.info(
            "OneShotFusion: methods=%s, min_nodes=%d",
            [(m.name, m.options()) for m in self.methods],
            self.min_nodes,
        )
        log.info("the sites' uploads are kept in %s", self.store.directory)

    # ------------------------------------------------------------------ Flower hooks
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Wait for the sites, check every method against them, then one message per site."""
        started = time.monotonic()
        self._grid = grid
        self._sent = wait_for_nodes(grid, self.min_nodes, self.node_wait_timeout)
        self.timings["wait_nodes"] = time.monotonic() - started
        spec = self.store.expected_spec
        check_methods(
            self.methods,
            len(self._sent),
            spec,
            self.available_inputs,
            None if self.target is None or spec is None else self.target(spec),
            wording=PLAIN_APP_NEEDS if self.adapter is not None else None,
        )
        if self.before_training is not None:
            self.before_training(len(self._sent))
        if self.check_contract:
            assert self.contract is not None
            self._sent = check_site_data(
                grid,
                self._sent,
                self.contract,
                self.upload_request,
                min(self._reply_timeout, CONTRACT_TIMEOUT),
                roster=self.roster,
                problems=self.problems,
                min_nodes=self.min_nodes,
                max_in_flight=self.max_in_flight,
            )
        config["server-round"] = server_round
        content = pack_train_request(
            arrays,
            config,
            request=self.upload_request,
            extras=self._extras,
            score_method=self.score_method,
            contract=self.contract,
        )
        self.roster.asked = list(self._sent)
        log.info("sending the one train message to %d sites", len(self._sent))
        return [
            Message(content=content, message_type=MessageType.TRAIN, dst_node_id=node)
            for node in self._sent
        ]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Accept every reply, then fuse (the batch path; :meth:`start` streams instead)."""
        replies = list(replies)
        for reply in replies:
            self.accept(reply)
        answered = {msg.metadata.src_node_id for msg in replies}
        self.note_silent([node for node in self._sent if node not in answered])
        return self.fuse()

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return []  # the server evaluates the fused model centrally

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        return None

    def start(  # type: ignore[override]
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 1,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """The one round, taking replies as they arrive instead of all at once at the end.

        ``evaluate_fn(1, arrays)``, as Flower's strategies call it, evaluates every fused model
        on the server: the first method's metrics are the result's
        ``evaluate_metrics_serverapp[1]``, each method's are in :attr:`evaluations`.
        ``evaluate_config`` is unused (there is no federated evaluation round).
        """
        if num_rounds != 1:
            raise ValueError(
                f"one-shot fusion has exactly one round, not {num_rounds} (leave num_rounds out)"
            )
        configure_logging()  # progress shows in a user's ServerApp as Flower's own logs do
        self.summary()
        self._reply_timeout = timeout
        messages = list(
            self.configure_train(1, initial_arrays, train_config or ConfigRecord(), grid)
        )
        started = time.monotonic()
        replies = stream_replies(grid, messages, timeout, max_in_flight=self.max_in_flight)
        while True:
            try:
                self.accept(next(replies))
            except StopIteration as done:
                self.note_silent(done.value)
                break
        self.timings["collect"] = time.monotonic() - started
        arrays, metrics = self.fuse()
        result = Result()
        result.arrays = arrays if arrays is not None else ArrayRecord()
        if metrics is not None:
            result.train_metrics_clientapp[1] = metrics
        if evaluate_fn is not None:
            for name, fused in self.results.items():
                evaluated = evaluate_fn(1, ArrayRecord(fused.model.state_dict()))
                if evaluated is not None:
                    self.evaluations[name] = evaluated
                    log.info("%s on the server's evaluation: %s", name, dict(evaluated))
            primary = next(iter(self.results))
            if primary in self.evaluations:
                result.evaluate_metrics_serverapp[1] = self.evaluations[primary]
        log.info("one-shot fusion of %d sites:\n%s", len(self.store), self.format_results())
        return result

    def format_results(self) -> str:
        """One line per method: its fusion time and server-side metrics, or its error."""
        return format_method_results(self.methods, self.results, self.failures, self.evaluations)

    # ------------------------------------------------------------------ steps
    def _stored_sites(self, rounds: str) -> tuple[Grid, list[int], list[str]]:
        """The grid, and the node and name of each stored upload's site, for ``rounds`` after
        the train round (RuntimeError before the strategy started)."""
        if self._grid is None:
            raise RuntimeError(f"{rounds} need the grid of a started strategy")
        entries = self.store.entries
        nodes = [self._node_of[e.partition_id] for e in entries]
        return self._grid, nodes, [e.source for e in entries]

    def _statistics_channel(self, models: Sequence[LeveledModel]) -> FlowerSites:
        """The channel of the statistics rounds: each stored upload's site, by node."""
        grid, nodes, names = self._stored_sites("statistics rounds")
        return FlowerSites(
            grid,
            models,
            nodes,
            names,
            timeout=self._reply_timeout,
            max_in_flight=self.max_in_flight,
            secure=self.secure,
            export=None if self.adapter is None else self.adapter.export,
        )

    def finetune_round(self) -> SiteFinetuneRound:
        """The fine-tuning round after fusion over the sites whose uploads were fused, each
        weighted by its upload's sample count."""
        grid, nodes, names = self._stored_sites("a fine-tuning round")
        entries = self.store.entries
        return SiteFinetuneRound(
            grid,
            nodes,
            names,
            [e.partition_id for e in entries],
            [e.num_examples for e in entries],
            timeout=self._reply_timeout,
            max_in_flight=self.max_in_flight,
        )

    def fuse(self) -> tuple[ArrayRecord | None, MetricRecord]:
        """Fuse the stored uploads with every method; each failure is kept, not raised.

        Raises:
            FusionAborted: fewer than ``min_nodes`` usable uploads, or every method failed.
        """
        self._agree_on_partitions()
        if len(self.store) < self.min_nodes:
            raise FusionAborted(
                f"{len(self.store)} usable upload(s), {self.min_nodes} needed to fuse: "
                + "; ".join(self.problems)
            )
        started = time.monotonic()
        entries = self.store.entries
        models = self.store.models()
        if isinstance(self.fusion_set, SyntheticFusionSet):  # generated from the uploads
            fusion_set = self.fusion_set.generate(models, self.methods)
        elif self.fusion_set is not None:
            fusion_set = self.fusion_set(self.num_partitions)
        else:
            fusion_set = self._fixed_fusion_set
        sites = (
            self._statistics_channel(models)
            if any(reads_sites(method.needs()) for method in self.methods)
            else None
        )
        inputs = complete_fusion_set(
            models,
            fusion_inputs(self.store, fusion_set, sites=sites),
            self.store,
            inversion=self.inversion,
            gaussians=self.gaussians if self.upload_request.gaussian_rank else None,
        )
        fuse_each_method(
            self.methods,
            models,
            inputs,
            results=self.results,
            failures=self.failures,
            target=self.target,
            export=None if self.adapter is None else self.adapter.export,
            on_fused=self.on_fused,
        )
        self.timings["fuse"] = time.monotonic() - started
        if not self.results:
            raise FusionAborted(
                "every fusion method failed: "
                + "; ".join(f"{name}: {f.error}" for name, f in self.failures.items())
            )
        if inputs.sites is not None:
            self.problems.extend(inputs.sites.problems)
            for index, reason in getattr(inputs.sites, "refused", {}).items():
                self.roster.refuse_statistics(entries[index].partition_id, reason)
        primary = next(iter(self.results.values()))
        metrics = MetricRecord(
            {
                "fusion-seconds": primary.seconds,
                "num-uploads": len(self.store),
                "num-examples": sum(e.num_examples for e in entries),
            }
        )
        return ArrayRecord(primary.model.state_dict()), metrics
