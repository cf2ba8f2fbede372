"""LeNet-5 (LeCun et al., 1998) with ReLUs and max-pooling, optionally without biases.

Levels: ``conv 5x5 (6)``, ReLU, max-pool 2, ``conv 5x5 (16)``, ReLU, max-pool 2,
``Flatten+Linear (120)``, ReLU, ``Linear (84)``, ReLU, ``Linear`` (logits): two convolutional
and three linear neuron levels, each affine, so every fusion method sees them.

LeNet-5 reads 32x32 images; as LeCun et al. did for MNIST, 28x28 inputs are padded by 2 on the
first convolution (the default ``padding`` for inputs smaller than 32 pixels), so the feature
maps keep the classic sizes 28, 14, 10 and 5 and the first linear level reads ``16 x 5 x 5``.
"""

from __future__ import annotations

from torch import nn

from fedfuse.models.leveled import LeveledModel
from fedfuse.models.spec import ModelSpec

#: the classic widths: conv 6, conv 16, fc 120, fc 84
LENET5_WIDTHS = (6, 16, 120, 84)
KERNEL = 5


def lenet5_spec(
    input_shape: tuple[int, ...],
    num_classes: int,
    widths: tuple[int, ...] | list[int] = LENET5_WIDTHS,
    bias: bool = True,
    padding: int | None = None,
) -> ModelSpec:
    """Spec of a LeNet-5 of hidden ``widths`` (conv, conv, fc, fc); ``bias`` False builds every
    conv and linear layer without a bias; ``padding`` of the first conv defaults to 2 for inputs
    under 32 pixels (28x28 as 32x32) and 0 otherwise."""
    if len(input_shape) != 3:
        raise ValueError(f"lenet5 needs a (C, H, W) input shape, got {tuple(input_shape)}")
    if not isinstance(bias, bool):
        raise ValueError(f"lenet5: bias must be true or false, got {bias!r}")
    if padding is None:
        padding = 2 if min(input_shape[1:]) < 32 else 0
    options = {"bias": bias, "padding": int(padding)}
    widths = tuple(int(w) for w in widths)
    spec = ModelSpec("lenet5", tuple(input_shape), num_classes, widths, options)
    _feature_size(spec)  # the input is large enough
    return spec


def build_lenet5(spec: ModelSpec) -> LeveledModel:
    """The levels of the module docstring, from ``spec`` (options ``bias`` and ``padding``)."""
    bias, padding = spec.options.get("bias", True), spec.options.get("padding", 0)
    if not isinstance(bias, bool) or not isinstance(padding, int) or not 0 <= padding <= 64:
        raise ValueError(
            f"lenet5 spec options need bias true/false and padding 0..64, got {spec.options}"
        )
    if len(spec.widths) != len(LENET5_WIDTHS):
        raise ValueError(
            f"lenet5 has {len(LENET5_WIDTHS)} hidden widths (conv, conv, fc, fc), spec gives "
            f"{len(spec.widths)}"
        )
    conv1, conv2, fc1, fc2 = spec.widths
    channels, side = _feature_size(spec)
    levels: list[nn.Module] = [
        nn.Conv2d(spec.input_shape[0], conv1, KERNEL, padding=padding, bias=bias),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(conv1, conv2, KERNEL, bias=bias),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Sequential(nn.Flatten(), nn.Linear(channels * side[0] * side[1], fc1, bias=bias)),
        nn.ReLU(),
        nn.Linear(fc1, fc2, bias=bias),
        nn.ReLU(),
        nn.Linear(fc2, spec.num_classes, bias=bias),
    ]
    return LeveledModel(levels, spec)


def _feature_size(spec: ModelSpec) -> tuple[int, tuple[int, int]]:
    """Channels and spatial size of the second pooling's output; a ValueError when the input
    is too small for two 5x5 convolutions and poolings."""
    if len(spec.input_shape) != 3:
        raise ValueError(f"lenet5 needs a (C, H, W) input shape, got {spec.input_shape}")
    padding = int(spec.options.get("padding", 0))
    sides = []
    for side in spec.input_shape[1:]:
        side = (side + 2 * padding - KERNEL + 1) // 2
        side = (side - KERNEL + 1) // 2
        sides.append(side)
    if min(sides) < 1:
        raise ValueError(
            f"lenet5: input {spec.input_shape} with padding {padding} is too small for two 5x5 "
            "convolutions and 2x2 poolings"
        )
    return spec.widths[1], (sides[0], sides[1])
