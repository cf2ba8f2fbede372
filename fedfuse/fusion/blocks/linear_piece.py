"""One linear map of a level, fitted in closed form (:class:`LinearPiece`), and how a fitted
BatchNorm holds the affine map it stands for (:func:`set_batchnorm`, :func:`output_moments`).

The pieces of fedfuse's own blocks are :mod:`.pieces`', those read off a user's traced graph
:mod:`.graph_pieces`'.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

Rows = Callable[[nn.Module, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LinearPiece:
    """One linear map of a level, fitted in closed form.

    Attributes:
        name: the piece's name in fit details (``"conv1"``, ``"conv2+shortcut"``, ``"q+k"``).
        design: ``(level, level input) -> rows``: the piece's inputs with a trailing 1 (an
            affine level's: only when its layer has a bias).
        target: ``(level, level input) -> rows``: the piece's outputs on that level.
        fan_in, width: the design's columns and the outputs' count on a level.
        load: ``(level, W, gram)``: write fitted weights, ``gram`` the design's ``X^T X``.
        stream: ``(level, level input) -> rows`` added to the piece's outputs (a residual
            stream), so the fit's targets are the centres minus it; None when nothing is.
        inner: its neurons are hidden inside the level (no importance scores: equal weights).
        kind: ``"neurons"`` (group the outputs, fit their centres) or ``"logits"`` (attention
            queries and keys, fitted by :func:`~.attention.attention_logits`).
    """

    name: str
    design: Rows
    target: Rows
    fan_in: Callable[[nn.Module], int]
    width: Callable[[nn.Module], int]
    load: Callable[[nn.Module, torch.Tensor, torch.Tensor], None]
    stream: Rows | None = None
    inner: bool = False
    kind: str = "neurons"


def set_batchnorm(
    norm: nn.BatchNorm2d,
    bias: torch.Tensor,
    moments: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """``norm`` as the map ``y + bias`` in eval mode.

    With ``moments``, the mean and variance of its input ``y`` on the fitted rows, they become
    its running statistics and its scale and shift absorb them (``sqrt(var + eps)``, ``bias +
    mean``): the same eval-mode map, and in train mode a batch like those rows is normalised as
    in eval mode, so the fused model can be trained further. Without them: mean 0, variance
    ``1 - eps``, scale 1."""
    with torch.no_grad():
        if moments is None:
            norm.running_mean.zero_()
            norm.running_var.fill_(1.0 - norm.eps)
            norm.weight.fill_(1.0)
            norm.bias.copy_(bias.to(norm.bias.dtype))
            return
        mean, var = (m.to(norm.running_mean.device, torch.float64) for m in moments)
        norm.running_mean.copy_(mean)
        norm.running_var.copy_(var)
        norm.weight.copy_((var + norm.eps).sqrt())
        norm.bias.copy_(bias.to(norm.bias.device, torch.float64) + mean)


def output_moments(
    w: torch.Tensor, gram: torch.Tensor, columns: slice
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per-output mean and variance over the design's rows of ``X[:, columns] @ w[columns]``
    (one conv's output before its BatchNorm), from the Gram ``X^T X`` of a design whose last
    column is the ones (its corner is the row count). None when the Gram has no such column."""
    if gram.shape != (len(w), len(w)) or not gram[-1, -1] > 0:
        return None
    gram, part = gram.double(), w[columns].double().to(gram.device)
    count = gram[-1, -1]
    mean = gram[-1, columns] @ part / count
    second = ((gram[columns, columns] @ part) * part).sum(0) / count
    return mean, (second - mean * mean).clamp_min(0)


__all__ = ["LinearPiece", "Rows", "output_moments", "set_batchnorm"]
