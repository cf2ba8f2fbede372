r"""RegMean anchored on the fusion set: the sites' Grams and the server's labelled rows in one fit.

RegMean (:mod:`fedfuse.fusion.methods.regression.regmean`) fits each level to every site's own
outputs on that site's inputs, ``sum_k ||X_k W - X_k W_k||^2``, from the Grams ``G_k = X_k^T X_k``
the sites upload once. It assumes the fused model's inputs of a level equal each site's, which fails
more with every level below (the fused prefix is a compromise), and it weighs every site's opinion
alike on every input, also where a site never saw the class. ``kf-sites`` removes the first error
with one statistics round per level; this method, in one upload round, adds what the server can
measure itself on its labelled fusion set ``(x_i, y_i)``, ``i = 1..n``:

* the fused model's **own inputs** of the level, ``F`` (rows of the fused prefix's design), and
* a **label-weighted target**: on row ``i``, each model's level output weighted by how much
  that model believes the true label, ``T_i = sum_k w_ik D_ik W_k`` with
  ``w_ik = p_k(y_i | x_i) / sum_j p_j(y_i | x_i)`` (``D_ik``: model ``k``'s own design row, all
  rows of a sample share its weight). A site's model is trusted on the inputs it classifies
  right, the ones its data taught it.

Level by level, bottom-up, with the fitted levels below:

.. math::

    W = \arg\min_W \frac{1}{n}\lVert F W - T\rVert^2
        + \frac{\mu}{c} \sum_k \lVert X_k A_k W - X_k W_k\rVert^2
      = \Big(\frac{F^\top F}{n} + \frac{\mu}{c} S\Big)^{-1}
        \Big(\frac{F^\top T}{n} + \frac{\mu}{c} \sum_k A_k^\top G_k W'_k\Big),
    \qquad S = \sum_k A_k^\top G_k A_k ,

with ``c = tr(S) / tr(F^T F / n)``, so that ``mu`` weighs the two sources whatever the sites' sample
counts and activation scales. ``A_k`` re-expresses site ``k``'s design in the fused model's neuron
order (the permutation that aligns it, through
:func:`~fedfuse.fusion.methods.neuron_interpolation.grams.design_map`; the identity with
``align="none"``) and ``W'_k`` are the aligned model's weights, so ``X_k A_k W'_k = X_k W_k P_k``
exactly. ``mu = 0`` is a fit on the fusion set alone, ``mu -> inf`` RegMean (``alpha = 1``) on
aligned models. ``mu="auto"`` is chosen among :data:`WEIGHT_GRID` by ``folds``-fold cross-validation
of the whole fit on the fusion set (the held-out rows' cross entropy), then refitted on every row.

Alignment (``align="activations"``): models are permuted, level by level, onto model 0 by a
maximum-correlation matching of their neurons on the fusion set (Git Re-Basin's activation
matching), which keeps each model's function and makes neuron ``j`` mean one thing across
models; sites trained from one shared initialisation are aligned already (``align="none"``),
and matching them again can only add noise. ``align="auto"`` (the default) cross-validates both
with ``mu``, and keeps the pair of lower held-out loss.

Exact properties (tested): identical sites give back the site's model for every ``mu``; the site
term depends on the sites only through ``sum_k A_k^T G_k A_k`` and ``sum_k A_k^T G_k W'_k``,
so sites sharing a model fit as their pooled data would; a permuted copy of a model is aligned
back and fused into the model itself.

A fusion set that lacks classes the sites hold (one site's data, as the paper's skewed
fusion set on class-sharded sites) cannot validate its own term on them, and its term would pull
every level towards the classes it shows: when the sites' class counts show such a class, the
fit falls back to the sites' term alone (``mu = inf``) and a warning names the classes.

Upload per site: the model and its level Grams, as RegMean's. Affine levels only (MLPs, plain
CNNs, VGG): the Grams of a ResNet block or a ViT encoder are not one level's design.
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Any

import torch
import torch.nn.functional as F

from fedfuse.fusion.base import FusionInputs, FusionMethod
from fedfuse.fusion.blocks.alignment import affine_levels, permute_level
from fedfuse.fusion.blocks.matching import correlation, linear_assignment
from fedfuse.fusion.methods.neuron_interpolation.grams import design_map
from fedfuse.fusion.registry import register_fusion_method
from fedfuse.io.grams import full_gram
from fedfuse.models import LeveledModel, ModelSpec
from fedfuse.models.affine import affine_view, check_fit_bias, fit_intercept
from fedfuse.models.symmetry import permutation_matrix
from fedfuse.runtime import resolve_device

log = logging.getLogger(__name__)

#: the candidates of ``weight="auto"``: the site term's weight against the fusion set's
WEIGHT_GRID = (0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)
ALIGNMENTS = ("auto", "activations", "none")


def _outputs(model: LeveledModel, data: torch.Tensor, batch_size: int) -> torch.Tensor:
    return torch.cat([model(x) for x in data.split(batch_size)])


def _design(model: LeveledModel, index: int, inputs: torch.Tensor, bias: bool) -> torch.Tensor:
    """The level's design rows on its ``inputs`` (float64), with the 1 only for an intercept."""
    rows = affine_view(model.levels[index]).design(inputs).double()
    return rows if bias else rows[:, :-1]


