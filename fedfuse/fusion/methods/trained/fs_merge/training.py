r"""Training FS-Merge's SuperNets: the objectives, the reconstruction loss and its schedule.

Only the merge/unmerge parameters learn; the loss is the squared error between the base models'
own features and the SuperNet's reconstruction of them, on the fusion set's inputs (no labels),
minimised by :func:`~fedfuse.training.loop.fit_with_early_stopping` with the paper's optimiser and
schedule (:func:`paper_schedule`) unless the options say otherwise.

Objectives (no labels; the fusion set's inputs only):

* ``"local"`` (Eq. 3; the paper's MLP method, Sec. 3.1): one problem per hidden level, on the
  base models' *own* pre-activations,
  :math:`\min_{M_l,U_l} \mathbb{E}_x\lVert f_l^1\Vert\dots\Vert f_l^K - U_l\sigma(M_lz_l)\rVert^2`.
* ``"global"`` (Eq. 4): all :math:`M_l, U_l` at once, the SuperNet run end to end from the input
  (each level fed with the previous reconstruction), reconstructing the features the classifier
  sees, :math:`\min \mathbb{E}_x \lVert f_L^1\Vert\dots\Vert f_L^K - \tilde f_L(x)\rVert^2`.

Both compare *post-activation* targets (the input of the next affine level, after pooling for a
CNN) with the reconstruction; the squared error is averaged over samples, positions and channels,
and with ``normalize_targets`` each model's block is divided by the mean square of its targets
("we normalized the target features of the two models to the same scale", App. E.1).

**Hyper-parameters** (App. E.1, MNIST, selected by the authors' validation search): full-batch
gradient descent with momentum on the fusion set (``batch_size=None``), lr 0.1; local: 15k epochs,
momentum 0.9, step schedule with two drops by 0.9; global: 1k epochs, momentum 0.8, one cosine
cycle with 20 warm-up epochs (global + ZipIt: 10k epochs, momentum 0.9). The MLP rank is not
stated in the paper; the default ``rank=12`` is its choice for pairs of ViT-B-16 and BERT
(Table 3, App. F.7). The default variant, global + ZipIt, is the paper's best MLP merge in *joint*
accuracy (one prediction over all classes, Tables 11, 12, 15), which is what a single fused head
over a shared label space is evaluated on; local + ZipIt is its best *per-task* variant (Table 2),
and the paper names the global objective as a key reason FS-Merge works (Sec. 4, App. G.3).
These schedules are long for a CPU (a full-batch step costs a forward and backward pass of the
SuperNet over the whole fusion set, for every base model), so the default recipe is ``"fast"``
(:func:`recipe_schedule`): Adam with lr 0.01 for 300 full-batch epochs on one cosine cycle. It
was chosen on the reconstruction loss it reaches on the fusion set (lower than App. E.1's SGD
after 10k epochs on the 2-site MLPs and 5-site LeNet-5s of ``docs/results.md``), not on test
accuracy; ``recipe="paper"`` restores App. E.1.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fedfuse.fusion.methods.trained.fs_merge.initialisation import initial_pair
from fedfuse.fusion.methods.trained.fs_merge.matrices import FoldableMatrix
from fedfuse.fusion.methods.trained.fs_merge.supernet import FoldableSuperNet, StackedLevel
from fedfuse.models import LeveledModel
from fedfuse.models.capture import capture_levels
from fedfuse.training.loop import fit_with_early_stopping, make_optimizer, make_scheduler

log = logging.getLogger(__name__)

OBJECTIVES = ("local", "global")
#: warm-up epochs of the cosine schedule (App. E.1), capped at a tenth of a short run
COSINE_WARMUP_EPOCHS = 20
#: the step schedule's decay per drop and its two drops (App. E.1), at 1/3 and 2/3 of the run
STEP_GAMMA = 0.9


#: the training recipes: ``"fast"`` (Adam, a few hundred full-batch epochs) and ``"paper"``
#: (App. E.1's gradient descent with momentum, 1k-15k epochs)
RECIPES = ("fast", "paper")
#: the fast recipe: epochs and Adam's learning rate (one cosine cycle with warm-up)
FAST_EPOCHS = 300
FAST_LR = 0.01


@dataclass(frozen=True)
class FSMergeSchedule:
    """Optimisation hyper-parameters of one FS-Merge variant."""

    epochs: int
    lr: float
    momentum: float
    scheduler: str
    optimizer: str = "sgd"


def paper_schedule(objective: str, init: str) -> FSMergeSchedule:
    """The App. E.1 (MNIST) hyper-parameters for ``objective`` and ``init``.

    The paper tunes the local problem from a random initialisation and uses the same setting
    for its ZipIt initialisation (Sec. 3.1); the global problem was tuned separately for the
    "average" (also used here for "first") and the ZipIt initialisations.
    """
    if objective == "local":
        return FSMergeSchedule(epochs=15_000, lr=0.1, momentum=0.9, scheduler="step")
    if init == "zipit":
        return FSMergeSchedule(epochs=10_000, lr=0.1, momentum=0.9, scheduler="cosine")
    return FSMergeSchedule(epochs=1_000, lr=0.1, momentum=0.8, scheduler="cosine")


def recipe_schedule(recipe: str, objective: str, init: str) -> FSMergeSchedule:
    """The schedule of ``recipe``: App. E.1's (``"paper"``), or ``"fast"``: Adam (lr
    :data:`FAST_LR`, betas 0.9/0.999) for :data:`FAST_EPOCHS` full-batch epochs on one cosine
    cycle with warm-up, every objective and initialisation."""
    if recipe == "paper":
        return paper_schedule(objective, init)
    if recipe != "fast":
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    return FSMergeSchedule(
        epochs=FAST_EPOCHS, lr=FAST_LR, momentum=0.9, scheduler="cosine", optimizer="adam"
    )


@dataclass(frozen=True)
class FitOptions:
    """How :func:`optimise` minimises the loss:
    :class:`~fedfuse.fusion.methods.trained.fs_merge.FSMerge`'s options of the same names."""

    weight_decay: float = 0.0
    batch_size: int | None = None
    normalize_targets: bool = True
    patience: int = 0
    eval_points: int = 100
    progress: bool = False


