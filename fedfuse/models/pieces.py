"""The linear pieces of a level: what a closed-form fit solves for, one least-squares problem each.

An affine level (parameter-free ops then one Linear/Conv2d) is one piece. A ResNet stem is one
(its conv with the BatchNorm after it folded in, eval mode), a BasicBlock two: ``conv1`` onto the
block's inner channels, then ``conv2`` (jointly with a projection shortcut's conv) onto its
output channels, the identity shortcut's input subtracted from the targets
(:mod:`fedfuse.fusion.neuron_interpolation.blocks` derives this). Each piece builds its design
rows from the fused level's input (the pieces before it already fitted), its targets (the
pre-activations it should reproduce) from any model's level and that level's input, and loads
fitted weights ``W`` (``fan_in x width``, the bias last). The fusion-set fits and the sites'
statistics rounds share these definitions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fedfuse.models.affine import AffineLevel, affine_view, output_rows
from fedfuse.models.resnet import BasicBlock, Stem

Rows = Callable[[nn.Module, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LinearPiece:
    """One linear map of a level, fitted in closed form.

    Attributes:
        name: the piece's name in fit details (``"conv1"``, ``"conv2+shortcut"``, ...).
        design: ``(level, level input) -> rows``: the piece's inputs with a trailing 1.
        target: ``(level, level input) -> rows``: the piece's outputs on that level.
        stream: ``(level, level input) -> rows`` added to the piece's outputs (an identity
            shortcut), so the fit's targets are the centres minus it; None when nothing is.
        inner: its neurons are hidden inside the level (no importance scores: equal weights).
    """

    name: str
    design: Rows
    target: Rows
    fan_in: Callable[[nn.Module], int]
    width: Callable[[nn.Module], int]
    load: Callable[[nn.Module, torch.Tensor], None]
    stream: Rows | None = None
    inner: bool = False


def linear_pieces(level: nn.Module) -> list[LinearPiece] | None:
    """The pieces of ``level``, bottom-up; None for a level that is not affine, nor a ResNet
    stem or BasicBlock."""
    if isinstance(level, Stem):
        return [_conv_piece("conv", ("conv",), "bn", lambda m, x: m.bn(m.conv(x)))]
    if isinstance(level, BasicBlock):
        inner = _conv_piece("conv1", ("conv1",), "bn1", lambda m, x: m.bn1(m.conv1(x)), True)
        if level.identity_shortcut:
            output = _conv_piece("conv2", ("conv2",), "bn2", pre_output, stream=_stream)
        else:
            output = _conv_piece("conv2+shortcut", ("conv2", "shortcut.0"), "bn2", pre_output)
        return [inner, output]
    if affine_view(level) is None:
        return None
    return [
        LinearPiece(
            "affine",
            design=lambda m, x: _affine(m).design(x),
            target=lambda m, x: output_rows(m(x)),
            fan_in=lambda m: _affine(m).fan_in,
            width=lambda m: _affine(m).layer.weight.shape[0],
            load=lambda m, w: _affine(m).set_weights(w),
        )
    ]


def pre_output(block: BasicBlock, x: torch.Tensor) -> torch.Tensor:
    """A block's pre-activation output ``BN_2(conv_2(h)) + s(x)`` (before its last ReLU)."""
    h = block.relu1(block.bn1(block.conv1(x)))
    return block.bn2(block.conv2(h)) + block.shortcut(x)


def set_batchnorm(norm: nn.BatchNorm2d, bias: torch.Tensor) -> None:
    """``norm`` as the map ``y + bias`` in eval mode (mean 0, variance ``1 - eps``, scale 1)."""
    with torch.no_grad():
        norm.running_mean.zero_()
        norm.running_var.fill_(1.0 - norm.eps)
        norm.weight.fill_(1.0)
        norm.bias.copy_(bias.to(norm.bias.dtype))


def _stream(_level: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An identity shortcut's contribution: the level input itself, as rows."""
    return output_rows(x)


def _affine(level: nn.Module) -> AffineLevel:
    view = affine_view(level)
    assert view is not None
    return view


def _conv_piece(
    name: str,
    convs: tuple[str, ...],
    norm: str,
    target: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    inner: bool = False,
    stream: Rows | None = None,
) -> LinearPiece:
    """Convs whose outputs add up, then BatchNorm ``norm`` (the bias); the first conv reads
    the block's ``h`` when it is ``conv2``, the others the level input."""

    def modules(level: nn.Module) -> list[nn.Conv2d]:
        found = dict(level.named_modules())
        return [found[c] for c in convs]

    def design(level: nn.Module, x: torch.Tensor) -> torch.Tensor:
        parts = []
        for conv_name, conv in zip(convs, modules(level), strict=True):
            inputs = level.relu1(level.bn1(level.conv1(x))) if conv_name == "conv2" else x
            parts.append(AffineLevel([], conv).design(inputs)[:, :-1])
        rows = torch.cat(parts, 1)
        return torch.cat([rows, rows.new_ones(len(rows), 1)], 1)

    def load(level: nn.Module, w: torch.Tensor) -> None:
        start = 0
        with torch.no_grad():
            for conv in modules(level):
                size = conv.weight[0].numel()
                conv.weight.copy_(w[start : start + size].T.reshape(conv.weight.shape))
                start += size
        set_batchnorm(getattr(level, norm), w[-1])
        if "shortcut.0" in convs:
            shortcut_norm = level.shortcut[1]
            set_batchnorm(shortcut_norm, torch.zeros(shortcut_norm.num_features))

    return LinearPiece(
        name,
        design=design,
        target=lambda m, x: output_rows(target(m, x)),
        fan_in=lambda m: sum(c.weight[0].numel() for c in modules(m)) + 1,
        width=lambda m: modules(m)[0].out_channels,
        load=load,
        stream=stream,
        inner=inner,
    )


__all__ = ["LinearPiece", "linear_pieces", "pre_output", "set_batchnorm"]
