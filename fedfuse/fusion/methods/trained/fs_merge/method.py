r"""The FS-Merge fusion method: learn a Foldable SuperNet of the frozen models, then fold it.

:class:`FSMerge` ties the package together: it picks the SuperNet by architecture (the level-wise
one of :mod:`~fedfuse.fusion.methods.trained.fs_merge.supernet` for MLPs and VGGs, the feature-space
one of :mod:`~fedfuse.fusion.methods.trained.fs_merge.spaces` for ViTs), captures the base models'
features on the fusion set, initialises the merge/unmerge matrices
(:mod:`~fedfuse.fusion.methods.trained.fs_merge.initialisation`), trains them on the local or global
objective (:mod:`~fedfuse.fusion.methods.trained.fs_merge.training`) and folds the result into one
model of model 0's spec (:mod:`~fedfuse.fusion.methods.trained.fs_merge.folding`), reporting losses
and timings in the details.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, NamedTuple

import torch

from fedfuse.fusion.base import FusionInputs, FusionMethod
from fedfuse.fusion.blocks.alignment import has_affine_levels
from fedfuse.fusion.inputs import check_levels
from fedfuse.fusion.methods.trained.fs_merge.folding import HEADS, fold_levels
from fedfuse.fusion.methods.trained.fs_merge.initialisation import INITS, initial_merge
from fedfuse.fusion.methods.trained.fs_merge.matrices import FoldableMatrix
from fedfuse.fusion.methods.trained.fs_merge.spaces import (
    SpaceSuperNet,
    check_supported,
    head_input,
    probe_rows,
)
from fedfuse.fusion.methods.trained.fs_merge.training import (
    OBJECTIVES,
    RECIPES,
    FitOptions,
    FSMergeSchedule,
    optimise,
    recipe_schedule,
    take_rows,
    train_levels,
)
from fedfuse.fusion.registry import register_fusion_method
from fedfuse.models import LeveledModel, ModelSpec
from fedfuse.models.symmetry import feature_spaces
from fedfuse.runtime import resolve_device
from fedfuse.training.loop import SCHEDULERS, check_optimizer, check_val_split, holdout_split

log = logging.getLogger(__name__)


class _Setup(NamedTuple):
    """What both SuperNets train with: the device, the frozen base models on it, the seeded
    generator and the fusion set's training and validation rows (on the device)."""

    device: torch.device
    frozen: list[LeveledModel]
    generator: torch.Generator
    split: tuple[torch.Tensor, torch.Tensor]


