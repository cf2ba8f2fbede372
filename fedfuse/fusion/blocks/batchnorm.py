"""BatchNorm after fusion: running statistics that describe the fused model's own activations.

A fused level is fitted in eval mode or assembled from other models' parameters, so its
BatchNorm running statistics are not those of the activations it now sees. Two repairs:

- :func:`refold_batchnorm_statistics` keeps the eval-mode function exactly and rewrites the
  parametrisation: the running mean and variance become the fusion set's, and the scale and
  shift absorb the difference. Fine-tuning in train mode then starts from the same function.
- :func:`reset_batchnorm_statistics` re-estimates them on the fusion set and changes the
  function on purpose: REPAIR's BatchNorm form, for averaged (aligned) models.
"""

from __future__ import annotations

import torch
from torch import nn

from fedfuse.models.capture import hooked, run_batches

_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


@torch.no_grad()
def batchnorm_input_statistics(
    model: nn.Module, data: torch.Tensor, *, batch_size: int = 256
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per-channel mean and (biased) variance of every BatchNorm's input over ``data``, in eval
    mode, float64, keyed by module name; the model's modes are restored."""
    norms = {name: m for name, m in model.named_modules() if isinstance(m, _NORMS)}
    if not norms:
        return {}
    sums: dict[str, list[torch.Tensor | int]] = {}

    def record(name: str, _module: nn.Module, args: tuple[torch.Tensor, ...], _out: object) -> None:
        x = args[0].detach().double()
        rows = x.movedim(1, -1).reshape(-1, x.shape[1])
        total = sums.setdefault(name, [0, 0, 0])
        total[0] = total[0] + rows.sum(0)
        total[1] = total[1] + (rows * rows).sum(0)
        total[2] = int(total[2]) + len(rows)

    with hooked(norms, record):
        run_batches(model, data, batch_size=batch_size, device=next(model.parameters()).device)
    result = {}
    for name, (total, squares, count) in sums.items():
        mean = total / count
        result[name] = (mean, (squares / count - mean * mean).clamp_min(0))
    return result


@torch.no_grad()
def refold_batchnorm_statistics(
    model: nn.Module, data: torch.Tensor, *, batch_size: int = 256
) -> int:
    """Set every BatchNorm's running statistics to its input's on ``data`` while keeping the
    model's eval-mode function: ``weight`` and ``bias`` absorb the change. Returns the number of
    BatchNorm layers rewritten (0 for a model without any)."""
    statistics = batchnorm_input_statistics(model, data, batch_size=batch_size)
    modules = dict(model.named_modules())
    rewritten = 0
    for name, (mean, var) in statistics.items():
        norm = modules[name]
        if norm.running_mean is None or norm.running_var is None or norm.bias is None:
            continue  # no running statistics, or no shift to absorb the new mean into
        old_scale = (norm.running_var.double() + norm.eps).sqrt()
        new_scale = (var.to(old_scale.device) + norm.eps).sqrt()
        mean = mean.to(old_scale.device)
        weight = norm.weight.double() if norm.weight is not None else torch.ones_like(old_scale)
        shift = weight * (mean - norm.running_mean.double()) / old_scale
        if norm.weight is not None:
            norm.weight.copy_(weight * new_scale / old_scale)
        if norm.bias is not None:
            norm.bias.add_(shift.to(norm.bias.dtype))
        norm.running_mean.copy_(mean)
        norm.running_var.copy_(var.to(old_scale.device))
        rewritten += 1
    return rewritten


def has_batchnorm(model: torch.nn.Module) -> bool:
    """Whether ``model`` has a BatchNorm layer that tracks running statistics."""
    return any(isinstance(m, _NORMS) and m.track_running_stats for m in model.modules())


def reset_batchnorm_statistics(
    model: torch.nn.Module,
    data: torch.Tensor,
    batch_size: int = 256,
    device: str | torch.device = "auto",
) -> torch.nn.Module:
    """Recompute every BatchNorm layer's running mean and variance on ``data`` (in place).

    The BatchNorm form of REPAIR (and Git Re-Basin's "reset BN"): after averaging aligned
    models, the averaged running statistics no longer describe the fused model's features.
    Each BatchNorm layer's statistics are reset and re-estimated as the cumulative average over
    the batches of ``data`` (``momentum=None``), with only the BatchNorm layers in training mode
    (dropout and the like stay off). Every module's mode and momentum is restored afterwards;
    the parameters are not changed. A model without BatchNorm is returned untouched.

    Returns:
        ``model``.
    """
    norms = [m for m in model.modules() if isinstance(m, _NORMS) and m.track_running_stats]
    if not norms:
        return model
    if len(data) == 0:
        raise ValueError("cannot reset BatchNorm statistics on an empty fusion set")
    momenta = [m.momentum for m in norms]
    try:
        for norm in norms:
            norm.reset_running_stats()
            norm.momentum = None
        # BatchNorm alone in train mode: it accumulates the statistics
        run_batches(model, data, batch_size=batch_size, device=device, training=norms)
    finally:
        for norm, momentum in zip(norms, momenta, strict=True):
            norm.momentum = momentum
    return model
