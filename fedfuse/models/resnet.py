"""ResNet with BasicBlocks (He et al., 2016): 18/34-style depths, a width multiplier, two stems.

Levels: the stem (conv, BatchNorm, ReLU), one level per residual block (kept whole: both convs,
both BatchNorms, the shortcut and the ReLU after the sum), and the head (global average pool,
flatten, linear: an affine level, so closed-form fits and linear probes reach it). A block's
neurons are its output channels; its inner width (the channels between its two convs) equals
its output width, so changing a spec's widths changes both.

A block whose input and output widths and resolution agree has an identity shortcut: its output
channel ``j`` is ``F(x)_j + x_j``, so its neurons share the order of its input's neurons (the
residual stream). Otherwise the shortcut is a strided 1x1 conv with BatchNorm.
"""

from __future__ import annotations

import torch
from torch import nn

from fedfuse.models.leveled import LeveledModel
from fedfuse.models.spec import ModelSpec

#: blocks per stage of the standard depths
DEPTHS: dict[int, tuple[int, ...]] = {
    10: (1, 1, 1, 1),
    18: (2, 2, 2, 2),
    34: (3, 4, 6, 3),
}
STAGE_WIDTHS = (64, 128, 256, 512)
STEMS = ("cifar", "imagenet")


class Stem(nn.Module):
    """``cifar``: 3x3 conv, stride 1 (28x28 and 32x32 inputs keep their resolution);
    ``imagenet``: 7x7 conv, stride 2, then a 3x3 max-pool, stride 2."""

    def __init__(self, in_channels: int, width: int, kind: str = "cifar") -> None:
        super().__init__()
        if kind not in STEMS:
            raise ValueError(f"stem must be one of {STEMS}, got {kind!r}")
        big = kind == "imagenet"
        self.conv = nn.Conv2d(
            in_channels, width, 7 if big else 3, stride=2 if big else 1, padding=3 if big else 1,
            bias=False,
        )  # fmt: skip
        self.bn = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(3, stride=2, padding=1) if big else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.relu(self.bn(self.conv(x))))


class BasicBlock(nn.Module):
    """``relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))`` with 3x3 convs."""

    def __init__(self, in_channels: int, width: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != width:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, width, 1, stride=stride, bias=False), nn.BatchNorm2d(width)
            )
        self.relu2 = nn.ReLU()  # a distinct module: DeepLIFT attributes through each ReLU once

    @property
    def identity_shortcut(self) -> bool:
        return isinstance(self.shortcut, nn.Identity)

    @property
    def residual(self) -> bool:
        """Whether output channel ``j`` adds input channel ``j`` (see LeveledModel.is_residual)."""
        return self.identity_shortcut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x)))))
        return self.relu2(y + self.shortcut(x))


def resnet_head(width: int, num_classes: int) -> nn.Sequential:
    """Global average pooling, flatten, then the linear classifier (logits): an affine level."""
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes))


def resnet_spec(
    input_shape: tuple[int, ...],
    num_classes: int,
    depth: int = 18,
    width_multiplier: float = 1.0,
    stem: str | None = None,
    blocks: tuple[int, ...] | list[int] | None = None,
) -> ModelSpec:
    """Spec of a BasicBlock ResNet: ``depth`` 10/18/34 (or explicit ``blocks`` per stage), stage
    widths 64/128/256/512 times ``width_multiplier``; ``stem`` defaults to ``cifar`` for inputs
    up to 64 pixels and ``imagenet`` above."""
    if blocks is None:
        if depth not in DEPTHS:
            raise ValueError(f"resnet depth must be one of {sorted(DEPTHS)}, got {depth}")
        blocks = DEPTHS[depth]
    blocks = tuple(int(b) for b in blocks)
    if not blocks or any(b < 1 for b in blocks):
        raise ValueError(f"resnet needs at least one block per stage, got {blocks}")
    if len(input_shape) != 3:
        raise ValueError(f"resnet needs a (C, H, W) input shape, got {tuple(input_shape)}")
    stem = stem or ("cifar" if max(input_shape[1:]) <= 64 else "imagenet")
    if stem not in STEMS:
        raise ValueError(f"stem must be one of {STEMS}, got {stem!r}")
    stage_widths = [max(1, round(w * width_multiplier)) for w in STAGE_WIDTHS]
    stage_widths += [stage_widths[-1]] * (len(blocks) - len(stage_widths))
    widths = [stage_widths[0]]
    for stage, count in enumerate(blocks):
        widths += [stage_widths[stage]] * count
    options = {"blocks": list(blocks), "stem": stem}
    return ModelSpec("resnet", tuple(input_shape), num_classes, tuple(widths), options)


def build_resnet(spec: ModelSpec) -> LeveledModel:
    """Levels: ``Stem``, one ``BasicBlock`` per block (stride 2 at the start of every stage
    after the first), the pooling linear head."""
    try:
        blocks = [int(b) for b in spec.options["blocks"]]
        stem = str(spec.options["stem"])
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(
            f"resnet spec options need 'blocks' (ints per stage) and 'stem', got {spec.options}"
        ) from error
    if not blocks or min(blocks) < 1 or sum(blocks) > 1024:
        raise ValueError(f"resnet blocks per stage must be 1 to 1024 in all, got {blocks}")
    if len(spec.input_shape) != 3:
        raise ValueError(f"resnet needs a (C, H, W) input shape, got {spec.input_shape}")
    if len(spec.widths) != 1 + sum(blocks):
        raise ValueError(
            f"resnet with blocks {blocks} has {1 + sum(blocks)} widths (stem, then one per "
            f"block), spec gives {len(spec.widths)}"
        )
    levels: list[nn.Module] = [Stem(spec.input_shape[0], spec.widths[0], stem)]
    channels = spec.widths[0]
    widths = iter(spec.widths[1:])
    for stage, count in enumerate(blocks):
        for block in range(count):
            width = next(widths)
            stride = 2 if stage > 0 and block == 0 else 1
            levels.append(BasicBlock(channels, width, stride))
            channels = width
    levels.append(resnet_head(channels, spec.num_classes))
    return LeveledModel(levels, spec)
