"""How the server reaches the sites for statistics rounds, and how it checks what they send.

A method fitted on the sites' data asks through a :class:`SiteChannel`, one site per base model:
:class:`LocalSites` answers in-process (the library, ``fedfuse compare``, tests), the Flower
strategy by one query message per site and round. Every reply is checked against the request and
the site's own model (:func:`check_reply`) before the fit reads it: a site's statistics are
input from outside.

A channel that is also :class:`SiteScoring` has the sites score a model on their own labelled
rows (Flower's federated evaluation): ``auto`` ranks its candidates by what every site sees,
where the server's fusion set shows only some classes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from fedfuse.fusion.blocks.graph_pieces import fold_norm_levels
from fedfuse.fusion.blocks.pieces import linear_pieces
from fedfuse.fusion.statistics.on_site import site_statistics
from fedfuse.fusion.statistics.rounds import SiteStatistics, StatisticsRequest
from fedfuse.models import LeveledModel, ModelAdapter
from fedfuse.models.capture import accuracy_and_loss


@runtime_checkable
class SiteChannel(Protocol):
    """How the server reaches the sites for statistics rounds, one per base model."""

    def __len__(self) -> int: ...

    def gather(self, request: StatisticsRequest) -> list[SiteStatistics | None]:
        """Each site's statistics, in model order; None for a site that did not answer (the
        channel records why in :attr:`problems`)."""
        ...

    @property
    def problems(self) -> list[str]: ...


@dataclass(frozen=True)
class SiteScore:
    """A model's score on one site's labelled rows, as a Flower ``evaluate`` reply holds it."""

    accuracy: float
    loss: float
    examples: int


@runtime_checkable
class SiteScoring(Protocol):
    """Sites that score a model on their own labelled rows, one site per base model."""

    @property
    def can_score(self) -> bool:
        """Whether :meth:`score` can be asked (e.g. the in-process sites were given labels)."""
        ...

    def score(self, model: nn.Module) -> list[SiteScore | None]:
        """Each site's score of ``model`` (a fused model of the sites' architecture), in model
        order; None for a site that did not answer (the reason in ``problems``)."""
        ...


def pooled_score(scores: Sequence[SiteScore]) -> SiteScore:
    """The scores of several sites as one: accuracy and loss weighted by each site's rows, so
    the pooled rows of the federation count alike."""
    examples = sum(s.examples for s in scores)
    if not examples:
        raise ValueError("pooled_score: no site scored any row")
    return SiteScore(
        accuracy=sum(s.accuracy * s.examples for s in scores) / examples,
        loss=sum(s.loss * s.examples for s in scores) / examples,
        examples=examples,
    )


class LocalSites:
    """The sites in-process: each base model with its own training inputs (and, optionally,
    a weight per input: ``sample_weights`` of
    :func:`~fedfuse.fusion.statistics.on_site.site_statistics`; a site whose weights sum
    to 0 does not answer).

    The library's :class:`SiteChannel` (``fedfuse compare``, tests, notebooks): every request is
    answered by :func:`site_statistics` on each site's data, one site after the other.
    ``models`` are fedfuse's leveled models or the user's own plain ``nn.Module`` s of one
    class, adapted here (:class:`~fedfuse.models.ModelAdapter`, on the data's input shape;
    they share the user's parameters).

    With ``validation`` (each site's labelled rows: ``(inputs, labels)``, its training rows or
    a split it held out) the sites also :meth:`score` models (:class:`SiteScoring`).
    """

    def __init__(
        self,
        models: Sequence[LeveledModel | nn.Module],
        data: Sequence[torch.Tensor],
        *,
        batch_size: int = 256,
        device: str | torch.device = "auto",
        sample_weights: Sequence[torch.Tensor] | None = None,
        validation: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        if validation is not None and len(validation) != len(data):
            raise ValueError(
                f"LocalSites: {len(validation)} validation sets for {len(data)} datasets"
            )
        self.validation = None if validation is None else list(validation)
        if len(models) != len(data):
            raise ValueError(f"LocalSites: {len(models)} models but {len(data)} datasets")
        if sample_weights is not None and len(sample_weights) != len(data):
            raise ValueError(
                f"LocalSites: {len(sample_weights)} weight vectors for {len(data)} datasets"
            )
        self.sample_weights = None if sample_weights is None else list(sample_weights)
        self.data = list(data)
        #: one input's shape (a fusion of plain models without a fusion set traces with it)
        self.input_shape: tuple[int, ...] | None = (
            tuple(int(d) for d in self.data[0].shape[1:]) if self.data else None
        )
        self.models = _leveled(list(models), self.input_shape)
        self.batch_size = batch_size
        self.device = device
        #: why a site gave no statistics (:class:`SiteChannel`); in-process sites always answer
        self.problems: list[str] = []

    def __len__(self) -> int:
        return len(self.models)

    @property
    def can_score(self) -> bool:
        return self.validation is not None

    def score(self, model: nn.Module) -> list[SiteScore | None]:
        if self.validation is None:
            raise ValueError("LocalSites: no validation rows to score a model on")
        scores: list[SiteScore | None] = []
        for inputs, labels in self.validation:
            accuracy, loss = accuracy_and_loss(
                model, inputs, labels, batch_size=self.batch_size, device=self.device
            )
            scores.append(SiteScore(accuracy, loss, len(labels)))
        return scores

    def gather(self, request: StatisticsRequest) -> list[SiteStatistics | None]:
        replies: list[SiteStatistics | None] = []
        for i, (model, data) in enumerate(zip(self.models, self.data, strict=True)):
            weights = None if self.sample_weights is None else self.sample_weights[i]
            if weights is not None and not float(torch.as_tensor(weights).sum()) > 0:
                replies.append(None)  # no row counts for this site: it has nothing to say
                continue
            replies.append(
                site_statistics(
                    model,
                    data,
                    request.for_site(i),
                    batch_size=self.batch_size,
                    device=self.device,
                    sample_weights=weights,
                )
            )
        return replies


def _leveled(
    models: list[LeveledModel | nn.Module], input_shape: tuple[int, ...] | None
) -> list[LeveledModel]:
    """``models`` as leveled models: plain modules adapted on ``input_shape``."""
    plain = [m for m in models if not isinstance(m, LeveledModel)]
    if not plain:
        return models
    classes = sorted({type(m).__name__ for m in models})
    if len(plain) != len(models) or len(classes) != 1:
        raise TypeError(f"LocalSites: models of several classes {classes}; give models of one")
    if input_shape is None:
        raise ValueError("LocalSites: no site data to take the plain models' input shape from")
    adapter = ModelAdapter.of(plain[0], input_shape)
    return [adapter.adapt(m) for m in plain]


def check_reply(
    reply: SiteStatistics, request: StatisticsRequest, model: LeveledModel, source: str
) -> None:
    """Raise ValueError naming ``source`` unless ``reply`` answers ``request`` with the shapes
    and values of the piece of the site's own ``model``."""
    if (reply.level, reply.piece) != (request.level, request.piece):
        raise ValueError(
            f"{source}: answered for level {reply.level} piece {reply.piece}, not "
            f"{request.level} piece {request.piece}"
        )
    level, piece = request.fused_level, request.linear_piece
    own_level = fold_norm_levels(model)[0].levels[request.level]
    own_pieces = linear_pieces(own_level)
    if own_pieces is None or len(own_pieces) <= request.piece:
        raise ValueError(f"{source}: its model has no piece {request.piece} here")
    reply.check(
        piece.fan_in(level),
        own_pieces[request.piece].width(own_level),
        source=source,
        stream_width=piece.width(level) if piece.stream is not None else None,
    )


def checked_replies(
    replies: Sequence[SiteStatistics | None],
    request: StatisticsRequest,
    models: Sequence[LeveledModel],
    active: Sequence[int],
    where: str,
) -> dict[int, SiteStatistics]:
    """The replies of the ``active`` sites that answered, by model index, each checked against
    its own model's piece (:func:`check_reply`; ValueError naming ``where`` and the site)."""
    statistics = {}
    for index in active:
        reply = replies[index]
        if reply is not None:
            check_reply(reply, request, models[index], f"{where}: site {index}")
            statistics[index] = reply
    return statistics


__all__ = [
    "LocalSites",
    "SiteChannel",
    "SiteScore",
    "SiteScoring",
    "check_reply",
    "checked_replies",
    "pooled_score",
]
