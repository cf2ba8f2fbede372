"""``fedfuse speed``'s architecture choices and default methods, light to import (no PyTorch):
the command line (:mod:`fedfuse.cli.speed`) offers them and :mod:`fedfuse.experiments.speed`
uses them, which keeps their names."""

from __future__ import annotations

#: ``--arch`` choices
ARCHS = ("vgg11", "mlp", "lenet5", "resnet", "vit")
#: the default ``--methods`` per architecture (``all``: every method that accepts it)
DEFAULT_METHODS = {"vgg11": "vanilla,hf-linear,kf-linear,kf-gradient", "mlp": "vanilla,hf-linear"}
