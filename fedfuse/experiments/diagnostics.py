r"""Diagnostics of fused models: the loss landscape around them, their weights, their templates.

Pure computations on models and tensors (no Flower, no files, no plotting); the experiment report
(:mod:`fedfuse.experiments.report.document`) turns their results into tables and figures.

**The plane through three models** (Garipov et al. 2018, Sec. 3; the landscapes of the
neuron-interpolation paper's Fig. 2). With the flattened parameter vectors
:math:`w_1, w_2, w_3` (two base models and the fused model) the plane is

.. math::
    \hat u = \frac{w_2 - w_1}{\lVert w_2 - w_1 \rVert}, \qquad
    v = (w_3 - w_1) - \langle w_3 - w_1, \hat u \rangle \hat u, \qquad \hat v = v / \lVert v \rVert,
    \qquad P(x, y) = w_1 + x \hat u + y \hat v,

so the anchors sit at :math:`(0, 0)`, :math:`(\lVert w_2 - w_1 \rVert, 0)` and
:math:`(\langle w_3 - w_1, \hat u \rangle, \lVert v \rVert)` and distances on the plane are
distances in weight space. A landscape evaluates the model :math:`P(x, y)` on a grid of the plane.

**Weight statistics** (Wang et al., "Rethinking weight-averaged model merging", Sec. "Model
predictions and weight magnitudes"): averaging weights lowers their largest magnitude and their
variance (their Eqs. 5-9); per level we report the Frobenius norm, mean, standard deviation and
largest magnitude of the weights, for each site and for the fused model.

**Templates** (same paper, Sec. "Template matching"): a first-layer neuron computes an inner
product with the input, so its weight row reshaped to the input image (an MLP) or its filter (a
convolution) is the pattern it responds to most.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from fedfuse.models import LeveledModel
from fedfuse.models.capture import predict

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------ weight vectors
def weight_vector(model: nn.Module) -> torch.Tensor:
    """All parameters of ``model`` flattened into one float64 CPU vector (``parameters()`` order).

    Buffers (BatchNorm statistics) are not part of the vector.
    """
    parameters = [p.detach().reshape(-1).to("cpu", torch.float64) for p in model.parameters()]
    if not parameters:
        raise ValueError(f"{type(model).__name__} has no parameters to flatten")
    return torch.cat(parameters)


def load_weight_vector(model: nn.Module, vector: torch.Tensor) -> nn.Module:
    """Copy ``vector`` (as made by :func:`weight_vector`) into ``model``'s parameters, in place."""
    total = sum(p.numel() for p in model.parameters())
    if vector.ndim != 1 or vector.numel() != total:
        raise ValueError(
            f"weight vector has shape {tuple(vector.shape)}, the model has {total} parameters"
        )
    with torch.no_grad():
        offset = 0
        for parameter in model.parameters():
            chunk = vector[offset : offset + parameter.numel()].view_as(parameter)
            parameter.copy_(chunk.to(parameter.device, parameter.dtype))
            offset += parameter.numel()
    return model


# ------------------------------------------------------------------------------ the plane
@dataclass(frozen=True)
class PlaneBasis:
    """The affine plane ``origin + x * u + y * v`` through three weight vectors.

    ``u`` and ``v`` are orthonormal float64 vectors; ``anchors`` holds the ``(x, y)`` coordinates
    of the three models that span the plane, in the order they were given.
    """

    origin: torch.Tensor
    u: torch.Tensor
    v: torch.Tensor
    anchors: torch.Tensor

    def point(self, x: float, y: float) -> torch.Tensor:
        """The weight vector at plane coordinates ``(x, y)``."""
        return self.origin + x * self.u + y * self.v

    def coordinates(self, vector: torch.Tensor) -> torch.Tensor:
        """The ``(x, y)`` of the orthogonal projection of ``vector`` onto the plane."""
        offset = vector.to(torch.float64) - self.origin
        return torch.stack([offset @ self.u, offset @ self.v])


def plane_basis(
    first: torch.Tensor, second: torch.Tensor, third: torch.Tensor, *, tol: float = 1e-12
) -> PlaneBasis:
    r"""Orthonormal basis of the plane through three weight vectors (Gram-Schmidt from ``first``).

    Returns :math:`w_1` as the origin, :math:`\hat u \propto w_2 - w_1` and
    :math:`\hat v \perp \hat u` in the span of :math:`w_3 - w_1`, and the anchors
    :math:`(0, 0), (\lVert w_2 - w_1 \rVert, 0), (\langle w_3 - w_1, \hat u \rangle,
    \lVert v \rVert)`.

    Raises:
        ValueError: the vectors differ in shape, or they do not span a plane (two coincide or the
            three are collinear, relative to ``tol`` times the largest squared distance).
    """
    vectors = [t.detach().reshape(-1).to("cpu", torch.float64) for t in (first, second, third)]
    shapes = {tuple(t.shape) for t in (first, second, third)}
    if len(shapes) != 1:
        raise ValueError(f"the three weight vectors must have one shape, got {sorted(shapes)}")
    origin, b, c = vectors
    du, dc = b - origin, c - origin
    scale = max(du.dot(du).item(), dc.dot(dc).item(), (c - b).dot(c - b).item())
    norm_u = du.norm().item()
    if scale == 0.0 or norm_u**2 <= tol * scale:
        raise ValueError("the first and second models have the same weights; no plane through them")
    u = du / norm_u
    along = dc.dot(u).item()
    v = dc - along * u
    norm_v = v.norm().item()
    if norm_v**2 <= tol * scale:
        raise ValueError("the three models' weights are collinear; they do not span a plane")
    anchors = torch.tensor([[0.0, 0.0], [norm_u, 0.0], [along, norm_v]], dtype=torch.float64)
    return PlaneBasis(origin=origin, u=u, v=v / norm_v, anchors=anchors)


