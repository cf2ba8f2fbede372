"""Fine-tuning after fusion, the neuron-interpolation paper's optional last step (App. F.3).

A fused model can be trained a little more, either on the server's fusion set or on the sites'
own data in one more federated round whose results are averaged. Both are written here, without
Flower, and both return a *new* model: the zero-shot fused model stays as it was, so results
always report the two apart.

* :func:`finetune`: a few epochs of the sites' recipe (their optimizer, weight decay, batch size
  and augmentation) with the paper's fine-tuning schedule: a learning rate of ``3e-4`` annealed
  by cosine warm restarts (torch's ``CosineAnnealingWarmRestarts``, stepped per batch) down to
  ``1e-6``, and label smoothing 0.1. The paper fine-tunes for 200 epochs; fedfuse's presets use
  a few.
* FedAvg of the sites' fine-tuned models, weighted by their sample counts, is
  :class:`fedfuse.training.averaging.WeightedAverage`.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from fedfuse.data.augmentation import random_crop_flip
from fedfuse.models.capture import predict
from fedfuse.runtime import resolve_device, row_major
from fedfuse.training.loop import check_optimizer, make_optimizer, make_scheduler

log = logging.getLogger(__name__)

#: where fine-tuning after fusion trains: the server's fusion set, or the sites in one round
FINETUNE_DATA = ("fusion-set", "sites")


def finetune(
    model: nn.Module,
    data: torch.Tensor,
    labels: torch.Tensor,
    *,
    epochs: int,
    lr: float = 3e-4,
    min_lr: float = 1e-6,
    label_smoothing: float = 0.1,
    optimizer: str = "adamw",
    weight_decay: float = 0.0,
    momentum: float = 0.9,
    batch_size: int = 128,
    augment: bool = False,
    crop_padding: int = 4,
    restart_epochs: int = 0,
    seed: int = 0,
    device: str | torch.device = "auto",
    progress: bool = False,
    description: str = "fine-tune",
) -> tuple[nn.Module, dict[str, Any]]:
    r"""A copy of ``model`` trained for ``epochs`` on ``(data, labels)``; ``model`` is untouched.

    Minimises the label-smoothed cross-entropy by mini-batches of ``batch_size`` rows in a new
    random order each epoch, with :func:`~fedfuse.training.loop.make_optimizer` ``optimizer`` (SGD
    with Nesterov momentum ``momentum``, as the sites train) and a per-step learning rate
    :math:`\eta_{min} + (\eta - \eta_{min})\,\tfrac12 (1 + \cos(\pi\,\frac{s \bmod P}{P}))`
    that restarts every ``restart_epochs`` epochs (``P`` steps; 0: one cycle over all epochs).
    The model trains in train mode (BatchNorm statistics update, dropout is on) and is returned
    in eval mode on the device ``model`` was on. A last batch of one row is left out of each
    epoch (BatchNorm cannot normalise a single row); it is drawn in other epochs.

    Args:
        model: the fused model (any classifier whose outputs are logits).
        data: its training inputs (normalised); images ``(N, C, H, W)`` when ``augment``.
        labels: ``(N,)`` class labels.
        epochs: passes over the data (0 gives an unchanged copy).
        lr, min_lr: the learning rate at the start of every cycle and at its end.
        label_smoothing: of the training loss.
        optimizer, weight_decay, momentum, batch_size: the optimizer and its batches.
        augment, crop_padding: random crops (up to ``crop_padding`` pixels) and flips of every
            batch (:func:`~fedfuse.data.augmentation.random_crop_flip`).
        restart_epochs: epochs per cosine cycle (0: one cycle).
        seed: seeds the batch order, the augmentation and any dropout; one seed, one result.
        device: where to train (``auto``: CUDA when present).
        progress, description: a progress bar over epochs, and the label of logs and the bar.

    Returns:
        The fine-tuned copy and its details: settings, steps, the mean training loss of each
        epoch, and the plain cross-entropy and accuracy on ``(data, labels)`` before and after.
    """
    _check(data, labels, epochs, lr, min_lr, label_smoothing, optimizer, batch_size, augment)
    data = row_major(data)  # batches in NCHW whatever order the caller's tensor has
    if restart_epochs < 0:
        raise ValueError(f"{description}: restart_epochs must be >= 0, got {restart_epochs}")
    started = time.perf_counter()
    compute = resolve_device(device)
    home = next(model.parameters()).device
    tuned = copy.deepcopy(model).to(compute)
    n = len(data)
    usable = n - 1 if n > 1 and n % batch_size == 1 else n  # no last batch of a single row
    steps_per_epoch = math.ceil(usable / batch_size)
    period = (restart_epochs or epochs) * steps_per_epoch
    generator = torch.Generator().manual_seed(seed)
    opt = make_optimizer(
        optimizer, tuned.parameters(), lr, weight_decay, momentum=momentum, nesterov=True
    )
    schedule = make_scheduler(
        opt, "cosine-restarts", epochs * steps_per_epoch, floor=min_lr / lr, period=period
    )
    before = _scores(tuned, data, labels, compute)
    epoch_losses: list[float] = []
    forked = [compute] if compute.type == "cuda" else []
    with torch.random.fork_rng(devices=forked):
        torch.manual_seed(seed)  # dropout draws from the global stream; fork_rng restores it
        bar = tqdm(range(epochs), desc=description, disable=None if progress else True)
        for epoch in bar:
            tuned.train()
            order = torch.randperm(n, generator=generator)[:usable]
            running = 0.0
            for start in range(0, usable, batch_size):
                index = order[start : start + batch_size]
                inputs = data[index]
                if augment:
                    inputs = random_crop_flip(inputs, generator, padding=crop_padding)
                inputs, targets = inputs.to(compute), labels[index].to(compute)
                loss = F.cross_entropy(tuned(inputs), targets, label_smoothing=label_smoothing)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                schedule.step()
                running += loss.item() * len(index)
            epoch_losses.append(running / max(1, usable))
            bar.set_postfix(loss=f"{epoch_losses[-1]:.4f}", refresh=False)
            log.debug("%s: epoch %d/%d loss %.4f", description, epoch + 1, epochs, epoch_losses[-1])
    tuned.eval()
    after = _scores(tuned, data, labels, compute)
    tuned.to(home)
    seconds = time.perf_counter() - started
    log.info(
        "%s: %d epochs on %d samples in %.1f s, loss %.4f -> %.4f, accuracy %.4f -> %.4f",
        description,
        epochs,
        n,
        seconds,
        before["loss"],
        after["loss"],
        before["accuracy"],
        after["accuracy"],
    )
    details = {
        "epochs": epochs,
        "samples": n,
        "steps": epochs * steps_per_epoch,
        "batch_size": batch_size,
        "optimizer": optimizer,
        "lr": lr,
        "min_lr": min_lr,
        "restart_epochs": restart_epochs,
        "label_smoothing": label_smoothing,
        "augment": augment,
        "seed": seed,
        "train_losses": epoch_losses,
        "loss_before": before["loss"],
        "loss_after": after["loss"],
        "accuracy_before": before["accuracy"],
        "accuracy_after": after["accuracy"],
        "seconds": seconds,
    }
    return tuned, details


def _check(
    data: torch.Tensor,
    labels: torch.Tensor,
    epochs: int,
    lr: float,
    min_lr: float,
    label_smoothing: float,
    optimizer: str,
    batch_size: int,
    augment: bool,
) -> None:
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
        raise ValueError(f"fine-tuning epochs must be an integer >= 0, got {epochs!r}")
    if not lr > 0 or not 0 <= min_lr <= lr:
        raise ValueError(f"fine-tuning needs lr > 0 and 0 <= min_lr <= lr, got {lr}, {min_lr}")
    if not 0 <= label_smoothing < 1:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    check_optimizer(optimizer)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if len(data) == 0 or labels.ndim != 1 or len(labels) != len(data):
        raise ValueError(
            f"fine-tuning needs samples with one label each, got data of shape "
            f"{tuple(data.shape)} and labels of shape {tuple(labels.shape)}"
        )
    if augment and data.ndim != 4:
        raise ValueError(
            f"augmented fine-tuning needs images (N, C, H, W), got shape {tuple(data.shape)}"
        )


def _scores(
    model: nn.Module, data: torch.Tensor, labels: torch.Tensor, device: torch.device
) -> dict[str, float]:
    """Plain cross-entropy and accuracy of ``model`` on the data (eval mode)."""
    logits = predict(model, data, device=device)
    return {
        "loss": F.cross_entropy(logits, labels).item(),
        "accuracy": (logits.argmax(1) == labels).double().mean().item(),
    }
