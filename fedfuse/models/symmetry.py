"""The neuron symmetries of each architecture: which tensor axes a hidden feature space indexes.

Reordering the neurons of a hidden feature space, and every tensor axis that produces or consumes
them in the same way, leaves a network's function unchanged. Alignment-based fusion (Git
Re-Basin, OTFusion, matching before RegMean or averaging) needs exactly that map from a feature
space to the axes it touches, and it is the one architecture-specific part of those methods. A
:class:`FeatureSpace` lists:

- ``axes``: every ``(state-dict key, dim)`` the space indexes, parameters and BatchNorm buffers
  alike (a ``Linear`` after a ``Flatten`` of ``(C, H, W)`` maps indexes its inputs in blocks of
  ``H * W``: ``repeat``);
- ``probes``: the module outputs that hold the space's features (for activation matching), with
  the dim of their channels;
- ``groups``: a permutation must stay inside contiguous groups (attention heads).

Attention also has a *scale* symmetry, per channel: queries times ``c`` and keys times ``1/c``
keep every logit, values times ``c`` and the output's matching inputs times ``1/c`` keep the
block's output. :func:`balance_attention` uses it to give fitted factors equal norms.

Spaces are disjoint in their axes, so they can be aligned independently and in any order. In a
ResNet, a residual stream (the stem or a projection block, and the identity blocks after it) is
one space; in a ViT the whole residual stream, from the patch embedding to the head, is one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from copy import deepcopy
from dataclasses import dataclass

import torch
from torch import nn

from fedfuse.models.affine import affine_view
from fedfuse.models.leveled import LeveledModel
from fedfuse.models.resnet import BasicBlock, Stem
from fedfuse.models.vit import Attention, EncoderBlock, PatchEmbedding


@dataclass(frozen=True)
class Axis:
    """Dim ``dim`` of state-dict tensor ``key``; each feature owns ``repeat`` consecutive entries
    of it. ``produces``: the tensor computes or normalises the features (else it consumes them).
    ``offset``: the space indexes only ``size * repeat`` entries of the dim from this one (a
    slice: packed attention projections, the inputs after a ``cat``); None: the whole dim."""

    key: str
    dim: int
    produces: bool = True
    repeat: int = 1
    offset: int | None = None

    def span(self, size: int) -> tuple[int, int]:
        """The entries ``[start, stop)`` of the dim that a space of ``size`` features indexes."""
        start = self.offset or 0
        return start, start + size * self.repeat


@dataclass(frozen=True)
class FeatureSpace:
    """A set of ``size`` interchangeable neurons and everything that refers to them."""

    name: str
    size: int
    axes: tuple[Axis, ...]
    probes: tuple[tuple[str, int], ...]
    groups: int = 1

    @property
    def keys(self) -> set[str]:
        return {axis.key for axis in self.axes}


def feature_spaces(model: LeveledModel) -> list[FeatureSpace]:
    """Every hidden feature space of ``model`` (the classes of the output are never permuted).

    A model of another architecture whose neuron levels are all affine (a chain of Linear and
    Conv2d layers, e.g. an adapted plain ``nn.Module``) is described as the MLP and VGG are.
    A model adapted from a plain module with branches or normalisation carries the spaces
    derived from its graph (:mod:`fedfuse.models.graph_symmetry`), or the reason they cannot be.
    Raises ValueError for any other architecture whose symmetries are not described here.
    """
    derived = getattr(model, "derived_spaces", None)
    describe = _DESCRIBERS.get(model.spec.arch)
    if derived is not None:
        if isinstance(derived, Exception):
            raise ValueError(str(derived))
        describe = lambda _: list(derived)  # noqa: E731
    elif describe is None:
        if not all(affine_view(model.levels[i]) is not None for i in model.neuron_levels):
            raise ValueError(
                f"the neuron symmetries of {model.spec.arch!r} models are not described; known: "
                f"{sorted(_DESCRIBERS)} and chains of Linear and Conv2d layers"
            )
        describe = _affine_spaces
    spaces = describe(model)
    _check_disjoint(model, spaces)
    return spaces


@torch.no_grad()
def map_state(
    state: Mapping[str, torch.Tensor], space: FeatureSpace, matrix: torch.Tensor
) -> dict[str, torch.Tensor]:
    """``state`` with the features of ``space`` replaced by ``matrix @ features``.

    ``matrix`` is ``(new, old)``: a permutation matrix reorders (exactly keeping the function),
    a transport or averaging map mixes, and a ``new != old`` changes the space's width (load the
    result into a model of the matching spec). Every axis, producing or consuming, is mapped by
    the same matrix, which for a permutation is the exact re-expression on both sides.
    """
    if matrix.dim() != 2 or matrix.shape[1] != space.size:
        raise ValueError(
            f"space {space.name} has {space.size} features; the map must be (new, {space.size}), "
            f"got {tuple(matrix.shape)}"
        )
    out = dict(state)
    for axis in space.axes:
        tensor = out[axis.key]
        start, stop, entries = _checked_span(tensor, axis, space)
        moved = tensor.movedim(axis.dim, 0)
        blocks = moved[start:stop].reshape(space.size, axis.repeat, *moved.shape[1:])
        mixed = torch.tensordot(matrix.to(tensor.dtype), blocks, dims=([1], [0]))
        mixed = mixed.reshape(-1, *moved.shape[1:])
        if axis.offset is not None:
            mixed = torch.cat([moved[:start], mixed, moved[stop:]])
        out[axis.key] = mixed.movedim(0, axis.dim).contiguous()
    return out


def _permute_state(
    state: Mapping[str, torch.Tensor], space: FeatureSpace, permutation: torch.Tensor
) -> dict[str, torch.Tensor]:
    """:func:`map_state` with a permutation's matrix, by indexing (exact, and linear in size)."""
    if permutation.shape != (space.size,):
        raise ValueError(f"space {space.name} has {space.size} features, got {permutation.shape}")
    out = dict(state)
    for axis in space.axes:
        tensor = out[axis.key]
        start, stop, entries = _checked_span(tensor, axis, space)
        block = (permutation[:, None] * axis.repeat + torch.arange(axis.repeat)).flatten()
        index = torch.cat([torch.arange(start), block + start, torch.arange(stop, entries)])
        out[axis.key] = tensor.index_select(axis.dim, index.to(tensor.device))
    return out


