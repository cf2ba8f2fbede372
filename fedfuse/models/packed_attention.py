"""``nn.MultiheadAttention``'s projections as RegMean's mergeable modules.

PyTorch's multi-head attention keeps ``q``, ``k`` and ``v`` as one packed parameter
(``in_proj_weight``, ``(3E, E)``) and applies it and ``out_proj`` as functions, so no module
hook sees their inputs. For self-attention (query, key and value the same tensor) both inputs
are known from the module's own: the packed projection reads the query, ``out_proj`` the heads'
attention-weighted values, recomputed here from the query and the module's weights. With them
RegMean merges torchvision's ViT attention as it merges fedfuse's own ViT (``q``, ``k``, ``v``
and ``out`` as ``nn.Linear`` layers) instead of averaging it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

#: the name of the packed projection of an attention module ``a``: ``"a.in_proj"``
IN_PROJ = "in_proj"

_FORWARD_ARGS = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask")


class PackedProjection:
    """The packed ``q``/``k``/``v`` projection of an ``nn.MultiheadAttention``, read and written
    as RegMean reads a ``nn.Linear``: ``weight`` ``(3E, E)``, ``bias``, ``in_features``."""

    def __init__(self, attention: nn.MultiheadAttention) -> None:
        self.attention = attention

    @property
    def weight(self) -> nn.Parameter:
        return self.attention.in_proj_weight

    @property
    def bias(self) -> nn.Parameter | None:
        return self.attention.in_proj_bias

    @property
    def in_features(self) -> int:
        return self.attention.embed_dim


def packable(attention: nn.MultiheadAttention) -> bool:
    """Whether RegMean can merge ``attention``'s projections by Grams: one packed projection
    of the embedding (no separate ``kdim``/``vdim``), no extra key/value biases or zero
    attention."""
    return bool(
        attention._qkv_same_embed_dim and attention.bias_k is None and not attention.add_zero_attn
    )


def attention_projections(level: nn.Module) -> list[tuple[str, Any]]:
    """``(name, projection)`` of the packed projection and ``out_proj`` of every
    :func:`packable` attention module inside ``level``."""
    found: list[tuple[str, Any]] = []
    for name, module in level.named_modules():
        if isinstance(module, nn.MultiheadAttention) and packable(module):
            prefix = f"{name}." if name else ""
            found += [
                (prefix + IN_PROJ, PackedProjection(module)),
                (prefix + "out_proj", module.out_proj),
            ]
    return found


def projection_module(level: nn.Module, name: str) -> Any:
    """The module ``name`` of ``level``, or the :class:`PackedProjection` it names."""
    head, _, tail = name.rpartition(".")
    if tail == IN_PROJ:
        owner = level.get_submodule(head) if head else level
        if isinstance(owner, nn.MultiheadAttention):
            return PackedProjection(owner)
    return level.get_submodule(name)


def weight_name(name: str) -> str:
    """The parameter name of a mergeable module's weight: ``"<attention>.in_proj_weight"`` for a
    packed projection, ``"<module>.weight"`` otherwise."""
    head, _, tail = name.rpartition(".")
    if tail == IN_PROJ:
        return f"{head}.in_proj_weight" if head else "in_proj_weight"
    return f"{name}.weight"


def _blocked(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: may not attend) as the additive one: -inf where True, else 0."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, -torch.inf)


def _mixed_values(
    attention: nn.MultiheadAttention, x: torch.Tensor, arguments: dict[str, Any]
) -> torch.Tensor:
    """The input of ``attention.out_proj`` in self-attention over ``x``: every head's
    attention-weighted values, concatenated (eval mode: no dropout)."""
    tokens = x if attention.batch_first else x.transpose(0, 1)
    if tokens.dim() == 2:  # one unbatched sequence
        tokens = tokens[None]
    n, t, width = tokens.shape
    heads = attention.num_heads
    q, k, v = F.linear(tokens, attention.in_proj_weight, attention.in_proj_bias).chunk(3, -1)

    def split(y: torch.Tensor) -> torch.Tensor:
        return y.reshape(n, t, heads, width // heads).transpose(1, 2)

    mask = torch.zeros(n, 1, t, t, dtype=tokens.dtype, device=tokens.device)
    given = arguments.get("attn_mask")
    if given is not None:
        additive = given if given.is_floating_point() else _blocked(given, tokens.dtype)
        mask = mask + (additive.reshape(n, heads, t, t) if additive.dim() == 3 else additive)
    elif arguments.get("is_causal"):
        mask = mask + torch.ones(t, t, device=tokens.device).triu(1) * -torch.inf
    padding = arguments.get("key_padding_mask")
    if padding is not None:
        additive = padding if padding.is_floating_point() else _blocked(padding, tokens.dtype)
        mask = mask + additive.reshape(n, 1, 1, t)
    mixed = F.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=mask)
    mixed = mixed.transpose(1, 2).reshape(n, t, width)
    if x.dim() == 2:
        return mixed[0]
    return mixed if attention.batch_first else mixed.transpose(0, 1)


@contextmanager
def hooked_inputs(
    modules: Mapping[Hashable, Any],
    record: Callable[[Any, Any, tuple[Any, ...], None], None],
) -> Iterator[None]:
    """As :func:`~fedfuse.models.capture.hooked` with ``before=True`` (``record(key, module,
    (input,), None)`` before each call), where ``modules`` may hold :class:`PackedProjection` s
    and attention ``out_proj`` s: their inputs are recorded after their attention module runs,
    when it attends over one tensor (self-attention; otherwise they are not recorded)."""
    from fedfuse.models.capture import hooked  # capture imports the models package

    packed = {
        id(m.attention): m.attention for m in modules.values() if isinstance(m, PackedProjection)
    }
    inside = {id(a.out_proj): a for a in packed.values()}
    plain: dict[Hashable, Any] = {}
    parts: dict[int, dict[str, tuple[Any, Any]]] = {}
    for key, module in modules.items():
        if isinstance(module, PackedProjection):
            parts.setdefault(id(module.attention), {})["in"] = (key, module)
        elif id(module) in inside:
            parts.setdefault(id(inside[id(module)]), {})["out"] = (key, module)
        else:
            plain[key] = module

    def attention_hook(
        attention: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], _output: Any
    ) -> None:
        arguments = dict(zip(_FORWARD_ARGS, args, strict=False)) | kwargs
        query = arguments["query"]
        if arguments.get("key") is not query or arguments.get("value") is not query:
            return  # attends over other tensors: no Gram of its inputs, it is averaged
        own = parts[id(attention)]
        if "in" in own:
            record(own["in"][0], own["in"][1], (query,), None)
        if "out" in own:
            mixed = _mixed_values(attention, query, arguments)
            record(own["out"][0], own["out"][1], (mixed,), None)

    handles = [
        packed[index].register_forward_hook(attention_hook, with_kwargs=True) for index in parts
    ]
    try:
        with hooked(plain, record, before=True):
            yield
    finally:
        for handle in handles:
            handle.remove()


__all__ = [
    "IN_PROJ",
    "PackedProjection",
    "attention_projections",
    "hooked_inputs",
    "packable",
    "projection_module",
    "weight_name",
]
