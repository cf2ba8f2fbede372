"""Which base level each fused neuron level fits, and whether the models can be fused at all.

Models of the target's architecture and classes are fused level by level, or stage by stage
when their depths differ (:func:`~fedfuse.models.corresponding_levels`); Hungarian Fusion needs
models (any number) of the target's levels and width, the Linear fit the target's neuron levels.
"""

from __future__ import annotations

from collections.abc import Iterable

from fedfuse.models import LeveledModel, ModelSpec, build_model, corresponding_levels


def check_structure(
    name: str, models: list[LeveledModel], target: ModelSpec, grouping: str, approximation: str
) -> list[dict[int, int]]:
    """Check the models against the target; return, per model, the base level that each
    fused neuron level fits (level by level, or stage by stage for other depths). Errors name
    the method ``name``."""
    reference = build_model(target, device="meta")
    mappings = []
    for index, model in enumerate(models):
        if (model.spec.input_shape, model.spec.num_classes) != (
            target.input_shape,
            target.num_classes,
        ):
            raise ValueError(
                f"{name}: model {index} maps {model.spec.input_shape} to "
                f"{model.spec.num_classes} classes, the target {target.input_shape} to "
                f"{target.num_classes}"
            )
        if model.spec.arch != target.arch:
            raise ValueError(
                f"{name}: model {index} is a {model.spec.arch}, the target a {target.arch}"
            )
        try:
            mapping = corresponding_levels(model, reference)
        except ValueError as error:
            raise ValueError(f"{name}: model {index}: {error}") from None
        if grouping == "hungarian" and model.num_levels != reference.num_levels:
            raise ValueError(
                f"{name}: model {index} has {model.num_levels} levels, the target "
                f"{reference.num_levels}; Hungarian Fusion pairs equal models (use kf-*)"
            )
        if approximation == "linear" and model.neuron_levels != reference.neuron_levels:
            raise ValueError(f"{name}: model {index} has other neuron levels")
        mappings.append(mapping)
    check_one_to_one(name, grouping, [*(m.spec.widths for m in models), target.widths])
    return mappings


def one_to_one_cost(grouping: str, num_models: int) -> str | None:
    """Why Hungarian grouping of ``num_models`` models costs more than K-means' as they grow
    (:meth:`~fedfuse.fusion.base.FusionMethod.cost_with_many_sites`), or None for K-means."""
    if grouping == "hungarian":
        return f"matches the neurons of {num_models} models one to one"
    return None


def check_one_to_one(name: str, grouping: str, widths: Iterable[tuple[int, ...]]) -> None:
    """Hungarian grouping pairs neurons one-to-one, so every model and the fused one need the
    same widths; K-means grouping fuses into any width."""
    distinct = sorted(set(widths))
    if grouping == "hungarian" and len(distinct) != 1:
        raise ValueError(
            f"{name}: Hungarian grouping matches neurons one-to-one, so the sites and the fused "
            f"model need the same widths (got {distinct}); use the K-means variant"
        )
