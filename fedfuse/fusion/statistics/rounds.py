r"""What a site computes on its own data for one level of a fusion: sufficient statistics.

Methods that fit the fused model on the sites' data
(:mod:`fedfuse.fusion.methods.neuron_interpolation.sites`) build it bottom-up, one round per linear
piece of each neuron level (one for an affine level,
:func:`~fedfuse.fusion.blocks.pieces.linear_pieces`). In the round of level ``l`` the server sends
the fused model (its levels below ``l`` are final) in a :class:`StatisticsRequest`; each site runs
the fused prefix and its **own** model on its own training data and returns
(:func:`site_statistics`), with ``X`` the fused level's design rows (its inputs with a trailing 1
where the fused layer has a bias, unfolded for convolutions) and ``Z`` the site model's level-``l``
outputs on the same rows:

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

The server reaches the sites through a :class:`SiteChannel`: :class:`LocalSites` calls
:func:`site_statistics` in-process (the library, ``fedfuse compare``); the Flower strategy sends
one query message per site and round and the ClientApp calls the same function.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

import torch

from fedfuse.fusion.blocks.least_squares import ridge_fit, symmetric_eigh
from fedfuse.fusion.blocks.pieces import LinearPiece, linear_pieces
from fedfuse.fusion.statistics.privacy import GaussianStatistics, clip_samples, noisy_moments
from fedfuse.models import LeveledModel
from fedfuse.runtime import resolve_device

#: wire precision of the statistics (sums are accumulated in float64 either way)
STATISTICS_DTYPES = {"float64": torch.float64, "float32": torch.float32}
#: design rows multiplied at once (bounds the memory of unfolded convolution patches)
_ROW_BUDGET = 1 << 24


@dataclass(frozen=True)
class StatisticsRequest:
    """The server's request for one round: the statistics of neuron level ``level``.

    Attributes:
        level: index of the fused model's level to fit (a level with neurons).
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
        pieces = linear_pieces(self.fused.levels[self.level])
        if pieces is None:
            raise ValueError(
                f"level {self.fused.level_name(self.level)} of the fused model is neither affine "
                "(parameter-free ops then one Linear/Conv2d) nor a ResNet stem or BasicBlock; "
                "site statistics need its linear pieces"
            )
        if not 0 <= self.piece < len(pieces):
            raise ValueError(
                f"piece {self.piece} of level {self.fused.level_name(self.level)}, which has "
                f"{len(pieces)}"
            )

    @property
    def linear_piece(self) -> LinearPiece:
        """The piece of the fused level whose statistics are requested."""
        pieces = linear_pieces(self.fused.levels[self.level])
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


