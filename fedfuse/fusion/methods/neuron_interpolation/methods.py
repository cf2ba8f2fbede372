"""The neuron-interpolation method: the bottom-up fit of the fused model, level by level.

:class:`NeuronInterpolation` checks the models, captures their level outputs on the fusion set,
and for each fused level groups the base neurons (:mod:`.grouping`) and fits the level to the
groups' targets (:mod:`.linear` or :mod:`.gradient`) from the fused levels below; then it refolds
BatchNorm statistics. Its options, each written once with its default, and what they configure
are :mod:`.interpolation_options`'.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from functools import partial
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from fedfuse.fusion.base import FusionInputs
from fedfuse.fusion.blocks.batchnorm import refold_batchnorm_statistics
from fedfuse.fusion.blocks.graph_pieces import fold_norm_levels
from fedfuse.fusion.blocks.kmeans import resolve_variance
from fedfuse.fusion.blocks.least_squares import RIDGE_GRID
from fedfuse.fusion.blocks.whitening import uses_whitening_cutoff
from fedfuse.fusion.inputs import head_weights as resolve_head_weights
from fedfuse.fusion.inputs import resolve_scores
from fedfuse.fusion.methods.neuron_interpolation import prior
from fedfuse.fusion.methods.neuron_interpolation.blocks import fit_block_linear, is_block_level
from fedfuse.fusion.methods.neuron_interpolation.costs import level_cost
from fedfuse.fusion.methods.neuron_interpolation.gradient import fit_gradient
from fedfuse.fusion.methods.neuron_interpolation.interpolation_options import InterpolationOptions
from fedfuse.fusion.methods.neuron_interpolation.level_fit import LevelFit
from fedfuse.fusion.methods.neuron_interpolation.linear import fit_linear
from fedfuse.fusion.methods.neuron_interpolation.structure import check_structure
from fedfuse.models import LeveledModel, ModelSpec, build_model
from fedfuse.models.affine import affine_view
from fedfuse.models.capture import LevelIO, LevelStream
from fedfuse.runtime import release_free_memory, resolve_device

log = logging.getLogger(__name__)


class NeuronInterpolation(InterpolationOptions):
    """Neuron-interpolation fusion with a choice of grouping and approximation.

    The shared base of :class:`~.variants.HFLinear`, :class:`~.variants.HFGradient`,
    :class:`~.variants.KFLinear` and :class:`~.variants.KFGradient`; its options (Args) and what
    they configure are :class:`~.interpolation_options.InterpolationOptions`'.
    """

    # ------------------------------------------------------------------ one level's fit
    def _head_candidates(
        self, inputs: FusionInputs, count: int, classes: int
    ) -> dict[str, torch.Tensor]:
        """The classifier targets' model weights ``(models, classes)`` to fit, by name
        (``"uniform"``, ``"classes"``): one, or both for ``head_weights="auto"`` when the
        class counts and the labelled fusion set are given and the two differ."""
        uniform = resolve_head_weights(self.name, None, count, classes)
        if self.head_weights is False or inputs.class_counts is None:
            if self.head_weights is True:  # requirements() made fuse() refuse this already
                raise ValueError(f"{self.name}: head_weights=true needs class_counts")
            return {"uniform": uniform}
        shares = resolve_head_weights(self.name, inputs.class_counts, count, classes)
        if self.head_weights is True or inputs.labels is None or torch.equal(shares, uniform):
            return {"classes": shares}
        return {"uniform": uniform, "classes": shares}

    def _fit_level(
        self,
        fit: LevelFit,
        models: list[LeveledModel],
        weights: torch.Tensor,
        labels: torch.Tensor | None,
        *,
        is_head: bool,
    ) -> dict[str, Any]:
        """Fit ``fit.level`` in place: closed form (Linear, or the Gradient variant's start),
        then gradient steps for the Gradient variant. Returns the level's details."""
        level, index, mappings = fit.level, fit.index, fit.mappings
        closed_form = self.approximation == "linear" or (
            self.start == "closed-form"
            and (is_block_level(level) or affine_view(level) is not None)
        )
        info: dict[str, Any] = {}
        if closed_form and is_block_level(level):
            info = fit_block_linear(
                level,
                fit.x,
                [m.levels[mp[index]] for m, mp in zip(models, mappings, strict=True)],
                [c[index].inputs for c in fit.captured],
                weights,
                fit.k,
                labels,
                group=self._group,
                batch_size=self.batch_size_capture,
            )
            info.update(
                level_cost(
                    level, fit.x, fit.outputs, info["labels"], weights, self.batch_size_capture
                )
            )
        elif closed_form:
            info = fit_linear(fit, weights, labels, group=self._group, options=self)
        if self.approximation == "gradient":
            start = {key: info[key] for key in ("representation_cost",) if key in info}
            info = fit_gradient(
                fit,
                weights,
                info.get("labels", labels),
                models[0].levels[mappings[0][index]],
                is_head=is_head,
                group=self._group,
                options=self,
                started=closed_form,
            )
            if start:
                info["closed_form_cost"] = start["representation_cost"]
        return info

    def _fit_head(
        self,
        fit: LevelFit,
        models: list[LeveledModel],
        heads: dict[str, torch.Tensor],
        fused: LeveledModel,
        inputs: FusionInputs,
        device: torch.device,
    ) -> dict[str, Any]:
        """Fit the classifier to each candidate target (:meth:`_head_candidates`); of several,
        keep the one whose fused model has the lower fusion-set cross-entropy."""
        classes = fit.k
        labels = torch.arange(classes, device=device).repeat(len(models))
        fitted: dict[str, tuple[dict[str, Any], dict[str, torch.Tensor]]] = {}
        initial = {key: v.detach().clone() for key, v in fit.level.state_dict().items()}
        for name, mix in heads.items():
            fit.level.load_state_dict(initial)
            weights = mix.reshape(-1).to(device)  # (model, class), model-major like labels
            info = self._fit_level(fit, models, weights, labels, is_head=True)
            state = {key: v.detach().clone() for key, v in fit.level.state_dict().items()}
            fitted[name] = (info, state)
        if len(fitted) == 1:
            name, (info, _) = next(iter(fitted.items()))
            info["head"] = name
            return info
        assert inputs.labels is not None
        losses = {}
        after = nn.Sequential(*fused.levels[fit.index + 1 :]).eval()
        with torch.no_grad():
            for name, (_, state) in fitted.items():
                fit.level.load_state_dict(state)
                logits = torch.cat(
                    [after(fit.level(chunk)) for chunk in fit.x.split(self.batch_size_capture)]
                )
                target = inputs.labels.to(logits.device)
                losses[name] = float(nn.functional.cross_entropy(logits.float(), target))
        chosen = min(losses, key=losses.__getitem__)
        info, state = fitted[chosen]
        fit.level.load_state_dict(state)
        info.update(head=chosen, head_fusion_set_losses=losses)
        log.info(
            "%s: classifier fitted to the %s target (fusion-set losses %s)",
            self.name,
            chosen,
            losses,
        )
        return info

    def _stream_level(
        self,
        streams: list[LevelStream],
        captured: list[dict[int, Any]],
        mappings: list[dict[int, int]],
        index: int,
        fused: LeveledModel,
        previous: tuple[torch.Tensor, list[int]] | None = None,
    ) -> torch.Tensor | None:
        """Every base model's level ``index`` into ``captured``. When K-means will cluster the
        level's neurons on principal coordinates (many models) and its outputs are vectors,
        they are written side by side into one tensor, returned, whose transpose is the
        neurons as points (the kernel route's points).

        ``previous``: the last level's such tensor and widths. With the same widths again, each
        model's block is overwritten once its stream read it (never two levels at once)."""
        first = streams[0].level(mappings[0][index])
        widths = [s.model.level_width(mp[index]) for s, mp in zip(streams, mappings, strict=True)]
        many = first.outputs.dim() == 2 and self.grouping == "kmeans"
        if not many or not resolve_variance(
            self.kmeans_variance, sum(widths), fused.level_width(index)
        ):
            captured[0][index] = first
            rest = zip(streams[1:], captured[1:], mappings[1:], strict=True)
            for stream, capture, mapping in rest:
                capture[index] = stream.level(mapping[index])
            return None
        shape = (len(first.outputs), sum(widths))
        reuse = (
            previous is not None
            and previous[1] == widths
            and previous[0].shape == shape
            and not any(s.keep_inputs for s in streams)  # kept inputs are views of previous
        )
        columns = previous[0] if reuse and previous else first.outputs.new_empty(shape)
        offsets = [0, *torch.tensor(widths).cumsum(0).tolist()]
        blocks = [columns[:, offsets[n] : offsets[n + 1]] for n in range(len(streams))]
        blocks[0].copy_(first.outputs)
        streams[0].keep(blocks[0])
        captured[0][index] = LevelIO(first.inputs, blocks[0])
        del first
        for number in range(1, len(streams)):
            level = streams[number].level(mappings[number][index], out=blocks[number])
            captured[number][index] = level
        return columns

    @uses_whitening_cutoff  # the algorithm
    def _fuse(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec
    ) -> tuple[LeveledModel, dict[str, Any]]:
        mappings = check_structure(self.name, models, target, self.grouping, self.approximation)
        device = resolve_device(self.device)
        data = inputs.data
        assert data is not None
        scores = resolve_scores(
            self.name,
            models,
            inputs,
            use_scores=self.use_scores,
            fallback=self.fallback_scores,
            normalization=self.score_normalization,
            device=self.device,
        )
        result = build_model(target, seed=self.seed).to(device).eval()
        # a user's BatchNorm level is fitted with the layer before it: the fit runs on views
        # of the models in which each such pair is one level (sharing the modules)
        fused, at = fold_norm_levels(result)
        views = [fold_norm_levels(m) for m in models]
        models = [view for view, _ in views]
        mappings = [
            {at[level]: where[base] for level, base in mapping.items()}
            for mapping, (_, where) in zip(mappings, views, strict=True)
        ]
        scores = [
            {where[level]: s[level] for level in sorted(s)}
            for s, (_, where) in zip(scores, views, strict=True)
        ]
        neuron_levels = fused.neuron_levels
        # each model's levels are computed as the fit reaches them: one level in memory at a time
        streams = [
            LevelStream(
                m,
                data,
                batch_size=self.batch_size_capture,
                device=device,
                store_device=device,
                keep_inputs=(self.approximation == "linear" or self.start == "closed-form")
                and any(is_block_level(level) for level in m.levels),
            )
            for m in models
        ]
        captured: list[dict[int, Any]] = [{} for _ in models]
        scores = [
            {level: model_scores[base_level] for level, base_level in mapping.items()}
            for model_scores, mapping in zip(scores, mappings, strict=True)
        ]
        heads = self._head_candidates(inputs, len(models), models[0].spec.num_classes)
        details: dict[str, Any] = {
            "variant": f"{self.grouping}-{self.approximation}",
            "levels": [],
        }
        if self.approximation == "linear" and self.ridge is None:
            details["ridge_grid"] = list(RIDGE_GRID)
        if self.approximation == "gradient":
            details["gradient"] = asdict(self.gradient_settings())
        x = data.to(device)
        previous: tuple[torch.Tensor, list[int]] | None = None
        plain = self.ridge_prior != "zero" and prior.has_plain_levels(fused)
        below: tuple[torch.Tensor, list[int], int] | None = None  # the last level's groups
        bar = tqdm(range(fused.num_levels), desc=self.name, disable=not self.progress, leave=False)
        for index in bar:
            level = fused.levels[index]
            if index not in neuron_levels:
                with torch.no_grad():
                    x = level(x)
                continue
            started = time.perf_counter()
            columns = self._stream_level(streams, captured, mappings, index, fused, previous)
            outputs = [c[index].outputs for c in captured]
            widths = [o.shape[1] for o in outputs]
            is_head = index == neuron_levels[-1]
            k = fused.level_width(index)
            fit = LevelFit(index, level, x, outputs, widths, k, captured, mappings, columns)
            if plain:
                bases = [m.levels[mp[index]] for m, mp in zip(models, mappings, strict=True)]
                fit.prior_weights = partial(prior.aligned_weight_centres, bases, below, level)
            if is_head:
                info = self._fit_head(fit, models, heads, fused, inputs, device)
            else:
                weights = torch.cat([scores[m][index] for m in range(len(models))]).to(device)
                labels = None
                if fused.is_residual(index):
                    labels = self._residual_labels(x, outputs, weights, widths, k)
                info = self._fit_level(fit, models, weights, labels, is_head=False)
            grouped = info.pop("labels", None)
            below = None if grouped is None else (grouped, widths, k)
            for capture in captured:  # this level's base outputs are not needed again
                del capture[index]
            previous = None if columns is None else (columns, widths)
            del outputs, fit, columns
            release_free_memory()
            with torch.no_grad():
                x = level(x)
            info.update(level=fused.level_name(index), seconds=time.perf_counter() - started)
            if fused.is_residual(index):
                info["residual"] = True
            details["levels"].append(info)
            log.debug("%s level %s: %s", self.name, index, info)
        folded = refold_batchnorm_statistics(result, data, batch_size=self.batch_size_capture)
        if folded:
            details["batchnorm_refolded"] = folded
        return result.cpu(), details
