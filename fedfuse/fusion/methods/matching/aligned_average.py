"""What OTFusion and Git Re-Basin share: align every model's neurons, then average the models.

Both methods take the *level path* on models whose neuron levels are all affine (MLP, VGG) and
the *feature-space path* (:mod:`fedfuse.fusion.blocks.space_alignment`) on any other model whose
neuron symmetries are described (ResNet, ViT). Around their own alignment step (optimal
transport, or permutations by MergeMany) they share the options and their checks, the capture of
the hidden levels' pre-activations, the importance scores, the averaging weights and the finish
of every fused model: REPAIR on affine levels and the BatchNorm statistics recomputed on the
fusion set. :class:`AlignedAverage` holds these once.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from typing import Any

import torch

from fedfuse.fusion.base import FusionInputs, FusionMethod
from fedfuse.fusion.blocks.alignment import has_affine_levels
from fedfuse.fusion.blocks.batchnorm import has_batchnorm, reset_batchnorm_statistics
from fedfuse.fusion.blocks.repair import repair as repair_model
from fedfuse.fusion.blocks.space_alignment import check_feature_spaces
from fedfuse.fusion.inputs import check_weighted_average, resolve_scores
from fedfuse.fusion.methods.averaging.fedavg import average_state_dicts
from fedfuse.models import LeveledModel, ModelSpec, build_model
from fedfuse.models.capture import LevelIO, capture_levels
from fedfuse.models.importance import SCORE_METHODS, Scores
from fedfuse.runtime import resolve_device


class AlignedAverage(FusionMethod):
    """Base of the methods that align the models' neurons, then average them (module docstring).

    Its options and their defaults are the subclasses' too (they forward them as
    ``**inherited``). Subclasses fuse on each path (:meth:`_fuse_levels`, :meth:`_fuse_spaces`)
    and refuse the options the feature-space path cannot honour (:meth:`_check_space_options`).
    """

    def __init__(
        self,
        *,
        use_scores: bool = False,
        fallback_scores: str = "uniform",
        weighted_average: bool | str = "auto",
        repair: bool = False,
        reset_batchnorm: bool = True,
        device: str = "auto",
        batch_size_capture: int = 256,
    ) -> None:
        if fallback_scores not in SCORE_METHODS:
            raise ValueError(f"fallback_scores must be one of {SCORE_METHODS}")
        check_weighted_average(self.name, weighted_average)
        self.use_scores = use_scores
        self.fallback_scores = fallback_scores
        self.weighted_average = weighted_average
        self.repair = repair
        self.reset_batchnorm = reset_batchnorm
        self.device = device
        self.batch_size_capture = batch_size_capture

    def check_architecture(self, model: LeveledModel) -> None:
        """Affine levels (MLP, VGG): every option. Otherwise any model with feature spaces
        (ResNet, ViT), without the options that work level by level."""
        if has_affine_levels(model):
            return
        check_feature_spaces(model)
        self._check_space_options()

    @abstractmethod
    def _check_space_options(self) -> None:
        """Raise ValueError naming the options the feature-space path refuses, if set."""

    def _fuse(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec
    ) -> tuple[LeveledModel, dict[str, Any]]:
        if has_affine_levels(models[0]):
            return self._fuse_levels(models, inputs, target)
        return self._fuse_spaces(models, inputs, target)

    @abstractmethod
    def _fuse_levels(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec
    ) -> tuple[LeveledModel, dict[str, Any]]:
        """The fusion on the level path (affine levels)."""

    @abstractmethod
    def _fuse_spaces(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec
    ) -> tuple[LeveledModel, dict[str, Any]]:
        """The fusion on the feature-space path (any model with feature spaces)."""

    def _scores(self, models: list[LeveledModel], inputs: FusionInputs) -> list[Scores] | None:
        """The models' importance scores with ``use_scores`` (else None)."""
        if not self.use_scores:
            return None
        return resolve_scores(
            self.name, models, inputs, fallback=self.fallback_scores, device=self.device
        )

    def _capture_hidden(
        self, models: list[LeveledModel], data: torch.Tensor, hidden: list[int]
    ) -> list[dict[int, LevelIO]]:
        """Every model's outputs of the ``hidden`` levels on ``data`` (kept on the device)."""
        device = resolve_device(self.device)
        return [
            capture_levels(
                m,
                data,
                hidden,
                batch_size=self.batch_size_capture,
                device=device,
                store_device=device,
                keep_inputs=False,
            )
            for m in models
        ]

    @staticmethod
    def _average(
        aligned: list[LeveledModel], weights: list[float], target: ModelSpec
    ) -> LeveledModel:
        """The ``weights``-average of the aligned models' parameters and buffers."""
        fused = build_model(target, seed=0)  # overwritten; the seed spares the global RNG
        fused.load_state_dict(average_state_dicts(aligned, weights))
        return fused

    def _finish(
        self,
        fused: LeveledModel,
        aligned: list[LeveledModel],
        weights: list[float],
        inputs: FusionInputs,
        details: dict[str, Any],
        affine: bool,
    ) -> LeveledModel:
        """``fused`` repaired (affine levels, ``repair``) and its BatchNorm statistics reset
        (``reset_batchnorm``), on the CPU; their timings go into ``details``."""
        device = resolve_device(self.device)
        if affine and self.repair:
            assert inputs.data is not None
            started = time.perf_counter()
            repair_model(
                fused,
                aligned,
                inputs.data,
                weights,
                batch_size=self.batch_size_capture,
                device=device,
            )
            details["repair_seconds"] = time.perf_counter() - started
        if self.reset_batchnorm and has_batchnorm(fused):
            if inputs.data is None:
                raise ValueError(f"{self.name}: resetting BatchNorm statistics needs the data")
            started = time.perf_counter()
            reset_batchnorm_statistics(fused, inputs.data, self.batch_size_capture, device)
            details["reset_batchnorm_seconds"] = time.perf_counter() - started
        return fused.cpu()
