"""Models as levels: the architectures, the registry that rebuilds them from a ModelSpec, and
what is read off a model's levels (affine views, activation capture, importance scores)."""

from __future__ import annotations

from fedfuse.models.adapter import ModelAdapter
from fedfuse.models.ensemble import Ensemble
from fedfuse.models.importance import Scores, importance_scores
from fedfuse.models.lenet import build_lenet5, lenet5_spec
from fedfuse.models.leveled import LeveledModel, corresponding_levels
from fedfuse.models.mlp import build_mlp, mlp_spec
from fedfuse.models.registry import (
    ARCHITECTURES,
    SPEC_BUILDERS,
    build_model,
    make_spec,
    parameter_shapes,
    register_architecture,
)
from fedfuse.models.resnet import build_resnet, resnet_spec
from fedfuse.models.spec import ModelSpec
from fedfuse.models.vgg import build_vgg11, vgg11_spec
from fedfuse.models.vit import build_vit, vit_spec

__all__ = [
    "ARCHITECTURES",
    "SPEC_BUILDERS",
    "Ensemble",
    "LeveledModel",
    "ModelAdapter",
    "Scores",
    "ModelSpec",
    "build_model",
    "build_lenet5",
    "build_mlp",
    "build_resnet",
    "build_vit",
    "corresponding_levels",
    "importance_scores",
    "build_vgg11",
    "lenet5_spec",
    "make_spec",
    "mlp_spec",
    "parameter_shapes",
    "register_architecture",
    "resnet_spec",
    "vgg11_spec",
    "vit_spec",
]
