r"""Fisher merging (Matena & Raffel, NeurIPS 2022) and FedFisher (Jhunjhunwala et al.,
AISTATS 2024): one-shot merges weighted by each site's Fisher information.

**What a site computes and uploads once** (:func:`site_fisher`; the sites' own data, labels
drawn from the site model's own predictions, so the true Fisher, one Monte Carlo label per
sample, and no label of the site's data is used):

* the *diagonal* Fisher, per parameter ``F = E_x E_{y ~ p(y|x)} [(d log p(y|x) / d theta)^2]``
  (the shape of the weights: an upload the size of the model again);
* the *K-FAC* factors (Martens & Grosse 2015; convolutions as in Grosse & Martens 2016) of
  every ``Linear`` and ``Conv2d``: with ``a`` a layer's input row (a patch of a convolution,
  with a trailing 1 when it has a bias) and ``g`` the gradient of ``log p(y|x)`` at its output
  (per position), ``A = E[a a^T]`` (positions averaged) and ``G = E[sum_positions g g^T]``, so
  that the layer's Fisher block is ``A (x) G``: an upload of ``fan_in^2 + fan_out^2`` per layer.

**What the server solves.** With ``p_k`` the site weights (uniform, or by sample counts), the
merged parameters minimise the Laplace-approximated sum of the sites' log-posteriors,

    ``theta* = argmin sum_k p_k (theta - theta_k)^T F_k (theta - theta_k)``.

*Diagonal* (Fisher merging; FedFisher(Diag)): per entry ``theta* = sum_k p_k F_k theta_k /
sum_k p_k F_k``. Each ``F_k`` gets ``damping`` times its tensor's mean Fisher added, a pull
towards the plain weighted average where no site's Fisher measures an entry (Matena & Raffel's
Fisher floor, made relative).

*K-FAC* (FedFisher(K-FAC)): per layer with weights ``W`` (``fan_out x fan_in``, the bias its
last column), ``vec(W)^T (A (x) G) vec(W) = tr(G W A W^T)``, so the minimiser solves the
generalised Sylvester equation

    ``sum_k p_k G_k W A_k = sum_k p_k G_k W_k A_k``,

whose operator ``W -> sum_k p_k G_k W A_k`` is symmetric positive definite once each factor
gets its damping (``damping`` times its mean eigenvalue on the diagonal). fedfuse solves it by
conjugate gradients on the matrices (each step ``2K`` small matrix products; started from the
weighted average, preconditioned by ``(sum_k p_k G_k)^{-1} R (sum_k p_k A_k)^{-1}``, the exact
inverse for one site, and run to a relative residual of 1e-6), where the paper runs Adam from FedAvg
on the same objective: the same minimiser, without a learning rate or a step count to tune.
Parameters outside ``Linear``/``Conv2d`` (normalisations, embeddings, tokens) and buffers are
the weighted average.

Neither aligns neurons: like FedAvg and RegMean they merge models that share an
initialisation (``init="shared"``), the setting of both papers. ``damping="auto"`` picks the
damping of :data:`DAMPING_GRID` whose merged model has the lowest loss on the server's
labelled fusion set, and :data:`UNLABELLED_DAMPING` without one.
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedfuse.fusion.base import FusionInputs, FusionMethod
from fedfuse.fusion.inputs import averaging_weights, fusion_set_loss
from fedfuse.fusion.registry import register_fusion_method
from fedfuse.models import LeveledModel, ModelSpec
from fedfuse.runtime import resolve_device

log = logging.getLogger(__name__)

#: what a site can compute: the diagonal Fisher, the K-FAC factors
FISHER_KINDS = ("diagonal", "kfac")
#: samples of its data a site computes its Fisher on (drawn with the site's seed)
DEFAULT_FISHER_SAMPLES = 2048
#: the dampings ``damping="auto"`` chooses from, by the merged model's fusion-set loss
DAMPING_GRID = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)
#: the damping ``"auto"`` takes without a labelled fusion set
UNLABELLED_DAMPING = 1e-2
DIAGONAL_PREFIX = "diagonal."
KFAC_PREFIX = "kfac."
_CG_TOLERANCE = 1e-6
_CG_MAX_STEPS = 1000


# ------------------------------------------------------------------------------- site side
def kfac_layers(model: nn.Module) -> dict[str, nn.Linear | nn.Conv2d]:
    """The layers K-FAC factors cover, by module name: every ``Linear`` and every ungrouped
    ``Conv2d``."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        or (isinstance(module, nn.Conv2d) and module.groups == 1 and module.padding_mode == "zeros")
    }


