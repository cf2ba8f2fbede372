"""Statistics rounds over Flower: the :class:`~fedfuse.fusion.site_statistics.SiteChannel` of a
Flower run, used by methods fitted on the sites' data (``kf-sites``, ``hf-sites``).

After the train round, such a method asks for one round per linear piece of each level (an
affine level has one, a ResNet block two). Each round sends every
site that uploaded a ``query.statistics`` message (the fused model so far and the site's own
model) and takes the replies as they arrive, with the train round's reply timeout and flow
control. A reply is validated before it is used; a site that fails, answers garbage or stays
silent is named in :attr:`FlowerSites.problems` and gets None, which the method handles (K-means
grouping goes on without that site; Hungarian grouping needs both).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from flwr.app import Message
from flwr.serverapp import Grid

from fedfuse.clients.records import (
    STATISTICS_MESSAGE,
    pack_statistics_request,
    unpack_statistics,
)
from fedfuse.fusion.pieces import linear_pieces
from fedfuse.fusion.site_statistics import SiteStatistics, StatisticsRequest
from fedfuse.models import LeveledModel

from .messaging import replies_by_site
from .replies import short_reason, site_answer

log = logging.getLogger(__name__)


class FlowerSites:
    """The sites of a Flower run as a ``SiteChannel``: model ``i`` is answered by ``nodes[i]``.

    Args:
        grid: the run's grid.
        models: the sites' uploaded models, in the order the fusion method sees them.
        nodes: the node id of each model's site.
        names: how each site is named in problems (e.g. ``client 3 (node 42)``).
        timeout: seconds to wait for one round's replies.
        max_in_flight: messages out at once (0: all), as for the train round.
    """

    def __init__(
        self,
        grid: Grid,
        models: Sequence[LeveledModel],
        nodes: Sequence[int],
        names: Sequence[str],
        *,
        timeout: float,
        max_in_flight: int = 0,
    ) -> None:
        if not len(models) == len(nodes) == len(names):
            raise ValueError("FlowerSites: one node and one name per model")
        self.grid = grid
        self.models = models
        self.nodes = list(nodes)
        self.names = list(names)
        self.timeout = timeout
        self.max_in_flight = max_in_flight
        self._problems: list[str] = []
        #: model index -> why its site refused a statistics round (its policy); it is asked no
        #: more in this run
        self.refused: dict[int, str] = {}
        #: per round: the level and the seconds it took
        self.rounds: list[dict[str, float]] = []

    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def problems(self) -> list[str]:
        return self._problems

    def gather(self, request: StatisticsRequest) -> list[SiteStatistics | None]:

        started = time.monotonic()
        asked = [index for index in range(len(self.nodes)) if index not in self.refused]
        messages = [
            Message(
                content=pack_statistics_request(request.for_site(index), self.models[index]),
                message_type=STATISTICS_MESSAGE,
                dst_node_id=self.nodes[index],
            )
            for index in asked
        ]
        answers: list[SiteStatistics | None] = [None] * len(self.nodes)
        replies = replies_by_site(
            self.grid,
            messages,
            [self.nodes[index] for index in asked],
            self.timeout,
            lambda position: self._note(asked[position], "no statistics before the reply timeout"),
            max_in_flight=self.max_in_flight,
        )
        for position, reply in replies:
            answers[asked[position]] = self._decode(reply, asked[position], request)
        self.rounds.append(
            {"level": request.level, "piece": request.piece, "seconds": time.monotonic() - started}
        )
        log.info(
            "statistics round of level %d (%s): %d of %d sites answered in %.1f s",
            request.level,
            request.linear_piece.name,
            sum(a is not None for a in answers),
            len(answers),
            time.monotonic() - started,
        )
        return answers

    def _decode(
        self, reply: Message, index: int, request: StatisticsRequest
    ) -> SiteStatistics | None:
        name = self.names[index]
        if reply.has_error():
            self._note(index, f"the client failed: {short_reason(reply.error.reason)}")
            return None
        answer = site_answer(reply)
        if answer is not None:  # the site said why it sends nothing (e.g. its policy)
            reason = short_reason(answer.reason, limit=1000)
            if answer.kind == "refused":
                self.refused[index] = reason
            self._note(index, f"{answer.kind}: {reason}")
            return None
        try:
            statistics = unpack_statistics(reply.content, source=name)
            if (statistics.level, statistics.piece) != (request.level, request.piece):
                raise ValueError(
                    f"{name}: answered for level {statistics.level} piece {statistics.piece}, "
                    f"not {request.level} piece {request.piece}"
                )
            piece, fused_level = request.linear_piece, request.fused.levels[request.level]
            own_level = self.models[index].levels[request.level]
            own_pieces = linear_pieces(own_level)
            if own_pieces is None or len(own_pieces) <= request.piece:
                raise ValueError(f"{name}: its model has no piece {request.piece} here")
            statistics.check(
                piece.fan_in(fused_level),
                own_pieces[request.piece].width(own_level),
                source=name,
                stream_width=piece.width(fused_level) if piece.stream is not None else None,
            )
        except ValueError as error:
            self._note(index, str(error).removeprefix(f"{name}: "))
            return None
        return statistics

    def _note(self, index: int, problem: str) -> None:
        message = f"{self.names[index]}: statistics round: {problem}"
        self._problems.append(message)
        log.error("%s", message)