@torch.no_grad()
def site_statistics(
    model: LeveledModel,
    data: torch.Tensor,
    request: StatisticsRequest,
    *,
    batch_size: int = 256,
    device: str | torch.device = "auto",
    sample_weights: torch.Tensor | None = None,
) -> SiteStatistics:
    """A site's statistics of ``request.level``: its own model and the fused prefix on ``data``.

    What the Flower ClientApp runs in each statistics round, and :class:`LocalSites` in-process.

    Args:
        model: the site's own trained model (the fused model's architecture up to the level;
            widths may differ).
        data: the site's training inputs ``(N, ...)``, normalised like the training data.
        request: the server's request (the fused model and the level).
        batch_size: samples per forward pass (design rows are chunked further).
        device: where to compute (``"auto"``: CUDA when available).
        sample_weights: a weight ``>= 0`` per sample: its rows count this much in every sum
            (and in the rows reported). None: 1 each.
    """
    started = time.perf_counter()
    if len(data) == 0:
        raise ValueError("site statistics need at least one sample")
    index = request.level
    run_on = resolve_device(device)
    fused, own = (_on(m, run_on) for m in (request.fused, model))
    piece = request.linear_piece
    fused_level, own_level = fused.levels[index], own.levels[index]
    own_pieces = linear_pieces(own_level)
    if own_pieces is None or len(own_pieces) <= request.piece:
        raise ValueError(
            f"level {index} of the site's model ({type(own_level).__name__}) has no piece "
            f"{request.piece}; the architectures differ"
        )
    if sample_weights is not None:
        sample_weights = torch.as_tensor(sample_weights, dtype=torch.float32).flatten()
        if len(sample_weights) != len(data):
            raise ValueError(f"{len(sample_weights)} sample weights for {len(data)} samples")
        if not bool(torch.isfinite(sample_weights).all()) or bool((sample_weights < 0).any()):
            raise ValueError("sample weights must be finite and >= 0")
    if request.max_samples is not None and request.max_samples < len(data):
        generator = torch.Generator().manual_seed(request.seed)
        kept = torch.randperm(len(data), generator=generator)[: request.max_samples]
        data = data[kept]
        sample_weights = None if sample_weights is None else sample_weights[kept]
    fan_in, width = piece.fan_in(fused_level), own_pieces[request.piece].width(own_level)
    if request.site_reading is not None:
        if request.site_reading.shape[1:] != (width,):
            raise ValueError(
                f"level {index}: the reading has shape {tuple(request.site_reading.shape)}, "
                f"the site's model has {width} neurons here"
            )
        width = len(request.site_reading)
    stream_width = piece.width(fused_level) if piece.stream is not None else 0
    privacy = request.privacy
    if privacy is not None and stream_width:
        raise ValueError(
            f"level {index} piece {request.piece} adds to the residual stream; differential "
            "privacy covers affine levels and pieces without a stream only"
        )
    sums = _Sums(fan_in, width, stream_width, run_on)
    for start in range(0, len(data), batch_size):
        x = data[start : start + batch_size].to(run_on)
        fused_inputs = fused.forward_levels(x, 0, index)
        own_inputs = own.forward_levels(x, 0, index)
        positions = max(1, len(piece.target(own_level, own_inputs[:1])))
        step = max(1, _ROW_BUDGET // (positions * fan_in))
        for chunk in range(0, len(x), step):
            part = slice(chunk, chunk + step)
            design = piece.design(fused_level, fused_inputs[part]).float()
            z = piece.target(own_level, own_inputs[part]).float()
            if request.site_reading is not None:  # the fused neurons as this site reads them
                z = z @ request.site_reading.to(z).T
            if len(design) != len(z):
                raise ValueError(
                    f"level {index}: the fused level gives {len(design)} rows per batch, the "
                    f"site's model {len(z)}; the architectures differ"
                )
            stream = None
            if piece.stream is not None:
                stream = piece.stream(fused_level, fused_inputs[part]).float()
            if privacy is not None:  # every sample's rows within the clip, X and Z together
                if privacy.design_scale is not None:
                    design = design * privacy.design_scale.to(design)
                rows = torch.cat([design, z * privacy.target_scale], 1)
                joint = clip_samples(rows, len(x[part]), privacy.clip)
                design, z = joint[:, :fan_in], joint[:, fan_in:]
            mass = None
            if sample_weights is not None:  # a sample's rows scaled by the root of its weight
                w = sample_weights[start : start + batch_size][part].to(design)
                positions = len(design) // len(w)
                root = w.sqrt().repeat_interleave(positions)[:, None]
                design, z = design * root, z * root
                stream = None if stream is None else stream * root
                mass = float(w.sum()) * positions
            sums.add(design, z, stream, mass)
    if privacy is not None:
        sums.add_noise(privacy)
    fit = ridge_fit(sums.gram, sums.cross, sums.target_gram.diagonal(), sums.rows)
    wire = STATISTICS_DTYPES[request.dtype]
    sent, floor = sums.gram, 0.0
    if request.gram_rank is not None and request.gram_rank < fan_in:
        sent, floor = compress_gram(sums.gram, request.gram_rank)
    streams = {
        name: None if value is None else value.to(wire).cpu()
        for name, value in (
            ("stream_cross", sums.stream_cross),
            ("stream_target", sums.stream_target),
            ("stream_norms", sums.stream_norms),
        )
    }
    return SiteStatistics(
        level=index,
        rows=max(1, round(sums.rows)),
        gram=sent.to(wire).cpu(),
        gram_floor=floor,
        cross=sums.cross.to(wire).cpu(),
        target_gram=sums.target_gram.to(wire).cpu(),
        translation=fit.weights.to(wire).cpu(),
        translation_ridge=fit.ridge,
        seconds=time.perf_counter() - started,
        piece=request.piece,
        **streams,
    )


class _Sums:
    """The float64 sums over a site's design rows ``X``, targets ``Z`` and stream ``S``."""

    def __init__(self, fan_in: int, width: int, stream_width: int, device: torch.device) -> None:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.float64, device=device)

        self.rows: float = 0
        self.gram, self.cross = zeros(fan_in, fan_in), zeros(fan_in, width)
        self.target_gram = zeros(width, width)
        self.stream_cross = zeros(fan_in, stream_width) if stream_width else None
        self.stream_target = zeros(width, stream_width) if stream_width else None
        self.stream_norms = zeros(stream_width) if stream_width else None

    def add(
        self,
        x: torch.Tensor,
        z: torch.Tensor,
        stream: torch.Tensor | None,
        mass: float | None = None,
    ) -> None:
        """Add rows ``x``, targets ``z`` and the stream; ``mass``: the rows' weight (their
        count unless given)."""
        self.rows += len(x) if mass is None else mass
        self.gram += (x.T @ x).double()
        self.cross += (x.T @ z).double()
        self.target_gram += (z.T @ z).double()
        if stream is not None:
            assert self.stream_cross is not None and self.stream_target is not None
            assert self.stream_norms is not None
            self.stream_cross += (x.T @ stream).double()
            self.stream_target += (z.T @ stream).double()
            self.stream_norms += (stream.double() ** 2).sum(0)

    def add_noise(self, mechanism: GaussianStatistics) -> None:
        """Replace ``gram``, ``cross`` and ``target_gram`` by the blocks of their joint matrix
        with the mechanism's noise, projected to be positive semi-definite."""
        fan_in = len(self.gram)
        joint = torch.cat(
            [
                torch.cat([self.gram, self.cross], 1),
                torch.cat([self.cross.T, self.target_gram], 1),
            ]
        )
        noisy = noisy_moments(joint, mechanism, design=fan_in)
        scale = mechanism.target_scale  # back to the design's and the targets' own units
        columns = torch.ones(fan_in, dtype=torch.float64, device=noisy.device)
        if mechanism.design_scale is not None:
            columns = mechanism.design_scale.to(noisy)
        self.gram = noisy[:fan_in, :fan_in] / (columns[:, None] * columns[None])
        self.cross = noisy[:fan_in, fan_in:] / (columns[:, None] * scale)
        self.target_gram = noisy[fan_in:, fan_in:] / scale**2


