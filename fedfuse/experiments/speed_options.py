"""``fedfuse speed``'s architecture choices and default methods, light to import (no PyTorch):
the command line (:mod:`fedfuse.cli.speed`) offers them and :mod:`fedfuse.experiments.speed`
uses them, which keeps their names."""

from __future__ import annotations

#: plain models (a user's ``nn.Module``, adapted by ``ModelAdapter``) that ``--arch`` offers,
#: each with fedfuse's own architecture of the same layers and widths (its ``--arch`` and
#: ``--model-options``), timed beside it (:mod:`fedfuse.experiments.speed_plain`)
PLAIN_ARCHS = {"torchvision-resnet18": ("resnet", "depth=18 stem=imagenet")}
#: ``--arch`` choices
ARCHS = ("vgg11", "mlp", "lenet5", "resnet", "vit", *PLAIN_ARCHS)
#: the default ``--methods`` per architecture (``all``: every method that accepts it)
DEFAULT_METHODS = {
    "vgg11": "vanilla,hf-linear,kf-linear,kf-gradient",
    "mlp": "vanilla,hf-linear",
    "torchvision-resnet18": "kf-linear",
}
