"""Models as users write them, for the experiments and examples that fuse plain ``nn.Module`` s.

* :class:`TemplateNet`: the CNN of Flower's PyTorch template (``flwr new``), for 28x28 grey images.
* :func:`torchvision_resnet18`: ``torchvision.models.resnet18(num_classes=10)`` with its first
  conv reading grey images, as people adapt it to MNIST-like data (BatchNorm, residual adds).
* :func:`torchvision_vit`: a small ``torchvision.models.VisionTransformer`` for 28x28 grey images
  (patch 7, 2 layers, 2 heads, hidden 32, MLP 64).

:data:`OWN_SPECS` gives the fedfuse architecture of the same shape for each torchvision model, so
an experiment can train both with one recipe and compare what fusion makes of them;
:func:`as_fedfuse_model` copies a torchvision model's weights into it (the same function), so
both can also start from the same initial weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from fedfuse.models import LeveledModel, ModelSpec, build_model, make_spec

#: the grey 28x28 images of Fashion-MNIST and MNIST
GREY_28 = (1, 28, 28)


class TemplateNet(nn.Module):
    """The CNN of Flower's PyTorch template, sized for 28x28x1 inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 4 * 4, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 4 * 4)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def torchvision_resnet18(num_classes: int = 10) -> torchvision.models.ResNet:
    """torchvision's ResNet-18 for grey images: its stem conv takes one channel."""
    model = torchvision.models.resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(1, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return model


def torchvision_vit(num_classes: int = 10) -> torchvision.models.VisionTransformer:
    """A small torchvision VisionTransformer for 28x28 grey images: 16 patches of 7x7."""
    model = torchvision.models.VisionTransformer(
        image_size=28,
        patch_size=7,
        num_layers=2,
        num_heads=2,
        hidden_dim=32,
        mlp_dim=64,
        num_classes=num_classes,
    )
    model.conv_proj = nn.Conv2d(1, 32, kernel_size=7, stride=7)
    return model


#: the plain models by the name the experiments and the example app use
USER_MODELS: dict[str, Callable[[], nn.Module]] = {
    "template": TemplateNet,
    "resnet18": torchvision_resnet18,
    "vit": torchvision_vit,
}

#: fedfuse's own architecture of the same shape as each torchvision model (same widths, depth,
#: stem or patches), on 28x28 grey images and 10 classes
OWN_SPECS: dict[str, ModelSpec] = {
    "resnet18": make_spec("resnet", GREY_28, 10, depth=18, stem="imagenet"),
    "vit": make_spec("vit", GREY_28, 10, patch=7, depth=2, heads=2, hidden=32, mlp=64),
}


@torch.no_grad()
def as_fedfuse_model(model: nn.Module, spec: ModelSpec) -> LeveledModel:
    """``model``'s function in fedfuse's own architecture ``spec`` (a new model, ``model`` is
    untouched): a torchvision ``ResNet`` into fedfuse's ``resnet`` of the same blocks and stem, a
    torchvision ``VisionTransformer`` into fedfuse's ``vit`` of the same patches, depth, heads and
    widths (the packed attention projection split into ``q``, ``k``, ``v``; the final norm's scale
    and shift folded into the classifier, which fedfuse's ViT holds instead).

    With it an experiment trains both architectures from the same initial weights, so what
    differs between their fusions is the fusion alone. A model of another shape fails naming the
    first parameter that does not fit."""
    own = build_model(spec).eval()
    if isinstance(model, torchvision.models.ResNet):
        _copy_resnet(model, own)
    elif isinstance(model, torchvision.models.VisionTransformer):
        _copy_vit(model, own)
    else:
        raise TypeError(
            f"as_fedfuse_model copies torchvision's ResNet and VisionTransformer, "
            f"got {type(model).__name__}"
        )
    return own


def _copy_resnet(model: torchvision.models.ResNet, own: LeveledModel) -> None:
    """Parameter by parameter: both state dicts list the stem, the blocks (conv1, bn1, conv2,
    bn2, then the shortcut's conv and BatchNorm) and the classifier in the same order."""
    theirs, mine = model.state_dict(), own.state_dict()
    if len(theirs) != len(mine):
        raise ValueError(
            f"a ResNet of {len(theirs)} tensors does not fit fedfuse's resnet of {len(mine)}: "
            "another depth or stem"
        )
    for (their_name, value), (name, target) in zip(theirs.items(), mine.items(), strict=True):
        if value.shape != target.shape:
            raise ValueError(
                f"{their_name} {tuple(value.shape)} does not fit fedfuse's {name} "
                f"{tuple(target.shape)}"
            )
    own.load_state_dict(dict(zip(mine, theirs.values(), strict=True)))


def _copy_vit(model: torchvision.models.VisionTransformer, own: LeveledModel) -> None:
    embedding, *blocks, head = own.levels
    if len(blocks) != len(model.encoder.layers):
        raise ValueError(
            f"a ViT of {len(model.encoder.layers)} layers does not fit fedfuse's vit of "
            f"{len(blocks)}"
        )
    embedding.projection.load_state_dict(model.conv_proj.state_dict())
    embedding.class_token.copy_(model.class_token[0].T)
    embedding.position.copy_(model.encoder.pos_embedding[0].T)
    hidden = model.hidden_dim
    for block, layer in zip(blocks, model.encoder.layers, strict=True):
        for mine, theirs in ((block.ln1, layer.ln_1), (block.ln2, layer.ln_2)):
            mine.load_state_dict(theirs.state_dict())
            mine.eps = theirs.eps
        attention = layer.self_attention
        projections = (block.attention.q, block.attention.k, block.attention.v)
        for i, linear in enumerate(projections):
            linear.weight.copy_(attention.in_proj_weight[hidden * i : hidden * (i + 1)])
            linear.bias.copy_(attention.in_proj_bias[hidden * i : hidden * (i + 1)])
        block.attention.out.load_state_dict(attention.out_proj.state_dict())
        block.fc1.load_state_dict(layer.mlp[0].state_dict())
        block.fc2.load_state_dict(layer.mlp[3].state_dict())
    norm, classifier = model.encoder.ln, model.heads.head
    head[1].eps = norm.eps
    head[2].weight.copy_(classifier.weight * norm.weight)
    head[2].bias.copy_(classifier.bias + classifier.weight @ norm.bias)


__all__ = [
    "GREY_28",
    "OWN_SPECS",
    "USER_MODELS",
    "TemplateNet",
    "as_fedfuse_model",
    "torchvision_resnet18",
    "torchvision_vit",
]
