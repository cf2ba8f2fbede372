"""Secure sums over the sites with Flower's SecAgg+ workflow (``secure-aggregation=true``).

A round summed over sites (:mod:`fedfuse.fusion.statistics.summed_terms`: a statistics round of
``kf-sites`` / ``hf-sites`` with ``statistics="sums"``, or RegMean's ``grams="sums"``) runs
Flower's own :class:`~flwr.server.workflow.SecAggPlusWorkflow`: its four stages (setup, share
keys, collect masked vectors, unmask) as train messages, with Flower's key agreement, Shamir
sharing and masking. In the collect stage each site is sent its request (the workflow would
send a ``FitIns``; :class:`_SummedRound` replaces it by fedfuse's request) and its client mod
(``fedfuse.clients.secure``) answers with its terms, masked. The server unmasks their sum only.

SecAgg+ averages weighted vectors; each site gives weight 1 (``max_weight`` 1, so no weight
is rounded), and the server multiplies the average by the number of sites it holds. The
values are clipped to the range of the request's fixed units and rounded to
:func:`~fedfuse.fusion.statistics.fixed_point.quantization_levels` levels. A site may drop out:
SecAgg+ rebuilds its masks when at least ``secure-threshold`` of its key shares (one per other site)
come back, and its terms count when they arrived before it dropped.

The workflow drives a legacy ``Strategy`` through a ``LegacyContext``; fedfuse gives it the two
calls it makes (:class:`_Collector`): which nodes to ask, and what to do with the sum.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common import FitIns, Parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.common.secure_aggregation.secaggplus_constants import Key as SecAggKey
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD, Key
from flwr.serverapp import Grid

from fedfuse.fusion import FusionMethod
from fedfuse.fusion.statistics.fixed_point import MODULUS, quantization_levels

from .messaging import stream_replies

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SecureSettings:
    """How the summed rounds are aggregated securely (run config ``secure-*``).

    Attributes:
        threshold: the share of a site's key shares (one per other site) that rebuild it:
            higher resists more colluding sites, lower survives more dropouts (SecAgg+'s
            ``reconstruction_threshold``; at least 2 shares either way).
        timeout: seconds to wait for each stage's replies (None: until every site answered).
    """

    threshold: float = 0.5
    timeout: float | None = None

    def __post_init__(self) -> None:
        if not 0 < self.threshold <= 1:
            raise ValueError(f"secure-threshold must be in (0, 1], got {self.threshold}")


def check_secure_methods(methods: Sequence[FusionMethod]) -> None:
    """Refuse, before any site trains, a method that would send the server anything per site
    that secure aggregation is meant to hide (per-site statistics, Grams, Fisher or scores)."""
    for method in methods:
        if "grams" in method.needs():
            raise ValueError(
                f"secure-aggregation=true: {method.name} reads each site's Grams; use "
                "method=regmean-sums (regmean with grams=sums) or kf-sites-sums, which need "
                "sums over the sites only"
            )
        if "fisher" in method.needs():
            raise ValueError(
                f"secure-aggregation=true: {method.name} reads each site's Fisher information; "
                "use regmean-sums or kf-sites-sums, which need sums over the sites only"
            )
        if "site_scores" in method.needs():
            raise ValueError(
                f"secure-aggregation=true: {method.name} reads each site's scores of its "
                f"candidates; set {method.name}.score_on=fusion-set to score them on the "
                "server's fusion set"
            )
        if "sites" in method.needs() and getattr(method, "statistics", "sums") != "sums":
            raise ValueError(
                f"secure-aggregation=true: {method.name} reads each site's statistics; use its "
                "statistics=sums variant (method=kf-sites-sums or hf-sites-sums)"
            )


@dataclass
class _Node:
    """What the workflow reads of a ``ClientProxy``: its node id."""

    node_id: int


class _Nodes:
    """What the workflow reads of a ``ClientManager``: how many nodes are there."""

    def __init__(self, count: int) -> None:
        self.count = count

    def num_available(self) -> int:
        return self.count


class _Collector:
    """The legacy strategy the workflow drives: every node of the round is asked, and the sum
    (SecAgg+'s average times the number of sites in it) is kept."""

    def __init__(self, nodes: Sequence[int]) -> None:
        self.nodes = list(nodes)
        self.total: list[np.ndarray] | None = None
        self.contributors: list[int] = []

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: Any
    ) -> list[tuple[_Node, FitIns]]:
        return [(_Node(node), FitIns(Parameters([], ""), {})) for node in self.nodes]

    def aggregate_fit(
        self, server_round: int, results: list[tuple[_Node, Any]], failures: list[Any]
    ) -> tuple[None, dict]:
        if results:
            self.contributors = [proxy.node_id for proxy, _ in results]
            mean = parameters_to_ndarrays(results[0][1].parameters)
            self.total = [np.asarray(a, dtype=np.float64) * len(results) for a in mean]
        return None, {}