def _input_rows(layer: nn.Module, inputs: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A layer's input rows (patches for a convolution; a trailing 1 with a bias) and the
    positions per sample."""
    if isinstance(layer, nn.Conv2d):
        patches = F.unfold(
            inputs, layer.kernel_size, layer.dilation, layer.padding, layer.stride
        )  # (B, C k k, T)
        positions = patches.shape[-1]
        rows = patches.transpose(1, 2).reshape(-1, patches.shape[1])
    else:
        positions = int(inputs[..., 0].numel() // len(inputs)) if inputs.dim() > 2 else 1
        rows = inputs.reshape(-1, inputs.shape[-1])
    if layer.bias is not None:
        rows = torch.cat([rows, rows.new_ones(len(rows), 1)], dim=1)
    return rows, positions


def _output_rows(layer: nn.Module, grads: torch.Tensor) -> torch.Tensor:
    if isinstance(layer, nn.Conv2d):
        return grads.permute(0, 2, 3, 1).reshape(-1, grads.shape[1])
    return grads.reshape(-1, grads.shape[-1])


def _sampled_labels(logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    probabilities = torch.softmax(logits.detach().double().cpu(), dim=1)
    return torch.multinomial(probabilities, 1, generator=generator).squeeze(1).to(logits.device)


def site_fisher(
    model: LeveledModel,
    inputs: torch.Tensor,
    kinds: Iterable[str],
    *,
    samples: int = DEFAULT_FISHER_SAMPLES,
    seed: int = 0,
    batch_size: int = 64,
    device: str | torch.device = "auto",
) -> dict[str, torch.Tensor]:
    """A site's Fisher information on up to ``samples`` of its ``inputs`` (module docstring):
    ``diagonal.<parameter>`` per parameter for ``"diagonal"``, ``kfac.<layer>.inputs`` and
    ``kfac.<layer>.outputs`` per covered layer for ``"kfac"``. Float32, on the CPU."""
    kinds = set(kinds)
    unknown = kinds - set(FISHER_KINDS)
    if unknown or not kinds:
        raise ValueError(f"Fisher kinds must be among {FISHER_KINDS}, got {sorted(kinds)}")
    generator = torch.Generator().manual_seed(seed)
    if 0 < samples < len(inputs):
        chosen = torch.randperm(len(inputs), generator=generator)[:samples].sort().values
        inputs = inputs[chosen]
    torch_device = resolve_device(device)
    model = model.to(torch_device).eval()
    result: dict[str, torch.Tensor] = {}
    if "diagonal" in kinds:
        result.update(_diagonal_fisher(model, inputs, generator, batch_size, torch_device))
    if "kfac" in kinds:
        result.update(_kfac_factors(model, inputs, generator, batch_size, torch_device))
    return {k: v.float().cpu() for k, v in result.items()}


def _diagonal_fisher(model, inputs, generator, batch_size, device) -> dict[str, torch.Tensor]:
    """Mean squared per-sample gradients of ``log p(y|x)`` (``torch.func``: one vectorised
    backward per batch)."""
    from torch.func import functional_call, grad, vmap

    params = {n: p.detach() for n, p in model.named_parameters()}
    buffers = {n: b.detach() for n, b in model.named_buffers()}

    def nll(parameters, x, y):
        logits = functional_call(model, (parameters, buffers), (x.unsqueeze(0),))
        return F.cross_entropy(logits, y.unsqueeze(0), reduction="sum")

    per_sample = vmap(grad(nll), in_dims=(None, 0, 0))
    sums = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()}
    with warnings.catch_warnings():  # attention has no batching rule yet: slower, still exact
        warnings.filterwarnings("ignore", message="There is a performance drop")
        for batch in inputs.split(batch_size):
            batch = batch.to(device)
            with torch.no_grad():
                labels = _sampled_labels(model(batch), generator)
            for name, gradient in per_sample(params, batch, labels).items():
                sums[name] += gradient.double().square().sum(0)
    return {f"{DIAGONAL_PREFIX}{n}": s / len(inputs) for n, s in sums.items()}


def _kfac_factors(model, inputs, generator, batch_size, device) -> dict[str, torch.Tensor]:
    """Each covered layer's ``A`` and ``G`` (module docstring), from hooks on one forward and
    one backward pass per batch of the summed ``log p(y|x)`` of sampled labels."""
    layers = kfac_layers(model)
    a_sums: dict[str, torch.Tensor] = {}
    g_sums: dict[str, torch.Tensor] = {}
    handles = []

    def forward_hook(name):
        def hook(layer, args, output):
            rows, positions = _input_rows(layer, args[0].detach())
            rows = rows.double()
            term = rows.T @ rows / positions
            a_sums[name] = a_sums[name] + term if name in a_sums else term
            output.register_hook(backward(name, layer))

        return hook

    def backward(name, layer):
        def hook(grad_output):
            rows = _output_rows(layer, grad_output.detach()).double()
            term = rows.T @ rows
            g_sums[name] = g_sums[name] + term if name in g_sums else term

        return hook

    for name, layer in layers.items():
        handles.append(layer.register_forward_hook(forward_hook(name)))
    try:
        for batch in inputs.split(batch_size):
            batch = batch.to(device)
            model.zero_grad(set_to_none=True)
            logits = model(batch)
            labels = _sampled_labels(logits, generator)
            F.cross_entropy(logits, labels, reduction="sum").backward()
    finally:
        for handle in handles:
            handle.remove()
        model.zero_grad(set_to_none=True)
    factors = {}
    for name in layers:
        if name not in a_sums or name not in g_sums:
            continue  # a layer the forward pass never reached
        factors[f"{KFAC_PREFIX}{name}.inputs"] = a_sums[name] / len(inputs)
        factors[f"{KFAC_PREFIX}{name}.outputs"] = g_sums[name] / len(inputs)
    return factors


def fisher_entry_shapes(model: nn.Module, kinds: Iterable[str]) -> dict[str, tuple[int, ...]]:
    """Every entry a site's Fisher of ``kinds`` holds for ``model``, with its shape."""
    kinds = set(kinds)
    shapes: dict[str, tuple[int, ...]] = {}
    if "diagonal" in kinds:
        for name, parameter in model.named_parameters():
            shapes[f"{DIAGONAL_PREFIX}{name}"] = tuple(parameter.shape)
    if "kfac" in kinds:
        for name, layer in kfac_layers(model).items():
            fan_in = layer.weight[0].numel() + (layer.bias is not None)
            shapes[f"{KFAC_PREFIX}{name}.inputs"] = (fan_in, fan_in)
            fan_out = layer.weight.shape[0]
            shapes[f"{KFAC_PREFIX}{name}.outputs"] = (fan_out, fan_out)
    return shapes


def check_fisher(
    model: nn.Module,
    fisher: Mapping[str, torch.Tensor],
    kinds: Iterable[str] = (),
    *,
    source: str,
) -> None:
    """Raise ValueError naming ``source`` and the entry unless every entry of ``fisher`` is
    one ``model`` has (:func:`fisher_entry_shapes`), of its shape and finite (diagonal entries
    >= 0), and every entry of ``kinds`` is there."""
    known = fisher_entry_shapes(model, FISHER_KINDS)
    for key in fisher_entry_shapes(model, kinds):
        if key not in fisher:
            raise ValueError(f"{source}: its Fisher information has no {key!r}")
    for key, tensor in fisher.items():
        if key not in known:
            raise ValueError(f"{source}: Fisher entry {str(key)[:200]!r} is not one of its model's")
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != known[key]:
            found = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor)
            raise ValueError(
                f"{source}: Fisher entry {key!r} has shape {found}, expected {known[key]}"
            )
        if not tensor.is_floating_point() or not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{source}: Fisher entry {key!r} has NaN/Inf values")
        if key.startswith(DIAGONAL_PREFIX) and bool((tensor < 0).any()):
            raise ValueError(f"{source}: diagonal Fisher entry {key!r} has negative values")