def reconstruction_weights(
    targets: torch.Tensor, rows: torch.Tensor, count: int, normalize: bool
) -> torch.Tensor:
    """Per-channel weights of the squared error, broadcastable to ``targets`` ``(N, K d, ...)``.

    ``normalize``: each model's block of ``d`` channels gets one over the mean square of its
    targets on ``rows`` (App. E.1); else every channel weighs 1.
    """
    shape = [1, -1] + [1] * (targets.dim() - 2)
    if normalize:
        blocks = targets[rows].split(targets.shape[1] // count, dim=1)
        scales = torch.stack([(b.double() ** 2).mean() for b in blocks]).clamp_min(1e-12)
        width = targets.shape[1] // count
        weights = (1.0 / scales).float().repeat_interleave(width)
    else:
        weights = torch.ones(targets.shape[1], device=targets.device)
    return weights.view(shape).to(targets.device)


def take_rows(tensor: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``tensor[idx]``, or ``tensor`` itself when ``idx`` lists all of its rows (full-batch
    steps): a mean over rows does not depend on their order, and the copy of every captured
    feature map would cost a tenth of an epoch."""
    return tensor if len(idx) == len(tensor) else tensor[idx]


def optimise(
    net: nn.Module,
    predict: Callable[[torch.Tensor], torch.Tensor],
    targets: torch.Tensor,
    count: int,
    split: tuple[torch.Tensor, torch.Tensor],
    schedule: FSMergeSchedule,
    generator: torch.Generator,
    description: str,
    options: FitOptions,
) -> dict[str, Any]:
    """Minimise the (normalised) reconstruction error of ``predict(idx)`` to ``targets[idx]``.

    :func:`~fedfuse.training.loop.fit_with_early_stopping`, evaluating the monitored loss
    (validation rows if any, else training rows) about ``eval_points`` times and keeping the
    best parameters; ``"sgd"`` is classical momentum ``schedule.momentum`` (Adam ignores it).
    """
    train = split[0]
    weights = reconstruction_weights(targets, train, count, options.normalize_targets)

    def loss_of(idx: torch.Tensor) -> torch.Tensor:
        return (((predict(idx) - take_rows(targets, idx)) ** 2) * weights).mean()

    params = [p for p in net.parameters() if p.requires_grad]
    optim = make_optimizer(
        schedule.optimizer, params, schedule.lr, options.weight_decay, momentum=schedule.momentum
    )
    batch_size = options.batch_size
    batch = len(train) if batch_size is None else min(batch_size, len(train))
    steps_per_epoch = max(1, math.ceil(len(train) / batch))
    epochs = schedule.epochs
    milestones = [round(epochs / 3) * steps_per_epoch, round(2 * epochs / 3) * steps_per_epoch]
    scheduler = make_scheduler(
        optim,
        schedule.scheduler,
        epochs * steps_per_epoch,
        warmup_steps=min(COSINE_WARMUP_EPOCHS, epochs // 10) * steps_per_epoch,
        milestones=[m for m in milestones if m > 0],
        gamma=STEP_GAMMA,
    )
    fit = fit_with_early_stopping(
        net,
        loss_of,
        split,
        optim,
        epochs=epochs,
        batch_size=batch_size,
        patience=options.patience,
        generator=generator,
        scheduler=scheduler,
        eval_every=max(1, epochs // options.eval_points),
        eval_batch_size=batch_size,
        min_delta=0.0,
        progress=options.progress,
        description=description,
    )
    return {
        "initial_loss": fit.initial_loss,
        "best_loss": fit.best_loss,
        "final_loss": fit.final_loss,
        "best_epoch": fit.best_epoch,
        "epochs_run": fit.epochs_run,
        "monitored": fit.monitored,
        "curve": fit.curve,
    }


@dataclass
class LevelTraining:
    """The trained merge/unmerge matrices of the hidden levels (bottom-up) and the report."""

    merges: list[FoldableMatrix]
    unmerges: list[FoldableMatrix]
    details: dict[str, Any]  # "levels" (local) or "training" (global), and "loss"
    init_seconds: float
    train_seconds: float


def capture_outputs(
    models: Sequence[LeveledModel],
    data: torch.Tensor,
    levels: Sequence[int],
    device: torch.device,
    batch_size: int,
) -> list[dict[int, torch.Tensor]]:
    """Per model, the outputs of ``levels`` on ``data`` (kept on ``device``)."""
    return [
        {
            index: io.outputs
            for index, io in capture_levels(
                m,
                data,
                sorted(set(levels)),
                batch_size=batch_size,
                device=device,
                store_device=device,
                keep_inputs=False,
            ).items()
        }
        for m in models
    ]


def train_levels(
    frozen: Sequence[LeveledModel],
    data: torch.Tensor,
    split: tuple[torch.Tensor, torch.Tensor],
    schedule: FSMergeSchedule,
    generator: torch.Generator,
    device: torch.device,
    *,
    objective: str,
    init: str,
    rank: int,
    options: FitOptions,
    batch_size_capture: int,
    name: str,
) -> LevelTraining:
    """The level-wise SuperNet of the frozen models ``frozen`` (on ``device``) trained on
    ``objective``: ``"local"`` one hidden level at a time, ``"global"`` all at once (nothing
    to train without a hidden level); each level's pair initialised as ``init`` says."""
    neuron_levels = frozen[0].neuron_levels
    hidden = neuron_levels[:-1]
    widths = [frozen[0].level_width(i) for i in hidden]
    count = len(frozen)
    between = [
        nn.Sequential(*frozen[0].levels[a + 1 : b])
        for a, b in zip(neuron_levels[:-1], neuron_levels[1:], strict=True)
    ]
    merges: list[FoldableMatrix] = []
    unmerges: list[FoldableMatrix] = []
    init_seconds = train_seconds = 0.0
    details: dict[str, Any]
    if objective == "local":
        levels_info = []
        for position, index in enumerate(hidden):
            tic = time.perf_counter()
            target_level = neuron_levels[position + 1] - 1
            captured = capture_outputs(
                frozen, data, [index, target_level], device, batch_size_capture
            )
            z = torch.cat([c[index] for c in captured], 1)
            targets = torch.cat([c[target_level] for c in captured], 1)
            pair = initial_pair(
                init, [c[target_level] for c in captured], widths[position], rank, generator
            )
            merges.append(pair[0].to(device))
            unmerges.append(pair[1].to(device))
            net = FoldableSuperNet(merges[-1:], unmerges[-1:], between[position : position + 1])
            init_seconds += time.perf_counter() - tic
            tic = time.perf_counter()
            info = optimise(
                net,
                lambda idx, z=z, net=net: net.level(0, take_rows(z, idx)),
                targets,
                count,
                split,
                schedule,
                generator,
                f"{name} level {frozen[0].level_name(index)}",
                options,
            )
            seconds = time.perf_counter() - tic
            train_seconds += seconds
            info.update(level=frozen[0].level_name(index), seconds=seconds)
            levels_info.append(info)
            log.info(
                "%s level %s: loss %.4g -> %.4g in %d epochs (%.1f s)",
                name,
                info["level"],
                info["initial_loss"],
                info["best_loss"],
                info["epochs_run"],
                seconds,
            )
            del z, targets, captured
        details = {
            "levels": levels_info,
            "loss": {
                "initial": sum(i["initial_loss"] for i in levels_info),
                "final": sum(i["best_loss"] for i in levels_info),
            },
        }
    elif hidden:
        tic = time.perf_counter()
        for position in range(len(hidden)):
            target_level = neuron_levels[position + 1] - 1
            features = [
                c[target_level]
                for c in capture_outputs(frozen, data, [target_level], device, batch_size_capture)
            ]
            pair = initial_pair(init, features, widths[position], rank, generator)
            merges.append(pair[0].to(device))
            unmerges.append(pair[1].to(device))
            del features
        net = FoldableSuperNet(merges, unmerges, between)
        last = neuron_levels[-1] - 1
        stacked_first = StackedLevel([m.levels[hidden[0]] for m in frozen])
        first_level = stacked_first if hidden[0] == 0 and stacked_first.folds_a_merge else None
        captured = capture_outputs(
            frozen, data, [last] if first_level else [hidden[0], last], device, batch_size_capture
        )
        # the first merge folded into the models' first level runs on the inputs themselves
        first_z = data.to(device) if first_level else torch.cat([c[hidden[0]] for c in captured], 1)
        targets = torch.cat([c[last] for c in captured], 1)
        del captured
        base_levels = [StackedLevel([m.levels[i] for m in frozen]) for i in hidden[1:]]
        init_seconds = time.perf_counter() - tic
        tic = time.perf_counter()
        info = optimise(
            net,
            lambda idx: net.chain(take_rows(first_z, idx), base_levels, first_level),
            targets,
            count,
            split,
            schedule,
            generator,
            f"{name} global",
            options,
        )
        train_seconds = time.perf_counter() - tic
        info["seconds"] = train_seconds
        details = {
            "training": info,
            "loss": {"initial": info["initial_loss"], "final": info["best_loss"]},
        }
        log.info(
            "%s global: loss %.4g -> %.4g in %d epochs (%.1f s)",
            name,
            info["initial_loss"],
            info["best_loss"],
            info["epochs_run"],
            train_seconds,
        )
    else:  # no hidden level: only the classifier is folded
        details = {"loss": {"initial": 0.0, "final": 0.0}}
    return LevelTraining(merges, unmerges, details, init_seconds, train_seconds)
