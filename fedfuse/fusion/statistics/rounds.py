r"""A statistics round's messages: what the server asks a site for and the statistics it returns.

Methods that fit the fused model on the sites' data
(:mod:`fedfuse.fusion.methods.neuron_interpolation.sites`) build it bottom-up, one round per linear
piece of each neuron level (one for an affine level,
:func:`~fedfuse.fusion.blocks.pieces.linear_pieces`). In the round of level ``l`` the server sends
the fused model (its levels below ``l`` are final) in a :class:`StatisticsRequest`; each site runs
the fused prefix and its **own** model on its own training data and returns
(:func:`~fedfuse.fusion.statistics.on_site.site_statistics`), with ``X`` the fused level's design
rows (its inputs with a trailing 1 where the fused layer has a bias, unfolded for convolutions) and
``Z`` the site model's level-``l`` outputs on the same rows:

* ``gram = X^T X`` (``fan_in x fan_in``): the fused inputs' second moments on the site;
* ``cross = X^T Z`` (``fan_in x width``): how the site's neurons relate to the fused inputs;
* ``target_gram = Z^T Z`` (``width x width``): the site neurons' second moments (for the
  residuals, hence the ridge choice);
* ``translation``: the site's own ridge fit of its neurons on the fused inputs,
  ``(gram + lambda I)^{-1} cross`` with ``lambda`` chosen by GCV on the site. It is a function
  of the three matrices above (nothing more is revealed) computed where the data is, so the
  server does one factorisation per level instead of one per site.

Sums over rows add up over sites: the statistics of a union of datasets are the sums of the
statistics of its parts (:func:`pooled`), which is what makes the server's least-squares fit
equal the fit on the pooled data. ``docs/privacy.md`` says what each statistic reveals.

Here are the messages (:class:`StatisticsRequest`, :class:`SiteStatistics`) and what the server
does with the replies (:func:`pooled`, :func:`without_intercept`). A site computes its reply in
:mod:`fedfuse.fusion.statistics.on_site`; the server reaches the sites through a channel
(:mod:`fedfuse.fusion.statistics.channels`): ``LocalSites`` in-process, or the Flower strategy,
one query message per site and round, whose ClientApp calls the same function.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import torch
from torch import nn

from fedfuse.fusion.blocks.graph_pieces import fold_norm_levels
from fedfuse.fusion.blocks.least_squares import ridge_fit
from fedfuse.fusion.blocks.pieces import LinearPiece, linear_pieces
from fedfuse.fusion.statistics.privacy import GaussianStatistics
from fedfuse.models import LeveledModel

#: wire precision of the statistics (sums are accumulated in float64 either way)
STATISTICS_DTYPES = {"float64": torch.float64, "float32": torch.float32}


@dataclass(frozen=True)
class StatisticsRequest:
    """The server's request for one round: the statistics of neuron level ``level``.

    Attributes:
        level: index of the level to fit (a level with neurons) in :attr:`view`, the fused model
            as its levels are fitted.
        piece: which of the level's linear pieces
        (:func:`~fedfuse.fusion.blocks.pieces.linear_pieces`):
            0 for an affine level; a ResNet block's ``conv1`` then ``conv2``.
        fused: the fused model; its levels below ``level`` are final.
        max_samples: use at most this many of the site's samples (a seeded subset; None: all).
        dtype: wire precision of the returned matrices (``"float32"`` or ``"float64"``).
        seed: seeds the subset.
        gram_rank: send ``gram`` compressed to its top ``gram_rank`` eigenpairs plus an
            isotropic remainder on levels wider than that (None: always in full).
        privacy: the Gaussian mechanism the site applies to its reply
            (:mod:`fedfuse.fusion.statistics.privacy`; None: exact statistics).
        readings: sum-only statistics (:mod:`fedfuse.fusion.statistics.readings`): per model index,
        the
            reading ``P`` (``fused width x width``) that maps the site's neurons onto the
            fused ones; each site is sent only its own (:meth:`for_site`) and returns the
            statistics of ``Z P^T`` instead of ``Z``, which add up over sites.
        site_reading: the site's own reading, as it receives it.
    """

    level: int
    fused: LeveledModel
    max_samples: int | None = None
    dtype: str = "float32"
    seed: int = 0
    gram_rank: int | None = None
    piece: int = 0
    privacy: GaussianStatistics | None = None
    readings: Mapping[int, torch.Tensor] | None = None
    site_reading: torch.Tensor | None = None

    def for_site(self, index: int) -> StatisticsRequest:
        """The request as the site of model ``index`` receives it: its own reading only."""
        if self.readings is None:
            return self
        return replace(self, readings=None, site_reading=self.readings[index])

    def __post_init__(self) -> None:
        if self.dtype not in STATISTICS_DTYPES:
            raise ValueError(f"statistics dtype must be one of {sorted(STATISTICS_DTYPES)}")
        if self.gram_rank is not None and self.gram_rank < 1:
            raise ValueError(f"gram_rank must be >= 1 or None, got {self.gram_rank}")
        if self.max_samples is not None and self.max_samples < 1:
            raise ValueError(f"max_samples must be >= 1 or None, got {self.max_samples}")
        if not 0 <= self.level < self.view.num_levels:
            raise ValueError(
                f"statistics request for level {self.level}; the model has {self.view.num_levels}"
            )
        pieces = linear_pieces(self.fused_level)
        if pieces is None:
            raise ValueError(
                f"level {self.view.level_name(self.level)} of the fused model is neither affine "
                "(parameter-free ops then one Linear/Conv2d) nor a ResNet stem or BasicBlock; "
                "site statistics need its linear pieces"
            )
        if not 0 <= self.piece < len(pieces):
            raise ValueError(
                f"piece {self.piece} of level {self.view.level_name(self.level)}, which has "
                f"{len(pieces)}"
            )

    @cached_property
    def view(self) -> LeveledModel:
        """The fused model as the rounds fit it, which :attr:`level` indexes: in a user's model,
        each BatchNorm level joined to the ``Linear``/``Conv2d`` level before it (one unit,
        :func:`~fedfuse.fusion.blocks.graph_pieces.fold_norm_levels`, sharing the modules);
        :attr:`fused` itself otherwise. Sites fold their own model the same way."""
        return fold_norm_levels(self.fused)[0]

    @property
    def fused_level(self) -> nn.Module:
        """The fused level whose statistics are requested."""
        return self.view.levels[self.level]

    @property
    def linear_piece(self) -> LinearPiece:
        """The piece of the fused level whose statistics are requested."""
        pieces = linear_pieces(self.fused_level)
        assert pieces is not None
        return pieces[self.piece]


@dataclass
class SiteStatistics:
    """One site's statistics of one level (see the module docstring).

    ``rows`` counts design rows (samples times output positions); ``translation_ridge`` is the
    relative ridge of ``translation``. For a piece whose outputs add to the level's input (an
    identity shortcut, rows ``S``), three more: ``stream_cross = X^T S``, ``stream_target =
    Z^T S`` and ``stream_norms``, the squared norms of ``S``'s columns. A compressed ``gram``
    is a factor ``F`` (``fan_in x r``, ``r < fan_in``) with
    ``gram ~ F F^T + gram_floor (I - P)``, ``P`` the projection onto ``F``'s columns: the top
    ``r`` eigenpairs exactly, the rest as their mean eigenvalue (:meth:`full_gram`).
    """

    level: int
    rows: int
    gram: torch.Tensor
    cross: torch.Tensor
    target_gram: torch.Tensor
    translation: torch.Tensor
    translation_ridge: float = 0.0
    gram_floor: float = 0.0
    seconds: float = field(default=0.0, compare=False)
    piece: int = 0
    stream_cross: torch.Tensor | None = None
    stream_target: torch.Tensor | None = None
    stream_norms: torch.Tensor | None = None

    TENSORS = ("gram", "cross", "target_gram", "translation")
    STREAM_TENSORS = ("stream_cross", "stream_target", "stream_norms")

    def tensors(self) -> dict[str, torch.Tensor]:
        """The matrices by name (what travels, in their wire precision)."""
        names = self.TENSORS + (self.STREAM_TENSORS if self.stream_cross is not None else ())
        return {name: getattr(self, name) for name in names}

    @classmethod
    def from_tensors(
        cls, tensors: Mapping[str, torch.Tensor], *, level: int, rows: int, **details: Any
    ) -> SiteStatistics:
        """The statistics whose :meth:`tensors` are ``tensors`` (other names ignored; the
        stream's where given), with the other fields from ``details``."""
        names = cls.TENSORS + tuple(name for name in cls.STREAM_TENSORS if name in tensors)
        return cls(level=level, rows=rows, **{name: tensors[name] for name in names}, **details)

    @property
    def compressed(self) -> bool:
        return self.gram.dim() == 2 and self.gram.shape[0] != self.gram.shape[1]

    def full_gram(self) -> torch.Tensor:
        """``X^T X`` in float64 (reconstructed from the factor when compressed)."""
        gram = self.gram.double()
        if not self.compressed:
            return gram
        norms = gram.norm(dim=0).clamp_min(1e-300)
        basis = gram / norms
        full = gram @ gram.T - self.gram_floor * (basis @ basis.T)
        full.diagonal().add_(self.gram_floor)
        return full

    def payload_bytes(self) -> int:
        """Bytes of the matrices as uploaded."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def check(
        self, fan_in: int, width: int, *, source: str, stream_width: int | None = None
    ) -> None:
        """Raise ValueError naming ``source`` and the tensor unless shapes and values fit;
        ``stream_width``: the fused level's width when the piece adds to its input."""
        rank = self.gram.shape[1] if self.gram.dim() == 2 and self.compressed else fan_in
        expected = {
            "gram": (fan_in, rank if rank < fan_in else fan_in),
            "cross": (fan_in, width),
            "target_gram": (width, width),
            "translation": (fan_in, width),
        }
        if stream_width is not None:
            expected.update(
                stream_cross=(fan_in, stream_width),
                stream_target=(width, stream_width),
                stream_norms=(stream_width,),
            )
        for name, shape in expected.items():
            tensor = getattr(self, name)
            if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                raise ValueError(f"{source}: statistic {name!r} is not a float tensor")
            if tuple(tensor.shape) != shape:
                raise ValueError(
                    f"{source}: statistic {name!r} of level {self.level} piece {self.piece} has "
                    "shape "
                    f"{tuple(tensor.shape)}, expected {shape}"
                )
            if not bool(torch.isfinite(tensor).all()):
                raise ValueError(f"{source}: statistic {name!r} has NaN/Inf values")
        if not (isinstance(self.rows, int) and self.rows > 0):
            raise ValueError(f"{source}: statistics of level {self.level} count {self.rows} rows")
        if not math.isfinite(self.gram_floor) or self.gram_floor < 0:
            raise ValueError(f"{source}: gram floor {self.gram_floor} is invalid")
        if not math.isfinite(self.translation_ridge) or self.translation_ridge < 0:
            raise ValueError(f"{source}: translation ridge {self.translation_ridge} is invalid")


def pooled(statistics: Sequence[SiteStatistics]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(sum gram, sum target_gram, sum rows)`` over sites whose models share one width: the
    statistics of the pooled data (``cross`` sums too, but each site's relates its own model)."""
    gram = sum(s.full_gram() for s in statistics)
    target = sum(s.target_gram.double() for s in statistics)
    return gram, target, sum(s.rows for s in statistics)  # type: ignore[return-value]


def without_intercept(statistics: SiteStatistics) -> SiteStatistics:
    """The statistics of the same rows without the design's last column (its 1: an affine
    level fitted without intercept although its layer has a bias): the Gram's leading block
    (in full, reconstructed when compressed), ``cross`` and ``stream_cross`` without their last
    row, and the translation refitted on them as the site fits it (GCV), so the grouping reads
    the neurons through the design the server fits."""
    gram = statistics.full_gram()[:-1, :-1]
    cross = statistics.cross.double()[:-1]
    targets = statistics.target_gram.double().diagonal()
    fit = ridge_fit(gram, cross, targets, statistics.rows)
    wire = statistics.cross.dtype
    stream_cross = statistics.stream_cross
    return replace(
        statistics,
        gram=gram.to(wire),
        gram_floor=0.0,
        cross=cross.to(wire),
        translation=fit.weights.to(wire),
        translation_ridge=fit.ridge,
        stream_cross=None if stream_cross is None else stream_cross[:-1],
    )


def statistics_round_bytes(details: dict, num_sites: int) -> list[list[int]]:
    """Bytes each site uploaded in each statistics round (``[round][site]``, 0 where it sent
    nothing), from a fusion result's details (empty for methods without such rounds)."""
    rounds = details.get("rounds", []) if isinstance(details, dict) else []
    return [
        [int(r.get("upload_bytes", {}).get(str(site), 0)) for site in range(num_sites)]
        for r in rounds
    ]


__all__ = [
    "STATISTICS_DTYPES",
    "SiteStatistics",
    "StatisticsRequest",
    "pooled",
    "statistics_round_bytes",
    "without_intercept",
]