def compress_gram(gram: torch.Tensor, rank: int) -> tuple[torch.Tensor, float]:
    """``(F, floor)``: the factor ``V_r sqrt(E_r)`` of the top ``rank`` eigenpairs and the mean
    of the other eigenvalues (see :class:`SiteStatistics`); trace and top spectrum are kept."""
    eigenvalues, vectors = symmetric_eigh(gram)
    top = eigenvalues[-rank:]
    rest = eigenvalues[:-rank]
    floor = float(rest.mean()) if len(rest) else 0.0
    return vectors[:, -rank:] * top.sqrt(), floor


def _on(model: LeveledModel, device: torch.device) -> LeveledModel:
    """``model`` in eval mode on ``device``: itself when it is there already, else a copy (the
    caller's model is never moved or switched to eval mode)."""
    if next(model.parameters()).device == device and not model.training:
        return model
    return copy.deepcopy(model).to(device).eval()


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


class LocalSites:
    """The sites in-process: each base model with its own training inputs (and, optionally,
    a weight per input: :func:`site_statistics`' ``sample_weights``; a site whose weights sum
    to 0 does not answer).

    The library's :class:`SiteChannel` (``fedfuse compare``, tests, notebooks): every request is
    answered by :func:`site_statistics` on each site's data, one site after the other.
    """

    def __init__(
        self,
        models: Sequence[LeveledModel],
        data: Sequence[torch.Tensor],
        *,
        batch_size: int = 256,
        device: str | torch.device = "auto",
        sample_weights: Sequence[torch.Tensor] | None = None,
    ) -> None:
        if len(models) != len(data):
            raise ValueError(f"LocalSites: {len(models)} models but {len(data)} datasets")
        if sample_weights is not None and len(sample_weights) != len(data):
            raise ValueError(
                f"LocalSites: {len(sample_weights)} weight vectors for {len(data)} datasets"
            )
        self.sample_weights = None if sample_weights is None else list(sample_weights)
        self.models = list(models)
        self.data = list(data)
        self.batch_size = batch_size
        self.device = device
        self._problems: list[str] = []

    def __len__(self) -> int:
        return len(self.models)

    @property
    def problems(self) -> list[str]:
        return self._problems

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
    level, piece = request.fused.levels[request.level], request.linear_piece
    own_level = model.levels[request.level]
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
    "STATISTICS_DTYPES",
    "SiteChannel",
    "SiteStatistics",
    "StatisticsRequest",
    "pooled",
    "compress_gram",
    "site_statistics",
    "statistics_round_bytes",
    "check_reply",
    "checked_replies",
    "without_intercept",
]