def _checked_span(tensor: torch.Tensor, axis: Axis, space: FeatureSpace) -> tuple[int, int, int]:
    """``axis``' entries of ``space`` in ``tensor`` (start, stop) and the dim's length, checked:
    a whole-dim axis fills the dim, a sliced one fits in it."""
    start, stop = axis.span(space.size)
    entries = tensor.shape[axis.dim]
    if (entries != stop) if axis.offset is None else (stop > entries):
        raise ValueError(
            f"{axis.key} has {entries} entries on dim {axis.dim}, expected {space.size} "
            f"features x {axis.repeat} of space {space.name} from entry {start}"
        )
    return start, stop, entries


def permutation_matrix(permutation: torch.Tensor) -> torch.Tensor:
    """The matrix with ``new feature i = old feature permutation[i]``."""
    return torch.eye(len(permutation), dtype=torch.float64)[permutation.cpu()]


@torch.no_grad()
def permute_model(model: LeveledModel, permutations: Mapping[str, torch.Tensor]) -> LeveledModel:
    """A copy of ``model`` with the spaces named in ``permutations`` reordered (same function)."""
    spaces = {space.name: space for space in feature_spaces(model)}
    unknown = sorted(set(permutations) - spaces.keys())
    if unknown:
        raise ValueError(f"unknown feature spaces {unknown}; the model has {sorted(spaces)}")
    state = model.state_dict()
    for name, permutation in permutations.items():
        state = _permute_state(state, spaces[name], permutation.cpu())
    copy = deepcopy(model)
    copy.load_state_dict(state)
    return copy


def random_permutations(
    model: LeveledModel, generator: torch.Generator | None = None
) -> dict[str, torch.Tensor]:
    """A random permutation of every feature space (inside its groups): for symmetry tests."""
    result = {}
    for space in feature_spaces(model):
        size = space.size // space.groups
        result[space.name] = torch.cat(
            [g * size + torch.randperm(size, generator=generator) for g in range(space.groups)]
        )
    return result


def balance_attention(attention: Attention) -> None:
    """Give each query/key channel pair and each value/output channel pair equal norms, in place.

    The function is unchanged (the scale symmetry of the module docstring). A closed-form fit
    determines the products ``q_j k_j`` and ``o_j v_j``, not how their factors share the scale,
    and its factors can differ by four orders of magnitude (values whitened on the data, the
    output carrying the rest). Gradient steps on such factors (fine-tuning, descent after the
    fit) move the small one by as much as the large one: one epoch of AdamW at ``3e-4`` took a
    fused ViT from 78% to 27%. Channel ``j`` is scaled by ``c = sqrt(|second_j| / |first_j|)``
    (a bias counts with its row), the balance gradient flow keeps in a trained network; a
    channel with a zero factor is left alone.
    """
    balance_query_key(attention)
    balance_value_output(attention)


