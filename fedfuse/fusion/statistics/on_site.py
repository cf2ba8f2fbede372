r"""What a site runs in a statistics round: :func:`site_statistics` on its own data.

The round's messages (:class:`~fedfuse.fusion.statistics.rounds.StatisticsRequest` in,
:class:`~fedfuse.fusion.statistics.rounds.SiteStatistics` out) and what they mean are in
:mod:`fedfuse.fusion.statistics.rounds`; here is how a site computes its reply: the fused prefix
and its own model run on its training data batch by batch, the design rows chunked so that
unfolded convolution patches stay within memory, the products summed in float64, clipped and
noised when the request carries a privacy mechanism, and the Gram compressed when asked. The
Flower ClientApp and :class:`~fedfuse.fusion.statistics.channels.LocalSites` call the same
function.
"""

from __future__ import annotations

import copy
import time

import torch

from fedfuse.fusion.blocks.graph_pieces import fold_norm_levels
from fedfuse.fusion.blocks.least_squares import ridge_fit, symmetric_eigh
from fedfuse.fusion.blocks.pieces import linear_pieces
from fedfuse.fusion.statistics.privacy import GaussianStatistics, clip_samples, noisy_moments
from fedfuse.fusion.statistics.rounds import STATISTICS_DTYPES, SiteStatistics, StatisticsRequest
from fedfuse.models import LeveledModel
from fedfuse.runtime import resolve_device

#: design rows multiplied at once (bounds the memory of unfolded convolution patches)
_ROW_BUDGET = 1 << 24


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

    What the Flower ClientApp runs in each statistics round, and
    :class:`~fedfuse.fusion.statistics.channels.LocalSites` in-process.

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
    # both models as the rounds index their levels (a user's BatchNorm joined to its layer)
    fused, own = (fold_norm_levels(_on(m, run_on))[0] for m in (request.fused, model))
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
    of the other eigenvalues (see :class:`~fedfuse.fusion.statistics.rounds.SiteStatistics`);
    trace and top spectrum are kept."""
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


__all__ = ["compress_gram", "site_statistics"]
