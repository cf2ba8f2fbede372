"""RegMean's least-squares systems: which it solves for an architecture, and how it solves them.

One system per affine level (its Grams carry the trailing 1; a fit without intercept drops it)
and one per Gram block of a level that is not affine (its mergeable modules' weight matrices side
by side as the right-hand side, :func:`~fedfuse.fusion.statistics.grams.module_grams_layout`).
Here are the systems (:func:`merge_systems`), each client's part of them, read one level's Gram
at a time (:func:`client_parts`), the regularised solve (:func:`solve_regularised`) and how a
solution is written back into the fused model (:func:`load_merged`); :mod:`.regmean` says why.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from torch import nn

from fedfuse.fusion.statistics.grams import module_grams_layout
from fedfuse.io.grams import full_gram
from fedfuse.models import LeveledModel
from fedfuse.models.affine import affine_view, fit_intercept
from fedfuse.models.packed_attention import projection_module

#: a system's key: ``(level, -1)`` for an affine level, ``(level, block)`` for a Gram block
SystemKey = tuple[int, int]


@dataclass(frozen=True)
class MergeSystem:
    """One least-squares system of RegMean: its name, its modules (none: an affine level's
    layer), whether it has an intercept, its side, and where it sits in its level's Gram (of
    side ``level_size``)."""

    name: str
    modules: tuple[str, ...]
    bias: bool
    size: int
    offset: int
    level_size: int


def system_key(key: SystemKey) -> str:
    """The system's name in a site's terms (``"3"`` for an affine level, ``"3.1"`` a block)."""
    return f"{key[0]}" if key[1] == -1 else f"{key[0]}.{key[1]}"


def module_matrix(module: nn.Module, bias: bool) -> torch.Tensor:
    """A mergeable module's parameters as ``(fan_in[+1], out)``, the bias as the last row."""
    weight = module.weight.detach().flatten(1)
    if bias:
        weight = torch.cat([weight, module.bias.detach()[:, None]], 1)
    return weight.T


@torch.no_grad()
def set_module_matrix(module: nn.Module, w: torch.Tensor, bias: bool) -> None:
    """Write ``w`` (as :func:`module_matrix` reads it) into the module."""
    weight = module.weight
    rows = w[:-1] if bias else w
    weight.copy_(rows.T.reshape(weight.shape).to(weight.dtype))
    if bias:
        module.bias.copy_(w[-1].to(weight.dtype))


def average_state(
    models: list[LeveledModel], counts: list[float] | None = None
) -> dict[str, torch.Tensor]:
    """The average of the floating-point state, weighted by the models' sample ``counts``
    (None: plain); other entries (BatchNorm's batch counters) from model 0."""
    weights = [1.0] * len(models) if counts is None else [float(c) for c in counts]
    if len(weights) != len(models):
        raise ValueError(f"average_state: {len(weights)} counts for {len(models)} models")
    total_weight = sum(weights)
    states = [m.state_dict() for m in models]
    state = {}
    for key, value in states[0].items():
        if value.is_floating_point():
            total = sum(w * s[key].double().cpu() for w, s in zip(weights, states, strict=True))
            state[key] = (total / total_weight).to(value.dtype)
        else:
            state[key] = value.clone()
    return state


def merge_systems(
    model: LeveledModel, fit_bias: bool | str, method: str
) -> dict[SystemKey, MergeSystem]:
    """The systems RegMean solves for ``model``'s architecture (module docstring); an affine
    level's intercept as ``fit_bias`` says (errors name ``method``)."""
    systems: dict[SystemKey, MergeSystem] = {}
    for level in model.neuron_levels:
        view = affine_view(model.levels[level])
        if view is not None:
            name = model.level_name(level)
            bias = fit_intercept(view.layer, fit_bias, where=f"{method}: level {name}")
            size = view.fan_in - int(not bias)
            systems[level, -1] = MergeSystem(name, (), bias, size, 0, view.fan_in)
    for level, blocks in module_grams_layout(model).items():
        offset, total = 0, sum(block.size for block in blocks)
        for number, block in enumerate(blocks):
            name = f"{model.level_name(level)}/{'+'.join(block.modules)}"
            systems[level, number] = MergeSystem(
                name, block.modules, block.bias, block.size, offset, total
            )
            offset += block.size
    return systems