@dataclass(frozen=True)
class Landscape:
    """Test loss and accuracy of the models on a grid of a plane in weight space.

    ``loss[i, j]`` and ``accuracy[i, j]`` belong to the point ``(xs[j], ys[i])`` (rows are ``y``,
    as matplotlib's ``contourf(xs, ys, values)`` expects). ``anchor_loss`` and
    ``anchor_accuracy`` are evaluated exactly at ``anchors`` (the three models).
    """

    xs: torch.Tensor
    ys: torch.Tensor
    loss: torch.Tensor
    accuracy: torch.Tensor
    anchors: torch.Tensor
    anchor_loss: torch.Tensor
    anchor_accuracy: torch.Tensor
    samples: int

    def to_dict(self) -> dict[str, Any]:
        """The landscape as JSON-serialisable lists."""
        return {
            "xs": self.xs.tolist(),
            "ys": self.ys.tolist(),
            "loss": self.loss.tolist(),
            "accuracy": self.accuracy.tolist(),
            "anchors": self.anchors.tolist(),
            "anchor_loss": self.anchor_loss.tolist(),
            "anchor_accuracy": self.anchor_accuracy.tolist(),
            "samples": self.samples,
        }


@torch.no_grad()
def evaluate_on_plane(
    template: nn.Module,
    basis: PlaneBasis,
    coordinates: torch.Tensor,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    *,
    batch_size: int = 1024,
    device: str | torch.device = "auto",
    progress: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy and top-1 accuracy of the model at each ``(x, y)`` of ``coordinates``.

    Args:
        template: a model of the plane's architecture; it is not modified (a copy is loaded
            with each point's weights; its buffers are kept as they are).
        basis: the plane.
        coordinates: ``(P, 2)`` plane coordinates.
        inputs, labels: the evaluation batch ``(N, ...)`` and its ``(N,)`` class indices.
        batch_size, device: as for :func:`fedfuse.models.capture.predict`.
        progress: show a progress bar over the points.

    Returns:
        ``(loss, accuracy)``, two float64 tensors of ``P`` values.
    """
    if coordinates.ndim != 2 or coordinates.shape[1] != 2:
        raise ValueError(f"coordinates must have shape (P, 2), got {tuple(coordinates.shape)}")
    if len(inputs) != len(labels) or len(inputs) == 0:
        raise ValueError(f"need as many labels as inputs (>0), got {len(inputs)} and {len(labels)}")
    model = copy.deepcopy(template)
    losses, accuracies = [], []
    points = tqdm(coordinates.tolist(), desc="landscape", disable=None if progress else True)
    for x, y in points:
        load_weight_vector(model, basis.point(x, y))
        logits = predict(model, inputs, batch_size=batch_size, device=device).double()
        losses.append(F.cross_entropy(logits, labels).item())
        accuracies.append((logits.argmax(1) == labels).double().mean().item())
    return torch.tensor(losses, dtype=torch.float64), torch.tensor(accuracies, dtype=torch.float64)


def landscape_on_plane(
    models: Sequence[nn.Module],
    inputs: torch.Tensor,
    labels: torch.Tensor,
    *,
    grid: int | tuple[int, int] = 11,
    margin: float = 0.25,
    batch_size: int = 1024,
    device: str | torch.device = "auto",
    progress: bool = False,
) -> Landscape:
    """Loss and accuracy on the plane through three models (paper Fig. 2), on a regular grid.

    The grid covers the anchors' bounding box widened by ``margin`` times its extent on each
    side; it costs ``nx * ny + 3`` evaluations of a model on ``inputs``.

    Args:
        models: three models of one architecture (e.g. two base models and the fused one).
        inputs, labels: the evaluation batch and its class indices (keep it small: a landscape
            evaluates every grid point on all of it).
        grid: points per axis, ``n`` or ``(nx, ny)``, each at least 2.
        margin: the widening of the bounding box, a fraction of its extent (>= 0).
        batch_size, device: as for :func:`fedfuse.models.capture.predict`.
        progress: show a progress bar over the grid.

    Raises:
        ValueError: not three models, different parameter shapes, or no plane through them.
    """
    if len(models) != 3:
        raise ValueError(f"a plane needs exactly 3 models, got {len(models)}")
    nx, ny = (grid, grid) if isinstance(grid, int) else grid
    if nx < 2 or ny < 2:
        raise ValueError(f"grid needs at least 2 points per axis, got {(nx, ny)}")
    if not margin >= 0:
        raise ValueError(f"margin must be >= 0, got {margin}")
    shapes = [[tuple(p.shape) for p in m.parameters()] for m in models]
    if any(s != shapes[0] for s in shapes[1:]):
        raise ValueError(
            "the three models' parameter shapes differ (different widths?); "
            f"parameter counts {[sum(math.prod(s) for s in ss) for ss in shapes]}"
        )
    basis = plane_basis(*(weight_vector(m) for m in models))
    low, high = basis.anchors.min(0).values, basis.anchors.max(0).values
    pad = margin * (high - low)
    xs = torch.linspace(low[0] - pad[0], high[0] + pad[0], nx, dtype=torch.float64)
    ys = torch.linspace(low[1] - pad[1], high[1] + pad[1], ny, dtype=torch.float64)
    yy, xx = torch.meshgrid(ys, xs, indexing="ij")
    points = torch.cat([torch.stack([xx.reshape(-1), yy.reshape(-1)], 1), basis.anchors])
    loss, accuracy = evaluate_on_plane(
        models[0],
        basis,
        points,
        inputs,
        labels,
        batch_size=batch_size,
        device=device,
        progress=progress,
    )
    cells = nx * ny
    return Landscape(
        xs=xs,
        ys=ys,
        loss=loss[:cells].view(ny, nx),
        accuracy=accuracy[:cells].view(ny, nx),
        anchors=basis.anchors,
        anchor_loss=loss[cells:],
        anchor_accuracy=accuracy[cells:],
        samples=len(inputs),
    )


# ------------------------------------------------------------------------------ weight statistics
@dataclass(frozen=True)
class LevelWeightStats:
    """Statistics of one neuron level's weights (every parameter named ``*weight``).

    ``std`` is the population standard deviation (``unbiased=False``) of all weight entries;
    ``norm`` their Frobenius norm; ``bias_norm`` the norm of the ``*bias`` parameters (None when
    the level has none).
    """

    level: int
    name: str
    numel: int
    norm: float
    mean: float
    std: float
    max_abs: float
    bias_norm: float | None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def layer_weight_stats(model: LeveledModel) -> list[LevelWeightStats]:
    """Norm, mean, std and largest magnitude of each neuron level's weights, bottom-up."""
    stats = []
    for index in model.neuron_levels:
        named = list(model.levels[index].named_parameters())
        weights = [p.detach().reshape(-1).double().cpu() for n, p in named if n.endswith("weight")]
        biases = [p.detach().reshape(-1).double().cpu() for n, p in named if n.endswith("bias")]
        if not weights:
            raise ValueError(f"level {model.level_name(index)} has no parameter named *weight")
        w = torch.cat(weights)
        stats.append(
            LevelWeightStats(
                level=index,
                name=model.level_name(index),
                numel=w.numel(),
                norm=w.norm().item(),
                mean=w.mean().item(),
                std=w.std(unbiased=False).item(),
                max_abs=w.abs().max().item(),
                bias_norm=torch.cat(biases).norm().item() if biases else None,
            )
        )
    return stats


# ------------------------------------------------------------------------------ templates
def first_layer_templates(
    model: LeveledModel, *, count: int | None = None, order: str = "index"
) -> torch.Tensor:
    """The first affine layer's weights as images: the patterns its neurons match.

    An MLP's first ``Linear`` has one row per neuron over the flattened input; each row is
    reshaped to the input's ``(C, H, W)``. A convolution's filters are returned as they are,
    ``(C, kh, kw)`` each.

    Args:
        model: the model; its first neuron level must hold a ``Linear`` or ``Conv2d``.
        count: keep at most this many templates (default: all).
        order: ``"index"`` (neuron order) or ``"norm"`` (largest weight norm first).

    Returns:
        A float32 CPU tensor ``(n, C, H, W)`` (MLP) or ``(n, C, kh, kw)`` (convolution).
    """
    if order not in ("index", "norm"):
        raise ValueError(f"order must be 'index' or 'norm', got {order!r}")
    if count is not None and count < 1:
        raise ValueError(f"count must be positive, got {count}")
    if not model.neuron_levels:
        raise ValueError("the model has no neuron level")
    level = model.levels[model.neuron_levels[0]]
    layer = next((m for m in level.modules() if isinstance(m, nn.Linear | nn.Conv2d)), None)
    if layer is None:
        raise ValueError(
            f"level {model.level_name(model.neuron_levels[0])} has no Linear or Conv2d layer"
        )
    weight = layer.weight.detach().float().cpu()
    if isinstance(layer, nn.Linear):
        shape = tuple(model.spec.input_shape)
        if weight.shape[1] != math.prod(shape):
            raise ValueError(
                f"the first Linear has {weight.shape[1]} inputs, the input shape {shape} has "
                f"{math.prod(shape)} values"
            )
        weight = weight.reshape(weight.shape[0], *shape)
    if order == "norm":
        weight = weight[weight.flatten(1).norm(dim=1).argsort(descending=True, stable=True)]
    return weight[:count].clone()
