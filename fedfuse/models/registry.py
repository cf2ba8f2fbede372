"""The architecture registry: every model is rebuilt from its :class:`ModelSpec` by name.

fedfuse's own architectures are registered here; :func:`register_architecture` adds a user's
(:class:`fedfuse.models.adapter.ModelAdapter` registers an adapted plain ``nn.Module``), so
fusion methods and checkpoints can build models of it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from fedfuse.models.lenet import build_lenet5, lenet5_spec
from fedfuse.models.leveled import LeveledModel
from fedfuse.models.mlp import build_mlp, mlp_spec
from fedfuse.models.resnet import build_resnet, resnet_spec
from fedfuse.models.spec import ModelSpec
from fedfuse.models.vgg import build_vgg11, vgg11_spec
from fedfuse.models.vit import build_vit, vit_spec

ARCHITECTURES: dict[str, Callable[[ModelSpec], LeveledModel]] = {
    "mlp": build_mlp,
    "vgg11": build_vgg11,
    "resnet": build_resnet,
    "vit": build_vit,
    "lenet5": build_lenet5,
}
BUILTIN_ARCHITECTURES = frozenset(ARCHITECTURES)

#: each architecture's spec builder from user-facing options
SPEC_BUILDERS: dict[str, Callable[..., ModelSpec]] = {
    "mlp": mlp_spec,
    "vgg11": vgg11_spec,
    "resnet": resnet_spec,
    "vit": vit_spec,
    "lenet5": lenet5_spec,
}


def build_model(
    spec: ModelSpec, *, seed: int | None = None, device: str | torch.device | None = None
) -> LeveledModel:
    """A freshly initialised model of ``spec``; ``seed`` makes the initialisation repeatable.

    ``device="meta"`` builds the structure without allocating any parameter memory: the way to
    learn a spec's tensor shapes before trusting it (a hostile spec may claim any width).
    """
    try:
        builder = ARCHITECTURES[spec.arch]
    except KeyError:
        raise ValueError(
            f"unknown architecture {spec.arch!r}; known: {sorted(ARCHITECTURES)}"
        ) from None
    with torch.device(device) if device is not None else contextlib.nullcontext():
        if seed is None:
            return builder(spec)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return builder(spec)


def parameter_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """The state-dict tensor shapes of a ``spec`` model, computed without allocating them."""
    return {
        name: tuple(t.shape) for name, t in build_model(spec, device="meta").state_dict().items()
    }


def make_spec(
    arch: str, input_shape: tuple[int, ...], num_classes: int, **options: object
) -> ModelSpec:
    """Spec from user-facing options: ``mlp`` takes ``widths``, ``bias``; ``vgg11``
    ``width_multiplier``; ``resnet`` ``depth``, ``width_multiplier``, ``stem``, ``blocks``;
    ``vit`` ``patch``, ``depth``, ``heads``, ``hidden``, ``mlp``; ``lenet5`` ``widths``,
    ``bias``, ``padding``."""
    try:
        builder = SPEC_BUILDERS[arch]
    except KeyError:
        raise ValueError(f"unknown architecture {arch!r}; known: {sorted(ARCHITECTURES)}") from None
    try:
        return builder(input_shape, num_classes, **options)
    except TypeError as error:
        raise ValueError(f"{arch}: {error}") from None


def register_architecture(
    name: str,
    builder: Callable[[ModelSpec], LeveledModel],
    spec_builder: Callable[..., ModelSpec] | None = None,
) -> None:
    """Register architecture ``name``: ``builder(spec)`` returns a fresh :class:`LeveledModel`
    of that spec (initialised from torch's random state), ``spec_builder(input_shape,
    num_classes, **options)`` the spec for user-facing options (optional). Registering a name
    again replaces it; fedfuse's own names cannot be replaced."""
    if not name or not isinstance(name, str):
        raise ValueError(f"an architecture name must be a non-empty string, got {name!r}")
    if name in BUILTIN_ARCHITECTURES and ARCHITECTURES.get(name) is not builder:
        raise ValueError(f"{name!r} is one of fedfuse's own architectures; choose another name")
    ARCHITECTURES[name] = builder
    if spec_builder is not None:
        SPEC_BUILDERS[name] = spec_builder
