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

The teacher, the loss, the fit and the student's start are in
:mod:`fedfuse.fusion.methods.trained.teaching`; this module holds the two methods and the options
they share (:class:`FusionSetTraining`).

References:
    Hinton, Vinyals & Dean, "Distilling the Knowledge in a Neural Network", 2015.
    Kinderman et al., "Foldable SuperNets", TMLR 2025: its distillation baseline starts from
    the first model ("first", App. G.2); it matches features before the head instead of logits.
"""

from __future__ import annotations

import copy
import logging
import time
from abc import abstractmethod
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from fedfuse.fusion.base import FusionInputs, FusionMethod
from fedfuse.fusion.methods.trained.teaching import (
    FitSettings,
    agreement,
    ensemble_log_probs,
    fit_to_teacher,
    initial_student,
)
from fedfuse.fusion.registry import register_fusion_method
from fedfuse.models import LeveledModel, ModelSpec
from fedfuse.models.capture import predict
from fedfuse.runtime import resolve_device
from fedfuse.training.loop import check_optimizer

log = logging.getLogger(__name__)

KIND = "trains on the fusion set"
STUDENT_INITS = ("first", "fresh", "average")
PROBE_TARGETS = ("ensemble", "labels")


class FusionSetTraining(FusionMethod):
    """What knowledge distillation and the linear probe share: the optimisation options (with
    their defaults; a subclass forwards them as ``**inherited``), the ensemble teacher, the fit
    and the before/after report (:meth:`_fuse`). A subclass says which model it returns
    (:meth:`_start`), what of it learns (:meth:`_learner`) and the cross-entropy share of its
    loss (:meth:`_ce_share`)."""

    kind = KIND
    requires = frozenset({"data"})
    same_spec = False
    retargetable = True

    def __init__(
        self,
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
        check_optimizer(optimizer)
        if lr <= 0 or weight_decay < 0 or epochs < 0 or batch_size < 1:
            raise ValueError(
                f"need lr > 0, weight_decay >= 0, epochs >= 0, batch_size >= 1; got "
                f"{lr}, {weight_decay}, {epochs}, {batch_size}"
            )
        if not 0 <= val_split < 1 or patience < 0:
            raise ValueError(
                f"need 0 <= val_split < 1 and patience >= 0, got {val_split}, {patience}"
            )
        if temperature <= 0 or not 0 <= ce_weight <= 1:
            raise ValueError(
                f"need temperature > 0, 0 <= ce_weight <= 1; got {temperature}, {ce_weight}"
            )
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

    def _ce_share(self) -> float:
        """The share of cross-entropy on the fusion labels in the loss (the rest: KD)."""
        return self.ce_weight

    def requirements(self) -> frozenset[str]:
        return self.requires | ({"labels"} if self._ce_share() > 0 else set())

    def needs(self) -> frozenset[str]:
        return self.requirements() | {"labels"}  # accuracy before/after, in the details

    def settings(self) -> FitSettings:
        ce = self._ce_share()
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

    @abstractmethod
    def _start(self, models: list[LeveledModel], target: ModelSpec) -> LeveledModel:
        """The model to train and return (a new one: ``models`` stay as they are)."""

    @abstractmethod
    def _learner(
        self, model: LeveledModel, data: torch.Tensor, device: torch.device
    ) -> tuple[nn.Module, torch.Tensor, dict[str, Any]]:
        """``model`` moved to ``device``; then the module of it that learns (its parameters with
        ``requires_grad``), the rows that module reads (on ``device``) and what the details say
        of them."""

    def _fuse(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec
    ) -> tuple[LeveledModel, dict[str, Any]]:
        started = time.perf_counter()
        device = resolve_device(self.device)
        data = inputs.data
        assert data is not None
        labels = inputs.labels
        teacher = ensemble_log_probs(models, data, device=device)
        model = self._start(models, target)
        module, rows, described = self._learner(model, data, device)
        before = agreement(predict(model, data, device=device), teacher, labels, self.temperature)
        info = fit_to_teacher(
            module,
            module,
            rows,
            teacher,
            labels,
            self.settings(),
            generator=torch.Generator().manual_seed(self.seed),
            progress=self.progress,
            description=self.name,
        )
        after = agreement(predict(model, data, device=device), teacher, labels, self.temperature)
        log.info(
            "%s: KL to the ensemble %.4f -> %.4f on the fusion set (%d epochs)",
            self.name,
            before["kl_to_ensemble"],
            after["kl_to_ensemble"],
            info["epochs_run"],
        )
        details = {
            "kind": KIND,
            **described,
            "settings": asdict(self.settings()),
            "training": info,
            "before": before,
            "after": after,
            "seconds": time.perf_counter() - started,
        }
        model.requires_grad_(True)
        return model.cpu().eval(), details


@register_fusion_method
class KnowledgeDistillation(FusionSetTraining):
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

    def __init__(
        self,
        student_init: str = "first",
        **inherited: Any,
    ) -> None:
        if student_init not in STUDENT_INITS:
            raise ValueError(f"student_init must be one of {STUDENT_INITS}, got {student_init!r}")
        super().__init__(**inherited)
        self.student_init = student_init

    def check_target(self, spec: ModelSpec, target: ModelSpec) -> None:
        if self.student_init != "fresh":
            raise ValueError(
                f"{self.name}: student_init={self.student_init!r} starts from the sites' models, "
                f"so it cannot fuse into the requested fused widths {list(target.widths)}; "
                "use student_init='fresh'"
            )

    def _start(self, models: list[LeveledModel], target: ModelSpec) -> LeveledModel:
        return initial_student(self.name, self.student_init, models, target, self.seed)

    def _learner(
        self, model: LeveledModel, data: torch.Tensor, device: torch.device
    ) -> tuple[nn.Module, torch.Tensor, dict[str, Any]]:
        student = model.to(device)
        student.requires_grad_(True)
        return student, data.to(device), {"student_init": self.student_init}


@register_fusion_method
class LinearProbe(FusionSetTraining):
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

    def __init__(
        self,
        target: str = "ensemble",
        *,
        body: int = 0,
        **inherited: Any,
    ) -> None:
        if target not in PROBE_TARGETS:
            raise ValueError(f"target must be one of {PROBE_TARGETS}, got {target!r}")
        super().__init__(**inherited)
        self.target = target
        self.body = body

    def _ce_share(self) -> float:
        return 1.0 if self.target == "labels" else self.ce_weight

    def check_target(self, spec: ModelSpec, target: ModelSpec) -> None:
        raise ValueError(
            f"{self.name}: the probe keeps a site's body, so the fused model has the sites' "
            f"widths {list(spec.widths)}, not the requested {list(target.widths)}"
        )

    def _fuse(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec
    ) -> tuple[LeveledModel, dict[str, Any]]:
        if self.body >= len(models):
            raise ValueError(f"{self.name}: body={self.body} but only {len(models)} models")
        base = models[self.body]
        if target != base.spec:
            raise ValueError(
                f"{self.name}: the probe keeps model {self.body}'s architecture "
                f"{base.spec.to_dict()}, not {target.to_dict()}"
            )
        return super()._fuse(models, inputs, target)

    def _start(self, models: list[LeveledModel], target: ModelSpec) -> LeveledModel:
        return copy.deepcopy(models[self.body])

    def _learner(
        self, model: LeveledModel, data: torch.Tensor, device: torch.device
    ) -> tuple[nn.Module, torch.Tensor, dict[str, Any]]:
        probe = model.to(device).eval()
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
        described = {
            "target": self.target,
            "body": self.body,
            "head_level": probe.level_name(head_index),
        }
        return head, features, described
