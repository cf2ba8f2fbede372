"""Models as users write them, for the experiments and examples that fuse plain ``nn.Module`` s.

* :class:`TemplateNet`: the CNN of Flower's PyTorch template (``flwr new``), for 28x28 grey images.
* :func:`torchvision_resnet18`: ``torchvision.models.resnet18(num_classes=10)`` with its first
  conv reading grey images, as people adapt it to MNIST-like data (BatchNorm, residual adds).
* :func:`torchvision_vit`: a small ``torchvision.models.VisionTransformer`` for 28x28 grey images
  (patch 7, 2 layers, 2 heads, hidden 32, MLP 64).

:data:`OWN_SPECS` gives the fedfuse architecture of the same shape for each torchvision model, so
an experiment can train both with one recipe and compare what fusion makes of them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from fedfuse.models import ModelSpec, make_spec

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

__all__ = [
    "GREY_28",
    "OWN_SPECS",
    "USER_MODELS",
    "TemplateNet",
    "torchvision_resnet18",
    "torchvision_vit",
]
