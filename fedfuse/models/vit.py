"""Vision Transformer (Dosovitskiy et al., 2021), pre-norm, with a class token.

Levels: the patch embedding (patches, class token, position embedding), one level per encoder
block, and the head (the class token, LayerNorm, linear). Between levels the tokens are kept
**channels first**, ``(N, hidden, tokens)``, like a 1-D feature map: a level's neurons are then
its embedding dimensions (dim 1, as for every other architecture), and every token of every
sample is a row of their captured outputs (the neurons pooled over tokens).

Every encoder block adds to the residual stream (``x + attn(ln(x))``, then ``+ mlp(ln(x))``),
so its neurons share the order of its input's neurons. The attention is written with separate
``q``, ``k``, ``v`` and ``out`` linears so each weight is addressable by itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fedfuse.models.leveled import LeveledModel
from fedfuse.models.spec import ModelSpec


class PatchEmbedding(nn.Module):
    """Non-overlapping ``patch x patch`` patches, linearly embedded, with a class token and a
    learned position embedding; output ``(N, hidden, 1 + patches)``. An input whose sides are
    not multiples of ``patch`` is zero-padded (evenly on both sides) up to the next multiple, so
    one ViT setting runs on 28x28 and 32x32 inputs alike."""

    def __init__(self, input_shape: tuple[int, ...], patch: int, hidden: int) -> None:
        super().__init__()
        channels, height, width = input_shape
        pad_h, pad_w = -height % patch, -width % patch
        self.padding = (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2)
        tokens = ((height + pad_h) // patch) * ((width + pad_w) // patch)
        self.projection = nn.Conv2d(channels, hidden, patch, stride=patch)
        self.class_token = nn.Parameter(torch.zeros(hidden, 1))
        self.position = nn.Parameter(torch.randn(hidden, 1 + tokens) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if any(self.padding):
            x = F.pad(x, self.padding)
        patches = self.projection(x).flatten(2)  # (N, hidden, tokens)
        cls = self.class_token.expand(len(x), -1, -1)
        return torch.cat([cls, patches], 2) + self.position


class Attention(nn.Module):
    """Multi-head self-attention over ``(N, tokens, hidden)``."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"{heads} heads do not divide the hidden size {hidden}")
        self.heads = heads
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(n, t, self.heads, d // self.heads).transpose(1, 2)

        y = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)))
        return self.out(y.transpose(1, 2).reshape(n, t, d))


class EncoderBlock(nn.Module):
    """Pre-norm encoder block on channels-first tokens: ``x + attn(ln1(x))``, then
    ``+ fc2(gelu(fc1(ln2(x))))``."""

    def __init__(self, hidden: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attention = Attention(hidden, heads)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, mlp)
        self.gelu = nn.GELU()
        self.fc2 = nn.Linear(mlp, hidden)

    #: output dim ``j`` adds input dim ``j`` (see LeveledModel.is_residual)
    residual = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.transpose(1, 2)  # (N, tokens, hidden)
        tokens = tokens + self.attention(self.ln1(tokens))
        tokens = tokens + self.fc2(self.gelu(self.fc1(self.ln2(tokens))))
        return tokens.transpose(1, 2)


class ClassToken(nn.Module):
    """The class token's features ``(N, hidden)`` from channels-first tokens."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :, 0]


def vit_head(hidden: int, num_classes: int) -> nn.Sequential:
    """Class token, LayerNorm, linear classifier. The norm has no affine parameters of its own
    (a scale and shift before a linear layer fold into it), so the head is an affine level."""
    return nn.Sequential(
        ClassToken(), nn.LayerNorm(hidden, elementwise_affine=False), nn.Linear(hidden, num_classes)
    )


def vit_spec(
    input_shape: tuple[int, ...],
    num_classes: int,
    patch: int = 8,
    depth: int = 7,
    heads: int = 12,
    hidden: int = 384,
    mlp: int = 384,
) -> ModelSpec:
    """Spec of a ViT; the defaults are the paper's CIFAR ViT (patch 8, 7 blocks, 12 heads,
    hidden 384, MLP 384). ``widths`` hold the hidden size once per level with neurons but the
    head (the embedding and every block write the same residual stream)."""
    if len(input_shape) != 3:
        raise ValueError(f"vit needs a (C, H, W) input shape, got {tuple(input_shape)}")
    if min(patch, depth, heads, hidden, mlp) < 1:
        raise ValueError("vit sizes (patch, depth, heads, hidden, mlp) must be positive")
    options = {"patch": int(patch), "heads": int(heads), "mlp": int(mlp)}
    return ModelSpec("vit", tuple(input_shape), num_classes, (int(hidden),) * (depth + 1), options)


def build_vit(spec: ModelSpec) -> LeveledModel:
    """Levels: ``PatchEmbedding``, one ``EncoderBlock`` per block, the class-token head."""
    if len(spec.input_shape) != 3:
        raise ValueError(f"vit needs a (C, H, W) input shape, got {spec.input_shape}")
    hidden = spec.widths[0]
    if len(spec.widths) < 2 or any(w != hidden for w in spec.widths):
        raise ValueError(
            f"vit widths are the residual stream's size, one per level, all equal and at least "
            f"two (embedding and a block); got {spec.widths}"
        )
    try:
        patch, heads, mlp = (int(spec.options[key]) for key in ("patch", "heads", "mlp"))
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(
            f"vit spec options need integer 'patch', 'heads' and 'mlp', got {spec.options}"
        ) from error
    if min(patch, heads, mlp) < 1 or mlp > (1 << 20):
        raise ValueError(f"vit patch, heads and mlp must be positive, got {spec.options}")
    levels: list[nn.Module] = [PatchEmbedding(spec.input_shape, patch, hidden)]
    levels += [EncoderBlock(hidden, heads, mlp) for _ in spec.widths[1:]]
    levels.append(vit_head(hidden, spec.num_classes))
    return LeveledModel(levels, spec)
