"""``OneShotFusion``: a Flower strategy with one round of local training and one fusion.

Methods fitted on the sites' own data (``kf-sites``, ``hf-sites``) add statistics rounds
after the train round, one per level, through ``statistics_rounds.FlowerSites`` (query
messages; the same flow control, timeout and validation as the train round). Fine-tuning on the
sites after fusion is one more round, ``finetune_round.SiteFinetuneRound``
(:meth:`OneShotFusion.finetune_round`), run by the ServerApp once the zero-shot results stand.

The server checks that every listed fusion method can fuse this run (number of sites,
architecture, inputs) before any site trains, sends every connected site one train message,
and takes the replies **as they arrive**: each is validated (naming a bad client) and written
at once to the run's :class:`~fedfuse.federation.uploads.UploadStore`, so the server never holds
every upload in memory and nothing a site computed is lost if a later step fails. Once all sites
replied, or the reply timeout passed, the accepted uploads are fused by each method of the
Flower-free library; a method that fails is recorded with its error and the others go on.
There is no federated evaluation round: the server evaluates the fused models itself.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from fedfuse.clients.records import pack_train_request
from fedfuse.data import ImageDataset
from fedfuse.federation.uploads import StoredUpload, UploadStore, fusion_inputs, needs_grams
from fedfuse.fusion import FusionMethod, FusionResult
from fedfuse.io.validation import ContributionError
from fedfuse.models import LeveledModel, ModelSpec

from .finetune_round import SiteFinetuneRound
from .messaging import stream_replies, wait_for_nodes
from .replies import decode_reply, describe_sender
from .statistics_rounds import FlowerSites

log = logging.getLogger(__name__)


class FusionAborted(RuntimeError):
    """Too few usable uploads arrived to fuse; the message lists every client's problem."""


class MethodsUnfit(ValueError):
    """A listed fusion method cannot fuse this run; raised before any site trains."""


@dataclass
class MethodFailure:
    """A fusion method that raised while fusing (the other methods still ran)."""

    error: str
    seconds: float


def check_methods(
    methods: Sequence[FusionMethod],
    num_sites: int,
    spec: ModelSpec | None,
    available: Iterable[str] | None = None,
    target: ModelSpec | None = None,
) -> None:
    """Raise :class:`MethodsUnfit` listing every method that cannot fuse this run (into
    ``target``, the fused model's spec; None: the sites')."""
    available = None if available is None else set(available)
    problems = []
    for method in methods:
        try:
            method.check_run(num_sites, spec, available, target)
        except ValueError as error:
            problems.append(str(error))
    if problems:
        raise MethodsUnfit(
            f"{len(problems)} of the listed fusion methods cannot fuse this run of {num_sites} "
            "sites (checked before any site trains): " + "; ".join(problems)
        )


class OneShotFusion(Strategy):
    """One round: every site trains and uploads once; the server fuses the uploads.

    Args:
        methods: the fusion methods (any :class:`fedfuse.fusion.FusionMethod`); all fuse the
            same uploads, and the first one that succeeds gives the round's result arrays.
        store: where each accepted upload is written as it arrives (its ``expected_spec``, when
            set, is the architecture every upload must have).
        fusion_set: given the sites' ``num-partitions`` (0 in a deployment), the server's
            fusion set (None: the methods need none).
        min_nodes: SuperNodes to wait for, and the fewest valid uploads to fuse.
        node_wait_timeout: seconds to wait for ``min_nodes`` SuperNodes.
        require_scores: reject uploads without importance scores.
        available_inputs: the :class:`FusionInputs` fields this run provides, for the check
            before training (None: all).
        before_training: called with the number of connected sites before the train message
            goes out: the place for any check that would otherwise fail after training (e.g.
            building the fusion set).
        on_upload: called with each stored upload (progress reports, result files).
        max_in_flight: train messages out at once (0: all; see :func:`stream_replies`).
    """

    def __init__(
        self,
        methods: Sequence[FusionMethod],
        *,
        store: UploadStore,
        fusion_set: Callable[[int], ImageDataset | None] | None = None,
        min_nodes: int = 2,
        node_wait_timeout: float = 120.0,
        require_scores: bool = True,
        available_inputs: Iterable[str] | None = None,
        before_training: Callable[[int], None] | None = None,
        on_upload: Callable[[StoredUpload], None] | None = None,
        max_in_flight: int = 0,
        target: Callable[[ModelSpec], ModelSpec | None] | None = None,
    ) -> None:
        if not methods:
            raise ValueError("OneShotFusion needs at least one fusion method")
        self.methods = list(methods)
        self.store = store
        self.fusion_set = fusion_set
        self.min_nodes = min_nodes
        self.node_wait_timeout = node_wait_timeout
        self.require_scores = require_scores
        self.available_inputs = available_inputs
        self.before_training = before_training
        self.on_upload = on_upload
        self.max_in_flight = max_in_flight
        self.target = target
        self.problems: list[str] = []
        self.results: dict[str, FusionResult] = {}
        self.failures: dict[str, MethodFailure] = {}
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
        config["server-round"] = server_round
        content = pack_train_request(arrays, config, send_grams=needs_grams(self.methods))
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
        **_: object,
    ) -> Result:
        """The one round, taking replies as they arrive instead of all at once at the end."""
        if num_rounds != 1:
            raise ValueError(f"one-shot fusion has exactly one round, not {num_rounds}")
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
        return result

    # ------------------------------------------------------------------ steps
    def accept(self, msg: Message) -> StoredUpload | None:
        """Validate one reply and store it; a bad one is named in :attr:`problems`."""
        source = describe_sender(msg)
        started = time.monotonic()
        try:
            upload = decode_reply(msg, self.store.expected_spec, require_scores=self.require_scores)
            entry = self.store.add(upload, source=source)
        except ContributionError as error:
            self.problems.append(str(error))
            log.error("rejected upload: %s", error)
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

    def note_silent(self, nodes: Iterable[int]) -> None:
        """Name the sites that did not reply before the timeout."""
        for node in nodes:
            problem = f"node {node}: no reply before the reply timeout"
            self.problems.append(problem)
            log.error("%s", problem)

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
        fusion_set = self.fusion_set(self.num_partitions) if self.fusion_set else None
        entries = self.store.entries
        models = self.store.models()
        sites = (
            self._statistics_channel(models)
            if any("sites" in method.needs() for method in self.methods)
            else None
        )
        inputs = fusion_inputs(self.store, fusion_set, sites=sites)
        for method in self.methods:
            method_started = time.monotonic()
            try:
                target = None if self.target is None else self.target(models[0].spec)
                self.results[method.name] = method.fuse(models, inputs, target=target)
            except Exception as error:  # one method's failure must not cost the others
                seconds = time.monotonic() - method_started
                self.failures[method.name] = MethodFailure(
                    f"{type(error).__name__}: {error}", seconds
                )
                log.exception("fusion method %s failed; the other methods go on", method.name)
        self.timings["fuse"] = time.monotonic() - started
        if not self.results:
            raise FusionAborted(
                "every fusion method failed: "
                + "; ".join(f"{name}: {f.error}" for name, f in self.failures.items())
            )
        if inputs.sites is not None:
            self.problems.extend(inputs.sites.problems)
        primary = next(iter(self.results.values()))
        metrics = MetricRecord(
            {
                "fusion-seconds": primary.seconds,
                "num-uploads": len(self.store),
                "num-examples": sum(e.num_examples for e in entries),
            }
        )
        return ArrayRecord(primary.model.state_dict()), metrics
