r"""Training a student against the base models' ensemble: the pieces the methods that do so share.

:class:`~fedfuse.fusion.methods.trained.distillation.KnowledgeDistillation` and
:class:`~fedfuse.fusion.methods.trained.distillation.LinearProbe` fit a model on the fusion set
with the same teacher (:func:`ensemble_log_probs`), loss (:func:`distillation_loss`, plus
cross-entropy on the labels), optimisation (:func:`fit_to_teacher`, :class:`FitSettings`) and
report (:func:`agreement`); they and DENSE (:mod:`fedfuse.fusion.methods.trained.dense`) start a
student the same ways (:func:`initial_student`). The loss is in the distillation module's
docstring.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedfuse.fusion.methods.averaging.fedavg import average_state_dicts
from fedfuse.models import LeveledModel, ModelSpec, build_model
from fedfuse.models.capture import predict
from fedfuse.training.loop import (
    fit_with_early_stopping,
    holdout_split,
    make_optimizer,
    make_scheduler,
)

#: what :func:`fit_to_teacher` reports of the fit (fields of the training loop's result)
FIT_SUMMARY = (
    "initial_loss",
    "best_loss",
    "best_epoch",
    "epochs_run",
    "monitored",
    "validation_samples",
    "train_curve",
)


def distillation_loss(
    student_logits: torch.Tensor, teacher_log_probs: torch.Tensor, temperature: float
) -> torch.Tensor:
    r"""``T^2 * KL(p_teacher^T || p_student^T)``, averaged over the batch.

    Args:
        student_logits: ``(B, C)`` logits of the student.
        teacher_log_probs: ``(B, C)`` log-probabilities (or logits) of the teacher; both sides
            are softened by ``temperature`` with a log-softmax of the values divided by it.
        temperature: :math:`T > 0`.

    Returns:
        The scalar loss (0 exactly when both give the same distribution).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return temperature**2 * F.kl_div(
        F.log_softmax(student_logits / temperature, dim=-1),
        F.log_softmax(teacher_log_probs / temperature, dim=-1),
        log_target=True,
        reduction="batchmean",
    )


@torch.no_grad()
def ensemble_log_probs(
    models: Sequence[nn.Module],
    data: torch.Tensor,
    *,
    batch_size: int = 1024,
    device: str | torch.device = "auto",
) -> torch.Tensor:
    """``log(mean_k softmax(f_k(x)))`` on ``data`` (as :class:`fedfuse.models.Ensemble`), on CPU.

    Each model is evaluated on its own, so its train/eval mode and device are left as found.
    """
    log_probs = torch.stack(
        [predict(m, data, batch_size=batch_size, device=device).log_softmax(-1) for m in models]
    )
    return torch.logsumexp(log_probs, 0) - math.log(len(models))


@dataclass(frozen=True)
class FitSettings:
    """The optimisation of :func:`fit_to_teacher`: the options knowledge distillation and the
    linear probe share, with the weights of their two losses."""

    optimizer: str
    lr: float
    weight_decay: float
    epochs: int
    batch_size: int
    val_split: float
    patience: int
    temperature: float
    kd_weight: float
    ce_weight: float


def fit_to_teacher(
    module: nn.Module,
    forward: Callable[[torch.Tensor], torch.Tensor],
    inputs: torch.Tensor,
    teacher_log_probs: torch.Tensor | None,
    labels: torch.Tensor | None,
    settings: FitSettings,
    *,
    generator: torch.Generator,
    progress: bool = False,
    description: str = "fit",
) -> dict[str, Any]:
    r"""Minimise ``kd_weight * L_KD + ce_weight * CE`` of ``forward(inputs[i])`` over the set.

    Only ``module``'s parameters with ``requires_grad`` are optimised, by
    :func:`~fedfuse.training.loop.fit_with_early_stopping`: a share ``val_split`` of the rows (none
    below 10 rows) is held out, the loss on it (else on the training rows) is measured after
    each epoch, training stops after ``patience`` epochs without improvement (0: never), and the
    best state of ``module`` is restored. The learning rate follows one cosine cycle over the
    epochs; ``"sgd"`` is Nesterov momentum 0.9.

    Returns:
        ``best_loss``, ``initial_loss`` (monitored set), ``epochs_run``, ``best_epoch``,
        ``monitored``, ``validation_samples`` and ``train_curve`` (mean training loss per epoch).
    """
    device = inputs.device
    teacher = None if teacher_log_probs is None else teacher_log_probs.to(device)
    targets = None if labels is None else labels.to(device)

    def loss_of(idx: torch.Tensor) -> torch.Tensor:
        logits = forward(inputs[idx])
        loss = logits.new_zeros(())
        if settings.kd_weight and teacher is not None:
            kd = distillation_loss(logits, teacher[idx], settings.temperature)
            loss = loss + settings.kd_weight * kd
        if settings.ce_weight and targets is not None:
            loss = loss + settings.ce_weight * F.cross_entropy(logits, targets[idx])
        return loss

    train, val = holdout_split(len(inputs), settings.val_split, generator)
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = make_optimizer(
        settings.optimizer, params, settings.lr, settings.weight_decay, momentum=0.9, nesterov=True
    )
    steps_per_epoch = max(1, math.ceil(len(train) / settings.batch_size))
    scheduler = make_scheduler(optimizer, "cosine", max(1, settings.epochs * steps_per_epoch))
    fit = fit_with_early_stopping(
        module,
        loss_of,
        (train.to(device), val.to(device)),
        optimizer,
        epochs=settings.epochs,
        batch_size=settings.batch_size,
        patience=settings.patience,
        generator=generator,
        scheduler=scheduler,
        eval_batch_size=1024,
        progress=progress,
        description=description,
    )
    return {name: getattr(fit, name) for name in FIT_SUMMARY}


@torch.no_grad()
def agreement(
    logits: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    labels: torch.Tensor | None,
    temperature: float,
) -> dict[str, float]:
    """How close ``logits`` are to the teacher (and the labels) over a set, for the details."""
    result = {
        "kd_loss": float(distillation_loss(logits, teacher_log_probs, temperature)),
        "kl_to_ensemble": float(distillation_loss(logits, teacher_log_probs, 1.0)),
        "argmax_agreement": float((logits.argmax(1) == teacher_log_probs.argmax(1)).float().mean()),
    }
    if labels is not None:
        result["accuracy"] = float((logits.argmax(1) == labels).float().mean())
    return result


def initial_student(
    method: str, student_init: str, models: Sequence[LeveledModel], target: ModelSpec, seed: int
) -> LeveledModel:
    """A student of spec ``target`` to train: ``"fresh"`` (a new model seeded with ``seed``),
    ``"first"`` (a copy of model 0, which must have the spec ``target``) or ``"average"`` (the
    parameter average of ``models``, which must all have it); errors name ``method``."""
    if student_init == "fresh":
        return build_model(target, seed=seed)
    if student_init == "first":
        if target != models[0].spec:
            raise ValueError(
                f"{method}: student_init='first' copies model 0, whose spec "
                f"{models[0].spec.to_dict()} is not the target {target.to_dict()}; "
                "use student_init='fresh'"
            )
        return copy.deepcopy(models[0])
    if any(m.spec != target for m in models):
        raise ValueError(
            f"{method}: student_init='average' needs every model to have the target spec "
            f"{target.to_dict()}"
        )
    student = build_model(target, seed=seed)
    student.load_state_dict(average_state_dicts(models))
    return student
