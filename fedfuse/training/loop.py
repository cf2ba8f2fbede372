"""Training, written once: optimizers, learning-rate schedules, the sites' local training, and
the early-stopping fit that every fusion method which trains uses.

* :func:`make_optimizer` and :func:`make_scheduler` are the only places an optimizer or a
  schedule is built (local training, gradient fitting of neuron interpolation, KD, linear
  probing, FS-Merge, post-fusion fine-tuning in :mod:`fedfuse.training.finetune`); each name means
  one thing, below.
* :func:`train` is the sites' recipe: AdamW or SGD with a linear warm-up into cosine decay,
  label smoothing, optional batch-wise crop/flip augmentation, deterministic by seed.
* :func:`fit_with_early_stopping` minimises a loss over the rows of a fixed set (a fusion set,
  its features, or level outputs) with a held-out split (:func:`holdout_split`), patience, and
  the best state kept.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from fedfuse.data import ImageDataset
from fedfuse.data.augmentation import random_crop_flip
from fedfuse.models.capture import predict
from fedfuse.runtime import resolve_device

log = logging.getLogger(__name__)

#: optimizer names of :func:`make_optimizer`
OPTIMIZERS = ("adamw", "adam", "sgd")
#: schedule names of :func:`make_scheduler`
SCHEDULERS = ("constant", "cosine", "cosine-restarts", "step")


def make_optimizer(
    name: str,
    params: Iterable[nn.Parameter],
    lr: float,
    weight_decay: float = 0.0,
    *,
    momentum: float = 0.0,
    nesterov: bool = False,
) -> torch.optim.Optimizer:
    """The optimizer ``name`` over ``params``; every caller states its SGD momentum.

    * ``"adamw"``: AdamW (Loshchilov & Hutter), weight decay decoupled from the gradient.
    * ``"adam"``: Adam, weight decay added to the gradient (L2).
    * ``"sgd"``: SGD with heavy-ball ``momentum`` (Nesterov's variant when ``nesterov``) and L2
      weight decay. ``momentum`` and ``nesterov`` apply to SGD only.

    What each caller passes for SGD: local training ``TrainConfig.momentum`` (0.9), Nesterov;
    KD and the linear probe 0.9, Nesterov; neuron interpolation's Gradient variant (Table 9,
    Setting 2) 0.9, classical; FS-Merge App. E.1's momentum (0.9 or 0.8), classical.
    """
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if name == "sgd":
        return torch.optim.SGD(
            params, lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov
        )
    raise ValueError(f"unknown optimizer {name!r}; choose one of {OPTIMIZERS}")


def check_optimizer(name: str) -> None:
    """Raise ValueError, naming the choices, unless ``name`` is one of :data:`OPTIMIZERS` (the
    one check of every option that picks an optimizer)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")


def lr_factor(
    name: str,
    step: int,
    total_steps: int,
    *,
    warmup_steps: int = 0,
    floor: float = 0.0,
    milestones: Sequence[int] = (),
    gamma: float = 0.1,
    period: int = 0,
) -> float:
    r"""The learning-rate multiplier of schedule ``name`` at optimizer step ``step`` (from 0).

    * ``"constant"``: 1.
    * ``"cosine"``: ``(step + 1) / warmup_steps`` during the warm-up, then one half cosine from 1
      down to ``floor`` over the remaining steps,
      :math:`f + (1 - f)\,\tfrac12 (1 + \cos(\pi \min(1, \frac{s - w}{\max(1, T - w)})))`.
    * ``"cosine-restarts"``: a half cosine from 1 down to ``floor`` over every ``period`` steps,
      starting again at 1 after each (torch's ``CosineAnnealingWarmRestarts`` with
      ``T_mult=1``, stepped per batch), :math:`f + (1 - f)\,\tfrac12 (1 + \cos(\pi
      \frac{s \bmod P}{P}))`; ``period`` 0 means one cycle over ``total_steps``.
    * ``"step"``: ``gamma`` to the power of the number of ``milestones`` reached.
    """
    if name == "constant":
        return 1.0
    if name == "cosine-restarts":
        cycle = period if period > 0 else max(1, total_steps)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * (step % cycle) / cycle))
    if name == "step":
        return gamma ** sum(step >= m for m in milestones)
    if name != "cosine":
        raise ValueError(f"unknown schedule {name!r}; choose one of {SCHEDULERS}")
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def make_scheduler(
    optimizer: torch.optim.Optimizer, name: str, total_steps: int, **options: Any
) -> torch.optim.lr_scheduler.LambdaLR:
    """The per-step schedule :func:`lr_factor` ``name``; ``step()`` it after each optimizer step.

    ``options`` are :func:`lr_factor`'s keywords (``warmup_steps``, ``floor``, ``milestones``,
    ``gamma``, ``period``).
    """
    if name not in SCHEDULERS:
        raise ValueError(f"unknown schedule {name!r}; choose one of {SCHEDULERS}")
    if "milestones" in options:  # read at every step: an iterator would run dry
        options["milestones"] = tuple(options["milestones"])
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, functools.partial(lr_factor, name, total_steps=total_steps, **options)
    )


