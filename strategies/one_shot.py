"""``OneShotFusion``: a Flower strategy with one round of local training and one fusion.

Methods fitted on the sites' own data (``kf-sites``, ``hf-sites``) add statistics rounds
after the train round, one per level, through ``statistics_rounds.FlowerSites`` (query
messages; the same flow control, timeout and validation as the train round). Fine-tuning on the
sites after fusion is one more round, ``finetune_round.SiteFinetuneRound``
(:meth:`OneShotFusion.finetune_round`), run by the ServerApp once the zero-shot results stand.

The server checks that every listed fusion method can fuse this run (number of sites, architecture,
inputs) before any site trains, sends every connected site one train message, and takes the replies
**as they arrive**: each is validated (naming a bad client) and written at once to the run's
:class:`~fedfuse.federation.uploads.UploadStore`, so the server never holds every upload in memory
and nothing a site computed is lost if a later step fails. Once all sites replied, or the reply
timeout passed, the accepted uploads are fused by each method of the Flower-free library; a method
that fails is recorded with its error and the others go on (no federated evaluation round: the
server evaluates the fused models itself).

**Any Flower app.** With ``model_fn`` (the app's own model class) the strategy takes the replies
of a plain ClientApp, as Flower's templates write it: the trained weights as an ``ArrayRecord``
under the app's own parameter names and ``num-examples`` in a ``MetricRecord``. The model is
traced once (:class:`~fedfuse.models.ModelAdapter`); the fusion set is the app's own samples
(tensors or a ``DataLoader``, in its normalisation); the result's arrays and every
``results[method].model`` are the app's model again::

    strategy = OneShotFusion("kf-linear,regmean", model_fn=Net, fusion_set=fusion_loader,
                             client_extras=True)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(Net().state_dict()))

Methods that read more than weights from the sites (``fedfuse methods``) get it when the ClientApp
calls :func:`fedfuse.clients.add_fusion_extras` and the strategy is told so
(``client_extras=True``); otherwise they are refused when the strategy is built, before any site
trains.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
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
from fedfuse.federation.plain_site import EXTRA_FIELDS, extras_for
from fedfuse.federation.uploads import (
    StoredUpload,
    UploadStore,
    complete_fusion_set,
    fusion_inputs,
    needs_grams,
)
from fedfuse.fusion import FusionMethod, FusionResult, as_fusion_methods
from fedfuse.fusion.inversion import InvertedFusionSet
from fedfuse.fusion.methods.averaging.fisher import fisher_kinds
from fedfuse.fusion.methods.trained.dense import SyntheticFusionSet
from fedfuse.fusion.statistics.class_gaussians import GaussianFusionSet, upload_rank
from fedfuse.io.validation import ContributionError
from fedfuse.models import LeveledModel, ModelAdapter, ModelSpec
from fedfuse.runtime import configure_logging

from .finetune_round import SiteFinetuneRound
from .messaging import stream_replies, wait_for_nodes
from .preflight import (
    CONTRACT_TIMEOUT,
    FusionAborted,
    MethodsUnfit,
    check_methods,
    check_site_data,
)
from .replies import (
    EXTRAS_HINT,
    SiteDidNotUpload,
    decode_plain_reply,
    decode_reply,
    describe_sender,
    sender_name,
)
from .roster import SiteRoster
from .secure_sums import SecureSettings, check_secure_methods
from .statistics_rounds import FlowerSites

log = logging.getLogger(__name__)


@dataclass
class MethodFailure:
    """A fusion method that raised while fusing (the other methods still ran)."""

    error: str
    seconds: float


class OneShotFusion(Strategy):
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
        gaussians: complete it from the class Gaussians every site uploads (None: not; sites
            of fedfuse's ClientApp only).

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
        if gaussians is not None and (model_fn is not None or secure is not None):
            raise ValueError(
                "class Gaussians are sent by fedfuse's ClientApp, site by site: not by a plain "
                "ClientApp, nor under secure aggregation (the server sees only sums)"
            )
        if secure is not None:
            check_secure_methods(self.methods)
        self.secure = secure
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
            self._plain_app(model_fn, input_shape, available_inputs, min_nodes)
        elif client_extras:
            raise ValueError("client_extras is for a plain ClientApp: give model_fn too")
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

    def _plain_app(
        self,
        model_fn: Callable[[], nn.Module],
        input_shape: Sequence[int] | None,
        available: Iterable[str] | None,
        min_nodes: int,
    ) -> None:
        """Trace the app's model and refuse, now, every method the plain sites cannot serve."""
        if input_shape is None:
            if self._fixed_fusion_set is None:
                raise ValueError(
                    "OneShotFusion(model_fn=...) needs the model's input shape: give the fusion "
                    "set (fusion_set=) or input_shape="
                )
            input_shape = tuple(self._fixed_fusion_set[0].shape[1:])
        self.adapter = ModelAdapter(model_fn, tuple(input_shape)).register()
        if self.client_extras:
            self._extras = extras_for(self.methods)
        if available is None:
            available = {"sample_counts", *(EXTRA_FIELDS[name] for name in self._extras)}
            if self._fixed_fusion_set is not None or self.fusion_set is not None:
                available |= {"data", "labels"}
        self.available_inputs = set(available)
        hint = (
            f". A plain ClientApp sends its weights and num-examples; for importance scores, "
            f"class counts, Gram matrices and Fisher {EXTRAS_HINT} and pass client_extras=True; "
            "statistics rounds (kf-sites, hf-sites) need fedfuse's own ClientApp"
        )
        check_methods(self.methods, min_nodes, self.adapter.spec, self.available_inputs, hint=hint)
        wider = [m.name for m in self.methods if m.chooses_widths]
        if wider:
            raise MethodsUnfit(
                f"{wider}: choose the fused widths, and a plain "
                f"{self.adapter.model_class.__name__} keeps the widths its class defines"
            )

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
        )
        if self.before_training is not None:
            self.before_training(len(self._sent))
        if self.check_contract:
            assert self.contract is not None
            self._sent = check_site_data(
                grid,
                self._sent,
                self.contract,
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
            send_grams=needs_grams(self.methods),
            send_fisher=fisher_kinds(self.methods),
            send_gaussians=upload_rank(self.gaussians, self.methods),
            extras=self._extras,
            score_method=self.score_method,
            contract=self.contract,
        )
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
        lines = []
        for method in self.methods:
            name = method.name
            if name in self.results:
                metrics = ", ".join(
                    f"{key} {value:.4f}" if isinstance(value, float) else f"{key} {value}"
                    for key, value in self.evaluations.get(name, {}).items()
                )
                seconds = self.results[name].seconds
                lines.append(f"  {name:<16} fused in {seconds:7.2f} s  {metrics}".rstrip())
            elif name in self.failures:
                lines.append(f"  {name:<16} FAILED: {self.failures[name].error}")
        return "\n".join(lines)

    # ------------------------------------------------------------------ steps
    def accept(self, msg: Message) -> StoredUpload | None:
        """Validate one reply and store it; a bad one is named in :attr:`problems`."""
        source = describe_sender(msg)
        started = time.monotonic()
        try:
            upload = self._decode(msg)
            entry = self.store.add(upload, source=source)
        except ContributionError as error:
            self.problems.append(str(error))
            kind = error.kind if isinstance(error, SiteDidNotUpload) else "rejected"
            self.roster.drop(kind, str(error), node=msg.metadata.src_node_id, name=sender_name(msg))
            log.error("%s upload: %s", "no" if kind in ("refused", "failed") else "rejected", error)
            return None
        finally:
            elapsed = time.monotonic() - started
            self.timings["handle_uploads"] = self.timings.get("handle_uploads", 0.0) + elapsed
        self._node_of[entry.partition_id] = msg.metadata.src_node_id
        log.info(
            "stored the upload of %s (%d examples): %d of %d sites",
            source,
            entry.num_examples,
            len(self.store),
            len(self._sent) or len(self.store),
        )
        if self.on_upload is not None:
            self.on_upload(entry)
        return entry

    def _decode(self, msg: Message) -> Any:
        """The upload of one reply: fedfuse's ClientApp's, or a plain one's (by its node)."""
        if self.adapter is None:
            return decode_reply(msg, self.store.expected_spec, require_scores=self.require_scores)
        node = msg.metadata.src_node_id
        if node not in self._sent:
            raise ContributionError(f"node {node}: replied without being asked to train")
        return decode_plain_reply(
            msg,
            self.adapter,
            partition_id=self._sent.index(node),
            num_partitions=len(self._sent),
            wanted=self._extras,
        )

    def note_silent(self, nodes: Iterable[int]) -> None:
        """Name the sites that did not reply before the timeout."""
        for node in nodes:
            problem = f"node {node}: no reply before the reply timeout"
            self.problems.append(problem)
            self.roster.drop("silent", problem, node=node)
            log.error("%s", problem)

    def sites(self) -> list[dict[str, Any]]:
        """Every site of the run by name, node id and status (:class:`SiteRoster`)."""
        return self.roster.sites(self.store.entries, self._node_of)

    def _agree_on_partitions(self) -> None:
        """Keep the uploads whose ``num-partitions`` is the majority's; name the others."""
        counts = Counter(entry.num_partitions for entry in self.store.entries)
        if not counts:
            return
        # the most common value; on a tie, the smallest (a deterministic choice)
        self.num_partitions = min(counts, key=lambda n: (-counts[n], n))
        for entry in self.store.entries:
            if entry.num_partitions != self.num_partitions:
                problem = (
                    f"{entry.source}: reports num-partitions {entry.num_partitions}, "
                    f"{counts[self.num_partitions]} other site(s) report {self.num_partitions}"
                )
                self.problems.append(problem)
                self.roster.drop(
                    "rejected",
                    problem,
                    node=self._node_of.pop(entry.partition_id, None),
                    name=entry.facts.get("site_name", ""),
                    partition_id=entry.partition_id,
                )
                self.store.discard(entry.partition_id, problem)

    def _statistics_channel(self, models: Sequence[LeveledModel]) -> FlowerSites:
        """The channel of the statistics rounds: each stored upload's site, by node."""
        if self._grid is None:
            raise RuntimeError("statistics rounds need the grid of a started strategy")
        entries = self.store.entries
        return FlowerSites(
            self._grid,
            models,
            [self._node_of[e.partition_id] for e in entries],
            [e.source for e in entries],
            timeout=self._reply_timeout,
            max_in_flight=self.max_in_flight,
            secure=self.secure,
        )

    def finetune_round(self) -> SiteFinetuneRound:
        """The fine-tuning round after fusion over the sites whose uploads were fused, each
        weighted by its upload's sample count."""
        if self._grid is None:
            raise RuntimeError("a fine-tuning round needs the grid of a started strategy")
        entries = self.store.entries
        return SiteFinetuneRound(
            self._grid,
            [self._node_of[e.partition_id] for e in entries],
            [e.source for e in entries],
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
            if any("sites" in method.needs() for method in self.methods)
            else None
        )
        inputs = complete_fusion_set(
            models,
            fusion_inputs(self.store, fusion_set, sites=sites),
            self.store,
            inversion=self.inversion,
            gaussians=self.gaussians if upload_rank(self.gaussians, self.methods) else None,
        )
        for method in self.methods:
            method_started = time.monotonic()
            try:
                target = None if self.target is None else self.target(models[0].spec)
                result = method.fuse(models, inputs, target=target)
                if self.adapter is not None:  # the app gets its own model, under its own names
                    result.model = self.adapter.export(result.model)
            except Exception as error:  # one method's failure must not cost the others
                seconds = time.monotonic() - method_started
                self.failures[method.name] = MethodFailure(
                    f"{type(error).__name__}: {error}", seconds
                )
                log.exception("fusion method %s failed; the other methods go on", method.name)
                continue
            self.results[method.name] = result
            if self.on_fused is not None:  # e.g. saved now, before anything else can fail
                self.on_fused(method.name, result)
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