def balance_query_key(attention: Attention) -> None:
    """:func:`balance_attention`'s query/key half: each logit's two factors, equal norms."""
    _balance(attention.q, attention.k.weight, attention.k.bias, dim=0)


def balance_value_output(attention: Attention) -> None:
    """:func:`balance_attention`'s value/output half: value channel ``j`` and the output's
    column ``j``, equal norms."""
    _balance(attention.v, attention.out.weight, None, dim=1)


@torch.no_grad()
def _balance(
    first: nn.Linear, second: torch.Tensor, second_bias: torch.Tensor | None, dim: int
) -> None:
    """Scale ``first``'s output channels by ``c`` and ``second``'s channels along ``dim`` (and
    ``second_bias``) by ``1 / c``, ``c`` equalising their norms."""
    first_norm = first.weight.double().pow(2).sum(1)
    if first.bias is not None:
        first_norm = first_norm + first.bias.double().pow(2)
    second_norm = second.double().pow(2).sum(1 - dim)
    if second_bias is not None:
        second_norm = second_norm + second_bias.double().pow(2)
    usable = (first_norm > 0) & (second_norm > 0)
    scale = torch.where(usable, (second_norm / first_norm.clamp_min(1e-300)) ** 0.25, 1.0)
    first.weight.mul_(scale[:, None].to(first.weight.dtype))
    if first.bias is not None:
        first.bias.mul_(scale.to(first.bias.dtype))
    shape = (-1, 1) if dim == 0 else (1, -1)
    second.div_(scale.view(shape).to(second.dtype))
    if second_bias is not None:
        second_bias.div_(scale.to(second_bias.dtype))


# ---------------------------------------------------------------------------- architectures
def _linear(prefix: str, produces: bool, repeat: int = 1) -> tuple[Axis, ...]:
    if produces:
        return (Axis(f"{prefix}.weight", 0), Axis(f"{prefix}.bias", 0))
    return (Axis(f"{prefix}.weight", 1, produces=False, repeat=repeat),)


def _batchnorm(prefix: str) -> tuple[Axis, ...]:
    return tuple(
        Axis(f"{prefix}.{name}", 0) for name in ("weight", "bias", "running_mean", "running_var")
    )


def _affine_spaces(model: LeveledModel) -> list[FeatureSpace]:
    """MLP and VGG: each hidden affine level is a space; the next neuron level consumes it."""

    names = {id(m): name for name, m in model.named_modules()}
    levels = model.neuron_levels
    spaces = []
    for index, following in zip(levels, levels[1:], strict=False):
        produced = affine_view(model.levels[index])
        consumer = affine_view(model.levels[following])
        if produced is None or consumer is None:
            raise ValueError(f"level {model.level_name(index)} or the next is not affine")
        width = produced.layer.weight.shape[0]
        fan_in = consumer.layer.weight.shape[1]
        repeat = fan_in // width if isinstance(consumer.layer, nn.Linear) else 1
        producer_key, consumer_key = names[id(produced.layer)], names[id(consumer.layer)]
        axes = _linear(producer_key, True)
        if produced.layer.bias is None:
            axes = axes[:1]
        spaces.append(
            FeatureSpace(
                f"level{index}",
                width,
                (*axes, *_linear(consumer_key, False, repeat)),
                ((f"levels.{index}", 1),),
            )
        )
    return spaces


