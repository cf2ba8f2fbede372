"""The Gradient fit of one level: gradient descent on the MSE to its groups' targets (Table 9).

Any level (not only affine ones) is fitted from its own inputs to the weighted centres of the
base neurons' groups, starting from an interpolation of model 0's level and a fresh
initialisation, with a held-out split and early stopping; :data:`GRADIENT_PRESETS` are the
paper's two settings. BatchNorms stay in eval mode while a level trains.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
from torch import nn

from fedfuse.fusion.methods.neuron_interpolation.costs import level_cost
from fedfuse.fusion.methods.neuron_interpolation.grouping import GroupFn
from fedfuse.fusion.methods.neuron_interpolation.level_fit import LevelFit
from fedfuse.fusion.methods.neuron_interpolation.sublayers import group_targets
from fedfuse.training.loop import FitResult, fit_with_early_stopping, holdout_split, make_optimizer


@dataclass(frozen=True)
class GradientPreset:
    """Hyper-parameters of the Gradient variant (paper Table 9).

    ``optimizer``/``last_optimizer`` (hidden levels / the classifier) are
    :func:`~fedfuse.training.loop.make_optimizer` names; ``"sgd"`` here is classical momentum 0.9.
    """

    optimizer: str
    lr: float
    epochs: int
    last_optimizer: str
    last_lr: float
    last_epochs: int
    weight_decay: float
    epsilon: float
    batch_size: int
    val_split: float
    patience: int


#: Table 9: Setting 1 moves far from the initialisation, Setting 2 stays near a base model.
#: ``refine`` polishes a closed-form start (``start="closed-form"``): a small step, few epochs,
#: stopped as soon as the held-out slice of the fusion set stops improving.
GRADIENT_PRESETS = {
    "setting1": GradientPreset("adamw", 1e-3, 100, "adamw", 1e-3, 100, 1e-4, 1.0, 32, 0.1, 10),
    "setting2": GradientPreset("sgd", 1e-4, 50, "adam", 1e-3, 100, 1e-4, 0.1, 32, 0.1, 10),
    "refine": GradientPreset("adamw", 1e-4, 20, "adamw", 1e-4, 20, 0.0, 0.0, 32, 0.1, 3),
}


#: the preset's fields an option of the same name overrides (None: the preset's value)
GRADIENT_OVERRIDES = ("epochs", "last_epochs", "lr", "last_lr", "epsilon", "batch_size", "patience")


def preset_with_overrides(preset: str, **overrides: Any) -> GradientPreset:
    """:data:`GRADIENT_PRESETS` ``[preset]`` with the ``overrides`` that are not None."""
    return replace(
        GRADIENT_PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None}
    )


class GradientOptions(Protocol):
    """The options :func:`fit_gradient` reads (:class:`~.interpolation_options.InterpolationOptions`
    has them all)."""

    weighted_loss: bool
    seed: int
    batch_size_capture: int

    def gradient_settings(self) -> GradientPreset: ...


def fit_gradient(
    fit: LevelFit,
    weights: torch.Tensor,
    labels: torch.Tensor | None,
    base_level: nn.Module,
    *,
    is_head: bool,
    group: GroupFn,
    options: GradientOptions,
    started: bool = False,
) -> dict[str, Any]:
    """Fit ``fit.level`` (inputs ``fit.x``) by gradient descent to the weighted centres of the
    base ``fit.outputs``' groups (``labels``, or ``group`` them by their outputs), starting from
    ``base_level`` (model 0's), or, when ``started``, from the weights the level already holds
    (a closed-form fit, which then also competes for the best state); return the level's
    details."""
    level, x, outputs, k = fit.level, fit.x, fit.outputs, fit.k
    settings = options.gradient_settings()
    labels, targets_rows = group_targets(outputs, weights, k, labels, group)
    targets_rows = targets_rows.float()
    shape = outputs[0].shape
    targets = (
        targets_rows
        if len(shape) == 2
        else targets_rows.reshape(shape[0], *shape[2:], k).movedim(-1, 1)
    )
    mass = torch.zeros(k, device=labels.device, dtype=weights.dtype)
    mass = mass.index_add_(0, labels, weights.to(mass))
    neuron_weights = (mass / mass.mean()).float() if options.weighted_loss else None
    if not started:
        _initialise(level, base_level, settings.epsilon)
    result = _fit_level(
        level,
        x,
        targets,
        neuron_weights,
        optimizer=settings.last_optimizer if is_head else settings.optimizer,
        lr=settings.last_lr if is_head else settings.lr,
        epochs=settings.last_epochs if is_head else settings.epochs,
        weight_decay=settings.weight_decay,
        batch_size=settings.batch_size,
        val_split=settings.val_split,
        patience=settings.patience,
        generator=torch.Generator().manual_seed(options.seed + fit.index),
        keep_initial=started,
    )
    return {
        **level_cost(level, x, outputs, labels, weights, options.batch_size_capture),
        "validation_mse": result.best_loss,
        "epochs_run": float(result.epochs_run),
    }


@torch.no_grad()
def _initialise(level: nn.Module, base_level: nn.Module, epsilon: float) -> None:
    """Level weights ``(1 - eps) * base + eps * fresh`` (fresh alone if shapes differ)."""
    fresh = [p.detach().clone() for p in level.parameters()]  # the fused model's own init
    base = list(base_level.parameters())
    same = len(base) == len(fresh) and all(
        a.shape == b.shape for a, b in zip(base, fresh, strict=False)
    )
    for param, new, old in zip(level.parameters(), fresh, base if same else fresh, strict=True):
        param.copy_((1 - epsilon) * old.to(param.device) + epsilon * new if same else new)


def _fit_level(
    level: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    neuron_weights: torch.Tensor | None,
    *,
    optimizer: str,
    lr: float,
    epochs: int,
    weight_decay: float,
    batch_size: int,
    val_split: float,
    patience: int,
    generator: torch.Generator,
    keep_initial: bool = False,
) -> FitResult:
    """Minimise the (optionally neuron-weighted) MSE of ``level(inputs)`` to ``targets``.

    :func:`~fedfuse.training.loop.fit_with_early_stopping` with ``val_split`` held out,
    ``patience``, the best weights restored; the starting weights count as the best only with
    ``keep_initial`` (Table 9's fit always takes a trained state; a closed-form start is kept
    when descent does not improve it); ``"sgd"`` is classical momentum 0.9, no schedule.
    """
    shape = [1, -1] + [1] * (targets.dim() - 2)
    w = None if neuron_weights is None else neuron_weights.view(*shape).to(targets.device)

    def mse(rows: torch.Tensor) -> torch.Tensor:
        err = (level(inputs[rows]) - targets[rows]) ** 2
        return (err * w).mean() if w is not None else err.mean()

    train, val = holdout_split(len(inputs), val_split, generator)
    return fit_with_early_stopping(
        _EvalModeNorms(level),
        mse,
        (train.to(inputs.device), val.to(inputs.device)),
        make_optimizer(optimizer, level.parameters(), lr, weight_decay, momentum=0.9),
        epochs=epochs,
        batch_size=batch_size,
        patience=patience,
        generator=generator,
        keep_initial=keep_initial,
    )


class _EvalModeNorms(nn.Module):
    """``level`` whose BatchNorms stay in eval mode while it trains: a fused level is fitted as
    the fixed function it computes at test time (a BatchNorm is then an affine map); its running
    statistics are set afterwards by
    :func:`~fedfuse.fusion.blocks.batchnorm.refold_batchnorm_statistics`.
    """

    def __init__(self, level: nn.Module) -> None:
        super().__init__()
        self.level = level

    def train(self, mode: bool = True) -> _EvalModeNorms:
        super().train(mode)
        for module in self.level.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.eval()
        return self