def fisher_kinds(methods: Iterable[FusionMethod]) -> tuple[str, ...]:
    """The Fisher kinds the sites must upload for ``methods`` (empty: none reads Fisher)."""
    wanted = {
        kind
        for method in methods
        if "fisher" in method.needs()
        for kind in getattr(method, "fisher_kinds", ())
    }
    return tuple(k for k in FISHER_KINDS if k in wanted)


# ----------------------------------------------------------------------------- server side
def _damped(factor: torch.Tensor, damping: float) -> torch.Tensor:
    scale = float(torch.diagonal(factor).mean().clamp_min(1e-12))
    return factor + damping * scale * torch.eye(
        len(factor), dtype=factor.dtype, device=factor.device
    )


def solve_kfac_layer(
    weights: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    shares: Sequence[float],
    damping: float,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, int]:
    """``W`` solving ``sum_k p_k G_k W A_k = sum_k p_k G_k W_k A_k`` (damped factors) by
    conjugate gradients from the weighted average, preconditioned by the inverse of the
    averaged factors' Kronecker product (exact for one site, so a few steps for sites alike);
    float64 on ``device``, returned on the CPU with the steps taken."""
    device = resolve_device(device)
    a = [_damped(x.to(device, torch.float64), damping) for x in inputs]
    g = [_damped(x.to(device, torch.float64), damping) for x in outputs]
    weights = [wk.to(device, torch.float64) for wk in weights]

    def operator(w: torch.Tensor) -> torch.Tensor:
        return sum(p * (gk @ w @ ak) for p, gk, ak in zip(shares, g, a, strict=True))

    mean_g = torch.linalg.cholesky(sum(p * gk for p, gk in zip(shares, g, strict=True)))
    mean_a = torch.linalg.cholesky(sum(p * ak for p, ak in zip(shares, a, strict=True)))

    def precondition(r: torch.Tensor) -> torch.Tensor:
        left = torch.cholesky_solve(r, mean_g)
        return torch.cholesky_solve(left.T, mean_a).T

    target = sum(p * (gk @ wk @ ak) for p, gk, wk, ak in zip(shares, g, weights, a, strict=True))
    w = sum(p * wk for p, wk in zip(shares, weights, strict=True))
    residual = target - operator(w)
    limit = _CG_TOLERANCE**2 * max(float((target * target).sum()), 1e-300)
    z = precondition(residual)
    direction = z.clone()
    rz = float((residual * z).sum())
    steps = 0
    while float((residual * residual).sum()) > limit and steps < _CG_MAX_STEPS:
        image = operator(direction)
        step = rz / float((direction * image).sum())
        w = w + step * direction
        residual = residual - step * image
        z = precondition(residual)
        rz, previous = float((residual * z).sum()), rz
        direction = z + (rz / previous) * direction
        steps += 1
    return w.cpu(), steps


