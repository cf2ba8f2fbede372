"""Statistics rounds over Flower: the :class:`~fedfuse.fusion.statistics.channels.SiteChannel` of a
Flower run, used by methods fitted on the sites' data (``kf-sites``, ``hf-sites``).

After the train round, such a method asks for one round per linear piece of each level (an
affine level has one, a ResNet block two). Each round sends every
site that uploaded a ``query.statistics`` message (the fused model so far and the site's own
model) and takes the replies as they arrive, with the train round's reply timeout and flow
control. A reply is validated before it is used; a site that fails, answers garbage or stays
silent is named in :attr:`FlowerSites.problems` and gets None, which the method handles (K-means
grouping goes on without that site; Hungarian grouping needs both).

The sites also score models (``SiteScoring``, Flower's federated evaluation: ``auto`` ranks its
candidates by what every site sees): one ``evaluate`` message per site, as Flower's stock
strategies send it (:mod:`fedfuse.clients.score_records`), answered by fedfuse's ClientApp or a
template app's ``@app.evaluate()`` handler unchanged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence

import torch
from flwr.app import Message, RecordDict
from flwr.serverapp import Grid
from torch import nn

from fedfuse.clients.records import (
    STATISTICS_MESSAGE,
    pack_statistics_request,
    unpack_statistics,
)
from fedfuse.clients.score_records import SCORE_MESSAGE, pack_score_request, unpack_site_score
from fedfuse.clients.sum_records import pack_sum_request
from fedfuse.fusion.statistics.channels import SiteScore, check_reply
from fedfuse.fusion.statistics.rounds import SiteStatistics, StatisticsRequest
from fedfuse.fusion.statistics.summed_terms import (
    SiteSums,
    SummedRequest,
    add_terms,
    statistics_terms,
)
from fedfuse.models import LeveledModel

from .messaging import replies_by_site
from .replies import short_reason, site_answer
from .secure_sums import SecureSettings, secure_sum

log = logging.getLogger(__name__)

#: how a problem of a scoring round is named
SCORING = "scoring round"


class FlowerSites:
    """The sites of a Flower run as a ``SiteChannel``: model ``i`` is answered by ``nodes[i]``.

    Args:
        grid: the run's grid.
        models: the sites' uploaded models, in the order the fusion method sees them.
        nodes: the node id of each model's site.
        names: how each site is named in problems (e.g. ``client 3 (node 42)``).
        timeout: seconds to wait for one round's replies.
        max_in_flight: messages out at once (0: all), as for the train round.
        secure: sum the summed rounds with SecAgg+ (:mod:`.secure_sums`); None: in the clear.
        export: for plain ClientApps, a leveled model as the user's own class
            (:meth:`~fedfuse.models.ModelAdapter.export`): :meth:`score` sends its state dict,
            which the app's ``Net().load_state_dict`` takes. None: fedfuse's ClientApp.
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
        secure: SecureSettings | None = None,
        export: Callable[[LeveledModel], nn.Module] | None = None,
    ) -> None:
        if not len(models) == len(nodes) == len(names):
            raise ValueError("FlowerSites: one node and one name per model")
        self.grid = grid
        self.models = models
        self.nodes = list(nodes)
        self.names = list(names)
        self.timeout = timeout
        self.max_in_flight = max_in_flight
        self.secure = secure
        self.export = export
        self._secure_rounds = 0
        self._problems: list[str] = []
        #: model index -> why its site refused a statistics round (its policy); it is asked no
        #: more in this run
        self.refused: dict[int, str] = {}
        #: model index -> why its site gave no score (:meth:`score`); it is asked no more
        self.unscored: dict[int, str] = {}
        #: per round: the level and the seconds it took
        self.rounds: list[dict[str, float]] = []

    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def problems(self) -> list[str]:
        return self._problems

    @property
    def can_score(self) -> bool:
        """Whether a site is left to ask: every site until it fails a scoring round (a site
        without an ``evaluate`` handler answers with an error, named in :attr:`problems`)."""
        return len(self.unscored) < len(self.nodes)

    def score(self, model: nn.Module) -> list[SiteScore | None]:
        """Each site's score of ``model`` on its own labelled rows, in model order: one
        ``evaluate`` message per site with the model's state dict in the sites' format (the
        user's class's through ``export``, else the leveled model's and its spec); None for a
        site that failed, answered garbage or stayed silent (named in :attr:`problems`). Such
        a site is not asked again in this run (:attr:`unscored`): a ranking compares the
        candidates on the sites that scored them all, and a silent site would cost every
        later round the reply timeout."""
        started = time.monotonic()
        if self.export is not None and isinstance(model, LeveledModel):
            content = pack_score_request(self.export(model).state_dict())
        elif self.export is not None:  # already the user's own class
            content = pack_score_request(model.state_dict())
        elif isinstance(model, LeveledModel):
            content = pack_score_request(model.state_dict(), model.spec)
        else:
            raise TypeError(
                f"FlowerSites.score: fedfuse's ClientApp scores a LeveledModel, got a "
                f"{type(model).__name__}"
            )
        asked = [index for index in range(len(self.nodes)) if index not in self.unscored]
        scores: list[SiteScore | None] = [None] * len(self.nodes)
        replies = self._ask(
            asked,
            lambda index: content,
            SCORE_MESSAGE,
            lambda index: self._unscored(index, "no score before the reply timeout"),
        )
        for index, reply in replies:
            scores[index] = self._decode_score(reply, index)
        log.info(
            "scoring round: %d of %d sites scored the model in %.1f s (%d asked)",
            sum(s is not None for s in scores),
            len(scores),
            time.monotonic() - started,
            len(asked),
        )
        return scores

    def gather(self, request: StatisticsRequest) -> list[SiteStatistics | None]:

        started = time.monotonic()
        asked = [index for index in range(len(self.nodes)) if index not in self.refused]
        answers: list[SiteStatistics | None] = [None] * len(self.nodes)
        replies = self._ask(
            asked,
            lambda index: pack_statistics_request(request.for_site(index), self.models[index]),
            STATISTICS_MESSAGE,
            lambda index: self._note(index, "no statistics before the reply timeout"),
        )
        for index, reply in replies:
            answers[index] = self._decode(reply, index, request)
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

    def sum_terms(self, summed: SummedRequest) -> SiteSums:
        """One round summed over the sites
        (:func:`~fedfuse.fusion.statistics.summed_terms.sum_over_sites`): with SecAgg+ when the
        channel is secure, else each site's checked statistics added."""
        started = time.monotonic()
        request = summed.request
        statistics = isinstance(request, StatisticsRequest)
        if self.secure is None:
            if not statistics or summed.norms:
                raise ValueError(
                    "regmean with grams='sums' runs over Flower with secure-aggregation=true; "
                    "without it, regmean uploads the Grams per site"
                )
            replies = self.gather(request)
            parts = {i: statistics_terms(r) for i, r in enumerate(replies) if r is not None}
            sizes = {i: replies[i].payload_bytes() for i in parts}  # type: ignore[union-attr]
            return SiteSums(add_terms(list(parts.values())), sorted(parts), sizes)
        units = summed.units
        if units is None:
            raise ValueError("a secure sum needs the request's fixed units")
        asked = [index for index in range(len(self.nodes)) if index not in self.refused]
        contents = {
            self.nodes[i]: pack_sum_request(summed.for_site(i), self.models[i]) for i in asked
        }
        self._secure_rounds += 1
        outcome = secure_sum(self.grid, contents, self.secure, units.clip, self._secure_rounds)
        what = ("statistics" if statistics else "regmean") + (" norms" if summed.norms else "")
        for node, reason in outcome.dropped.items():
            self._note(self.nodes.index(node), f"dropped out of the secure {what} round: {reason}")
        if outcome.total is None:
            raise ValueError(
                f"secure aggregation of the {what} round halted: fewer sites answered than "
                f"secure-threshold={self.secure.threshold} needs ({len(asked)} asked, "
                f"{len(outcome.dropped)} dropped out)"
            )
        arrays, nodes = outcome.total, outcome.contributors
        names = sorted(units.scales)
        if len(arrays) != len(names):
            raise ValueError(f"the secure sum has {len(arrays)} terms, the request {len(names)}")
        terms = units.decode({n: torch.from_numpy(a) for n, a in zip(names, arrays, strict=True)})
        error = {n: units.resolution(n, tuple(t.shape), len(nodes)) for n, t in terms.items()}
        contributors = sorted(self.nodes.index(node) for node in nodes)
        size = sum(a.size for a in arrays) * 8  # SecAgg+ sends int64 masked values
        seconds = time.monotonic() - started
        self.rounds.append({"level": getattr(request, "level", -1), "seconds": seconds})
        log.info(
            "secure %s round: the sum of %d of %d sites in %.1f s",
            what,
            len(contributors),
            len(asked),
            seconds,
        )
        return SiteSums(terms, contributors, {i: size for i in contributors}, error)

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
            check_reply(statistics, request, self.models[index], name)
        except ValueError as error:
            self._note(index, str(error).removeprefix(f"{name}: "))
            return None
        return statistics

    def _decode_score(self, reply: Message, index: int) -> SiteScore | None:
        name = self.names[index]
        if reply.has_error():
            self._unscored(index, f"the client failed: {short_reason(reply.error.reason)}")
            return None
        answer = site_answer(reply)
        if answer is not None:  # the site said why it did not score (fedfuse's ClientApp)
            self._unscored(index, f"{answer.kind}: {short_reason(answer.reason)}")
            return None
        try:
            return unpack_site_score(reply.content, source=name)
        except ValueError as error:
            self._unscored(index, str(error).removeprefix(f"{name}: "))
            return None

    def _ask(
        self,
        asked: list[int],
        content_of: Callable[[int], RecordDict],
        message_type: str,
        silent: Callable[[int], None],
    ) -> Iterator[tuple[int, Message]]:
        """One message of ``message_type`` to each site of ``asked`` (its content
        ``content_of(index)``); ``(site index, reply)`` as the replies come, and ``silent(index)``
        for each site that did not answer before the reply timeout."""
        messages = [
            Message(content=content_of(i), message_type=message_type, dst_node_id=self.nodes[i])
            for i in asked
        ]
        replies = replies_by_site(
            self.grid,
            messages,
            [self.nodes[i] for i in asked],
            self.timeout,
            lambda position: silent(asked[position]),
            max_in_flight=self.max_in_flight,
        )
        for position, reply in replies:
            yield asked[position], reply

    def _unscored(self, index: int, problem: str) -> None:
        """Site ``index`` gave no score (``problem``): named, and not asked again."""
        self.unscored[index] = problem
        self._note(index, problem, SCORING)

    def _note(self, index: int, problem: str, round_: str = "statistics round") -> None:
        message = f"{self.names[index]}: {round_}: {problem}"
        self._problems.append(message)
        log.error("%s", message)
