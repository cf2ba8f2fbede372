"""The cost of a fitted level (paper Theorem 1), and the fusion-set chunks it is summed over.

Both fits report the representation cost of the fused level on the fusion set, split into its
approximation and grouping errors; the base models' outputs are concatenated chunk by chunk so
that wide levels of many models stay within memory.
"""

from __future__ import annotations

import torch
from torch import nn

from fedfuse.fusion.blocks.costs import representation_cost
from fedfuse.models.affine import output_rows


def row_chunk(columns: int, samples: int, batch_size_capture: int) -> int:
    """Fusion-set samples per chunk when all models' outputs are concatenated: at most
    ``batch_size_capture``, and few enough that a float64 chunk of ``columns`` base neurons
    stays near 128 MB (a thousand 512-wide models need chunks of 32 samples)."""
    return max(1, min(batch_size_capture, samples, (1 << 24) // max(columns, 1)))


@torch.no_grad()
def level_cost(
    level: nn.Module,
    x: torch.Tensor,
    outputs: list[torch.Tensor],
    labels: torch.Tensor,
    weights: torch.Tensor,
    batch_size_capture: int,
) -> dict[str, float]:
    """Theorem 1 terms of the fitted level on the fusion set (per row)."""
    chunk = row_chunk(sum(o.shape[1] for o in outputs), len(x), batch_size_capture)
    starts = range(0, len(x), chunk)
    cost = representation_cost(
        (output_rows(level(x[s : s + chunk])) for s in starts),
        (torch.cat([output_rows(o[s : s + chunk]) for o in outputs], 1) for s in starts),
        labels,
        weights,
    )
    return {
        "representation_cost": cost.total,
        "approximation_error": cost.approximation,
        "grouping_error": cost.grouping,
    }
