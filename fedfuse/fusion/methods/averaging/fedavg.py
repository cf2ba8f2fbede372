"""Weight averaging: vanilla (uniform) averaging and FedAvg (weighted by sample counts).

Both average parameters coordinate by coordinate, so they only make sense for models whose
neurons already correspond (a shared initialisation, as in Flower's usual FedAvg); with
independently initialised clients they are the baseline the alignment methods must beat.

Every state-dict entry is averaged, BatchNorm running statistics included; integer buffers
(BatchNorm's ``num_batches_tracked``) get the rounded weighted average. Any architecture
(MLP, VGG, ResNet, ViT) works. With ``reset_batchnorm=True`` (off by default, so FedAvg stays
the plain reference) the fused model's BatchNorm running statistics are then recomputed on the
fusion set (:func:`~fedfuse.fusion.blocks.batchnorm.reset_batchnorm_statistics`), which the option
then requires; models without BatchNorm are unaffected.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fedfuse.fusion.base import FusionInputs, FusionMethod
from fedfuse.fusion.blocks.batchnorm import has_batchnorm, reset_batchnorm_statistics
from fedfuse.fusion.inputs import sample_counts
from fedfuse.fusion.registry import register_fusion_method
from fedfuse.models import LeveledModel, ModelSpec, build_model
from fedfuse.training.averaging import WeightedAverage


def average_state_dicts(
    models: Sequence[torch.nn.Module], weights: Sequence[float] | None = None
) -> dict[str, torch.Tensor]:
    """``sum_k w_k * theta_k`` over the models' state dicts, with ``w`` normalised to sum to 1
    first (:class:`~fedfuse.training.averaging.WeightedAverage` with shares, one model at a time:
    models may be a lazy sequence of a thousand sites)."""
    w = (
        torch.ones(len(models), dtype=torch.float64)
        if weights is None
        else torch.as_tensor(weights, dtype=torch.float64)
    )
    if w.shape != (len(models),) or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"averaging weights must be {len(models)} non-negative numbers, got {w}")
    w = w / w.sum()
    average = WeightedAverage(fractions=True)
    for weight, model in zip(w.tolist(), models, strict=True):
        average.add(model.state_dict(), weight)
    return average.result()


class _Averaging(FusionMethod):
    """Shared options: the optional BatchNorm statistics reset on the fusion set."""

    def __init__(
        self, reset_batchnorm: bool = False, device: str = "auto", batch_size: int = 256
    ) -> None:
        self.reset_batchnorm = reset_batchnorm
        self.device = device
        self.batch_size = batch_size

    def requirements(self) -> frozenset[str]:
        return self.requires | ({"data"} if self.reset_batchnorm else set())

    def _average(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec, weights
    ) -> tuple[LeveledModel, dict[str, Any]]:
        fused = build_model(target, seed=0)  # weights are overwritten; keep the global RNG
        fused.load_state_dict(average_state_dicts(models, weights))
        total = sum(weights)
        details: dict[str, Any] = {"weights": [w / total for w in weights]}
        if self.reset_batchnorm and has_batchnorm(fused):
            assert inputs.data is not None
            reset_batchnorm_statistics(fused, inputs.data, self.batch_size, self.device)
            details["reset_batchnorm"] = True
        return fused, details


@register_fusion_method
class VanillaAveraging(_Averaging):
    """Uniform average of the models' parameters and buffers.

    Args:
        reset_batchnorm: recompute BatchNorm running statistics on the fusion set (needs it).
        device: where the BatchNorm statistics are recomputed.
        batch_size: samples per forward pass of that reset.
    """

    name = "vanilla"

    def _fuse(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec
    ) -> tuple[LeveledModel, dict[str, Any]]:
        return self._average(models, inputs, target, [1.0] * len(models))


@register_fusion_method
class FedAvg(_Averaging):
    """Average weighted by each client's number of training samples (McMahan et al., 2017).

    Args: as :class:`VanillaAveraging`; ``reset_batchnorm`` is off by default so that FedAvg
    stays the plain reference.
    """

    name = "fedavg"
    requires = frozenset({"sample_counts"})

    def _fuse(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec
    ) -> tuple[LeveledModel, dict[str, Any]]:
        counts = sample_counts(self.name, inputs, len(models))
        return self._average(models, inputs, target, [float(c) for c in counts])