def _weights(model: LeveledModel, index: int, bias: bool) -> torch.Tensor:
    weights = affine_view(model.levels[index]).weights().double()
    return weights if bias else weights[:-1]


class _Level:
    """One neuron level's fixed parts: its intercept, the sites' summed mapped Grams ``S`` and
    moments ``sum_k A_k^T G_k W'_k``, and the label-weighted targets on every fusion row."""

    def __init__(
        self, index: int, bias: bool, gram: torch.Tensor, moments: torch.Tensor, mean: torch.Tensor
    ) -> None:
        self.index, self.bias = index, bias
        self.gram, self.moments, self.mean = gram, moments, mean
        self.targets: torch.Tensor | None = None  # (samples, rows per sample, outputs)


@register_fusion_method
class RegMeanFusionSet(FusionMethod):
    """RegMean anchored on the labelled fusion set (module docstring): each affine level fitted
    in closed form to the sites' Grams and to label-weighted targets on the fused model's own
    inputs of the fusion set. One upload per site (weights and Grams), no statistics round.

    Args:
        weight: ``mu``, the weight of the sites' Gram term against the fusion set's (after
            scaling both to one trace), ``>= 0`` (``inf``: the sites' term alone, RegMean on
            the aligned models); ``"auto"``: chosen among :data:`WEIGHT_GRID` by
            cross-validation on the fusion set, or ``inf`` when the fusion set shows no sample
            of a class some site holds (:attr:`FusionInputs.class_counts`): the fusion term
            would then pull the fit towards the classes it shows, and its cross-validation
            cannot see the others.
        align: ``"activations"``: permute every model onto model 0 by matching its neurons'
            activations on the fusion set (models from independent initialisations);
            ``"none"``: neuron ``j`` is the same in every model (one shared initialisation);
            ``"auto"``: the one of lower held-out loss, cross-validated with ``weight``.
        folds: folds of the cross-validation of ``weight="auto"``.
        label_power: the exponent ``gamma`` of the target weights ``w_ik ~ p_k(y_i | x_i)^gamma``
            (0: every model alike, as RegMean; larger: the surest model alone).
        jitter: ridge towards the models' mean weights, relative to the system's mean
            diagonal: it settles the directions no data reaches.
        fit_bias: an intercept ``"auto"`` (where the layer has a bias), always or never.
        batch_size: fusion-set samples per forward pass.
        device: where the forward passes run (the solves run in float64 there too).
    """

    name = "regmean-fs"
    requires = frozenset({"grams", "data", "labels"})
    needs_affine_levels = True

    def __init__(
        self,
        weight: float | str = "auto",
        align: str = "auto",
        folds: int = 5,
        label_power: float = 1.0,
        jitter: float = 1e-6,
        fit_bias: bool | str = "auto",
        batch_size: int = 256,
        device: str = "auto",
    ) -> None:
        if weight != "auto" and not (
            isinstance(weight, int | float) and not isinstance(weight, bool) and weight >= 0
        ):
            raise ValueError(f"{self.name}: weight must be a number >= 0 or 'auto', got {weight!r}")
        if align not in ALIGNMENTS:
            raise ValueError(f"{self.name}: align must be one of {ALIGNMENTS}, got {align!r}")
        if not jitter >= 0:
            raise ValueError(f"{self.name}: jitter must be >= 0, got {jitter}")
        check_fit_bias(fit_bias, self.name)
        self.weight = weight if weight == "auto" else float(weight)
        if not (isinstance(label_power, int | float) and label_power >= 0):
            raise ValueError(f"{self.name}: label_power must be >= 0, got {label_power!r}")
        self.align, self.folds, self.jitter = align, int(folds), float(jitter)
        self.label_power = float(label_power)
        self.fit_bias, self.batch_size, self.device = fit_bias, int(batch_size), device

    def needs(self) -> frozenset[str]:
        # the sites' class counts say which classes the fusion set must show (when sent)
        return self.requirements() | {"class_counts"}

    def check_architecture(self, model: LeveledModel) -> None:
        """Every neuron level affine, each with an intercept as ``fit_bias`` asks."""
        for index, view in affine_levels(model).items():
            fit_intercept(
                view.layer, self.fit_bias, where=f"{self.name}: {model.level_name(index)}"
            )

    @torch.no_grad()
    def _fuse(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec
    ) -> tuple[LeveledModel, dict[str, Any]]:
        assert inputs.data is not None and inputs.labels is not None and inputs.grams is not None
        device = resolve_device(self.device)
        data, labels = inputs.data.to(device), inputs.labels.to(device)
        aligns = ("activations", "none") if self.align == "auto" else (self.align,)
        weights = WEIGHT_GRID if self.weight == "auto" else (self.weight,)
        unseen = self._unseen_classes(inputs)
        if unseen and self.weight == "auto":  # an explicit weight is the user's choice
            log.warning(
                "%s: the fusion set has no sample of classes %s, which the sites hold; its "
                "term cannot be checked there, so the levels are fitted on the sites' Grams "
                "alone (weight=inf)",
                self.name,
                unseen,
            )
            weights = (math.inf,)
        choosing = len(aligns) * len(weights) > 1
        if choosing and len(data) < self.folds:
            raise ValueError(
                f"{self.name}: weight or align 'auto' cross-validates on {self.folds} folds of "
                f"the fusion set, which has {len(data)} samples"
            )
        candidates, losses = {}, {}
        for align in aligns:
            aligned = [copy.deepcopy(m).to(device).eval() for m in models]
            readings = self._align(aligned, data) if align == "activations" else {}
            levels = self._levels(aligned, inputs.grams, readings, data, labels)
            candidates[align] = (aligned[0], levels)
            if choosing:
                for weight, loss in self._cross_validate(*candidates[align], data, labels, weights):
                    losses[align, weight] = loss
        align, weight = min(losses, key=losses.get) if choosing else (aligns[0], weights[0])
        details: dict[str, Any] = {"align": align, "weight": weight, "unseen_classes": unseen}
        if choosing:
            details["held_out_losses"] = {f"{a} {w:g}": loss for (a, w), loss in losses.items()}
            log.info(
                "%s: align %s, weight %g (held-out loss %.4f)",
                self.name,
                align,
                weight,
                losses[align, weight],
            )
        fused = self._fit(*candidates[align], data, weight)
        return fused.cpu(), details

    @staticmethod
    def _unseen_classes(inputs: FusionInputs) -> list[int]:
        """Classes some site holds (by its class counts) that no fusion-set sample shows."""
        if inputs.class_counts is None or inputs.labels is None:
            return []
        held = {c for counts in inputs.class_counts for c, n in enumerate(counts) if n > 0}
        return sorted(held - set(inputs.labels.tolist()))

    def _align(self, models: list[LeveledModel], data: torch.Tensor) -> dict[int, list]:
        """Permute models ``1..`` onto model 0 in place, level by level; each level's
        permutation matrices (model 0's: the identity), by neuron level."""
        reference, levels = models[0], models[0].neuron_levels
        readings: dict[int, list] = {}
        hidden = [data for _ in models]
        for index in range(reference.num_levels):
            hidden = [m.levels[index](h) for m, h in zip(models, hidden, strict=True)]
            if index not in levels or index == levels[-1]:
                continue
            width = hidden[0].shape[1]
            matrices = [torch.eye(width, dtype=torch.float64)]
            for number, model in enumerate(models[1:], start=1):
                permutation = linear_assignment(
                    correlation(hidden[0], hidden[number], self.batch_size), maximize=True
                )
                permute_level(model, index, permutation)
                hidden[number] = hidden[number][:, permutation.to(hidden[number].device)]
                matrices.append(permutation_matrix(permutation))
            readings[index] = matrices
        return readings

    def _levels(self, models, grams, readings, data, labels) -> list[_Level]:
        """Every neuron level's site terms (mapped through the alignment) and targets."""
        reference = models[0]
        probabilities = (
            torch.stack(
                [
                    _outputs(m, data, self.batch_size).softmax(1)[torch.arange(len(data)), labels]
                    for m in models
                ],
                1,
            ).double()
            ** self.label_power
        )
        total = probabilities.sum(1, keepdim=True)
        share = torch.where(total > 0, probabilities / total.clamp_min(1e-300), 1 / len(models))
        levels, previous = [], None
        hidden = [data for _ in models]
        for index in range(reference.num_levels):
            if index in reference.neuron_levels:
                name = reference.level_name(index)
                bias = fit_intercept(
                    affine_view(reference.levels[index]).layer, self.fit_bias, where=name
                )
                level = self._site_terms(models, grams, readings.get(previous), index, bias)
                outputs = []
                for k, (model, h) in enumerate(zip(models, hidden, strict=True)):
                    rows = _design(model, index, h, bias) @ _weights(model, index, bias)
                    rows = rows.reshape(len(data), -1, rows.shape[1])
                    outputs.append(share[:, k, None, None] * rows)
                level.targets = torch.stack(outputs).sum(0)
                levels.append(level)
                previous = index
            hidden = [m.levels[index](h) for m, h in zip(models, hidden, strict=True)]
        return levels

    def _site_terms(self, models, grams, reading, index, bias) -> _Level:
        """``S = sum_k A_k^T G_k A_k`` and ``sum_k A_k^T G_k W'_k`` of one level, float64."""
        gram_sum, moment_sum, weight_sum = None, None, None
        for k, model in enumerate(models):
            where = f"{self.name}: site {k}, level {model.level_name(index)}"
            if index not in grams[k]:
                raise ValueError(f"{where}: no Gram uploaded for this level")
            gram = full_gram(torch.as_tensor(grams[k][index])).double().cpu()
            weights = affine_view(model.levels[index]).weights().double().cpu()
            if gram.shape != (len(weights), len(weights)) or not torch.isfinite(gram).all():
                raise ValueError(
                    f"{where}: the Gram must be a finite ({len(weights)}, {len(weights)}) "
                    f"matrix, got shape {tuple(gram.shape)}"
                )
            mapping = design_map(
                None if reading is None else reading[k], len(weights), len(weights), where=where
            )
            mapped = mapping.T @ gram @ mapping
            keep = slice(None) if bias else slice(0, -1)
            mapped = mapped[keep, keep]
            moments = mapped @ weights[keep]
            gram_sum = mapped if gram_sum is None else gram_sum + mapped
            moment_sum = moments if moment_sum is None else moment_sum + moments
            weight_sum = weights[keep] if weight_sum is None else weight_sum + weights[keep]
        return _Level(index, bias, gram_sum, moment_sum, weight_sum / len(models))

    def _fit(
        self,
        reference: LeveledModel,
        levels: list[_Level],
        data: torch.Tensor,
        weight: float,
        rows: torch.Tensor | None = None,
    ) -> LeveledModel:
        """The fused model for ``weight``, its fusion-set terms on the samples ``rows``."""
        fused = copy.deepcopy(reference)
        chosen = torch.arange(len(data), device=data.device) if rows is None else rows
        hidden = data[chosen]
        by_index = {level.index: level for level in levels}
        for index in range(fused.num_levels):
            level = by_index.get(index)
            if level is not None:
                design = _design(fused, index, hidden, level.bias)
                targets = level.targets[chosen.to(level.targets.device)]
                targets = targets.reshape(-1, targets.shape[-1]).to(design.device)
                count = len(hidden)
                system = design.T @ design / count
                rhs = design.T @ targets / count
                gram = level.gram.to(design.device)
                scale = float(gram.trace()) / max(float(system.trace()), 1e-300)
                if math.isinf(weight):  # the sites' term alone: RegMean on the aligned models
                    system, rhs = gram / scale, level.moments.to(design.device) / scale
                elif weight > 0 and scale > 0:
                    system = system + (weight / scale) * gram
                    rhs = rhs + (weight / scale) * level.moments.to(design.device)
                # directions no data reaches keep the models' mean weights
                ridge = self.jitter * float(system.diagonal().mean()) + 1e-12
                system.diagonal().add_(ridge)
                rhs = rhs + ridge * level.mean.to(design.device)
                solution = torch.linalg.solve(system, rhs)
                full = (
                    solution
                    if level.bias
                    else torch.cat([solution, solution.new_zeros(1, solution.shape[1])])
                )
                affine_view(fused.levels[index]).set_weights(full.float())
            hidden = fused.levels[index](hidden)
        return fused

    def _cross_validate(self, reference, levels, data, labels, weights):
        """Each of ``weights`` with its mean held-out cross entropy over ``folds`` folds."""
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
        folds = order.chunk(self.folds)
        for weight in weights:
            total = 0.0
            for fold in folds:
                keep = torch.ones(len(data), dtype=torch.bool)
                keep[fold] = False
                kept = keep.nonzero().squeeze(1).to(data.device)
                model = self._fit(reference, levels, data, weight, kept)
                held = fold.to(data.device)
                logits = _outputs(model, data[held], self.batch_size)
                total += float(F.cross_entropy(logits, labels[held], reduction="sum"))
            yield weight, total / len(data)


__all__ = ["ALIGNMENTS", "WEIGHT_GRID", "RegMeanFusionSet"]