class _WatchedGrid:
    """The run's grid as the workflow sees it, noting each node that fails or stays silent in a
    stage (Flower's workflow only counts them). Replies are read as the other rounds read them
    (:func:`~fedfuse.strategies.messaging.stream_replies`, every 0.5 s), not by the Grid's own
    ``send_and_receive``, which looks every 3 s: a secure ``kf-sites`` runs 8 stages a level."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        self.dropped: dict[int, str] = {}

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None):
        messages = list(messages)
        stage = _stage(messages)
        wait = math.inf if timeout is None else timeout
        # a stage is not sent twice: SecAgg+ names a site lost mid-protocol a dropout
        replies = list(stream_replies(self.grid, messages, wait, retries=0))
        answered = set()
        for reply in replies:
            node = reply.metadata.src_node_id
            answered.add(node)
            if reply.has_error():
                self.dropped.setdefault(node, f"failed at stage {stage}: {reply.error.reason}")
        for message in messages:
            node = message.metadata.dst_node_id
            if node not in answered:
                self.dropped.setdefault(node, f"no reply at stage {stage}")
        return replies

    def __getattr__(self, name: str) -> Any:
        return getattr(self.grid, name)


def _stage(messages: list[Message]) -> str:
    if not messages:
        return "?"
    configs = messages[0].content.config_records.get(RECORD_KEY_CONFIGS)
    return str(configs.get(SecAggKey.STAGE, "?")) if configs is not None else "?"


@dataclass
class SecureOutcome:
    """One SecAgg+ round: the sum (None when the protocol halted), the nodes whose vectors it
    holds, and the nodes that failed or fell silent, with the stage."""

    total: list[np.ndarray] | None
    contributors: list[int]
    dropped: dict[int, str]


class _SummedRound(SecAggPlusWorkflow):
    """SecAgg+ whose collect stage sends each node fedfuse's request instead of a FitIns."""

    def __init__(self, contents: Mapping[int, RecordDict], **options: Any) -> None:
        super().__init__(**options)
        self.contents = contents

    def setup_stage(self, grid: Grid, context: LegacyContext, state: Any) -> bool:
        proceed = super().setup_stage(grid, context, state)
        for node in state.nid_to_fitins:
            state.nid_to_fitins[node] = self.contents[node]
        return proceed


def secure_sum(
    grid: Grid,
    contents: Mapping[int, RecordDict],
    settings: SecureSettings,
    clip: float,
    round_number: int,
) -> SecureOutcome:
    """Run one SecAgg+ round over the nodes of ``contents`` (node id -> its request), values
    clipped to ``[-clip, clip]``: the sum of their vectors, the nodes in it and those that
    dropped out (no sum when the protocol halted: too few sites left for its threshold)."""
    if len(contents) < 2:
        raise ValueError(f"secure aggregation needs at least 2 sites, got {len(contents)}")
    collector = _Collector(list(contents))
    context = LegacyContext(
        Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={}),
        strategy=collector,  # type: ignore[arg-type]
        client_manager=_Nodes(len(contents)),  # type: ignore[arg-type]
    )
    context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord(
        {Key.CURRENT_ROUND: round_number}
    )
    context.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()
    workflow = _SummedRound(
        contents,
        num_shares=1.0,
        reconstruction_threshold=settings.threshold,
        max_weight=1.0,
        clipping_range=clip,
        quantization_range=quantization_levels(len(contents)),
        modulus_range=MODULUS,
        timeout=settings.timeout,
    )
    watched = _WatchedGrid(grid)
    workflow(watched, context)  # type: ignore[arg-type]
    return SecureOutcome(collector.total, collector.contributors, watched.dropped)


__all__ = ["SecureOutcome", "SecureSettings", "check_secure_methods", "secure_sum"]
