"""RegMean's client side: the Gram matrices of each neuron level's design rows on a site's own
data (:func:`level_grams`), and how the mergeable modules of a level that is not affine share
them (:func:`module_grams_layout`). :mod:`fedfuse.fusion.methods.regression.regmean` says what they
are for."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fedfuse.fusion.blocks.space_alignment import align_model, match_spaces
from fedfuse.fusion.statistics.privacy import GaussianStatistics, clip_samples, noisy_moments
from fedfuse.io.grams import gram_factor, is_gram_factor
from fedfuse.models import LeveledModel
from fedfuse.models.affine import (
    _patches,
    affine_view,
    gram_levels,
    mergeable,
    mergeable_modules,
    module_gram_levels,
    output_rows,
)
from fedfuse.models.capture import hooked, run_batches
from fedfuse.models.packed_attention import hooked_inputs, projection_module, weight_name
from fedfuse.models.symmetry import FeatureSpace

#: rows of the design matrix multiplied at once in :func:`level_grams` (bounds memory for convs)
_ROW_BUDGET = 1 << 14


@dataclass(frozen=True)
class GramBlock:
    """One Gram of a non-affine level: the mergeable modules reading one input the same way.

    Attributes:
        modules: the modules' qualified names inside the level (``"attention.q"``, ``"conv1"``).
        size: the Gram's side: the modules' fan-in, plus one when they have a bias.
        bias: whether the design rows carry the trailing 1 (the modules have biases).
    """

    modules: tuple[str, ...]
    size: int
    bias: bool


def _reading(module: nn.Module) -> tuple[Any, ...]:
    """How a module turns its input into design rows (equal: the rows are equal)."""
    if isinstance(module, nn.Conv2d):
        return ("conv", module.kernel_size, module.stride, module.padding, module.dilation)
    return ("linear", module.in_features)


def _has_bias(module: nn.Module) -> bool:
    return getattr(module, "bias", None) is not None


def _block_size(module: nn.Module) -> int:
    return module.weight[0].numel() + int(_has_bias(module))


@torch.no_grad()
def module_grams_layout(model: LeveledModel) -> dict[int, list[GramBlock]]:
    """The Gram blocks of every non-affine neuron level of ``model``, in packing order.

    Found by one forward pass of a zero input through ``model`` (on its device, in eval mode)
    with hooks on the mergeable modules: those that receive the very same input tensor and read
    it the same way (same kernel, stride, padding, or both linear; both biased or both not)
    share a block. Modules the forward never calls get no block (they are averaged).
    """
    levels = module_gram_levels(model)
    seen: dict[tuple[int, str], torch.Tensor] = {}  # the inputs are kept alive: ids stay unique

    def record(key: tuple[int, str], _module: nn.Module, args: tuple[Any, ...], _: None) -> None:
        seen.setdefault(key, args[0])

    watched = {
        (level, name): module
        for level in levels
        for name, module in mergeable_modules(model.levels[level])
    }
    device = next(model.parameters()).device
    probe = torch.zeros(1, *model.spec.input_shape, device=device)
    with hooked_inputs(watched, record):
        run_batches(model, probe, batch_size=1, device=device)
    layout: dict[int, list[GramBlock]] = {}
    for level in levels:
        groups: dict[tuple[Any, ...], list[str]] = {}
        sizes: dict[tuple[Any, ...], tuple[int, bool]] = {}
        for name, module in mergeable_modules(model.levels[level]):
            if (level, name) not in seen:
                continue
            key = (id(seen[level, name]), _reading(module), _has_bias(module))
            groups.setdefault(key, []).append(name)
            sizes[key] = (_block_size(module), _has_bias(module))
        layout[level] = [GramBlock(tuple(names), *sizes[key]) for key, names in groups.items()]
    return layout


def _design_rows(module: nn.Module, x: torch.Tensor, bias: bool) -> torch.Tensor:
    if isinstance(module, nn.Conv2d):
        rows = _patches(x, module)
    else:
        rows = x.reshape(-1, module.in_features)
    if bias:
        rows = torch.cat([rows, rows.new_ones(len(rows), 1)], 1)
    return rows


def _accumulate(module: nn.Module, x: torch.Tensor, bias: bool, gram: torch.Tensor) -> None:
    """Add the design Gram of the inputs ``x`` of ``module`` to ``gram`` (CPU, float64)."""
    if isinstance(module, nn.Conv2d):
        positions = 1  # output positions per sample (calling the module would re-enter hooks)
        for size, kernel, stride, pad, dilation in zip(
            x.shape[2:], module.kernel_size, module.stride, module.padding, module.dilation,
            strict=True,
        ):  # fmt: skip
            positions *= max(1, (size + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1)
        step = max(1, _ROW_BUDGET // positions)
        for chunk in range(0, len(x), step):
            design = _design_rows(module, x[chunk : chunk + step], bias).double()
            gram += (design.T @ design).cpu()
        return
    rows = x.reshape(-1, module.in_features)
    for chunk in range(0, len(rows), _ROW_BUDGET):
        design = _design_rows(module, rows[chunk : chunk + _ROW_BUDGET], bias).double()
        gram += (design.T @ design).cpu()


@torch.no_grad()
def level_grams(
    model: LeveledModel,
    data: torch.Tensor,
    *,
    batch_size: int = 256,
    factor: bool = False,
    privacy: Mapping[int, GaussianStatistics] | None = None,
) -> dict[int, torch.Tensor]:
    """Client side of RegMean: each neuron level's design Gram ``X^T X`` over ``data``, float64.

    For an affine level, ``X`` holds the level's design rows (:meth:`AffineLevel.design`: the
    level's inputs computed by ``model`` itself, flattened or unfolded into patches, with a
    trailing 1 for the bias), so the Gram has shape ``(fan_in + 1, fan_in + 1)``. For any other
    level it is the block-diagonal packing of its mergeable modules' Grams (module docstring,
    :func:`module_grams_layout`), each collected by a hook on the module's input
    (:func:`~fedfuse.models.capture.hooked`). The model runs in eval mode on its current device
    and is restored afterwards.

    Args:
        model: the client's model.
        data: the client's training inputs ``(N, ...)``, normalised like the training data.
        batch_size: samples per forward pass; design rows are further chunked to bound memory.
        factor: give an affine level with fewer design rows than columns as its exact factor
            ``R`` (``rows x columns``, ``R^T R = X^T X``; :mod:`fedfuse.io.grams`), which is
            what a site with few samples uploads: a fraction of the matrix's size.
        privacy: per affine level, the Gaussian mechanism of its Gram
            (:mod:`fedfuse.fusion.statistics.privacy`): each sample's design rows scaled by the
            mechanism's ``design_scale`` and clipped to its ``clip``, the sum noised and
            projected, then scaled back (a level that is not affine cannot have one).

    Returns:
        ``{neuron level index: Gram}`` on the CPU, as :attr:`FusionInputs.grams` expects.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if len(data) == 0:
        raise ValueError("level_grams needs at least one sample")
    views = {i: affine_view(model.levels[i]) for i in model.neuron_levels}
    views = {i: v for i, v in views.items() if v is not None}
    privacy = dict(privacy or {})
    if set(privacy) - set(views):
        raise ValueError(
            f"level_grams: privacy covers affine levels only, not {set(privacy) - set(views)}"
        )
    if privacy and factor:
        raise ValueError("level_grams: a noised Gram is sent in full (factor=False)")
    layout = module_grams_layout(model)
    grams: dict[int, torch.Tensor] = {
        index: torch.zeros(view.fan_in, view.fan_in, dtype=torch.float64)
        for index, view in views.items()
    }
    # design rows kept while a level has fewer than its columns (then its Gram is sent as R)
    kept: dict[int, list[torch.Tensor] | None] = {i: [] if factor else None for i in views}
    blocks: dict[tuple[int, int], torch.Tensor] = {}
    block_modules: dict[tuple[int, int], nn.Module] = {}
    for level, level_blocks in layout.items():
        for number, block in enumerate(level_blocks):
            blocks[level, number] = torch.zeros(block.size, block.size, dtype=torch.float64)
            block_modules[level, number] = projection_module(model.levels[level], block.modules[0])

    def record_level(index: int, _level: nn.Module, args: tuple[Any, ...], y: torch.Tensor) -> None:
        x, view = args[0], views[index]
        rows_per_sample = max(1, len(output_rows(y[:1])))
        step = max(1, _ROW_BUDGET // rows_per_sample)
        for chunk in range(0, len(x), step):
            samples = x[chunk : chunk + step]
            design = view.design(samples).double()
            mechanism = privacy.get(index)
            if mechanism is not None:  # each sample's rows scaled, then within the clip
                if mechanism.design_scale is not None:
                    design = design * mechanism.design_scale.to(design)
                design = clip_samples(design, len(samples), mechanism.clip)
            grams[index] += (design.T @ design).cpu()
            rows = kept[index]
            if rows is not None:
                rows.append(design.cpu())
                if sum(len(r) for r in rows) >= view.fan_in:
                    kept[index] = None

    def record_block(
        key: tuple[int, int], module: nn.Module, args: tuple[Any, ...], _: None
    ) -> None:
        _accumulate(module, args[0], layout[key[0]][key[1]].bias, blocks[key])

    with (
        hooked_inputs(block_modules, record_block),
        hooked({index: model.levels[index] for index in views}, record_level),
    ):
        run_batches(model, data, batch_size=batch_size, device=next(model.parameters()).device)
    for level, level_blocks in layout.items():
        grams[level] = torch.block_diag(*(blocks[level, n] for n in range(len(level_blocks))))
    for index, rows in kept.items():
        if rows:
            grams[index] = gram_factor(torch.cat(rows))
    for index, mechanism in privacy.items():
        noisy = noisy_moments(grams[index], mechanism, design=len(grams[index]))
        if mechanism.design_scale is not None:  # back to the design's own units
            scale = mechanism.design_scale.double()
            noisy = noisy / (scale[:, None] * scale[None])
        grams[index] = noisy
    return dict(sorted(grams.items()))


__all__ = [
    "GramBlock",
    "gram_levels",
    "level_grams",
    "mergeable",
    "module_gram_levels",
    "module_grams_layout",
]


def align_grams(
    model: LeveledModel,
    grams: Mapping[int, torch.Tensor],
    spaces: list[FeatureSpace],
    maps: Mapping[str, torch.Tensor],
) -> dict[int, torch.Tensor]:
    """``model``'s level Grams as the Grams of its permuted copy
    (:func:`~fedfuse.fusion.blocks.space_alignment.align_model` with the same ``maps``).

    A module's design rows are its input features (each repeated over its kernel patch or
    flattened positions, feature-major) and a trailing 1; permuting the space that feeds it by
    ``new i = old p[i]`` permutes the rows and columns of its Gram block the same way, so the
    server re-expresses a site's upload without the site's data. Each Gram (or block) is
    permuted by the space whose axes consume its module's weight on dim 1; the bias entry and
    inputs no space permutes (pixels) stay. Gram factors ``R`` keep their form (columns
    permuted). ``maps``: permutation matrices ``(new, old)`` by space name.
    """
    consumers = {
        axis.key: space
        for space in spaces
        for axis in space.axes
        if axis.dim == 1 and not axis.produces
    }
    names = {id(module): name for name, module in model.named_modules()}
    aligned = dict(grams)

    def order(key: str, size: int) -> torch.Tensor | None:
        space = consumers.get(key)
        if space is None or space.name not in maps:
            return None
        matrix = maps[space.name]
        if not bool(((matrix == 0) | (matrix == 1)).all()) or not bool((matrix.sum(1) == 1).all()):
            raise ValueError(f"align_grams: the map of space {space.name} is not a permutation")
        permutation = matrix.argmax(1)
        repeat = size // space.size
        return (permutation[:, None] * repeat + torch.arange(repeat)).flatten()

    def permuted(stored: torch.Tensor, index: torch.Tensor, level: int) -> torch.Tensor:
        stored = torch.as_tensor(stored)
        if stored.dim() != 2 or stored.shape[-1] != len(index):
            raise ValueError(
                f"the Gram of level {model.level_name(level)} has shape {tuple(stored.shape)}, "
                f"the level's inputs need side {len(index)}"
            )
        if is_gram_factor(stored):
            return stored[:, index]
        return stored[index][:, index]

    for level in model.neuron_levels:
        view = affine_view(model.levels[level])
        if view is None or level not in grams:
            continue
        size = view.fan_in  # the design columns, the trailing 1 included
        inner = order(names[id(view.layer)] + ".weight", size - 1)
        if inner is not None:
            aligned[level] = permuted(
                grams[level], torch.cat([inner, torch.tensor([size - 1])]), level
            )
    for level, blocks in module_grams_layout(model).items():
        if level not in grams:
            continue
        index, offset = [], 0
        for block in blocks:
            fan_in = block.size - int(block.bias)
            key = f"{names[id(model.levels[level])]}.{weight_name(block.modules[0])}"
            inner = order(key, fan_in)
            inner = torch.arange(fan_in) if inner is None else inner
            index.append(inner + offset)
            if block.bias:
                index.append(torch.tensor([offset + fan_in]))
            offset += block.size
        aligned[level] = permuted(grams[level], torch.cat(index), level)
    return aligned


def align_sites(
    models: list[LeveledModel], grams: list[dict[int, torch.Tensor]], data: torch.Tensor
) -> tuple[list[LeveledModel], list[dict[int, torch.Tensor]], dict[str, Any]]:
    """Every model permuted onto one neuron order by its activations on ``data``
    (:func:`~fedfuse.fusion.blocks.space_alignment.match_spaces`), its Grams with it
    (:func:`align_grams`); and what it did: neurons ``moved`` (summed over models and spaces)
    and ``seconds``."""
    started = time.perf_counter()
    spaces, maps = match_spaces(models, data)
    aligned = [align_model(m, m_maps, spaces) for m, m_maps in zip(models, maps, strict=True)]
    aligned_grams = []
    for site, (model, site_grams, model_maps) in enumerate(zip(models, grams, maps, strict=True)):
        try:
            aligned_grams.append(align_grams(model, site_grams, spaces, model_maps))
        except (ValueError, IndexError) as error:
            raise ValueError(f"the Grams of site {site}: {error}") from None
    moved = sum(
        int((matrix.argmax(1) != torch.arange(len(matrix))).sum())
        for model_maps in maps
        for matrix in model_maps.values()
    )
    return aligned, aligned_grams, {"moved": moved, "seconds": time.perf_counter() - started}
