"""Affine levels as linear maps of their weights: ``outputs = design(inputs) @ W``.

A level is *affine* when it is parameter-free operations (e.g. ``Flatten``) followed by one
``nn.Linear`` or ``nn.Conv2d``. Its outputs are then linear in the weights: each output row
(a sample, or a sample at one spatial position) is the row of the *design matrix* (the input,
or its unfolded patch, with a trailing 1 for the bias) times ``W`` of shape ``(fan_in, out)``,
``fan_in`` counting the bias row.
That is what makes the closed-form (Linear) fusion variants possible.

A view *without intercept* (``bias=False``) drops the trailing 1 and the bias row: the fit of a
layer without a bias is then a least-squares problem without intercept, not a fit with one
whose bias is dropped. :func:`fit_intercept` decides which a fit uses (a method's
``fit_bias`` option).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedfuse.models.packed_attention import attention_projections


@dataclass
class AffineLevel:
    """The parameter-free prefix and the one affine layer of a level.

    ``bias``: whether the design rows carry the trailing 1 and ``W`` the bias row (the
    default, whatever the layer: a bias-free layer reads as bias 0 and :meth:`set_weights`
    drops the row); False: no intercept, ``W`` is the weight alone and :meth:`set_weights`
    zeroes a bias the layer has.
    """

    prefix: list[nn.Module]
    layer: nn.Linear | nn.Conv2d
    bias: bool = True

    @property
    def fan_in(self) -> int:
        """Rows of ``W``: the inputs of one output neuron, plus one for the bias (if any)."""
        weight = self.layer.weight
        return weight[0].numel() + int(self.bias)

    def weights(self) -> torch.Tensor:
        """The layer's parameters as ``W`` of shape ``(fan_in, out)``, the bias as the last row."""
        weight = self.layer.weight.detach().flatten(1)
        if not self.bias:
            return weight.T
        bias = self.layer.bias
        bias = bias.detach() if bias is not None else torch.zeros(len(weight), device=weight.device)
        return torch.cat([weight, bias[:, None]], 1).T

    @torch.no_grad()
    def set_weights(self, w: torch.Tensor) -> None:
        """Load ``W`` of shape ``(fan_in, out)`` (bias last, if the view has one) into the layer."""
        weight = self.layer.weight
        if w.shape != (self.fan_in, weight.shape[0]):
            raise ValueError(
                f"weights of shape {tuple(w.shape)} do not fit {self.layer}, "
                f"which needs ({self.fan_in}, {weight.shape[0]})"
            )
        rows = w[:-1] if self.bias else w
        weight.copy_(rows.T.reshape(weight.shape).to(weight.dtype))
        if self.layer.bias is not None:
            if self.bias:
                self.layer.bias.copy_(w[-1].to(weight.dtype))
            else:
                self.layer.bias.zero_()

    def layer_inputs(self, inputs: torch.Tensor) -> torch.Tensor:
        for module in self.prefix:
            inputs = module(inputs)
        return inputs

    def design(self, inputs: torch.Tensor) -> torch.Tensor:
        """Design rows ``(N, fan_in)`` for a batch of level inputs (a trailing 1 for the bias,
        if the view has one)."""
        x = self.layer_inputs(inputs)
        if isinstance(self.layer, nn.Linear):
            rows = x.reshape(len(x), -1)
        else:
            rows = _patches(x, self.layer)
        if not self.bias:
            return rows
        return torch.cat([rows, rows.new_ones(len(rows), 1)], 1)

    def design_batches(self, inputs: torch.Tensor, batch_size: int) -> Iterator[torch.Tensor]:
        """Design rows in chunks of ``batch_size`` samples (bounded memory for convolutions)."""
        for start in range(0, len(inputs), batch_size):
            yield self.design(inputs[start : start + batch_size])


def channel_blocks(mix: torch.Tensor, per_channel: int) -> torch.Tensor:
    """``mix`` (``channels x channels'``, float64) spread over design columns: a design's
    columns are channel-major (``per_channel`` positions after a flatten, or patch entries of a
    convolution, per input channel), so mixing the channels mixes each column block alike."""
    eye = torch.eye(per_channel, dtype=torch.float64, device=mix.device)
    return torch.kron(mix.double().contiguous(), eye)


