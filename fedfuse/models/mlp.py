"""Multi-layer perceptron with one level per affine layer and one per activation."""

from __future__ import annotations

import math

from torch import nn

from fedfuse.models.leveled import LeveledModel
from fedfuse.models.spec import ModelSpec


def mlp_spec(
    input_shape: tuple[int, ...],
    num_classes: int,
    widths: tuple[int, ...] = (512, 512, 512),
    bias: bool = True,
) -> ModelSpec:
    """Spec of an MLP ``prod(input_shape) -> widths... -> num_classes`` with ReLUs; ``bias``
    False builds every Linear without a bias (the spec's option ``bias``, absent when True)."""
    if not isinstance(bias, bool):
        raise ValueError(f"mlp: bias must be true or false, got {bias!r}")
    options = {} if bias else {"bias": False}
    return ModelSpec("mlp", tuple(input_shape), num_classes, tuple(widths), options)


def build_mlp(spec: ModelSpec) -> LeveledModel:
    """Levels: ``Flatten+Linear``, ``ReLU``, ``Linear``, ``ReLU``, ..., ``Linear`` (logits)."""
    bias = spec.options.get("bias", True)
    if not isinstance(bias, bool):
        raise ValueError(f"mlp spec option bias must be true or false, got {bias!r}")
    levels: list[nn.Module] = []
    fan_in = math.prod(spec.input_shape)
    for index, width in enumerate(spec.widths):
        affine = nn.Linear(fan_in, width, bias=bias)
        levels.append(nn.Sequential(nn.Flatten(), affine) if index == 0 else affine)
        levels.append(nn.ReLU())
        fan_in = width
    head = nn.Linear(fan_in, spec.num_classes, bias=bias)
    levels.append(head if spec.widths else nn.Sequential(nn.Flatten(), head))
    return LeveledModel(levels, spec)