@register_fusion_method
class FSMerge(FusionMethod):
    r"""FS-Merge (Kinderman et al., TMLR 2025) for MLPs and CNNs of affine levels, and ViTs.

    Models whose neuron levels are all affine (MLP, VGG) use the level-wise SuperNet below;
    others with described feature spaces and no BatchNorm (ViT) use the feature-space SuperNet
    of :mod:`fedfuse.fusion.methods.trained.fs_merge.spaces` (App. B: a merge/unmerge pair around
    every linear layer, LayerNorms learned in the merged space, global objective only; App. E.2's
    schedule unless the options override it). ResNets (BatchNorm) are refused by
    :meth:`check_architecture`.

    Learns the merge/unmerge matrices of a Foldable SuperNet of the frozen base models on the
    fusion set's inputs (no labels), then folds them into one model of model 0's spec; see
    :mod:`~fedfuse.fusion.methods.trained.fs_merge.supernet`,
    :mod:`~fedfuse.fusion.methods.trained.fs_merge.training` and
    :mod:`~fedfuse.fusion.methods.trained.fs_merge.folding` for the SuperNet, the problems solved
    and the folding.

    Args:
        objective: ``"local"`` (Eq. 3, one problem per hidden level on the base models' own
            pre-activations) or ``"global"`` (Eq. 4, the whole SuperNet reconstructing the
            classifier's input features).
        init: ``"first"`` (Eq. 6), ``"average"`` (App. G.4) or ``"zipit"`` (App. A.2).
        rank: rank of the low-rank part of each ``M``/``U`` (Eq. 7); 0: concatenated diagonals
            only; -1: dense (full-rank) matrices.
        head: ``"mean"`` (average of the models' logits on their reconstructed features) or
            ``"first"`` (model 0's head on model 0's reconstruction).
        recipe: the training schedule that the options below left at None take:
            ``"fast"`` (default): Adam, lr 0.01, 300 full-batch epochs, one cosine cycle with
            20 warm-up epochs, for every objective and initialisation; ``"paper"``: App. E.1's
            gradient descent with momentum (lr 0.1; 10k epochs for global + ZipIt, 1k for
            global + average or first, 15k for local: :func:`paper_schedule`). App. E.1's
            schedules were tuned for pairs of models; an epoch costs a SuperNet forward and
            backward pass over the whole fusion set for every base model, so at 5 LeNet-5s
            10k epochs take about half an hour on 2 CPU cores. Adam reaches a lower
            reconstruction loss in 300 epochs than App. E.1's SGD in 10k on the fusion sets we
            measured (see ``docs/results.md``); the loss, not test accuracy, chose it. The
            feature-space SuperNet (ViT) keeps App. E.2's schedule under both recipes (SGD,
            200 epochs), which is short already.
        epochs: passes over the fusion set (steps, with full batches); None: the recipe's.
        lr: learning rate; None: the recipe's (fast: 0.01; App. E.1: 0.1 for every variant).
        momentum: SGD momentum; None: App. E.1's (the fast recipe's Adam ignores it).
        scheduler: ``"step"`` (two drops by 0.9, at 1/3 and 2/3), ``"cosine"`` (20 warm-up
            epochs, then one cosine cycle to 0) or ``"constant"``; None: the recipe's.
        optimizer: ``"sgd"`` (App. E.1: gradient descent with momentum), ``"adam"``,
            ``"adamw"``; None: the recipe's (fast: Adam; paper: SGD).
        weight_decay: on the merge/unmerge parameters (App. E.1: none).
        batch_size: samples per step; None: the whole fusion set (App. E.1).
        normalize_targets: divide each model's squared error by its targets' mean square.
        val_split: share of the fusion set held out to pick the best state (0: the paper's: all
            of it is optimised on; the best training-loss state is kept).
        patience: stop after this many evaluations without improvement (0: never).
        eval_points: about how many times per run the monitored loss is evaluated (the curve).
        seed: seeds the low-rank factors, the validation split and the batch order.
        device: ``"auto"``, ``"cpu"`` or ``"cuda"``.
        batch_size_capture: samples per forward pass when capturing the base features.
        progress: show a progress bar over epochs.

    Returns (from :meth:`fuse`): the folded model and details with ``kind``, the settings,
    the number of learnable parameters, per level (local) or overall (global) loss curves
    ``(epoch, loss)`` with their initial/final/best values, and timings.
    """

    name = "fs-merge"
    needs_affine_levels = False  # check_architecture decides: affine levels or a ViT
    requires = frozenset({"data"})

    def __init__(
        self,
        objective: str = "global",
        init: str = "zipit",
        *,
        rank: int = 12,
        head: str = "mean",
        recipe: str = "fast",
        epochs: int | None = None,
        lr: float | None = None,
        momentum: float | None = None,
        scheduler: str | None = None,
        optimizer: str | None = None,
        weight_decay: float = 0.0,
        batch_size: int | None = None,
        normalize_targets: bool = True,
        val_split: float = 0.0,
        patience: int = 0,
        eval_points: int = 100,
        seed: int = 0,
        device: str = "auto",
        batch_size_capture: int = 256,
        progress: bool = False,
    ) -> None:
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
        if init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {init!r}")
        if head not in HEADS:
            raise ValueError(f"head must be one of {HEADS}, got {head!r}")
        if scheduler is not None and scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {scheduler!r}")
        if recipe not in RECIPES:
            raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
        if optimizer is not None:
            check_optimizer(optimizer)
        bad_momentum = momentum is not None and not 0 <= momentum < 1
        if (lr is not None and lr <= 0) or weight_decay < 0 or bad_momentum:
            raise ValueError(f"invalid lr={lr}, weight_decay={weight_decay}, momentum={momentum}")
        check_val_split(val_split)
        self.objective = objective
        self.init = init
        self.rank = rank
        self.head = head
        self.recipe = recipe
        self.epochs = epochs
        self.lr = lr
        self.momentum = momentum
        self.scheduler = scheduler
        self.optimizer = optimizer
        self.weight_decay = weight_decay
        self.batch_size = batch_size
        self.normalize_targets = normalize_targets
        self.val_split = val_split
        self.patience = patience
        self.eval_points = eval_points
        self.seed = seed
        self.device = device
        self.batch_size_capture = batch_size_capture
        self.progress = progress

    def schedule(self) -> FSMergeSchedule:
        """The effective schedule: the recipe's for this variant, overridden by the options."""
        return self._overridden(recipe_schedule(self.recipe, self.objective, self.init))

    def _overridden(self, base: FSMergeSchedule) -> FSMergeSchedule:
        """``base`` with every option that is not None in its place."""
        return FSMergeSchedule(
            epochs=base.epochs if self.epochs is None else self.epochs,
            lr=base.lr if self.lr is None else self.lr,
            momentum=base.momentum if self.momentum is None else self.momentum,
            scheduler=base.scheduler if self.scheduler is None else self.scheduler,
            optimizer=base.optimizer if self.optimizer is None else self.optimizer,
        )

    def _fit_options(self) -> FitOptions:
        return FitOptions(
            weight_decay=self.weight_decay,
            batch_size=self.batch_size,
            normalize_targets=self.normalize_targets,
            patience=self.patience,
            eval_points=self.eval_points,
            progress=self.progress,
        )

    def check_architecture(self, model: LeveledModel) -> None:
        """Affine levels (MLP, VGG): the level-wise SuperNet; else the feature-space SuperNet of
        :mod:`fedfuse.fusion.methods.trained.fs_merge.spaces` (ViT; global objective only; no
        BatchNorm)."""
        if has_affine_levels(model):
            return
        check_supported(model)
        if self.objective != "global":
            raise ValueError(
                "FS-Merge merges transformers with the global objective only (the paper's "
                "local one fails on them, Sec. 2.2, App. G.3); use objective='global'"
            )

    # ------------------------------------------------------------------ the algorithm
    def _fuse(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec
    ) -> tuple[LeveledModel, dict[str, Any]]:
        if not has_affine_levels(models[0]):
            return self._fuse_spaces(models, inputs)
        started = time.perf_counter()
        check_levels(self.name, models)  # a ValueError naming the model and level not affine
        data = inputs.data
        assert data is not None
        schedule = self.schedule()
        device, frozen, generator, split = self._setup(models, data)
        details = self._settings_details(schedule, len(data), len(split[1]))
        trained = train_levels(
            frozen,
            data,
            split,
            schedule,
            generator,
            device,
            objective=self.objective,
            init=self.init,
            rank=self.rank,
            options=self._fit_options(),
            batch_size_capture=self.batch_size_capture,
            name=self.name,
        )
        details.update(trained.details)
        merges, unmerges = trained.merges, trained.unmerges
        init_seconds, train_seconds = trained.init_seconds, trained.train_seconds
        tic = time.perf_counter()
        fused = self.fold(models, merges, unmerges)
        details["learnable_parameters"] = sum(
            p.numel() for m in (*merges, *unmerges) for p in m.parameters()
        )
        details["init_seconds"] = init_seconds
        details["train_seconds"] = train_seconds
        details["fold_seconds"] = time.perf_counter() - tic
        details["seconds"] = time.perf_counter() - started
        return fused, details

    def _setup(self, models: list[LeveledModel], data: torch.Tensor) -> _Setup:
        """:class:`_Setup` of a fusion of ``models`` on the fusion set ``data``."""
        device = resolve_device(self.device)
        frozen = [copy.deepcopy(m).to(device).eval().requires_grad_(False) for m in models]
        generator = torch.Generator().manual_seed(self.seed)
        train, val = holdout_split(len(data), self.val_split, generator)
        return _Setup(device, frozen, generator, (train.to(device), val.to(device)))

    def _settings_details(
        self, schedule: FSMergeSchedule, fusion_samples: int, validation_samples: int
    ) -> dict[str, Any]:
        """The fusion's details that state its settings and data (both SuperNets)."""
        return {
            "kind": "fusion",
            "objective": self.objective,
            "init": self.init,
            "rank": self.rank,
            "head": self.head,
            "schedule": asdict(schedule),
            "batch_size": self.batch_size or "full",
            "normalize_targets": self.normalize_targets,
            "fusion_samples": fusion_samples,
            "validation_samples": validation_samples,
        }

    def space_supernet(
        self, models: Sequence[LeveledModel], data: torch.Tensor, generator: torch.Generator
    ) -> SpaceSuperNet:
        """The initialised feature-space SuperNet of ``models`` (ViT; see
        :mod:`~fedfuse.fusion.methods.trained.fs_merge.spaces`)."""
        count = len(models)
        inits = {}
        for space in feature_spaces(models[0]):
            rows = None
            if self.init == "zipit":
                rows = [probe_rows(m, data, space, self.batch_size_capture) for m in models]
            inits[space.name] = initial_merge(self.init, count, space.size, rows)
        coefficients = torch.zeros(count)
        if self.head == "mean":
            coefficients += 1.0 / count
        else:
            coefficients[0] = 1.0
        return SpaceSuperNet(models, inits, self.rank, coefficients, generator)

    def _fuse_spaces(
        self, models: list[LeveledModel], inputs: FusionInputs
    ) -> tuple[LeveledModel, dict[str, Any]]:
        """FS-Merge of transformers (App. B): the global objective on the feature-space
        SuperNet, then folded (App. E.2's schedule unless the options override it)."""
        started = time.perf_counter()
        data = inputs.data
        assert data is not None
        device, frozen, generator, split = self._setup(models, data)
        data = data.to(device)
        count = len(models)
        # App. E.2 (ViT), under either recipe: 200 epochs of SGD, one cosine cycle
        schedule = self._overridden(FSMergeSchedule(200, 0.1, 0.9, "cosine", "sgd"))
        tic = time.perf_counter()
        net = self.space_supernet(frozen, data, generator).to(device)
        with torch.no_grad():
            chunks = [
                torch.cat([head_input(m, data[i : i + self.batch_size_capture]) for m in frozen], 1)
                for i in range(0, len(data), self.batch_size_capture)
            ]
        targets = torch.cat(chunks, 0)
        init_seconds = time.perf_counter() - tic
        tic = time.perf_counter()
        info = optimise(
            net,
            lambda idx: net.reconstruction(take_rows(data, idx)),
            targets,
            count,
            split,
            schedule,
            generator,
            f"{self.name} global",
            self._fit_options(),
        )
        train_seconds = time.perf_counter() - tic
        info["seconds"] = train_seconds
        log.info(
            "%s global (feature spaces): loss %.4g -> %.4g in %d epochs (%.1f s)",
            self.name,
            info["initial_loss"],
            info["best_loss"],
            info["epochs_run"],
            train_seconds,
        )
        tic = time.perf_counter()
        fused = net.fold().cpu()
        details: dict[str, Any] = {
            **self._settings_details(schedule, len(data), len(split[1])),
            "supernet": "feature spaces",
            "sites": len(net.sites),
            "training": info,
            "loss": {"initial": info["initial_loss"], "final": info["best_loss"]},
            "learnable_parameters": sum(p.numel() for p in net.parameters()),
            "init_seconds": init_seconds,
            "train_seconds": train_seconds,
            "fold_seconds": time.perf_counter() - tic,
            "seconds": time.perf_counter() - started,
        }
        return fused, details

    def fold(
        self,
        models: Sequence[LeveledModel],
        merges: Sequence[FoldableMatrix],
        unmerges: Sequence[FoldableMatrix],
    ) -> LeveledModel:
        """Eq. 5 on every neuron level with this method's head
        (:func:`~fedfuse.fusion.methods.trained.fs_merge.folding.fold_levels`): a new model of model
        0's spec."""
        return fold_levels(models, merges, unmerges, self.head)