def _resnet_spaces(model: LeveledModel) -> list[FeatureSpace]:

    spaces: list[FeatureSpace] = []
    stream: list[Axis] = []
    probes: list[tuple[str, int]] = []
    stream_start = 0

    def close(consumers: tuple[Axis, ...]) -> None:
        width = model.level_width(stream_start)
        name = f"stream{stream_start}"
        spaces.append(FeatureSpace(name, width, (*stream, *consumers), tuple(probes)))

    for index, level in enumerate(model.levels):
        prefix = f"levels.{index}"
        if isinstance(level, Stem):
            stream = [Axis(f"{prefix}.conv.weight", 0), *_batchnorm(f"{prefix}.bn")]
            probes, stream_start = [(prefix, 1)], index
        elif isinstance(level, BasicBlock):
            consumers = [Axis(f"{prefix}.conv1.weight", 1, produces=False)]
            if not level.identity_shortcut:
                consumers.append(Axis(f"{prefix}.shortcut.0.weight", 1, produces=False))
                close(tuple(consumers))
                stream = [
                    Axis(f"{prefix}.shortcut.0.weight", 0),
                    *_batchnorm(f"{prefix}.shortcut.1"),
                ]
                probes, stream_start = [], index
            else:
                stream.extend(consumers)
            stream += [Axis(f"{prefix}.conv2.weight", 0), *_batchnorm(f"{prefix}.bn2")]
            probes.append((prefix, 1))
            inner = (
                Axis(f"{prefix}.conv1.weight", 0),
                *_batchnorm(f"{prefix}.bn1"),
                Axis(f"{prefix}.conv2.weight", 1, produces=False),
            )
            width = level.conv1.weight.shape[0]
            spaces.append(
                FeatureSpace(f"block{index}.inner", width, inner, ((f"{prefix}.relu1", 1),))
            )
        elif index == model.num_levels - 1:
            close((Axis(f"{prefix}.2.weight", 1, produces=False),))
        else:
            raise ValueError(f"unexpected resnet level {model.level_name(index)}")
    return spaces


def _vit_spaces(model: LeveledModel) -> list[FeatureSpace]:

    spaces: list[FeatureSpace] = []
    stream: list[Axis] = []
    probes: list[tuple[str, int]] = []
    hidden = model.spec.widths[0]
    for index, level in enumerate(model.levels):
        prefix = f"levels.{index}"
        if isinstance(level, PatchEmbedding):
            stream += [
                *_linear(f"{prefix}.projection", True),
                Axis(f"{prefix}.class_token", 0),
                Axis(f"{prefix}.position", 0),
            ]
            probes.append((prefix, 1))
        elif isinstance(level, EncoderBlock):
            attention = f"{prefix}.attention"
            stream += [
                *_layernorm(f"{prefix}.ln1"),
                *(Axis(f"{attention}.{name}.weight", 1, produces=False) for name in "qkv"),
                *_linear(f"{attention}.out", True),
                *_layernorm(f"{prefix}.ln2"),
                *_linear(f"{prefix}.fc1", False),
                *_linear(f"{prefix}.fc2", True),
            ]
            probes.append((prefix, 1))
            heads = level.attention.heads
            spaces += [
                FeatureSpace(
                    f"block{index}.qk",
                    hidden,
                    (*_linear(f"{attention}.q", True), *_linear(f"{attention}.k", True)),
                    ((f"{attention}.q", -1), (f"{attention}.k", -1)),
                    groups=heads,
                ),
                FeatureSpace(
                    f"block{index}.v",
                    hidden,
                    (*_linear(f"{attention}.v", True), *_linear(f"{attention}.out", False)),
                    ((f"{attention}.v", -1),),
                    groups=heads,
                ),
                FeatureSpace(
                    f"block{index}.mlp",
                    level.fc1.out_features,
                    (*_linear(f"{prefix}.fc1", True), *_linear(f"{prefix}.fc2", False)),
                    ((f"{prefix}.gelu", -1),),
                ),
            ]
        elif index == model.num_levels - 1:
            stream.append(Axis(f"{prefix}.2.weight", 1, produces=False))
        else:
            raise ValueError(f"unexpected vit level {model.level_name(index)}")
    return [FeatureSpace("stream", hidden, tuple(stream), tuple(probes)), *spaces]


def _layernorm(prefix: str) -> tuple[Axis, ...]:
    return (Axis(f"{prefix}.weight", 0), Axis(f"{prefix}.bias", 0))


def _check_disjoint(model: LeveledModel, spaces: list[FeatureSpace]) -> None:
    """Each entry of a (key, dim) belongs to one space at most, and every key exists."""
    state = model.state_dict()
    seen: dict[tuple[str, int], list[tuple[int, int, str]]] = {}
    for space in spaces:
        for axis in space.axes:
            if axis.key not in state:
                raise ValueError(f"space {space.name} names {axis.key}, which the model lacks")
            start, stop = axis.span(space.size)
            taken = seen.setdefault((axis.key, axis.dim), [])
            for first, last, owner in taken:
                if start < last and first < stop and owner != space.name:
                    raise ValueError(
                        f"{axis.key} dim {axis.dim} is in spaces {owner} and {space.name}"
                    )
            taken.append((start, stop, space.name))


_DESCRIBERS: dict[str, Callable[[LeveledModel], list[FeatureSpace]]] = {
    "mlp": _affine_spaces,
    "vgg11": _affine_spaces,
    "resnet": _resnet_spaces,
    "vit": _vit_spaces,
}
