"""Fixed units for sums over sites that pass through secure aggregation
(:mod:`fedfuse.fusion.statistics.summed_terms` says how they are chosen).

SecAgg+ adds integers: each site clips every value to ``[-clip, clip]`` and rounds it to one of
``Q`` levels. A :class:`FixedPoint` says in which units a site writes each term before that:
entry ``(i, j)`` of term ``name`` is divided by ``scales[name][0][i] * scales[name][1][j]``
(a 1-D term by its row scale alone), and the server multiplies the sum back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

#: SecAgg+'s modulus (Flower's default and largest): sums of the quantised values stay below it
MODULUS = 1 << 32

Scales = tuple[torch.Tensor | None, torch.Tensor | None]


def quantization_levels(num_sites: int) -> int:
    """The most levels ``Q`` that ``num_sites`` clipped values can add up in without wrapping
    around SecAgg+'s modulus (each quantised value is at most ``Q``), and that Flower's int32
    rounding holds."""
    if num_sites < 1:
        raise ValueError(f"secure sums need at least one site, got {num_sites}")
    return min(MODULUS // (num_sites + 1), (1 << 31) - 1)


@dataclass(frozen=True)
class FixedPoint:
    """The public units of one secure sum: per term, its row and column scales (None: 1), and
    the clipping range SecAgg+ applies to the scaled values."""

    scales: Mapping[str, Scales] = field(default_factory=dict)
    clip: float = 1.0

    def __post_init__(self) -> None:
        if not self.clip > 0:
            raise ValueError(f"the clipping range must be > 0, got {self.clip}")
        for name, pair in self.scales.items():
            for scale in pair:
                if scale is not None and not bool((scale > 0).all() & torch.isfinite(scale).all()):
                    raise ValueError(f"the scales of term {name!r} must be positive and finite")

    def units(self, name: str, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        """The unit of every entry of term ``name`` (float64)."""
        rows, columns = self.scales.get(name, (None, None))
        units = torch.ones(shape, dtype=torch.float64)
        if rows is not None:
            units = units * (rows.double() if len(shape) == 1 else rows.double()[:, None])
        if columns is not None:
            units = units * columns.double()[None, :]
        return units

    def encode(self, terms: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A site's terms in the fixed units (float64; SecAgg+ clips and quantises them)."""
        return {n: t.double().cpu() / self.units(n, t.shape) for n, t in terms.items()}

    def decode(self, terms: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Sums in the fixed units back in the terms' own (float64)."""
        return {n: t.double().cpu() * self.units(n, t.shape) for n, t in terms.items()}

    def resolution(self, name: str, shape: tuple[int, ...], num_sites: int) -> torch.Tensor:
        """The largest rounding error of a sum of ``num_sites`` values of term ``name``, in the
        term's own units: one quantisation step per site."""
        step = 2 * self.clip / quantization_levels(num_sites)
        return self.units(name, shape) * (step * num_sites)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The scales as named tensors (how they travel: ``<term>@rows``, ``<term>@columns``)."""
        named = {}
        for name, (rows, columns) in self.scales.items():
            if rows is not None:
                named[f"{name}@rows"] = rows
            if columns is not None:
                named[f"{name}@columns"] = columns
        return named

    @classmethod
    def from_tensors(cls, named: Mapping[str, torch.Tensor], clip: float) -> FixedPoint:
        """The inverse of :meth:`tensors` (ValueError on a name it did not write)."""
        scales: dict[str, list[torch.Tensor | None]] = {}
        for key, value in named.items():
            name, _, part = key.rpartition("@")
            if part not in ("rows", "columns") or not name:
                raise ValueError(f"unknown fixed-point scale {key!r}")
            scales.setdefault(name, [None, None])[part == "columns"] = value.double()
        return cls({name: (pair[0], pair[1]) for name, pair in scales.items()}, clip)


def norm_bound(norms: torch.Tensor, error: torch.Tensor | None = None) -> torch.Tensor:
    """An upper bound on the pooled column norms ``sqrt(sum_k ||a_ki||^2)`` from the sum of the
    sites' norms ``sum_k ||a_ki||`` (which is at least that), raised by its rounding ``error``,
    and kept above a tiny share of the largest (a column that is zero everywhere divides
    nothing by zero)."""
    upper = norms.double() + (error.double() if error is not None else 0)
    floor = max(float(upper.max()) * 1e-12, 1e-300) if upper.numel() else 1.0
    return upper.clamp_min(floor)


def coarse_norm_scale(
    energy: torch.Tensor, samples: int, floor_share: float = 1e-4
) -> torch.Tensor:
    """The units of a norms round: the column norms a site of ``samples`` samples would have
    with the per-sample mean squares ``energy`` (of the fusion set), each mean square at least
    ``floor_share`` of the median non-zero one (1 where every one is zero)."""
    energy = energy.double().clamp_min(0)
    positive = energy[energy > 0]
    floor = float(positive.median()) * floor_share if len(positive) else 1.0
    return (energy.clamp_min(floor) * samples).sqrt()


__all__ = [
    "FixedPoint",
    "MODULUS",
    "coarse_norm_scale",
    "norm_bound",
    "quantization_levels",
]
