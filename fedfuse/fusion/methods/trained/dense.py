r"""DENSE (Zhang et al., NeurIPS 2022): data-free one-shot fusion by a generator trained
against the ensemble of the uploaded models, then distillation on what it generates.

The server holds no data. It alternates two stages, ``epochs`` times:

1. **Data generation.** A generator ``G`` maps noise ``z ~ N(0, I)`` to inputs ``x = G(z)``.
   With ``D`` the ensemble (the mean of the models' logits, as in the paper), ``S`` the
   student and ``y`` labels drawn uniformly, ``G`` minimises

   ``L_G = CE(D(x), y) + lambda_bn * L_BN(x) + lambda_adv * L_adv(x)``:

   * ``CE`` makes the ensemble confident of the drawn class (the samples lie in the models'
     class regions);
   * ``L_BN`` (every BatchNorm layer of every model) matches the batch's feature mean and
     variance to the layer's running statistics, the statistics of the site's own data:
     ``sum_layers ||mu(x) - mu_run||_2 + ||sigma^2(x) - sigma^2_run||_2`` (zero for models
     without BatchNorm);
   * ``L_adv = -KL(D(x) || S(x))`` on the samples where ``D`` and ``S`` predict the same
     class: samples on which the student has not yet learnt the ensemble, near the decision
     boundaries (the paper's boundary-support loss).

2. **Model distillation.** ``S`` minimises ``KL(D(x) || S(x))`` on fresh samples of ``G`` and
   on a memory of earlier batches (the paper keeps the synthetic data of earlier epochs so the
   student does not forget them).

The generator is DCGAN-like (a linear map to a quarter-size map, two upsampling convolutions,
BatchNorm and LeakyReLU, then a BatchNorm without affine parameters: the output has the scale of
normalised data). :func:`synthesize_fusion_set` trains the generator alone (no student, so no
``L_adv``) and returns samples and the ensemble's labels: a synthetic fusion set for the methods
that need one (``fusion-source=synthetic``).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from fedfuse.fusion.base import FusionInputs, FusionMethod
from fedfuse.fusion.methods.trained.teaching import initial_student
from fedfuse.fusion.registry import register_fusion_method
from fedfuse.models import LeveledModel, ModelSpec
from fedfuse.runtime import resolve_device

log = logging.getLogger(__name__)

STUDENT_INITS = ("fresh", "average", "first")
KIND = "trains on synthetic data"


class Generator(nn.Module):
    """DCGAN-like generator of inputs of ``shape`` (``C, H, W``; ``H``, ``W`` multiples of 4)
    from noise of ``latent`` dimensions and a class; a dense one for other shapes.

    The class enters as a one-hot vector beside the noise: an unconditional generator cannot
    know which of the uniformly drawn labels a sample is scored against, and lowers ``CE`` by
    making every sample ambiguous (measured: ``CE`` stalls at ``log C``)."""

    def __init__(
        self, shape: Sequence[int], classes: int, latent: int = 100, width: int = 64
    ) -> None:
        super().__init__()
        self.shape = tuple(int(d) for d in shape)
        self.latent = latent
        self.classes = classes
        inputs = latent + classes
        channels, *size = self.shape
        self.convolutional = len(size) == 2 and size[0] % 4 == 0 and size[1] % 4 == 0
        if self.convolutional:
            h, w = size[0] // 4, size[1] // 4
            self.start = (2 * width, h, w)
            self.project = nn.Linear(inputs, 2 * width * h * w)
            self.body = nn.Sequential(
                nn.BatchNorm2d(2 * width),
                nn.Upsample(scale_factor=2),
                nn.Conv2d(2 * width, 2 * width, 3, padding=1, bias=False),
                nn.BatchNorm2d(2 * width),
                nn.LeakyReLU(0.2),
                nn.Upsample(scale_factor=2),
                nn.Conv2d(2 * width, width, 3, padding=1, bias=False),
                nn.BatchNorm2d(width),
                nn.LeakyReLU(0.2),
                nn.Conv2d(width, channels, 3, padding=1),
                nn.BatchNorm2d(channels, affine=False),
            )
        else:
            features = int(torch.tensor(self.shape).prod())
            self.project = nn.Linear(inputs, 4 * width)
            self.body = nn.Sequential(
                nn.BatchNorm1d(4 * width),
                nn.LeakyReLU(0.2),
                nn.Linear(4 * width, features),
                nn.BatchNorm1d(features, affine=False),
            )

    def forward(self, z: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.project(torch.cat([z, F.one_hot(labels, self.classes).to(z.dtype)], 1))
        if self.convolutional:
            x = x.view(len(z), *self.start)
        return self.body(x).view(len(z), *self.shape)


class _BatchNormStatistics:
    """Forward hooks on every BatchNorm of the teachers, summing ``L_BN`` of the last pass."""

    def __init__(self, models: Sequence[nn.Module]) -> None:
        self.loss: torch.Tensor | float = 0.0
        self.handles = [
            module.register_forward_hook(self._hook)
            for model in models
            for module in model.modules()
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats
        ]

    def _hook(self, module: nn.Module, args: tuple[torch.Tensor, ...], _: Any) -> None:
        x = args[0]
        dims = [0, *range(2, x.dim())]
        mean, var = x.mean(dims), x.var(dims, unbiased=False)
        term = (mean - module.running_mean).norm() + (var - module.running_var).norm()
        self.loss = self.loss + term

    def take(self) -> torch.Tensor | float:
        loss, self.loss = self.loss, 0.0
        return loss

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _teacher_logits(models: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
    return torch.stack([m(x) for m in models]).mean(0)


def _kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor, reduce: bool = True):
    divergence = F.kl_div(
        F.log_softmax(student_logits, 1),
        F.log_softmax(teacher_logits, 1),
        log_target=True,
        reduction="none",
    ).sum(1)
    return divergence.mean() if reduce else divergence


class _Synthesis:
    """The generator and its training step against the teachers (and a student)."""

    def __init__(
        self,
        models: Sequence[nn.Module],
        shape: Sequence[int],
        classes: int,
        *,
        latent: int,
        lr: float,
        batch_size: int,
        bn_weight: float,
        adversarial_weight: float,
        generator: torch.Generator,
        device: torch.device,
    ) -> None:
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=generator)))
        self.generator = Generator(shape, classes, latent).to(device)
        self.optimizer = torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(0.5, 0.999))
        self.teachers = list(models)
        self.statistics = _BatchNormStatistics(self.teachers)
        self.classes = classes
        self.batch_size = batch_size
        self.bn_weight = bn_weight
        self.adversarial_weight = adversarial_weight
        self.rng = generator
        self.device = device
        self.latent = latent

    @classmethod
    def against(
        cls,
        models: Sequence[LeveledModel],
        spec: ModelSpec,
        *,
        seed: int,
        device: str,
        **options: Any,
    ) -> _Synthesis:
        """A synthesis of inputs of ``spec`` against frozen copies of ``models`` on ``device``
        (resolved), its noise and labels drawn from a generator seeded with ``seed`` (its
        ``rng``); ``options``: the constructor's ``latent``, ``lr``, ``batch_size``,
        ``bn_weight`` and ``adversarial_weight``. What :func:`synthesize_fusion_set` and
        :class:`Dense` both start from."""
        torch_device = resolve_device(device)
        return cls(
            _frozen(models, torch_device),
            spec.input_shape,
            spec.num_classes,
            generator=torch.Generator().manual_seed(seed),
            device=torch_device,
            **options,
        )

    def noise(self, count: int) -> torch.Tensor:
        return torch.randn(count, self.latent, generator=self.rng).to(self.device)

    def labels(self, count: int) -> torch.Tensor:
        return torch.randint(0, self.classes, (count,), generator=self.rng).to(self.device)

    def step(self, student: nn.Module | None) -> dict[str, float]:
        self.generator.train()
        labels = self.labels(self.batch_size)
        x = self.generator(self.noise(self.batch_size), labels)
        self.statistics.take()
        teacher = _teacher_logits(self.teachers, x)
        bn = self.statistics.take()
        loss = F.cross_entropy(teacher, labels) + self.bn_weight * bn
        adversarial = torch.zeros((), device=self.device)
        if student is not None and self.adversarial_weight > 0:
            own = student(x)
            agree = (teacher.argmax(1) == own.argmax(1)).float()
            adversarial = -(agree * _kl(teacher, own, reduce=False)).sum() / agree.sum().clamp_min(
                1
            )
            loss = loss + self.adversarial_weight * adversarial
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return {
            "loss": float(loss.detach()),
            "bn": float(bn.detach()) if isinstance(bn, torch.Tensor) else float(bn),
            "adversarial": float(adversarial.detach()),
        }

    @torch.no_grad()
    def sample(self, count: int) -> torch.Tensor:
        """``count`` samples (batch statistics, as in training: the generator's running
        statistics lag its fast-moving weights)."""
        self.generator.train()
        return torch.cat(
            [
                self.generator(self.noise(len(c)), self.labels(len(c)))
                for c in torch.arange(count).split(self.batch_size)
            ]
        )

    def close(self) -> None:
        self.statistics.remove()


def _frozen(models: Sequence[LeveledModel], device: torch.device) -> list[nn.Module]:
    teachers = [copy.deepcopy(m).to(device).eval() for m in models]
    for teacher in teachers:
        teacher.requires_grad_(False)
    return teachers


def synthesize_fusion_set(
    models: Sequence[LeveledModel],
    samples: int,
    *,
    epochs: int = 200,
    batch_size: int = 128,
    lr: float = 1e-3,
    bn_weight: float = 1.0,
    latent: int = 100,
    seed: int = 0,
    device: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic fusion set of ``samples`` inputs and the ensemble's labels, from DENSE's
    generator trained ``epochs`` steps against ``models`` (module docstring; no data)."""
    synthesis = _Synthesis.against(
        models,
        models[0].spec,
        seed=seed,
        device=device,
        latent=latent,
        lr=lr,
        batch_size=batch_size,
        bn_weight=bn_weight,
        adversarial_weight=0.0,
    )
    try:
        for _ in tqdm(range(epochs), desc="synthetic fusion set", disable=None, leave=False):
            synthesis.step(None)
        inputs = synthesis.sample(samples)
        with torch.no_grad():
            labels = _teacher_logits(synthesis.teachers, inputs).argmax(1)
    finally:
        synthesis.close()
    return inputs.cpu(), labels.cpu()