def _layer_matrix(layer: nn.Module, state: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    weight = state[f"{name}.weight"].reshape(len(state[f"{name}.weight"]), -1)
    if layer.bias is None:
        return weight
    return torch.cat([weight, state[f"{name}.bias"].reshape(-1, 1)], dim=1)


class _FisherFusion(FusionMethod):
    """The shared solve of the Fisher-weighted merges (module docstring)."""

    requires = frozenset({"fisher"})
    #: the Fisher kinds this method reads (:func:`fisher_kinds`)
    fisher_kinds: tuple[str, ...] = ("diagonal",)

    def __init__(self, weighting: str = "uniform", damping: float | str = "auto") -> None:
        if weighting not in ("uniform", "samples"):
            raise ValueError(
                f"{self.name}: weighting must be 'uniform' or 'samples', got {weighting!r}"
            )
        if damping != "auto" and not (isinstance(damping, int | float) and damping >= 0):
            raise ValueError(f"{self.name}: damping must be 'auto' or >= 0, got {damping!r}")
        self.weighting = weighting
        self.damping = damping
        #: where the K-FAC solve runs (the diagonal merges are elementwise, on the CPU)
        self.device = "cpu"

    def requirements(self) -> frozenset[str]:
        extra = {"sample_counts"} if self.weighting == "samples" else set()
        return frozenset(self.requires | extra)

    def needs(self) -> frozenset[str]:
        auto = {"data", "labels"} if self.damping == "auto" else set()
        return self.requirements() | auto

    def _fuse(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec
    ) -> tuple[LeveledModel, dict[str, Any]]:
        assert inputs.fisher is not None  # a requirement
        fishers = list(inputs.fisher)
        for index, (model, fisher) in enumerate(zip(models, fishers, strict=True)):
            check_fisher(model, fisher, self.fisher_kinds, source=f"{self.name}: site {index}")
        shares = averaging_weights(self.name, inputs, len(models), self.weighting == "samples")
        if self.damping != "auto":
            return self._merge(models, fishers, shares, float(self.damping))
        if inputs.data is None or inputs.labels is None:
            log.info("%s: no labelled fusion set; damping %s", self.name, UNLABELLED_DAMPING)
            return self._merge(models, fishers, shares, UNLABELLED_DAMPING)
        candidates = [self._merge(models, fishers, shares, d) for d in DAMPING_GRID]
        losses = [fusion_set_loss(model, inputs) for model, _ in candidates]
        best = min(range(len(losses)), key=losses.__getitem__)
        fused, details = candidates[best]
        details["fusion_set_losses"] = dict(zip(map(str, DAMPING_GRID), losses, strict=True))
        return fused, details

    def _merge(
        self,
        models: list[LeveledModel],
        fishers: list[Mapping[str, torch.Tensor]],
        shares: list[float],
        damping: float,
    ) -> tuple[LeveledModel, dict[str, Any]]:
        states = [m.state_dict() for m in models]
        merged = {
            name: sum(p * s[name].double() for p, s in zip(shares, states, strict=True))
            if tensor.is_floating_point()
            else tensor.clone()
            for name, tensor in states[0].items()
        }
        details: dict[str, Any] = {"damping": damping, "shares": shares}
        if "kfac" in self.fisher_kinds:
            steps = {}
            for name, layer in kfac_layers(models[0]).items():
                key = f"{KFAC_PREFIX}{name}"
                solved, steps[name] = solve_kfac_layer(
                    [_layer_matrix(layer, s, name) for s in states],
                    [f[f"{key}.inputs"] for f in fishers],
                    [f[f"{key}.outputs"] for f in fishers],
                    shares,
                    damping,
                    device=self.device,
                )
                weight = merged[f"{name}.weight"]
                merged[f"{name}.weight"] = solved[:, : weight[0].numel()].reshape(weight.shape)
                if layer.bias is not None:
                    merged[f"{name}.bias"] = solved[:, -1]
            details["cg_steps"] = steps
        else:
            for name, _ in models[0].named_parameters():
                key = f"{DIAGONAL_PREFIX}{name}"
                floor = damping * sum(float(f[key].double().mean()) for f in fishers) / len(fishers)
                weights = [
                    p * (f[key].double() + floor) for p, f in zip(shares, fishers, strict=True)
                ]
                total = sum(weights)
                numerator = sum(w * s[name].double() for w, s in zip(weights, states, strict=True))
                merged[name] = torch.where(
                    total > 0, numerator / total.clamp_min(1e-300), merged[name]
                )
        return _copy_with(models[0], merged), details


def _copy_with(model: LeveledModel, state: Mapping[str, torch.Tensor]) -> LeveledModel:
    """A copy of ``model`` (on the CPU) holding ``state``."""
    fused = copy.deepcopy(model).cpu()
    own = fused.state_dict()
    fused.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()})
    return fused


