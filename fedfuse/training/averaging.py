"""Weight averaging, written once: a running weighted average of state dicts, in float64.

It serves FedAvg of the sites' fine-tuned models (one more Flower round after fusion) and
:func:`fedfuse.fusion.methods.averaging.fedavg.average_state_dicts` (vanilla averaging and FedAvg
fusion). Models are added one at a time, so the server holds one model and the running sum, however
many sites answer.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping

import torch
from torch import nn


class WeightedAverage:
    """A running weighted average of state dicts, summed in float64 (FedAvg of the sites'
    fine-tuned models; the weight averaging fusion methods).

    Every entry is averaged, BatchNorm running means and variances included; integer entries
    (BatchNorm's ``num_batches_tracked``) are rounded back. Models are added one at a time, so
    the server holds one model and the running sum, however many sites answer.

    Args:
        fractions: the weights are already each model's share of a whole that sums to 1,
            normalised by the caller (``average_state_dicts`` of the fusion methods): a share
            may be 0, and :meth:`result` returns the sum as it is. Otherwise the weights are
            positive and the sum is divided by their total.
    """

    def __init__(self, *, fractions: bool = False) -> None:
        self.fractions = fractions
        self._sums: dict[str, torch.Tensor] = {}
        self._dtypes: dict[str, torch.dtype] = {}
        self.total = 0.0
        self.count = 0

    def add(self, state: Mapping[str, torch.Tensor], weight: float) -> None:
        if self.fractions:
            if not weight >= 0 or not math.isfinite(weight):
                raise ValueError(f"averaging shares must be finite and >= 0, got {weight}")
        elif not weight > 0 or not math.isfinite(weight):
            raise ValueError(f"averaging weights must be positive and finite, got {weight}")
        if self._sums and set(state) != set(self._sums):
            raise ValueError(
                f"state dict keys differ from the first model's: "
                f"{sorted(set(state) ^ set(self._sums))[:5]}"
            )
        for name, tensor in state.items():
            value = tensor.detach().cpu().double()
            if name not in self._sums:
                self._sums[name] = torch.zeros_like(value)
                self._dtypes[name] = tensor.dtype
            elif value.shape != self._sums[name].shape:
                raise ValueError(
                    f"{name}: shape {tuple(value.shape)}, the first model's is "
                    f"{tuple(self._sums[name].shape)}"
                )
            self._sums[name].add_(value, alpha=weight)
        self.total += weight
        self.count += 1

    def result(self) -> dict[str, torch.Tensor]:
        """The weighted mean of the states added so far."""
        if not self.count:
            raise ValueError("no model was added to the average")
        out = {}
        for name, total in self._sums.items():
            mean = total if self.fractions else total / self.total
            dtype = self._dtypes[name]
            out[name] = (mean if dtype.is_floating_point else mean.round()).to(dtype)
        return out


def average_models(
    models: list[nn.Module], weights: list[float], *, like: nn.Module | None = None
) -> nn.Module:
    """A new model (a copy of ``like``, default ``models[0]``) holding the weighted average of
    the models' state dicts (:class:`WeightedAverage`)."""
    if not models or len(models) != len(weights):
        raise ValueError(f"average_models: {len(models)} models and {len(weights)} weights")
    average = WeightedAverage()
    for model, weight in zip(models, weights, strict=True):
        average.add(model.state_dict(), float(weight))
    merged = copy.deepcopy(like if like is not None else models[0])
    merged.load_state_dict(average.result())
    return merged.eval()


def state_bytes(model: nn.Module) -> int:
    """Bytes of a model's state dict (what a site uploads after fine-tuning it)."""
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())
