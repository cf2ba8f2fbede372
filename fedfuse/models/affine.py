"""Affine levels as linear maps of their weights: ``outputs = design(inputs) @ W``.

A level is *affine* when it is parameter-free operations (e.g. ``Flatten``) followed by one
``nn.Linear`` or ``nn.Conv2d``. Its outputs are then linear in the weights: each output row
(a sample, or a sample at one spatial position) is the row of the *design matrix* (the input,
or its unfolded patch, with a trailing 1 for the bias) times ``W`` of shape ``(fan_in, out)``,
``fan_in`` counting the bias row.
That is what makes the closed-form (Linear) fusion variants possible.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class AffineLevel:
    """The parameter-free prefix and the one affine layer of a level."""

    prefix: list[nn.Module]
    layer: nn.Linear | nn.Conv2d

    @property
    def fan_in(self) -> int:
        """Rows of ``W``: the inputs of one output neuron plus one for the bias."""
        weight = self.layer.weight
        return weight[0].numel() + 1

    def weights(self) -> torch.Tensor:
        """The layer's parameters as ``W`` of shape ``(fan_in, out)``, the bias as the last row."""
        weight = self.layer.weight.detach().flatten(1)
        bias = self.layer.bias
        bias = bias.detach() if bias is not None else torch.zeros(len(weight), device=weight.device)
        return torch.cat([weight, bias[:, None]], 1).T

    @torch.no_grad()
    def set_weights(self, w: torch.Tensor) -> None:
        """Load ``W`` of shape ``(fan_in, out)`` (bias last) into the layer."""
        weight = self.layer.weight
        if w.shape != (self.fan_in, weight.shape[0]):
            raise ValueError(
                f"weights of shape {tuple(w.shape)} do not fit {self.layer}, "
                f"which needs ({self.fan_in}, {weight.shape[0]})"
            )
        weight.copy_(w[:-1].T.reshape(weight.shape).to(weight.dtype))
        if self.layer.bias is not None:
            self.layer.bias.copy_(w[-1].to(weight.dtype))

    def layer_inputs(self, inputs: torch.Tensor) -> torch.Tensor:
        for module in self.prefix:
            inputs = module(inputs)
        return inputs

    def design(self, inputs: torch.Tensor) -> torch.Tensor:
        """Design rows ``(N, fan_in)`` for a batch of level inputs (a trailing 1 for the bias)."""
        x = self.layer_inputs(inputs)
        if isinstance(self.layer, nn.Linear):
            rows = x.reshape(len(x), -1)
        else:
            rows = _patches(x, self.layer)
        return torch.cat([rows, rows.new_ones(len(rows), 1)], 1)

    def design_batches(self, inputs: torch.Tensor, batch_size: int) -> Iterator[torch.Tensor]:
        """Design rows in chunks of ``batch_size`` samples (bounded memory for convolutions)."""
        for start in range(0, len(inputs), batch_size):
            yield self.design(inputs[start : start + batch_size])


def affine_view(level: nn.Module) -> AffineLevel | None:
    """The :class:`AffineLevel` view of ``level``, or None if it is not an affine level."""
    modules = list(level) if isinstance(level, nn.Sequential) else [level]
    *prefix, last = modules
    if any(any(True for _ in m.parameters()) for m in prefix):
        return None
    if isinstance(last, nn.Linear):
        return AffineLevel(prefix, last)
    if (
        isinstance(last, nn.Conv2d)
        and last.groups == 1
        and last.padding_mode == "zeros"
        and isinstance(last.padding, tuple)
    ):
        return AffineLevel(prefix, last)
    return None


def output_rows(outputs: torch.Tensor) -> torch.Tensor:
    """Level outputs as rows ``(N, channels)``: one row per sample (and spatial position)."""
    if outputs.dim() == 2:
        return outputs
    return outputs.movedim(1, -1).reshape(-1, outputs.shape[1])


def _patches(x: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    """The conv's input patches as rows ``(B*H_out*W_out, C*kh*kw)``, columns in weight order.

    A strided view of the padded input copied once; ``F.unfold`` gives the same rows but is
    about ten times slower on the CPU. Dilated convolutions fall back to it.
    """
    if conv.dilation != (1, 1):
        patches = F.unfold(
            x, conv.kernel_size, dilation=conv.dilation, padding=conv.padding, stride=conv.stride
        )
        return patches.transpose(1, 2).reshape(-1, patches.shape[1])
    (kh, kw), (sh, sw), (ph, pw) = conv.kernel_size, conv.stride, conv.padding
    padded = F.pad(x, (pw, pw, ph, ph)) if ph or pw else x
    windows = padded.unfold(2, kh, sh).unfold(3, kw, sw)  # (B, C, H_out, W_out, kh, kw)
    return windows.permute(0, 2, 3, 1, 4, 5).reshape(-1, x.shape[1] * kh * kw)
