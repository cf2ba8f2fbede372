"""VGG-style CNN (VGG11 layout, width multiplier) for 28x28x1 and 32x32x3 inputs."""

from __future__ import annotations

from torch import nn

from fedfuse.models.leveled import LeveledModel
from fedfuse.models.spec import ModelSpec

#: VGG11 feature layout: conv widths, with "M" for 2x2 max-pooling.
VGG11_LAYOUT: tuple[int | str, ...] = (
    64,
    "M",
    128,
    "M",
    256,
    256,
    "M",
    512,
    512,
    "M",
    512,
    512,
    "M",
)


def vgg11_spec(
    input_shape: tuple[int, ...], num_classes: int, width_multiplier: float = 1.0
) -> ModelSpec:
    """Spec of a VGG11 whose conv widths are the standard ones times ``width_multiplier``."""
    widths = tuple(max(1, round(int(w) * width_multiplier)) for w in VGG11_LAYOUT if w != "M")
    return ModelSpec("vgg11", tuple(input_shape), num_classes, widths)


def build_vgg11(spec: ModelSpec) -> LeveledModel:
    """Levels: each 3x3 conv, each ReLU, each max-pool, then ``Flatten+Linear`` (logits).

    A pooling step is skipped once the feature map is smaller than 2x2, so 28x28 inputs get four
    poolings and 32x32 inputs five; the classifier sees ``width x s x s`` features.
    """
    if len(spec.input_shape) != 3:
        raise ValueError(f"vgg11 needs a (C, H, W) input shape, got {spec.input_shape}")
    conv_count = sum(1 for w in VGG11_LAYOUT if w != "M")
    if len(spec.widths) != conv_count:
        raise ValueError(f"vgg11 has {conv_count} conv widths, spec gives {len(spec.widths)}")
    channels, height, width = spec.input_shape
    widths = iter(spec.widths)
    levels: list[nn.Module] = []
    for item in VGG11_LAYOUT:
        if item == "M":
            if min(height, width) >= 2:
                levels.append(nn.MaxPool2d(kernel_size=2, stride=2))
                height, width = height // 2, width // 2
            continue
        out_channels = next(widths)
        levels.append(nn.Conv2d(channels, out_channels, kernel_size=3, padding=1))
        levels.append(nn.ReLU())
        channels = out_channels
    levels.append(
        nn.Sequential(nn.Flatten(), nn.Linear(channels * height * width, spec.num_classes))
    )
    return LeveledModel(levels, spec)