@register_fusion_method
class FisherMerging(_FisherFusion):
    """Fisher merging (Matena & Raffel 2022): each parameter the average of the sites' values
    weighted by their diagonal Fisher (module docstring); merging coefficients uniform, as the
    paper's default, or by sample counts.

    Args:
        weighting: ``"uniform"`` site coefficients, or ``"samples"`` (by training samples).
        damping: added to each site's Fisher, relative to the tensor's mean Fisher (a pull
            towards the plain average); ``"auto"``: chosen on the labelled fusion set among
            :data:`DAMPING_GRID` (:data:`UNLABELLED_DAMPING` without one).
    """

    name = "fisher-merging"
    fisher_kinds = ("diagonal",)


@register_fusion_method
class FedFisherDiagonal(_FisherFusion):
    """FedFisher(Diag) (Jhunjhunwala et al. 2024): the Fisher-weighted merge with sites
    weighted by their sample counts (the paper's data-size weights); its minimiser is Fisher
    merging's, solved in closed form here (module docstring).

    Args:
        weighting: ``"samples"`` (the paper's) or ``"uniform"``.
        damping: as :class:`FisherMerging`'s.
    """

    name = "fedfisher-diag"
    fisher_kinds = ("diagonal",)

    def __init__(self, weighting: str = "samples", damping: float | str = "auto") -> None:
        super().__init__(weighting, damping)


