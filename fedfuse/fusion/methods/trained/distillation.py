r"""Reference points that *train on the fusion set*: knowledge distillation and a linear probe.

Neither is a one-shot fusion of weights: both optimise a model's parameters by gradient descent
on the fusion set (inputs, and for some options its labels), so their results are labelled
``details["kind"] = "trains on the fusion set"``. They bound what the fusion set alone can teach
a model of the fused size.

The teacher is the ensemble of the base models, the average of their softmax probabilities
:math:`\bar p(x) = \frac1K \sum_k \operatorname{softmax}(f_k(x))`, softened by a temperature
:math:`T` as if its log-probabilities were logits (Hinton et al., 2015):

.. math::
    \mathcal L_{\mathrm{KD}}(x) = T^2\,\mathrm{KL}\!\left(\operatorname{softmax}(\log\bar p(x)/T)
    \;\Vert\; \operatorname{softmax}(s(x)/T)\right),

where :math:`s(x)` are the student's logits; the :math:`T^2` factor keeps the gradient scale
independent of :math:`T`. With ``ce_weight`` :math:`= \alpha` the loss is
:math:`(1-\alpha)\,\mathcal L_{\mathrm{KD}} + \alpha\,\mathrm{CE}(s(x), y)` on the fusion labels.

References:
    Hinton, Vinyals & Dean, "Distilling the Knowledge in a Neural Network", 2015.
    Kinderman et al., "Foldable SuperNets", TMLR 2025: its distillation baseline starts from
    the first model ("first", App. G.2); it matches features before the head instead of logits.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedfuse.fusion.base import FusionInputs, FusionMethod
from fedfuse.fusion.methods.averaging.fedavg import average_state_dicts
from fedfuse.fusion.registry import register_fusion_method
from fedfuse.models import LeveledModel, ModelSpec, build_model
from fedfuse.models.capture import predict
from fedfuse.runtime import resolve_device
from fedfuse.training.loop import (
    OPTIMIZERS,
    fit_with_early_stopping,
    holdout_split,
    make_optimizer,
    make_scheduler,
)

log = logging.getLogger(__name__)

KIND = "trains on the fusion set"
STUDENT_INITS = ("first", "fresh", "average")
PROBE_TARGETS = ("ensemble", "labels")


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
    """Optimisation settings shared by :class:`KnowledgeDistillation` and :class:`LinearProbe`."""

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


def _check_settings(
    optimizer: str,
    lr: float,
    weight_decay: float,
    epochs: int,
    batch_size: int,
    val_split: float,
    patience: int,
    temperature: float,
    ce_weight: float,
) -> None:
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if lr <= 0 or weight_decay < 0 or epochs < 0 or batch_size < 1:
        raise ValueError(
            f"need lr > 0, weight_decay >= 0, epochs >= 0, batch_size >= 1; got "
            f"{lr}, {weight_decay}, {epochs}, {batch_size}"
        )
    if not 0 <= val_split < 1 or patience < 0:
        raise ValueError(f"need 0 <= val_split < 1 and patience >= 0, got {val_split}, {patience}")
    if temperature <= 0 or not 0 <= ce_weight <= 1:
        raise ValueError(
            f"need temperature > 0, 0 <= ce_weight <= 1; got {temperature}, {ce_weight}"
        )


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
    return {
        "initial_loss": fit.initial_loss,
        "best_loss": fit.best_loss,
        "best_epoch": fit.best_epoch,
        "epochs_run": fit.epochs_run,
        "monitored": fit.monitored,
        "validation_samples": fit.validation_samples,
        "train_curve": fit.train_curve,
    }


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


@register_fusion_method
class KnowledgeDistillation(FusionMethod):
    r"""Knowledge distillation of the base models' ensemble into one student, *on the fusion set*.

    A reference point that trains on the fusion set (``details["kind"]``), not a weight fusion.
    Solves, over the student's parameters :math:`\theta` and the fusion set :math:`D`,

    .. math::
        \min_\theta\; \mathbb{E}_{(x,y)\sim D}\,(1-\alpha)\,T^2\,
        \mathrm{KL}\big(\bar p^{T}(x)\,\Vert\,\operatorname{softmax}(s_\theta(x)/T)\big)
        + \alpha\,\mathrm{CE}(s_\theta(x), y),

    with :math:`\bar p^{T}` the temperature-softened ensemble distribution (module docstring).

    Args:
        student_init: ``"first"`` (a copy of model 0, the best start in Kinderman et al.,
            App. G.2), ``"fresh"`` (a new model of the target spec, seeded) or ``"average"``
            (the plain parameter average of the base models).
        temperature: :math:`T` (Hinton et al.: 2 to 20; 4 by default).
        ce_weight: :math:`\alpha`, the share of cross-entropy on the fusion labels (0: none).
        epochs, lr, batch_size, weight_decay, optimizer: the optimisation (``"adamw"``,
            ``"adam"`` or ``"sgd"`` with Nesterov momentum 0.9; see
            :func:`~fedfuse.training.loop.make_optimizer`), one cosine cycle.
        val_split, patience: held-out share of the fusion set and early-stopping patience in
            epochs (0: never stop early); the best state on it is kept.
        seed: seeds ``"fresh"`` students, the split and the batch order.
        device: ``"auto"``, ``"cpu"`` or ``"cuda"``.
        progress: show a progress bar over epochs.

    Returns (from :meth:`fuse`): the student and details: ``kind``, the settings, the training
    summary, and ``before``/``after`` agreement with the ensemble (KD loss, KL at T=1, argmax
    agreement, accuracy on the labels if given) on the whole fusion set.
    """

    name = "kd"
    kind = KIND
    requires = frozenset({"data"})
    same_spec = False
    retargetable = True

    def __init__(
        self,
        student_init: str = "first",
        *,
        temperature: float = 4.0,
        ce_weight: float = 0.0,
        epochs: int = 100,
        lr: float = 1e-3,
        batch_size: int = 32,
        weight_decay: float = 1e-4,
        optimizer: str = "adamw",
        val_split: float = 0.1,
        patience: int = 10,
        seed: int = 0,
        device: str = "auto",
        progress: bool = False,
    ) -> None:
        if student_init not in STUDENT_INITS:
            raise ValueError(f"student_init must be one of {STUDENT_INITS}, got {student_init!r}")
        _check_settings(
            optimizer,
            lr,
            weight_decay,
            epochs,
            batch_size,
            val_split,
            patience,
            temperature,
            ce_weight,
        )
        self.student_init = student_init
        self.temperature = temperature
        self.ce_weight = ce_weight
        self.epochs = epochs
        self.lr = lr
        self.batch_size = batch_size
        self.weight_decay = weight_decay
        self.optimizer = optimizer
        self.val_split = val_split
        self.patience = patience
        self.seed = seed
        self.device = device
        self.progress = progress

    def requirements(self) -> frozenset[str]:
        return self.requires | ({"labels"} if self.ce_weight > 0 else set())

    def needs(self) -> frozenset[str]:
        return self.requirements() | {"labels"}  # accuracy before/after, in the details

    def settings(self) -> FitSettings:
        return FitSettings(
            optimizer=self.optimizer,
            lr=self.lr,
            weight_decay=self.weight_decay,
            epochs=self.epochs,
            batch_size=self.batch_size,
            val_split=self.val_split,
            patience=self.patience,
            temperature=self.temperature,
            kd_weight=1.0 - self.ce_weight,
            ce_weight=self.ce_weight,
        )

    def check_target(self, spec: ModelSpec, target: ModelSpec) -> None:
        if self.student_init != "fresh":
            raise ValueError(
                f"{self.name}: student_init={self.student_init!r} starts from the sites' models, "
                f"so it cannot fuse into the requested fused widths {list(target.widths)}; "
                "use student_init='fresh'"
            )

    def _student(self, models: list[LeveledModel], target: ModelSpec) -> LeveledModel:
        if self.student_init == "fresh":
            return build_model(target, seed=self.seed)
        if self.student_init == "first":
            if target != models[0].spec:
                raise ValueError(
                    f"{self.name}: student_init='first' copies model 0, whose spec "
                    f"{models[0].spec.to_dict()} is not the target {target.to_dict()}; "
                    "use student_init='fresh'"
                )
            return copy.deepcopy(models[0])
        if any(m.spec != target for m in models):
            raise ValueError(
                f"{self.name}: student_init='average' needs every model to have the target spec "
                f"{target.to_dict()}"
            )
        student = build_model(target, seed=self.seed)
        student.load_state_dict(average_state_dicts(models))
        return student

    def _fuse(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec
    ) -> tuple[LeveledModel, dict[str, Any]]:
        started = time.perf_counter()
        device = resolve_device(self.device)
        data = inputs.data
        assert data is not None
        labels = inputs.labels
        teacher = ensemble_log_probs(models, data, device=device)
        student = self._student(models, target).to(device)
        student.requires_grad_(True)
        x = data.to(device)
        before = agreement(predict(student, data, device=device), teacher, labels, self.temperature)
        info = fit_to_teacher(
            student,
            student,
            x,
            teacher,
            labels,
            self.settings(),
            generator=torch.Generator().manual_seed(self.seed),
            progress=self.progress,
            description=self.name,
        )
        after = agreement(predict(student, data, device=device), teacher, labels, self.temperature)
        log.info(
            "%s: KL to the ensemble %.4f -> %.4f on the fusion set (%d epochs)",
            self.name,
            before["kl_to_ensemble"],
            after["kl_to_ensemble"],
            info["epochs_run"],
        )
        details = {
            "kind": KIND,
            "student_init": self.student_init,
            "settings": asdict(self.settings()),
            "training": info,
            "before": before,
            "after": after,
            "seconds": time.perf_counter() - started,
        }
        return student.cpu().eval(), details


@register_fusion_method
class LinearProbe(FusionMethod):
    r"""Refit only the classifier of one base model on the fusion set (a linear probe).

    A reference point that trains on the fusion set (``details["kind"]``). The body of model
    ``body`` (every level before the last neuron level) is frozen and gives features
    :math:`h(x)`; only the head :math:`(W, b)` is trained, from the model's own head:

    .. math::
        \min_{W,b}\; \mathbb{E}_{(x,y)\sim D}\,(1-\alpha)\,T^2\,
        \mathrm{KL}\big(\bar p^{T}(x)\,\Vert\,\operatorname{softmax}((W h(x)+b)/T)\big)
        + \alpha\,\mathrm{CE}(W h(x)+b, y)

    with ``target="ensemble"`` (:math:`\alpha` = ``ce_weight``, default 0), or plain
    cross-entropy on the fusion labels with ``target="labels"`` (:math:`\alpha = 1`).

    Args:
        target: ``"ensemble"`` (match the ensemble's softened probabilities) or ``"labels"``.
        body: index of the base model whose body (and initial head) is used.
        temperature, ce_weight: as for :class:`KnowledgeDistillation` (``ce_weight`` only with
            ``target="ensemble"``).
        epochs, lr, batch_size, weight_decay, optimizer, val_split, patience, seed, device,
            progress: as for :class:`KnowledgeDistillation`.

    Returns (from :meth:`fuse`): model ``body`` with a refitted head (all other parameters
    bit-identical), and details as for :class:`KnowledgeDistillation`.
    """

    name = "linear-probe"
    kind = KIND
    requires = frozenset({"data"})
    same_spec = False
    retargetable = True

    def __init__(
        self,
        target: str = "ensemble",
        *,
        body: int = 0,
        temperature: float = 4.0,
        ce_weight: float = 0.0,
        epochs: int = 100,
        lr: float = 1e-3,
        batch_size: int = 32,
        weight_decay: float = 1e-4,
        optimizer: str = "adamw",
        val_split: float = 0.1,
        patience: int = 10,
        seed: int = 0,
        device: str = "auto",
        progress: bool = False,
    ) -> None:
        if target not in PROBE_TARGETS:
            raise ValueError(f"target must be one of {PROBE_TARGETS}, got {target!r}")
        _check_settings(
            optimizer,
            lr,
            weight_decay,
            epochs,
            batch_size,
            val_split,
            patience,
            temperature,
            ce_weight,
        )
        self.target = target
        self.body = body
        self.temperature = temperature
        self.ce_weight = ce_weight
        self.epochs = epochs
        self.lr = lr
        self.batch_size = batch_size
        self.weight_decay = weight_decay
        self.optimizer = optimizer
        self.val_split = val_split
        self.patience = patience
        self.seed = seed
        self.device = device
        self.progress = progress

    def requirements(self) -> frozenset[str]:
        uses_labels = self.target == "labels" or self.ce_weight > 0
        return self.requires | ({"labels"} if uses_labels else set())

    def needs(self) -> frozenset[str]:
        return self.requirements() | {"labels"}  # accuracy before/after, in the details

    def settings(self) -> FitSettings:
        ce = 1.0 if self.target == "labels" else self.ce_weight
        return FitSettings(
            optimizer=self.optimizer,
            lr=self.lr,
            weight_decay=self.weight_decay,
            epochs=self.epochs,
            batch_size=self.batch_size,
            val_split=self.val_split,
            patience=self.patience,
            temperature=self.temperature,
            kd_weight=1.0 - ce,
            ce_weight=ce,
        )

    def check_target(self, spec: ModelSpec, target: ModelSpec) -> None:
        raise ValueError(
            f"{self.name}: the probe keeps a site's body, so the fused model has the sites' "
            f"widths {list(spec.widths)}, not the requested {list(target.widths)}"
        )

    def _fuse(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec
    ) -> tuple[LeveledModel, dict[str, Any]]:
        started = time.perf_counter()
        if self.body >= len(models):
            raise ValueError(f"{self.name}: body={self.body} but only {len(models)} models")
        settings = self.settings()
        base = models[self.body]
        if target != base.spec:
            raise ValueError(
                f"{self.name}: the probe keeps model {self.body}'s architecture "
                f"{base.spec.to_dict()}, not {target.to_dict()}"
            )
        device = resolve_device(self.device)
        data = inputs.data
        assert data is not None
        labels = inputs.labels
        teacher = ensemble_log_probs(models, data, device=device)
        probe = copy.deepcopy(base).to(device).eval()
        head_index = probe.neuron_levels[-1]
        probe.requires_grad_(False)
        head = probe.levels[head_index]
        head.requires_grad_(True)
        with torch.no_grad():
            features = torch.cat(
                [
                    probe.forward_levels(data[s : s + 1024].to(device), 0, head_index)
                    for s in range(0, len(data), 1024)
                ]
            )
        before = agreement(predict(probe, data, device=device), teacher, labels, self.temperature)
        info = fit_to_teacher(
            head,
            head,
            features,
            teacher,
            labels,
            settings,
            generator=torch.Generator().manual_seed(self.seed),
            progress=self.progress,
            description=self.name,
        )
        probe.requires_grad_(True)
        after = agreement(predict(probe, data, device=device), teacher, labels, self.temperature)
        log.info(
            "%s: KL to the ensemble %.4f -> %.4f on the fusion set (%d epochs)",
            self.name,
            before["kl_to_ensemble"],
            after["kl_to_ensemble"],
            info["epochs_run"],
        )
        details = {
            "kind": KIND,
            "target": self.target,
            "body": self.body,
            "head_level": probe.level_name(head_index),
            "settings": asdict(settings),
            "training": info,
            "before": before,
            "after": after,
            "seconds": time.perf_counter() - started,
        }
        return probe.cpu().eval(), details