@dataclass
class SyntheticFusionSet:
    """A fusion set the server generates from the uploaded models (``fusion-source=synthetic``):
    pass it where a fusion set goes (``OneShotFusion(fusion_set=SyntheticFusionSet())``); it
    is made once the uploads are in, and only when a method of the run reads a fusion set.

    Args:
        samples: samples to generate.
        epochs, seed, device: :func:`synthesize_fusion_set`'s.
    """

    samples: int = 400
    epochs: int = 200
    seed: int = 0
    device: str = "auto"
    #: wall seconds of the last generation (None before one)
    seconds: float | None = None

    def generate(
        self, models: Sequence[LeveledModel], methods: Sequence[FusionMethod] = ()
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The synthetic fusion set of ``models`` (None when no method of ``methods`` reads a
        fusion set; every method is assumed to when none is given)."""
        if methods and not any(m.needs() & {"data", "labels"} for m in methods):
            return None
        started = time.perf_counter()
        generated = synthesize_fusion_set(
            list(models), self.samples, epochs=self.epochs, seed=self.seed, device=self.device
        )
        self.seconds = time.perf_counter() - started
        log.info("synthetic fusion set of %d samples in %.1f s", self.samples, self.seconds)
        return generated


@register_fusion_method
class Dense(FusionMethod):
    """DENSE: a generator trained against the uploaded models' ensemble, and a student distilled
    from the ensemble on its samples, in alternation (module docstring). No fusion set; the
    fused model is the student.

    Args:
        student_init: ``"fresh"`` (a new model, the paper's), ``"average"`` (the parameter
            average: for sites with a shared initialisation) or ``"first"`` (model 0).
        epochs: alternations of the two stages.
        generator_steps, student_steps: generator and student updates per epoch.
        batch_size: synthetic samples per step.
        memory: synthetic batches kept for the student (the oldest dropped first).
        lr, generator_lr: the student's (SGD, momentum 0.9) and the generator's (Adam) rates.
        bn_weight, adversarial_weight: ``lambda_bn`` and ``lambda_adv``.
        latent: the noise's dimensions.
        seed: seeds the generator, the noise, the labels and a fresh student.
        device: ``"auto"``, ``"cpu"`` or ``"cuda"``.
    """

    name = "dense"
    kind = KIND

    def __init__(
        self,
        student_init: str = "fresh",
        *,
        epochs: int = 60,
        generator_steps: int = 5,
        student_steps: int = 10,
        batch_size: int = 128,
        memory: int = 40,
        lr: float = 0.01,
        generator_lr: float = 1e-3,
        bn_weight: float = 1.0,
        adversarial_weight: float = 0.5,
        latent: int = 100,
        seed: int = 0,
        device: str = "auto",
    ) -> None:
        if student_init not in STUDENT_INITS:
            raise ValueError(f"{self.name}: student_init must be one of {STUDENT_INITS}")
        for option, value in (("lr", lr), ("generator_lr", generator_lr)):
            if not value > 0:
                raise ValueError(f"{self.name}: {option} must be > 0, got {value}")
        for option, value in (("bn_weight", bn_weight), ("adversarial_weight", adversarial_weight)):
            if not value >= 0:
                raise ValueError(f"{self.name}: {option} must be >= 0, got {value}")
        self.student_init = student_init
        self.epochs = epochs
        self.generator_steps = generator_steps
        self.student_steps = student_steps
        self.batch_size = batch_size
        self.memory = memory
        self.lr = lr
        self.generator_lr = generator_lr
        self.bn_weight = bn_weight
        self.adversarial_weight = adversarial_weight
        self.latent = latent
        self.seed = seed
        self.device = device

    def _fuse(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec
    ) -> tuple[LeveledModel, dict[str, Any]]:
        started = time.perf_counter()
        student = initial_student(self.name, self.student_init, models, target, self.seed)
        synthesis = _Synthesis.against(
            models,
            target,
            seed=self.seed,
            device=self.device,
            latent=self.latent,
            lr=self.generator_lr,
            batch_size=self.batch_size,
            bn_weight=self.bn_weight,
            adversarial_weight=self.adversarial_weight,
        )
        device, generator, teachers = synthesis.device, synthesis.rng, synthesis.teachers
        student = student.to(device)
        optimizer = torch.optim.SGD(student.parameters(), lr=self.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, max(self.epochs, 1))
        memory: list[tuple[torch.Tensor, torch.Tensor]] = []
        history = []
        try:
            for _ in tqdm(range(self.epochs), desc=self.name, disable=None, leave=False):
                student.eval()
                for _ in range(self.generator_steps):
                    generated = synthesis.step(student)
                x = synthesis.sample(self.batch_size)
                with torch.no_grad():
                    memory.append((x, _teacher_logits(teachers, x)))
                del memory[: -self.memory]
                student.train()
                kl = 0.0
                for _ in range(self.student_steps):
                    pick = int(torch.randint(0, len(memory), (1,), generator=generator))
                    batch, teacher = memory[pick]
                    loss = _kl(teacher, student(batch))
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
                    kl += float(loss.detach()) / self.student_steps
                scheduler.step()
                history.append({"student_kl": kl, **generated})
        finally:
            synthesis.close()
        details = {
            "kind": KIND,
            "student_init": self.student_init,
            "first_epoch": history[0] if history else None,
            "last_epoch": history[-1] if history else None,
            "seconds": time.perf_counter() - started,
        }
        return student.cpu().eval(), details


__all__ = ["Dense", "Generator", "SyntheticFusionSet", "synthesize_fusion_set"]