# ---------------------------------------------------------------------------------- local training
@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of local training (defaults follow the paper's App. E where they apply).

    ``optimizer`` is a :func:`make_optimizer` name; SGD uses ``momentum`` with Nesterov's
    variant. The learning rate warms up linearly over ``warmup_epochs``, then follows one cosine
    cycle down to ``min_lr``.
    """

    epochs: int = 5
    batch_size: int = 128
    optimizer: str = "adamw"
    lr: float = 1e-3
    min_lr: float = 1e-5
    weight_decay: float = 1e-4
    momentum: float = 0.9
    warmup_epochs: float = 1.0
    label_smoothing: float = 0.1
    augment: bool = False

    def __post_init__(self) -> None:
        check_optimizer(self.optimizer)
        if self.epochs < 0 or self.batch_size < 1 or self.lr <= 0:
            raise ValueError(f"invalid training config {asdict(self)}")


@dataclass(frozen=True)
class EvalResult:
    """Accuracy and mean cross-entropy of a classifier on a dataset."""

    accuracy: float
    loss: float
    num_examples: int


def iterate_batches(
    dataset: ImageDataset,
    batch_size: int,
    *,
    shuffle: bool,
    generator: torch.Generator | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield normalised ``(inputs, labels)`` batches straight from the dataset's tensors."""
    order = (
        torch.randperm(len(dataset), generator=generator) if shuffle else torch.arange(len(dataset))
    )
    for start in range(0, len(dataset), batch_size):
        index = order[start : start + batch_size]
        yield dataset.inputs(index), dataset.labels[index]


def _augment(x: torch.Tensor, generator: torch.Generator, padding: int = 4) -> torch.Tensor:
    """Random crop (from the zero-padded image) and horizontal flip, drawn per sample."""
    return random_crop_flip(x, generator, padding=padding)


def train(
    model: nn.Module,
    dataset: ImageDataset,
    config: TrainConfig = TrainConfig(),
    *,
    seed: int = 0,
    device: str | torch.device = "auto",
    progress: bool = True,
    description: str = "train",
) -> list[float]:
    """Train ``model`` in place on ``dataset``; returns the mean training loss of each epoch."""
    if len(dataset) == 0:
        raise ValueError(f"{description}: cannot train on an empty dataset")
    compute = resolve_device(device)
    generator = torch.Generator().manual_seed(seed)
    model.to(compute).train()
    optimizer = make_optimizer(
        config.optimizer,
        model.parameters(),
        config.lr,
        config.weight_decay,
        momentum=config.momentum,
        nesterov=True,
    )
    steps_per_epoch = math.ceil(len(dataset) / config.batch_size)
    scheduler = make_scheduler(
        optimizer,
        "cosine",
        config.epochs * steps_per_epoch,
        warmup_steps=round(config.warmup_epochs * steps_per_epoch),
        floor=config.min_lr / config.lr,
    )
    epoch_losses: list[float] = []
    for epoch in range(config.epochs):
        running, seen = 0.0, 0
        batches = iterate_batches(dataset, config.batch_size, shuffle=True, generator=generator)
        bar = tqdm(
            batches,
            total=steps_per_epoch,
            disable=None if progress else True,
            leave=False,
            desc=f"{description} epoch {epoch + 1}/{config.epochs}",
        )
        for inputs, labels in bar:
            if config.augment:
                inputs = _augment(inputs, generator)
            inputs, labels = inputs.to(compute), labels.to(compute)
            loss = F.cross_entropy(model(inputs), labels, label_smoothing=config.label_smoothing)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            running += loss.item() * len(labels)
            seen += len(labels)
            bar.set_postfix(loss=f"{running / seen:.4f}", refresh=False)
        epoch_losses.append(running / seen)
        log.info("%s: epoch %d/%d loss %.4f", description, epoch + 1, config.epochs, running / seen)
    model.eval()
    return epoch_losses


def evaluate(
    model: nn.Module,
    dataset: ImageDataset,
    *,
    batch_size: int = 1024,
    device: str | torch.device = "auto",
) -> EvalResult:
    """Top-1 accuracy and mean cross-entropy of ``model``'s outputs treated as logits."""
    logits = predict(model, dataset.inputs(), batch_size=batch_size, device=device)
    labels = dataset.labels
    accuracy = (logits.argmax(1) == labels).float().mean().item()
    loss = F.cross_entropy(logits, labels).item()
    return EvalResult(accuracy=accuracy, loss=loss, num_examples=len(labels))


# ---------------------------------------------------------------------------------- early stopping
def check_val_split(val_split: float) -> None:
    """Raise ValueError unless ``val_split``, a share held out for validation, is in [0, 1)."""
    if not 0 <= val_split < 1:
        raise ValueError(f"val_split must be in [0, 1), got {val_split}")


def holdout_split(
    n: int, val_split: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, validation)`` row indices of ``n`` rows: a random share ``val_split`` held out.

    Sets of fewer than 10 rows hold nothing out (the fit then monitors its training rows). One
    ``randperm`` of ``n`` is drawn from ``generator``.
    """
    check_val_split(val_split)
    order = torch.randperm(n, generator=generator)
    n_val = int(round(val_split * n)) if n >= 10 else 0
    return order[n_val:], order[:n_val]


@dataclass
class FitResult:
    """What :func:`fit_with_early_stopping` did.

    Attributes:
        initial_loss: the monitored loss of the starting state.
        best_loss: the monitored loss of the state kept (``inf`` if none qualified).
        final_loss: the last monitored loss measured.
        best_epoch: the epoch whose state was kept (0: the starting state).
        epochs_run: epochs trained before stopping.
        monitored: ``"validation"`` or ``"training"`` (no rows held out).
        validation_samples: rows held out.
        train_curve: mean training loss of each epoch (over its optimizer steps).
        curve: ``(epoch, monitored loss)`` at each evaluation, ``(0, initial_loss)`` first.
    """

    initial_loss: float
    best_loss: float
    final_loss: float
    best_epoch: int
    epochs_run: int
    monitored: str
    validation_samples: int
    train_curve: list[float] = field(default_factory=list)
    curve: list[tuple[int, float]] = field(default_factory=list)


def fit_with_early_stopping(
    module: nn.Module,
    loss_of: Callable[[torch.Tensor], torch.Tensor],
    split: tuple[torch.Tensor, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    *,
    epochs: int,
    batch_size: int | None,
    patience: int,
    generator: torch.Generator,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    eval_every: int = 1,
    eval_batch_size: int | None = None,
    min_delta: float = 1e-12,
    keep_initial: bool = True,
    progress: bool = False,
    description: str = "fit",
) -> FitResult:
    """Minimise ``loss_of(rows)`` by mini-batch steps over the training rows; keep the best state.

    The loop every fusion method that trains shares (gradient fitting, KD, the linear probe,
    FS-Merge). Each epoch visits the training rows of ``split = (train, validation)`` (see
    :func:`holdout_split`) in batches of ``batch_size`` (None: one batch of all), in a new
    order drawn from ``generator`` unless one batch holds them all; after each optimizer step
    ``scheduler`` steps. Every ``eval_every`` epochs (and after the last) the loss on the
    validation rows (on the training rows when none are held out) is measured without gradients
    in eval mode, in chunks of ``eval_batch_size`` rows (None: all at once), averaged by rows.
    A loss below the best by more than ``min_delta`` makes that state the best; after
    ``patience`` evaluations without one training stops (0: never), as it does when the loss
    is not finite. The best state is loaded into ``module`` (left in eval mode) at the end.

    Args:
        module: holds the parameters ``optimizer`` updates; its state is what is kept.
        loss_of: mean loss over a 1-D tensor of row indices (on the split's device).
        split: training and validation row indices.
        optimizer: from :func:`make_optimizer`.
        epochs, batch_size, patience, generator: as above.
        scheduler: from :func:`make_scheduler`, or None for a constant learning rate.
        eval_every, eval_batch_size, min_delta: as above.
        keep_initial: whether the starting state competes for the best (else the first finite
            evaluation after training is the first best).
        progress, description: a progress bar over epochs, and its label.
    """
    if epochs < 0 or patience < 0 or eval_every < 1:
        raise ValueError(
            f"{description}: need epochs >= 0, patience >= 0 and eval_every >= 1; got "
            f"{epochs}, {patience}, {eval_every}"
        )
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"{description}: batch_size must be >= 1 or None, got {batch_size}")
    train_rows, val_rows = split
    monitor = val_rows if len(val_rows) else train_rows
    batch = len(train_rows) if batch_size is None else min(batch_size, len(train_rows))
    batch = max(batch, 1)

    @torch.no_grad()
    def evaluate() -> float:
        was_training = module.training
        module.eval()
        chunk = eval_batch_size or max(1, len(monitor))
        total = 0.0
        for start in range(0, len(monitor), chunk):
            part = monitor[start : start + chunk]
            total += float(loss_of(part)) * len(part)
        module.train(was_training)
        return total / max(1, len(monitor))

    initial = evaluate()
    best = initial if keep_initial else math.inf
    best_epoch, stale, epoch = 0, 0, 0
    best_state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    curve: list[tuple[int, float]] = [(0, initial)]
    train_curve: list[float] = []
    bar = tqdm(range(epochs), desc=description, disable=not progress, leave=False)
    for epoch in bar:
        module.train()
        order = train_rows
        if batch < len(train_rows):
            shuffle = torch.randperm(len(train_rows), generator=generator)
            order = train_rows[shuffle.to(train_rows.device)]
        running = torch.zeros((), dtype=torch.float64, device=train_rows.device)
        for start in range(0, len(order), batch):
            rows = order[start : start + batch]
            optimizer.zero_grad(set_to_none=True)
            loss = loss_of(rows)
            loss.backward()
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            running += loss.detach().double() * len(rows)
        train_curve.append(float(running) / max(1, len(train_rows)))
        done = epoch + 1
        if done % eval_every and done != epochs:
            continue
        current = evaluate()
        curve.append((done, current))
        bar.set_postfix(loss=f"{current:.4g}", refresh=False)
        if not math.isfinite(current):
            log.warning(
                "%s: the loss diverged at epoch %d (learning rate too large?); keeping the "
                "best state, from epoch %d",
                description,
                done,
                best_epoch,
            )
            break
        if current < best - min_delta:
            best, best_epoch, stale = current, done, 0
            best_state = {k: v.detach().clone() for k, v in module.state_dict().items()}
        else:
            stale += 1
            if patience and stale >= patience:
                break
    module.load_state_dict(best_state)
    module.eval()
    return FitResult(
        initial_loss=initial,
        best_loss=best,
        final_loss=curve[-1][1],
        best_epoch=best_epoch,
        epochs_run=epoch + 1 if epochs else 0,
        monitored="validation" if len(val_rows) else "training",
        validation_samples=len(val_rows),
        train_curve=train_curve,
        curve=curve,
    )
