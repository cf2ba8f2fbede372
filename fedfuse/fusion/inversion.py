r"""A skewed fusion set completed from the uploaded models' BatchNorm statistics (model inversion).

The paper's fusion set is drawn from one site, so on class-sharded sites it holds none of the
other sites' classes, and every fit on it (neuron interpolation's levels, their grouping) sees
only part of what the fused model must do. A site's network with BatchNorm already carries a
summary of its data: each BatchNorm's running mean :math:`\mu_l` and variance
:math:`\sigma^2_l` of its input channels over the site's training set. Inputs whose batch
statistics match them, and which the model assigns to the site's classes, stand in for the
site's data without any of it leaving the site and without any extra upload (the statistics
are part of the weights). For each model :math:`k`, a batch :math:`x` (``samples`` rows, labels
:math:`y` cycling through the classes the site holds, from its class counts, else all classes)
is optimised from Gaussian noise with Adam:

.. math::

    \min_x \; \mathrm{CE}(f_k(x), y)
      + \beta \sum_l \big(\lVert \bar x_l - \mu_l \rVert_2 + \lVert s^2_l - \sigma^2_l \rVert_2\big)
      + \tau\, \mathrm{TV}(x),

with :math:`\bar x_l, s^2_l` the batch mean and (biased) variance of BatchNorm :math:`l`'s input
per channel and :math:`\mathrm{TV}` the mean squared difference of neighbouring pixels (a
smoothness prior). This is the BatchNorm-matching loss of DeepInversion (Yin et al., "Dreaming
to Distill", CVPR 2020), without its competition term. The generated rows are appended to the
real fusion set, which comes first and unchanged.

Neuron interpolation needs no label on a row (its targets are the models' own activations), so
what the rows must give is coverage of each model's input distribution; the labels only steer
each batch towards the classes its site saw. Only models with BatchNorm layers can be inverted
this way (:func:`check_invertible`), which is checked before any site trains.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from fedfuse.fusion.base import FusionInputs
from fedfuse.runtime import resolve_device

log = logging.getLogger(__name__)


def batchnorm_layers(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """The model's BatchNorm layers that keep running statistics."""
    return [
        m
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None
    ]


def check_invertible(model: nn.Module, *, where: str = "fusion-set inversion") -> None:
    """Raise ValueError unless ``model`` has BatchNorm layers with running statistics (what
    :func:`invert_batchnorm` matches)."""
    if not batchnorm_layers(model):
        raise ValueError(
            f"{where}: the model ({type(model).__name__}) has no BatchNorm layer with running "
            "statistics to invert; use it with BatchNorm models (e.g. the ResNet), or set the "
            "inverted samples to 0"
        )


def invert_batchnorm(
    model: nn.Module,
    labels: torch.Tensor,
    input_shape: Sequence[int],
    *,
    steps: int = 200,
    lr: float = 0.05,
    bn_weight: float = 1.0,
    tv_weight: float = 1e-2,
    seed: int = 0,
    device: str | torch.device = "auto",
) -> torch.Tensor:
    """Inputs ``(len(labels), *input_shape)`` (in the model's normalisation) that ``model``
    assigns to ``labels`` and whose BatchNorm batch statistics match its running ones (module
    docstring). The model is left as found (its mode, its parameters' ``requires_grad``)."""
    if steps < 1 or lr <= 0 or bn_weight < 0 or tv_weight < 0:
        raise ValueError(
            f"need steps >= 1, lr > 0, bn_weight >= 0, tv_weight >= 0; got {steps}, {lr}, "
            f"{bn_weight}, {tv_weight}"
        )
    check_invertible(model)
    run_on = resolve_device(device)
    was_training = model.training
    grads = [p.requires_grad for p in model.parameters()]
    original_device = next(model.parameters()).device
    model.eval().to(run_on)
    for p in model.parameters():
        p.requires_grad_(False)
    mismatch: list[torch.Tensor] = []

    def match(norm: nn.Module, args: tuple[torch.Tensor, ...], _out: torch.Tensor) -> None:
        x = args[0]
        dims = [0, *range(2, x.ndim)]
        mean, var = x.mean(dims), x.var(dims, unbiased=False)
        mismatch.append(
            (mean - norm.running_mean).norm() + (var - norm.running_var).norm()  # type: ignore[operator]
        )

    hooks = [norm.register_forward_hook(match) for norm in batchnorm_layers(model)]
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(len(labels), *input_shape, generator=generator).to(run_on)
    x.requires_grad_(True)
    targets = labels.to(run_on)
    optimiser = torch.optim.Adam([x], lr=lr)
    try:
        for _ in range(steps):
            mismatch.clear()
            optimiser.zero_grad()
            loss = F.cross_entropy(model(x), targets)
            loss = loss + bn_weight * torch.stack(mismatch).sum() + tv_weight * _smoothness(x)
            loss.backward()
            optimiser.step()
    finally:
        for hook in hooks:
            hook.remove()
        for p, flag in zip(model.parameters(), grads, strict=True):
            p.requires_grad_(flag)
        model.train(was_training).to(original_device)
    return x.detach().cpu()