@register_fusion_method
class FedFisherKFAC(_FisherFusion):
    """FedFisher(K-FAC) (Jhunjhunwala et al. 2024): each ``Linear``/``Conv2d`` the minimiser of
    the sites' K-FAC-approximated quadratic, by conjugate gradients on the generalised
    Sylvester equation (module docstring); other parameters the weighted average.

    Args:
        weighting: ``"samples"`` (the paper's) or ``"uniform"``.
        damping: each K-FAC factor's ridge relative to its mean eigenvalue; ``"auto"`` as
            :class:`FisherMerging`'s.
        device: where the conjugate-gradient solve runs (float64); ``"auto"``: CUDA when
            available. A ResNet-18's factors are up to 4609 x 4609 per layer.
    """

    name = "fedfisher-kfac"
    fisher_kinds = ("kfac",)

    def __init__(
        self, weighting: str = "samples", damping: float | str = "auto", device: str = "auto"
    ) -> None:
        super().__init__(weighting, damping)
        self.device = device


def fisher_bytes(fisher: Mapping[str, torch.Tensor]) -> int:
    """Bytes of a site's Fisher upload."""
    return sum(t.numel() * t.element_size() for t in fisher.values())


__all__ = [
    "DAMPING_GRID",
    "FISHER_KINDS",
    "FedFisherDiagonal",
    "FedFisherKFAC",
    "FisherMerging",
    "check_fisher",
    "fisher_entry_shapes",
    "fisher_bytes",
    "fisher_kinds",
    "kfac_layers",
    "site_fisher",
    "solve_kfac_layer",
]