def client_weights(
    model: LeveledModel, systems: dict[SystemKey, MergeSystem]
) -> dict[SystemKey, torch.Tensor]:
    """Each system's weight matrix of one client (float64, CPU; the bias row only with an
    intercept)."""
    weights = {}
    for (level, number), system in systems.items():
        if number == -1:
            matrix = affine_view(model.levels[level]).weights().double().cpu()
            weights[level, number] = matrix if system.bias else matrix[:-1]
            continue
        level_modules = [projection_module(model.levels[level], m) for m in system.modules]
        matrix = torch.cat([module_matrix(m, system.bias) for m in level_modules], 1)
        weights[level, number] = matrix.double().cpu()
    return weights


def checked_gram(
    grams: dict[int, torch.Tensor], client: int, level: int, name: str, size: int, method: str
) -> torch.Tensor:
    """Client ``client``'s Gram of level ``level`` (named ``name``) in full, checked to be a
    finite ``(size, size)`` matrix (ValueError naming ``method``)."""
    if level not in grams:
        raise ValueError(
            f"{method}: FusionInputs.grams[{client}] has no Gram for level {name} "
            f"(has levels {sorted(grams)}); compute them with "
            "fedfuse.fusion.methods.regression.regmean.level_grams"
        )
    gram = full_gram(torch.as_tensor(grams[level]))
    if gram.shape != (size, size) or not torch.isfinite(gram).all():
        raise ValueError(
            f"{method}: FusionInputs.grams[{client}][{level}] must be a finite "
            f"({size}, {size}) matrix for level {name}, got shape {tuple(gram.shape)}"
        )
    return gram


def client_parts(
    model: LeveledModel,
    grams: dict[int, torch.Tensor],
    client: int,
    systems: dict[SystemKey, MergeSystem],
    method: str,
) -> Iterator[tuple[SystemKey, torch.Tensor, torch.Tensor]]:
    """``(key, Gram, weights)`` of every system for one client (float64, CPU), one level's
    Gram read at a time."""
    weights = client_weights(model, systems)
    for level in sorted({key[0] for key in systems}):
        keys = [key for key in systems if key[0] == level]
        size = systems[keys[0]].level_size
        gram = checked_gram(grams, client, level, model.level_name(level), size, method)
        for key in keys:
            system = systems[key]
            if key[1] == -1:
                part = gram if system.bias else gram[:-1, :-1]
            else:
                rows = slice(system.offset, system.offset + system.size)
                part = gram[rows, rows]
            yield key, part, weights[key]


def solve_regularised(
    total: torch.Tensor, rhs: torch.Tensor, mean: torch.Tensor, jitter: float, name: str
) -> tuple[torch.Tensor, float]:
    """``(total + lambda I)^{-1} (rhs + lambda mean)``, lambda relative to the mean diagonal,
    raised tenfold (from at least 1e-12) while the solve fails or returns non-finite values."""
    scale = float(total.diagonal().mean())
    if not scale > 0:
        raise ValueError(
            f"regmean: the clients' Grams of level {name} are all zero (no data reached it?)"
        )
    eye = torch.eye(len(total), dtype=total.dtype)
    relative = jitter
    for _ in range(14):
        penalty = relative * scale
        solution, info = torch.linalg.solve_ex(total + penalty * eye, rhs + penalty * mean)
        if int(info) == 0 and bool(torch.isfinite(solution).all()):
            return solution, relative
        relative = max(relative * 10, 1e-12)
    raise ValueError(f"regmean: the Gram system of level {name} stays singular (NaN inputs?)")


def load_merged(
    fused: LeveledModel, key: SystemKey, system: MergeSystem, merged: torch.Tensor
) -> None:
    """Write a system's solution into ``fused``: the affine level's layer, or each module of
    the Gram block its columns."""
    level = fused.levels[key[0]]
    if key[1] == -1:
        view = affine_view(level)
        replace(view, bias=system.bias).set_weights(merged)
        return
    column = 0
    for module_name in system.modules:
        module = projection_module(level, module_name)
        out = module.weight.shape[0]
        set_module_matrix(module, merged[:, column : column + out], system.bias)
        column += out


__all__ = [
    "MergeSystem",
    "SystemKey",
    "average_state",
    "client_parts",
    "client_weights",
    "load_merged",
    "merge_systems",
    "solve_regularised",
    "system_key",
]