def _smoothness(x: torch.Tensor) -> torch.Tensor:
    """Mean squared difference of vertically and horizontally neighbouring pixels."""
    return (x[..., 1:, :] - x[..., :-1, :]).pow(2).mean() + (x[..., 1:] - x[..., :-1]).pow(2).mean()


def site_classes(class_counts: torch.Tensor | None, model: int, classes: int) -> list[int]:
    """The classes site ``model`` holds (nonzero counts), every class without counts."""
    if class_counts is None:
        return list(range(classes))
    held = (torch.as_tensor(class_counts)[model] > 0).nonzero().flatten().tolist()
    return held or list(range(classes))


@dataclass
class InvertedFusionSet:
    """Completes a fusion set with ``samples`` inverted rows per uploaded model (module
    docstring); pass the real set and the uploads to :meth:`complete` once the models are in.

    Args:
        samples: rows to generate per model (0: the real set unchanged).
        steps, lr, bn_weight, tv_weight, seed, device: :func:`invert_batchnorm`'s (model ``k``
            is seeded with ``seed + k``).
        progress: a progress bar over the models (None: where the output is a terminal).
    """

    samples: int = 200
    steps: int = 200
    lr: float = 0.05
    bn_weight: float = 1.0
    tv_weight: float = 1e-2
    seed: int = 0
    device: str = "auto"
    progress: bool | None = None
    #: wall seconds of the last completion (None before one)
    seconds: float | None = None

    def complete(
        self,
        models: Sequence[nn.Module],
        inputs: torch.Tensor,
        labels: torch.Tensor | None,
        *,
        num_classes: int | None = None,
        class_counts: torch.Tensor | Sequence[Sequence[int]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The real rows ``(inputs, labels)`` followed by each model's inverted rows, labelled
        with the classes they were inverted for (those its site holds by ``class_counts``, a
        row per model; else all ``num_classes``, by default the models' outputs). Unlabelled
        real rows (``labels`` None) give unlabelled rows."""
        if self.samples <= 0:
            return inputs, labels
        if num_classes is None:
            with torch.no_grad():
                num_classes = int(models[0].eval()(inputs[:1]).shape[1])
        started = time.perf_counter()
        rows = [inputs]
        targets = [labels if labels is not None else torch.empty(0, dtype=torch.int64)]
        bar = tqdm(models, desc="BatchNorm inversion", disable=self._quiet(), leave=False)
        for k, model in enumerate(bar):
            counts = None if class_counts is None else torch.as_tensor(class_counts)
            held = torch.tensor(site_classes(counts, k, num_classes))
            wanted = held[torch.arange(self.samples) % len(held)]
            rows.append(
                invert_batchnorm(
                    model,
                    wanted,
                    inputs.shape[1:],
                    steps=self.steps,
                    lr=self.lr,
                    bn_weight=self.bn_weight,
                    tv_weight=self.tv_weight,
                    seed=self.seed + k,
                    device=self.device,
                ).to(inputs.dtype)
            )
            targets.append(wanted)
        self.seconds = time.perf_counter() - started
        log.info(
            "fusion set completed with %d inverted rows per model (%d models) in %.1f s",
            self.samples,
            len(models),
            self.seconds,
        )
        return torch.cat(rows), None if labels is None else torch.cat(targets).to(labels.dtype)

    def _quiet(self) -> bool | None:
        return None if self.progress is None else not self.progress

    def complete_inputs(
        self,
        models: Sequence[nn.Module],
        inputs: FusionInputs,
        class_counts: Sequence[Sequence[int]] | None = None,
    ) -> FusionInputs:
        """``inputs`` with their fusion set completed (:meth:`complete`; the class counts are
        ``inputs``' unless given); unchanged without a fusion set."""
        if inputs.data is None:
            return inputs
        counts = class_counts if class_counts is not None else inputs.class_counts
        data, labels = self.complete(models, inputs.data, inputs.labels, class_counts=counts)
        return replace(inputs, data=data, labels=labels)


__all__ = [
    "InvertedFusionSet",
    "batchnorm_layers",
    "check_invertible",
    "invert_batchnorm",
    "site_classes",
]
