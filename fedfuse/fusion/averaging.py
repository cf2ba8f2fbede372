"""Weight averaging: vanilla (uniform) averaging and FedAvg (weighted by sample counts).

Both average parameters coordinate by coordinate, so they only make sense for models whose
neurons already correspond (a shared initialisation, as in Flower's usual FedAvg); with
independently initialised clients they are the baseline the alignment methods must beat.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..models import LeveledModel, ModelSpec, build_model
from .base import FusionInputs, FusionMethod, register_fusion_method
from .inputs import sample_counts


def average_state_dicts(
    models: Sequence[torch.nn.Module], weights: Sequence[float] | None = None
) -> dict[str, torch.Tensor]:
    """``sum_k w_k * theta_k`` over the models' state dicts, with ``w`` normalised to sum to 1."""
    w = (
        torch.ones(len(models), dtype=torch.float64)
        if weights is None
        else torch.as_tensor(weights, dtype=torch.float64)
    )
    if w.shape != (len(models),) or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"averaging weights must be {len(models)} non-negative numbers, got {w}")
    w = w / w.sum()
    # a running sum, one model at a time: models may be a lazy sequence of a thousand sites
    totals: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    for weight, model in zip(w.tolist(), models, strict=True):
        for name, tensor in model.state_dict().items():
            if name not in totals:
                totals[name] = torch.zeros(tensor.shape, dtype=torch.float64)
                dtypes[name] = tensor.dtype
            totals[name].add_(tensor.detach().cpu().double(), alpha=weight)
    return {name: total.to(dtypes[name]) for name, total in totals.items()}


@register_fusion_method
class VanillaAveraging(FusionMethod):
    """Uniform average of the models' parameters."""

    name = "vanilla"

    def _fuse(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec
    ) -> tuple[LeveledModel, dict[str, Any]]:
        fused = build_model(target, seed=0)  # weights are overwritten; keep the global RNG
        fused.load_state_dict(average_state_dicts(models))
        return fused, {"weights": [1 / len(models)] * len(models)}


@register_fusion_method
class FedAvg(FusionMethod):
    """Average weighted by each client's number of training samples (McMahan et al., 2017)."""

    name = "fedavg"
    requires = frozenset({"sample_counts"})

    def _fuse(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec
    ) -> tuple[LeveledModel, dict[str, Any]]:
        counts = sample_counts(self.name, inputs, len(models))
        fused = build_model(target, seed=0)  # weights are overwritten; keep the global RNG
        fused.load_state_dict(average_state_dicts(models, counts))
        return fused, {"weights": [c / sum(counts) for c in counts]}
