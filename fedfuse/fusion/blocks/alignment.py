"""Re-expressing a model's neurons: the shared step of matching-based fusion methods.

OTFusion, Git Re-Basin and FedMA-style matching all align a model's neurons to a reference, level
by level: the neurons of a level are replaced by combinations of themselves (a permutation, a
transport map, a matching into a wider global layer), and the next level's incoming weights are
re-expressed accordingly so the function is kept (exactly, for a permutation).

For an affine level (see :mod:`fedfuse.models.affine`) the outgoing side is the rows of ``W``
(and the bias); the incoming side of the *next* neuron level is its input-channel axis, which for
a ``Linear`` after a ``Flatten`` of ``(C, H, W)`` maps is the channel of each ``H*W`` block. Both
are handled by viewing the next weight as ``(out, C, rest)``.
"""

from __future__ import annotations

import torch

from fedfuse.models import LeveledModel
from fedfuse.models.affine import AffineLevel, affine_view


def affine_levels(model: LeveledModel) -> dict[int, AffineLevel]:
    """The affine view of every neuron level; a ValueError names the first one that is not."""
    views = {}
    for index in model.neuron_levels:
        view = affine_view(model.levels[index])
        if view is None:
            raise ValueError(
                f"level {model.level_name(index)} is not affine (parameter-free ops then one "
                "Linear/Conv2d); this method aligns affine levels only"
            )
        views[index] = view
    return views


def has_affine_levels(model: LeveledModel) -> bool:
    """Whether every neuron level of ``model`` is affine (:func:`affine_levels` accepts it): the
    level path of the aligning methods and FS-Merge's level-wise SuperNet apply."""
    try:
        affine_levels(model)
    except ValueError:
        return False
    return True


def incoming_by_channel(view: AffineLevel, channels: int) -> torch.Tensor:
    """The layer's weight as ``(out, channels, rest)``: incoming weights by input channel."""
    weight = view.layer.weight.detach()
    if weight[0].numel() % channels:
        raise ValueError(
            f"{view.layer} has {weight[0].numel()} inputs per neuron, not a multiple of the "
            f"previous level's {channels} neurons"
        )
    return weight.reshape(weight.shape[0], channels, -1)


@torch.no_grad()
def map_outgoing(view: AffineLevel, matrix: torch.Tensor) -> None:
    """Replace the level's neurons by ``matrix @ neurons`` (``matrix``: new x old)."""
    weight = view.layer.weight
    flat = weight.reshape(weight.shape[0], -1)
    new = matrix.to(flat.dtype) @ flat
    view.layer.weight = torch.nn.Parameter(new.reshape(len(matrix), *weight.shape[1:]))
    if view.layer.bias is not None:
        view.layer.bias = torch.nn.Parameter(matrix.to(flat.dtype) @ view.layer.bias)
    _resize(view, out=len(matrix))


@torch.no_grad()
def map_incoming(view: AffineLevel, matrix: torch.Tensor, channels: int) -> None:
    """Re-express the layer's inputs after the previous level's neurons became ``matrix @ old``.

    The incoming weights become ``W_in @ matrix^T`` on the channel axis (``matrix``: new x old;
    ``channels`` = old); for a permutation this keeps the function exactly.
    """
    grouped = incoming_by_channel(view, channels)  # (out, old, rest)
    new = torch.einsum("ocr,nc->onr", grouped, matrix.to(grouped.dtype))
    weight = view.layer.weight
    shape = (
        (weight.shape[0], len(matrix) * grouped.shape[2])
        if weight.dim() == 2
        else (weight.shape[0], len(matrix), *weight.shape[2:])
    )
    view.layer.weight = torch.nn.Parameter(new.reshape(shape))
    _resize(view, inputs=len(matrix))


def _resize(view: AffineLevel, *, out: int | None = None, inputs: int | None = None) -> None:
    """Keep the layer's size attributes in step with its (replaced) weight."""
    layer = view.layer
    if isinstance(layer, torch.nn.Linear):
        layer.out_features, layer.in_features = layer.weight.shape
    else:
        layer.out_channels, layer.in_channels = layer.weight.shape[:2]


@torch.no_grad()
def permute_level(model: LeveledModel, index: int, permutation: torch.Tensor) -> None:
    """Reorder the neurons of neuron level ``index`` (new neuron i = old ``permutation[i]``),
    fixing the next neuron level's inputs so the model computes the same function."""
    views = affine_levels(model)
    levels = model.neuron_levels
    position = levels.index(index)
    if position == len(levels) - 1:
        raise ValueError("the output level's neurons are the classes and are never permuted")
    matrix = torch.eye(
        len(permutation),
        dtype=model.levels[index].weight.dtype
        if hasattr(model.levels[index], "weight")
        else torch.float32,
    )[permutation]
    map_outgoing(views[index], matrix)
    map_incoming(views[levels[position + 1]], matrix, channels=len(permutation))
