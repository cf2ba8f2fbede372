r"""FS-Merge: merging by a *Foldable SuperNet* of the frozen base models (MLP/CNN levels).

Kinderman, Hubara, Maron & Soudry, "Foldable SuperNets: Scalable Merging of Transformers with
Different Initializations and Tasks", TMLR 2025 (Sec. 2.1, Eq. 1-7; App. E.1, F.1, G.4, H).

Between consecutive hidden neuron levels of ``K`` base models of width ``d`` the SuperNet holds a
learnable *merge* matrix :math:`M_l \in \mathbb{R}^{d \times Kd}` and *unmerge* matrix
:math:`U_l \in \mathbb{R}^{Kd \times d}`. The base weights stay frozen. At neuron level ``l`` the
models' pre-activations are concatenated, :math:`z_l = z_l^1 \Vert \dots \Vert z_l^K`, merged to
``d`` channels, passed through the parameter-free levels that follow (the activation
:math:`\sigma`, max-pooling), and unmerged into one reconstruction per model, which is what each
model's next affine level consumes:

.. math::
    \tilde f_l = U_l\,\sigma(M_l z_l),\qquad
    z_{l+1}^k = W_{l+1}^k \tilde f_l^k + b_{l+1}^k \quad (\text{Eq. 2; } U_0 = (I;\dots;I)).

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

**Folding** (Eq. 5): the fused model has model 0's spec, with
:math:`W_l^* = M_l \operatorname{blockdiag}(W_l^1,\dots,W_l^K)\,U_{l-1}` and
:math:`b_l^* = M_l (b_l^1\Vert\dots\Vert b_l^K)`, applied on the input-channel axis (conv kernels
and the ``Flatten`` before a classifier keep their spatial part). It computes exactly what the
SuperNet computes.

**Parameterisation** (Eq. 7): :math:`M = M^{\text{diag}} + M^1 M^2` with rank ``r`` and
:math:`M^{\text{diag}}` a concatenation of ``K`` diagonal matrices (one learnable scalar per base
neuron); likewise ``U``. ``rank=-1`` learns dense matrices (the MLP theory of App. H). Low-rank
factors start as in the authors' code: the factor on one side at zero, the other small random, so
the product is 0. For the ZipIt initialisation the "diagonal" is taken in the matched basis
(base neuron ``j`` of model ``k`` sits at its ZipIt cluster instead of at row ``j``), which is a
concatenation of diagonals after re-indexing each model's neurons.

**Initialisations**: ``"first"`` (Eq. 6, App. G.4): :math:`M = (I\;0\dots0)`, :math:`U=(I;\dots;I)`,
folding to model 0 exactly; ``"average"`` (App. G.4): :math:`M = (I/K \dots I/K)`, :math:`U=(I;
\dots;I)`, plain averaging of the models' neuron ``i``; ``"zipit"`` (Sec. 3.1, App. A.2; Stoica
et al., 2024): neurons of all models (and within a model) are greedily paired by the correlation
of their features on the fusion set, :math:`M[p,i] = M[p,j] = 1/2` for a matched pair ``p``,
:math:`U = 2M^\top`.

**The classifier** (our adaptation): the paper merges multi-task models and keeps one head per
task. Here all models share the label space and the fused model has one head, so the head is
folded with a fixed merge: ``head="mean"`` averages the models' logits, each computed by that
model's head on *its* reconstructed features, :math:`M_{\text{head}} = (I/K \dots I/K)`;
``head="first"`` keeps model 0's head on model 0's reconstruction (with ``init="first"`` and
``epochs=0`` the fused model is then model 0 exactly).

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
SuperNet over the whole fusion set): ``epochs`` trades accuracy for time.
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
from torch import nn

from fedfuse.fusion.base import FusionInputs, FusionMethod, register_fusion_method
from fedfuse.fusion.blocks.alignment import affine_levels
from fedfuse.fusion.fs_merge_spaces import SpaceSuperNet, check_supported, head_input, probe_rows
from fedfuse.fusion.inputs import check_levels
from fedfuse.models import LeveledModel, ModelSpec
from fedfuse.models.affine import AffineLevel, output_rows
from fedfuse.models.capture import capture_levels
from fedfuse.models.symmetry import feature_spaces
from fedfuse.runtime import resolve_device
from fedfuse.training.loop import (
    OPTIMIZERS,
    SCHEDULERS,
    fit_with_early_stopping,
    holdout_split,
    make_optimizer,
    make_scheduler,
)

log = logging.getLogger(__name__)

OBJECTIVES = ("local", "global")
INITS = ("first", "average", "zipit")
HEADS = ("mean", "first")
#: the authors' scale of the random low-rank factor (``LOW_RANK_FACTOR`` in their code)
LOW_RANK_FACTOR = 0.1
#: warm-up epochs of the cosine schedule (App. E.1), capped at a tenth of a short run
COSINE_WARMUP_EPOCHS = 20
#: the step schedule's decay per drop and its two drops (App. E.1), at 1/3 and 2/3 of the run
STEP_GAMMA = 0.9


@dataclass(frozen=True)
class FSMergeSchedule:
    """Optimisation hyper-parameters of one FS-Merge variant (App. E.1)."""

    epochs: int
    lr: float
    momentum: float
    scheduler: str


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


class FoldableMatrix(nn.Module):
    r"""A merge ``M`` (``width x n``) or unmerge ``U`` (``n x width``) matrix, ``n = K * width``.

    ``M = D + A B``: ``D`` has one learnable entry per base neuron ``j``, at merged channel
    ``assign[j]`` (a concatenation of diagonal matrices when ``assign`` is the identity in each
    model), and ``A B`` has rank ``rank`` (0: none). ``rank=-1`` makes the whole matrix a dense
    parameter. Applied to rows ``(R, in)`` it returns ``(R, out)`` without forming the matrix.
    """

    def __init__(
        self,
        kind: str,
        assign: torch.Tensor,
        diagonal: torch.Tensor,
        width: int,
        rank: int,
        generator: torch.Generator,
    ) -> None:
        super().__init__()
        if kind not in ("merge", "unmerge"):
            raise ValueError(f"kind must be 'merge' or 'unmerge', got {kind!r}")
        self.kind = kind
        self.width = width
        self.n = len(assign)
        self.rank = rank
        self.register_buffer("assign", assign.long().clone())
        models = self.n // width
        sizes = torch.bincount(self.assign, minlength=width)
        #: how the sparse part is applied: "identity" (neuron i of every model -> channel i: a
        #: reshape), "regular" (every merged channel has exactly K base neurons: a gather and a
        #: reshape) or "general" (index_add)
        self.layout = "general"
        if self.n == models * width and bool((sizes == models).all()):
            identity = torch.arange(width).repeat(models)
            self.layout = "identity" if torch.equal(self.assign, identity) else "regular"
        # members of each channel, slot-major: position s * width + c holds channel c's s-th one
        order = torch.argsort(self.assign * self.n + torch.arange(self.n), stable=True)
        slots = order.view(width, models).T.reshape(-1) if self.layout == "regular" else order
        self.register_buffer("slots", slots)
        self.diagonal: nn.Parameter | None = None
        self.left: nn.Parameter | None = None
        self.right: nn.Parameter | None = None
        self.full: nn.Parameter | None = None
        sparse = self._sparse(diagonal.float())
        if rank < 0:
            self.full = nn.Parameter(sparse)
            return
        self.diagonal = nn.Parameter(diagonal.float().clone())
        if rank > 0:
            scale = LOW_RANK_FACTOR * width**-0.5 / rank
            if kind == "merge":  # M = left (width x r, random) @ right (r x n, zero)
                self.left = nn.Parameter(scale * torch.randn(width, rank, generator=generator))
                self.right = nn.Parameter(torch.zeros(rank, self.n))
            else:  # U = left (n x r, random) @ right (r x width, zero)
                self.left = nn.Parameter(scale * torch.randn(self.n, rank, generator=generator))
                self.right = nn.Parameter(torch.zeros(rank, width))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.width, self.n) if self.kind == "merge" else (self.n, self.width)

    def _sparse(self, values: torch.Tensor) -> torch.Tensor:
        matrix = torch.zeros(self.shape, dtype=values.dtype, device=values.device)
        columns = torch.arange(self.n, device=values.device)
        assign = self.assign.to(values.device)
        if self.kind == "merge":
            matrix[assign, columns] = values
        else:
            matrix[columns, assign] = values
        return matrix

    def dense(self) -> torch.Tensor:
        """The matrix itself, ``(out, in)``."""
        if self.full is not None:
            return self.full
        assert self.diagonal is not None
        matrix = self._sparse(self.diagonal)
        if self.left is not None and self.right is not None:
            matrix = matrix + self.left @ self.right
        return matrix

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows @ matrix.T`` for rows ``(R, in)``."""
        if self.full is not None:
            return rows @ self.full.T
        assert self.diagonal is not None
        if self.kind == "merge":
            scaled = rows * self.diagonal
            if self.layout == "identity":
                out = scaled.view(len(rows), -1, self.width).sum(1)
            elif self.layout == "regular":
                out = scaled.index_select(1, self.slots).view(len(rows), -1, self.width).sum(1)
            else:
                out = rows.new_zeros(len(rows), self.width).index_add(1, self.assign, scaled)
        elif self.layout == "identity":
            out = rows.repeat(1, self.n // self.width) * self.diagonal
        else:
            out = rows.index_select(1, self.assign) * self.diagonal
        if self.left is not None and self.right is not None:
            out = out + (rows @ self.right.T) @ self.left.T
        return out


def _is_affine(model: LeveledModel) -> bool:
    """Whether every neuron level is affine (the level-wise SuperNet of MLPs and VGGs)."""
    try:
        affine_levels(model)
    except ValueError:
        return False
    return True


def on_channels(function: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Apply a map of rows ``(R, C) -> (R, C')`` to the channel axis (dim 1) of ``x``."""
    if x.dim() == 2:
        return function(x)
    moved = x.movedim(1, -1)
    out = function(moved.reshape(-1, moved.shape[-1]))
    return out.reshape(*moved.shape[:-1], out.shape[-1]).movedim(-1, 1)


@torch.no_grad()
def correlation_matrix(features: Sequence[torch.Tensor], chunk: int = 65_536) -> torch.Tensor:
    """Pearson correlation ``(n, n)`` of the channels of the concatenated ``features``.

    ``features`` are per model ``(N, d, ...)``; each sample and spatial position is one
    observation. Constant channels (e.g. dead ReLUs) get correlation 0 with everything.
    """
    rows = torch.cat([output_rows(f) for f in features], 1)
    n = rows.shape[1]
    total = torch.zeros(n, dtype=torch.float64, device=rows.device)
    gram = torch.zeros(n, n, dtype=torch.float64, device=rows.device)
    for start in range(0, len(rows), chunk):
        block = rows[start : start + chunk].double()
        total += block.sum(0)
        gram += block.T @ block
    count = len(rows)
    mean = total / count
    cov = gram / count - torch.outer(mean, mean)
    std = cov.diagonal().clamp_min(0).sqrt()
    alive = std > 1e-12 * std.max().clamp_min(1e-300)
    scale = torch.where(alive, std, torch.ones_like(std))
    corr = cov / torch.outer(scale, scale)
    corr[~alive] = 0
    corr[:, ~alive] = 0
    return corr.clamp(-1, 1)


@torch.no_grad()
def zipit_assignment(corr: torch.Tensor, models: int, width: int) -> torch.Tensor:
    """Greedy ZipIt matching: the merged channel (``0..width-1``) of each of ``n`` base neurons.

    Repeatedly merges the two most correlated clusters, within or across models, whose sizes
    add up to at most ``models`` (for two models: disjoint pairs, as in ZipIt), with average
    linkage, until ``width`` clusters remain. If the size cap blocks every merge (possible for
    three or more models), it is raised by one, so clusters may then differ in size. Clusters
    are numbered by their smallest member.
    """
    n = corr.shape[0]
    if n != models * width:
        raise ValueError(f"{n} neurons cannot form {width} clusters of {models} models")
    link = corr.double().clone()
    sizes = torch.ones(n, dtype=torch.long, device=corr.device)
    alive = torch.ones(n, dtype=torch.bool, device=corr.device)
    labels = torch.arange(n, device=corr.device)
    cap = models
    minus_inf = torch.tensor(float("-inf"), dtype=torch.float64, device=corr.device)

    def scores() -> torch.Tensor:
        valid = alive[:, None] & alive[None, :] & (sizes[:, None] + sizes[None, :] <= cap)
        valid.fill_diagonal_(False)
        return torch.where(valid, link, minus_inf)

    score = scores()
    clusters = n
    while clusters > width:
        flat = int(torch.argmax(score))
        i, j = divmod(flat, n)
        if not torch.isfinite(score[i, j]):
            if cap >= n:
                raise RuntimeError("ZipIt matching is stuck")  # cannot happen: clusters > 1
            cap += 1
            score = scores()
            continue
        si, sj = sizes[i].item(), sizes[j].item()
        link[i] = (si * link[i] + sj * link[j]) / (si + sj)
        link[:, i] = link[i]
        sizes[i] += sj
        alive[j] = False
        labels[labels == j] = i
        clusters -= 1
        score[j] = minus_inf
        score[:, j] = minus_inf
        row = torch.where(alive & (sizes + sizes[i] <= cap), link[i], minus_inf)
        row[i] = minus_inf
        score[i] = row
        score[:, i] = row
    roots = torch.unique(labels)
    first_member = torch.stack([torch.nonzero(labels == r)[0, 0] for r in roots])
    order = roots[torch.argsort(first_member)]
    relabel = torch.empty(n, dtype=torch.long, device=corr.device)
    relabel[order] = torch.arange(len(order), device=corr.device)
    return relabel[labels]


class FoldableSuperNet(nn.Module):
    """The merge/unmerge matrices of every hidden level, and the SuperNet's forward passes."""

    def __init__(
        self,
        merges: Sequence[FoldableMatrix],
        unmerges: Sequence[FoldableMatrix],
        between: Sequence[nn.Module],
    ) -> None:
        super().__init__()
        self.merges = nn.ModuleList(merges)
        self.unmerges = nn.ModuleList(unmerges)
        self.between = nn.ModuleList(between)  # parameter-free levels after each hidden level

    def level(self, position: int, z: torch.Tensor) -> torch.Tensor:
        """``U_l sigma(M_l z)`` of hidden level ``position`` (the local SuperNet, Eq. 2)."""
        merged = self.between[position](on_channels(self.merges[position], z))
        return on_channels(self.unmerges[position], merged)

    def chain(
        self, first_z: torch.Tensor, base_levels: Sequence[Sequence[nn.Module]]
    ) -> torch.Tensor:
        """The global SuperNet (Eq. 4) from the concatenated first-level pre-activations.

        ``base_levels[p][k]`` is model ``k``'s (frozen) neuron level ``p + 1``.
        """
        reconstruction = self.level(0, first_z)
        for position in range(1, len(self.merges)):
            parts = reconstruction.split(self.unmerges[position - 1].width, dim=1)
            z = torch.cat(
                [layer(part) for layer, part in zip(base_levels[position - 1], parts, strict=True)],
                1,
            )
            reconstruction = self.level(position, z)
        return reconstruction


@register_fusion_method
class FSMerge(FusionMethod):
    r"""FS-Merge (Kinderman et al., TMLR 2025) for MLPs and CNNs of affine levels, and ViTs.

    Models whose neuron levels are all affine (MLP, VGG) use the level-wise SuperNet below;
    others with described feature spaces and no BatchNorm (ViT) use the feature-space SuperNet
    of :mod:`fedfuse.fusion.fs_merge_spaces` (App. B: a merge/unmerge pair around every linear
    layer, LayerNorms learned in the merged space, global objective only; ``epochs`` None there
    means App. E.2's 200). ResNets (BatchNorm) are refused by :meth:`check_architecture`.

    Learns the merge/unmerge matrices of a Foldable SuperNet of the frozen base models on the
    fusion set's inputs (no labels), then folds them into one model of model 0's spec; see the
    module docstring for the problems solved and the folding.

    Args:
        objective: ``"local"`` (Eq. 3, one problem per hidden level on the base models' own
            pre-activations) or ``"global"`` (Eq. 4, the whole SuperNet reconstructing the
            classifier's input features).
        init: ``"first"`` (Eq. 6), ``"average"`` (App. G.4) or ``"zipit"`` (App. A.2).
        rank: rank of the low-rank part of each ``M``/``U`` (Eq. 7); 0: concatenated diagonals
            only; -1: dense (full-rank) matrices.
        head: ``"mean"`` (average of the models' logits on their reconstructed features) or
            ``"first"`` (model 0's head on model 0's reconstruction).
        epochs: passes over the fusion set (steps, with full batches); None: App. E.1's
            (:func:`paper_schedule`).
        lr: learning rate (App. E.1: 0.1 for every variant).
        momentum: SGD momentum; None: App. E.1's.
        scheduler: ``"step"`` (two drops by 0.9, at 1/3 and 2/3), ``"cosine"`` (20 warm-up
            epochs, then one cosine cycle to 0) or ``"constant"``; None: App. E.1's.
        optimizer: ``"sgd"`` (App. E.1: gradient descent with momentum), ``"adam"``, ``"adamw"``.
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
        epochs: int | None = None,
        lr: float = 0.1,
        momentum: float | None = None,
        scheduler: str | None = None,
        optimizer: str = "sgd",
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
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
        if rank < -1:
            raise ValueError(f"rank must be >= 0, or -1 for dense matrices, got {rank}")
        if epochs is not None and epochs < 0:
            raise ValueError(f"epochs must be >= 0, got {epochs}")
        if lr <= 0 or weight_decay < 0 or (momentum is not None and not 0 <= momentum < 1):
            raise ValueError(f"invalid lr={lr}, weight_decay={weight_decay}, momentum={momentum}")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
        if not 0 <= val_split < 1 or patience < 0 or eval_points < 1:
            raise ValueError(
                f"need 0 <= val_split < 1, patience >= 0, eval_points >= 1; got "
                f"{val_split}, {patience}, {eval_points}"
            )
        self.objective = objective
        self.init = init
        self.rank = rank
        self.head = head
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
        """The effective schedule: App. E.1's for this variant, with the options overriding it."""
        paper = paper_schedule(self.objective, self.init)
        return FSMergeSchedule(
            epochs=paper.epochs if self.epochs is None else self.epochs,
            lr=self.lr,
            momentum=paper.momentum if self.momentum is None else self.momentum,
            scheduler=paper.scheduler if self.scheduler is None else self.scheduler,
        )

    def check_architecture(self, model: LeveledModel) -> None:
        """Affine levels (MLP, VGG): the level-wise SuperNet; else the feature-space SuperNet of
        :mod:`fedfuse.fusion.fs_merge_spaces` (ViT; global objective only; no BatchNorm)."""
        if _is_affine(model):
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
        if not _is_affine(models[0]):
            return self._fuse_spaces(models, inputs)
        started = time.perf_counter()
        check_levels(self.name, models)  # a ValueError naming the model and level not affine
        device = resolve_device(self.device)
        data = inputs.data
        assert data is not None
        schedule = self.schedule()
        frozen = [copy.deepcopy(m).to(device).eval().requires_grad_(False) for m in models]
        neuron_levels = frozen[0].neuron_levels
        hidden = neuron_levels[:-1]
        widths = [frozen[0].level_width(i) for i in hidden]
        count = len(models)
        generator = torch.Generator().manual_seed(self.seed)
        train, val = holdout_split(len(data), self.val_split, generator)
        n_val = len(val)
        split = (train.to(device), val.to(device))
        between = [
            nn.Sequential(*frozen[0].levels[a + 1 : b])
            for a, b in zip(neuron_levels[:-1], neuron_levels[1:], strict=True)
        ]
        details: dict[str, Any] = {
            "kind": "fusion",
            "objective": self.objective,
            "init": self.init,
            "rank": self.rank,
            "head": self.head,
            "schedule": asdict(schedule),
            "batch_size": self.batch_size or "full",
            "normalize_targets": self.normalize_targets,
            "fusion_samples": len(data),
            "validation_samples": n_val,
        }
        merges: list[FoldableMatrix] = []
        unmerges: list[FoldableMatrix] = []
        init_seconds = train_seconds = 0.0
        if self.objective == "local":
            levels_info = []
            for position, index in enumerate(hidden):
                tic = time.perf_counter()
                target_level = neuron_levels[position + 1] - 1
                captured = self._capture(frozen, data, [index, target_level], device)
                z = torch.cat([c[index] for c in captured], 1)
                targets = torch.cat([c[target_level] for c in captured], 1)
                pair = self._initial_pair(
                    [c[target_level] for c in captured], widths[position], generator
                )
                merges.append(pair[0].to(device))
                unmerges.append(pair[1].to(device))
                net = FoldableSuperNet(merges[-1:], unmerges[-1:], between[position : position + 1])
                init_seconds += time.perf_counter() - tic
                tic = time.perf_counter()
                info = self._optimise(
                    net,
                    lambda idx, z=z, net=net: net.level(0, z[idx]),
                    targets,
                    count,
                    split,
                    schedule,
                    generator,
                    f"{self.name} level {frozen[0].level_name(index)}",
                )
                seconds = time.perf_counter() - tic
                train_seconds += seconds
                info.update(level=frozen[0].level_name(index), seconds=seconds)
                levels_info.append(info)
                log.info(
                    "%s level %s: loss %.4g -> %.4g in %d epochs (%.1f s)",
                    self.name,
                    info["level"],
                    info["initial_loss"],
                    info["best_loss"],
                    info["epochs_run"],
                    seconds,
                )
                del z, targets, captured
            details["levels"] = levels_info
            details["loss"] = {
                "initial": sum(i["initial_loss"] for i in levels_info),
                "final": sum(i["best_loss"] for i in levels_info),
            }
        elif hidden:
            tic = time.perf_counter()
            for position in range(len(hidden)):
                target_level = neuron_levels[position + 1] - 1
                features = [
                    c[target_level] for c in self._capture(frozen, data, [target_level], device)
                ]
                pair = self._initial_pair(features, widths[position], generator)
                merges.append(pair[0].to(device))
                unmerges.append(pair[1].to(device))
                del features
            net = FoldableSuperNet(merges, unmerges, between)
            last = neuron_levels[-1] - 1
            captured = self._capture(frozen, data, [hidden[0], last], device)
            first_z = torch.cat([c[hidden[0]] for c in captured], 1)
            targets = torch.cat([c[last] for c in captured], 1)
            del captured
            base_levels = [[m.levels[i] for m in frozen] for i in hidden[1:]]
            init_seconds = time.perf_counter() - tic
            tic = time.perf_counter()
            info = self._optimise(
                net,
                lambda idx: net.chain(first_z[idx], base_levels),
                targets,
                count,
                split,
                schedule,
                generator,
                f"{self.name} global",
            )
            train_seconds = time.perf_counter() - tic
            info["seconds"] = train_seconds
            details["training"] = info
            details["loss"] = {"initial": info["initial_loss"], "final": info["best_loss"]}
            log.info(
                "%s global: loss %.4g -> %.4g in %d epochs (%.1f s)",
                self.name,
                info["initial_loss"],
                info["best_loss"],
                info["epochs_run"],
                train_seconds,
            )
        else:  # no hidden level: only the classifier is folded
            details["loss"] = {"initial": 0.0, "final": 0.0}
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

    def space_supernet(
        self, models: Sequence[LeveledModel], data: torch.Tensor, generator: torch.Generator
    ) -> SpaceSuperNet:
        """The initialised feature-space SuperNet of ``models`` (ViT; see fs_merge_spaces)."""
        count = len(models)
        inits = {}
        for space in feature_spaces(models[0]):
            width = space.size
            if self.init == "zipit":
                rows = [probe_rows(m, data, space, self.batch_size_capture) for m in models]
                assign = zipit_assignment(correlation_matrix(rows), count, width).cpu()
                sizes = torch.bincount(assign, minlength=width).double()
                diagonal = (1.0 / sizes[assign]).float()
            else:
                assign = torch.arange(width).repeat(count)
                if self.init == "first":
                    diagonal = torch.zeros(count * width)
                    diagonal[:width] = 1.0
                else:
                    diagonal = torch.full((count * width,), 1.0 / count)
            inits[space.name] = (assign, diagonal)
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
        SuperNet, then folded. ``epochs`` None: App. E.2's 200, one cosine cycle."""
        started = time.perf_counter()
        device = resolve_device(self.device)
        data = inputs.data
        assert data is not None
        data = data.to(device)
        count = len(models)
        frozen = [copy.deepcopy(m).to(device).eval().requires_grad_(False) for m in models]
        generator = torch.Generator().manual_seed(self.seed)
        train, val = holdout_split(len(data), self.val_split, generator)
        split = (train.to(device), val.to(device))
        schedule = self.schedule()
        if self.epochs is None:  # App. E.2 (ViT): 200 epochs, one cosine cycle with warm-up
            schedule = FSMergeSchedule(
                epochs=200,
                lr=schedule.lr,
                momentum=0.9 if self.momentum is None else self.momentum,
                scheduler="cosine" if self.scheduler is None else self.scheduler,
            )
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
        info = self._optimise(
            net,
            lambda idx: net.reconstruction(data[idx]),
            targets,
            count,
            split,
            schedule,
            generator,
            f"{self.name} global",
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
            "kind": "fusion",
            "objective": self.objective,
            "supernet": "feature spaces",
            "init": self.init,
            "rank": self.rank,
            "head": self.head,
            "schedule": asdict(schedule),
            "batch_size": self.batch_size or "full",
            "normalize_targets": self.normalize_targets,
            "fusion_samples": len(data),
            "validation_samples": len(val),
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

    def _capture(
        self,
        models: Sequence[LeveledModel],
        data: torch.Tensor,
        levels: Sequence[int],
        device: torch.device,
    ) -> list[dict[int, torch.Tensor]]:
        """Per model, the outputs of ``levels`` on ``data`` (kept on ``device``)."""
        return [
            {
                index: io.outputs
                for index, io in capture_levels(
                    m,
                    data,
                    sorted(set(levels)),
                    batch_size=self.batch_size_capture,
                    device=device,
                    store_device=device,
                    keep_inputs=False,
                ).items()
            }
            for m in models
        ]

    def _initial_pair(
        self, features: Sequence[torch.Tensor], width: int, generator: torch.Generator
    ) -> tuple[FoldableMatrix, FoldableMatrix]:
        """``M`` and ``U`` of one hidden level, initialised as ``self.init`` says."""
        count = len(features)
        n = count * width
        if self.init == "zipit":
            assign = zipit_assignment(correlation_matrix(features), count, width).cpu()
            sizes = torch.bincount(assign, minlength=width).double()
            merge_diagonal = (1.0 / sizes[assign]).float()
        else:
            assign = torch.arange(width).repeat(count)
            if self.init == "first":
                merge_diagonal = torch.zeros(n)
                merge_diagonal[:width] = 1.0
            else:
                merge_diagonal = torch.full((n,), 1.0 / count)
        merge = FoldableMatrix("merge", assign, merge_diagonal, width, self.rank, generator)
        unmerge = FoldableMatrix("unmerge", assign, torch.ones(n), width, self.rank, generator)
        return merge, unmerge

    def _optimise(
        self,
        net: nn.Module,
        predict: Callable[[torch.Tensor], torch.Tensor],
        targets: torch.Tensor,
        count: int,
        split: tuple[torch.Tensor, torch.Tensor],
        schedule: FSMergeSchedule,
        generator: torch.Generator,
        description: str,
    ) -> dict[str, Any]:
        """Minimise the (normalised) reconstruction error of ``predict(idx)`` to ``targets[idx]``.

        :func:`~fedfuse.training.loop.fit_with_early_stopping`, evaluating the monitored loss
        (validation rows if any, else training rows) about ``eval_points`` times and keeping the
        best parameters; ``"sgd"`` is classical momentum ``schedule.momentum``.
        """
        train = split[0]
        shape = [1, -1] + [1] * (targets.dim() - 2)
        if self.normalize_targets:
            blocks = targets[train].split(targets.shape[1] // count, dim=1)
            scales = torch.stack([(b.double() ** 2).mean() for b in blocks]).clamp_min(1e-12)
            width = targets.shape[1] // count
            weights = (1.0 / scales).float().repeat_interleave(width)
        else:
            weights = torch.ones(targets.shape[1], device=targets.device)
        weights = weights.view(shape).to(targets.device)

        def loss_of(idx: torch.Tensor) -> torch.Tensor:
            return (((predict(idx) - targets[idx]) ** 2) * weights).mean()

        params = [p for p in net.parameters() if p.requires_grad]
        optimizer = make_optimizer(
            self.optimizer, params, schedule.lr, self.weight_decay, momentum=schedule.momentum
        )
        batch = len(train) if self.batch_size is None else min(self.batch_size, len(train))
        steps_per_epoch = max(1, math.ceil(len(train) / batch))
        epochs = schedule.epochs
        milestones = [round(epochs / 3) * steps_per_epoch, round(2 * epochs / 3) * steps_per_epoch]
        scheduler = make_scheduler(
            optimizer,
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
            optimizer,
            epochs=epochs,
            batch_size=self.batch_size,
            patience=self.patience,
            generator=generator,
            scheduler=scheduler,
            eval_every=max(1, epochs // self.eval_points),
            eval_batch_size=self.batch_size,
            min_delta=0.0,
            progress=self.progress,
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

    @torch.no_grad()
    def fold(
        self,
        models: Sequence[LeveledModel],
        merges: Sequence[FoldableMatrix],
        unmerges: Sequence[FoldableMatrix],
    ) -> LeveledModel:
        """Eq. 5 on every neuron level: ``W* = M blockdiag(W^k) U_prev``, ``b* = M (b^k)``.

        ``merges``/``unmerges`` are those of the hidden neuron levels, bottom-up; the classifier
        is folded with the fixed merge of ``self.head``. Returns a new model of model 0's spec.
        """
        views: list[dict[int, AffineLevel]] = [affine_levels(m) for m in models]
        count = len(models)
        if len(merges) != len(models[0].neuron_levels) - 1 or len(unmerges) != len(merges):
            raise ValueError(
                f"{len(merges)} merge and {len(unmerges)} unmerge matrices for "
                f"{len(models[0].neuron_levels) - 1} hidden neuron levels"
            )
        fused = copy.deepcopy(models[0]).cpu()
        fused_views = affine_levels(fused)
        neuron_levels = fused.neuron_levels
        for position, index in enumerate(neuron_levels):
            blocks, biases = [], []
            for k in range(count):
                layer = views[k][index].layer
                weight = layer.weight.detach().cpu().double()
                out = weight.shape[0]
                if position == 0:  # U_0 = (I; ...; I)
                    grouped = weight.reshape(out, 1, -1)
                else:
                    unmerge = unmerges[position - 1].dense().detach().cpu().double()
                    previous = unmerges[position - 1].width
                    block = unmerge[k * previous : (k + 1) * previous]  # (base, merged)
                    grouped = torch.einsum("ocr,cj->ojr", weight.reshape(out, previous, -1), block)
                blocks.append(grouped)
                bias = layer.bias
                biases.append(
                    bias.detach().cpu().double()
                    if bias is not None
                    else torch.zeros(out, dtype=torch.float64)
                )
            stacked = torch.cat(blocks, 0)
            if position < len(merges):
                merge = merges[position].dense().detach().cpu().double()
            else:  # the classifier
                out = blocks[0].shape[0]
                eye = torch.eye(out, dtype=torch.float64)
                parts = (
                    [eye / count] * count
                    if self.head == "mean"
                    else [eye] + [torch.zeros_like(eye)] * (count - 1)
                )
                merge = torch.cat(parts, 1)
            weight = torch.einsum("so,ocr->scr", merge, stacked)
            target_layer = fused_views[index].layer
            target_layer.weight.copy_(
                weight.reshape(target_layer.weight.shape).to(target_layer.weight.dtype)
            )
            if target_layer.bias is not None:
                target_layer.bias.copy_((merge @ torch.cat(biases)).to(target_layer.bias.dtype))
        return fused.eval()