def affine_view(level: nn.Module, *, bias: bool = True) -> AffineLevel | None:
    """The :class:`AffineLevel` view of ``level`` (``bias``: with the intercept column and bias
    row), or None if it is not an affine level."""
    modules = list(level) if isinstance(level, nn.Sequential) else [level]
    *prefix, last = modules
    if any(any(True for _ in m.parameters()) for m in prefix):
        return None
    if isinstance(last, nn.Linear):
        return AffineLevel(prefix, last, bias)
    if (
        isinstance(last, nn.Conv2d)
        and last.groups == 1
        and last.padding_mode == "zeros"
        and isinstance(last.padding, tuple)
    ):
        return AffineLevel(prefix, last, bias)
    return None


#: the values of the fits' ``fit_bias`` option
FIT_BIAS: tuple[Any, ...] = ("auto", True, False)


def check_fit_bias(value: Any, method: str) -> None:
    """Raise ValueError naming ``method`` unless ``value`` is one of :data:`FIT_BIAS`."""
    if not (value == "auto" or isinstance(value, bool)):
        raise ValueError(f"{method}: fit_bias must be 'auto', true or false, got {value!r}")


def fit_intercept(layer: nn.Module, fit_bias: Any, *, where: str) -> bool:
    """Whether a closed-form fit of ``layer`` has an intercept (a bias column): ``fit_bias``
    ``"auto"`` exactly when the layer has a bias, True always (a ValueError naming ``where`` when
    the layer has none: the fitted bias could not be kept), False never (a bias the layer has is
    set to 0)."""
    has_bias = getattr(layer, "bias", None) is not None
    if fit_bias == "auto":
        return has_bias
    if fit_bias and not has_bias:
        raise ValueError(
            f"{where}: fit_bias=True, but its layer {layer} has no bias to hold the fitted one; "
            "use fit_bias='auto' (a bias exactly where the layer has one) or false"
        )
    return bool(fit_bias)


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


def mergeable(module: nn.Module) -> bool:
    """Whether RegMean merges ``module`` by its Gram: an ``nn.Linear``, or an ``nn.Conv2d``
    without groups, dilation-free or not, zero-padded by explicit amounts."""
    if isinstance(module, nn.Linear):
        return True
    return (
        isinstance(module, nn.Conv2d)
        and module.groups == 1
        and module.padding_mode == "zeros"
        and isinstance(module.padding, tuple)
    )


def mergeable_modules(level: nn.Module) -> list[tuple[str, Any]]:
    """The :func:`mergeable` modules inside ``level`` (not the level itself), by name, then the
    projections of its ``nn.MultiheadAttention`` s (:mod:`fedfuse.models.packed_attention`:
    ``"<attention>.in_proj"``, the packed ``q``/``k``/``v``, and ``"<attention>.out_proj"``).
    An attention module that cannot be packed so has no Gram and is averaged."""
    inside = {
        id(m)
        for attention in level.modules()
        if isinstance(attention, nn.MultiheadAttention)
        for m in attention.modules()
        if m is not attention
    }
    plain = [
        (name, m)
        for name, m in level.named_modules()
        if name and mergeable(m) and id(m) not in inside
    ]
    return plain + attention_projections(level)


def module_gram_levels(model: Any) -> list[int]:
    """The neuron levels of a leveled ``model`` that are not affine but hold a mergeable module:
    each has one Gram, the block-diagonal of its modules' (RegMean's
    :func:`~fedfuse.fusion.statistics.grams.module_grams_layout`)."""
    return [
        i
        for i in model.neuron_levels
        if affine_view(model.levels[i]) is None and mergeable_modules(model.levels[i])
    ]


def gram_levels(model: Any) -> list[int]:
    """The neuron levels a site sends a Gram of: the affine ones and those holding a mergeable
    module. Any other level (a user's BatchNorm cut as a level of its own) has no Gram: RegMean
    averages its parameters."""
    grams = set(module_gram_levels(model))
    return [
        i for i in model.neuron_levels if i in grams or affine_view(model.levels[i]) is not None
    ]
