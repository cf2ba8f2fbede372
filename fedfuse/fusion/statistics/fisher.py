r"""Fisher merging's and FedFisher's site side: the Fisher information a site computes on its
own data and uploads once (:func:`site_fisher`), and the checks the server runs on it.

The sites' own data, labels from the site model's own predictions (the true Fisher, not the
empirical one: no label of the site's data is used):

* the *diagonal* Fisher, per parameter ``F = E_x E_{y ~ p(y|x)} [(d log p(y|x) / d theta)^2]``
  (the shape of the weights: an upload the size of the model again);
* the *K-FAC* factors (Martens & Grosse 2015; convolutions as in Grosse & Martens 2016) of
  every ``Linear`` and ``Conv2d``: with ``a`` a layer's input row (a patch of a convolution,
  with a trailing 1 when it has a bias) and ``g`` the gradient of ``log p(y|x)`` at its output
  (per position), ``A = E[a a^T]`` (positions averaged) and ``G = E[sum_positions g g^T]``, so
  that the layer's Fisher block is ``A (x) G``: an upload of ``fan_in^2 + fan_out^2`` per layer.

**What the papers send, and what fedfuse sends.** Matena & Raffel (Fisher merging, 2022) define
the diagonal Fisher with the expectation over the model's predicted distribution ``p(y|x)`` and,
for classification, compute that expectation *exactly*: each class's squared gradient weighted
by its predicted probability, on the examples the site holds; FedFisher(Diag) (Jhunjhunwala et
al. 2024) uploads the same quantity computed on the client's data. fedfuse computes it so by
default (``labels="expected"``, ``samples=0``: all the site's rows), for both kinds: K-FAC's
``G`` is then ``E_x sum_y p(y|x) g_y g_y^T``, the exact expectation Martens & Grosse estimate
with one sampled label per input. ``labels="sampled"`` draws that one label per row instead
(the Monte Carlo estimate: one backward pass rather than one per class). On 5 LeNets trained
with another recipe than fedfuse's (``benchmarks/other_recipe_lenet.py``) the sampled label
cost FedFisher(Diag) about 3 points and 2048 rows instead of all about 1 (issue 52). The exact
expectation costs one backward pass per class: ``labels="auto"`` (the default) takes it up to
:data:`EXPECTED_MAX_CLASSES` classes and samples above.

An upload holds ``diagonal.<parameter>`` and ``kfac.<layer>.inputs``/``.outputs`` entries. What
the server solves with them is in :mod:`fedfuse.fusion.methods.averaging.fisher`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from fedfuse.models import LeveledModel
from fedfuse.runtime import resolve_device

if TYPE_CHECKING:
    from fedfuse.fusion.base import FusionMethod

#: what a site can compute: the diagonal Fisher, the K-FAC factors
FISHER_KINDS = ("diagonal", "kfac")
#: samples of its data a site computes its Fisher on (drawn with the site's seed; 0: all, as
#: both papers compute it on the client's data)
DEFAULT_FISHER_SAMPLES = 0
#: how the expectation over labels is taken: exactly over the classes, or one sampled label
FISHER_LABELS = ("auto", "expected", "sampled")
#: ``labels="auto"`` takes the exact expectation up to this many classes (one backward pass
#: per class), and one sampled label per row above
EXPECTED_MAX_CLASSES = 20
DIAGONAL_PREFIX = "diagonal."
KFAC_PREFIX = "kfac."


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


def _label_weights(
    logits: torch.Tensor, generator: torch.Generator | None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``(labels, weights)`` per row whose weighted squared gradients sum to the Fisher:
    with a ``generator``, one label drawn per row from ``p(y|x)`` (weight 1); without, every
    class ``c`` with its probability ``p(c|x)`` (the exact expectation; classes no row
    predicts with a positive probability skipped)."""
    probabilities = torch.softmax(logits.detach().double(), dim=1)
    if generator is not None:
        drawn = torch.multinomial(probabilities.cpu(), 1, generator=generator).squeeze(1)
        return [(drawn.to(logits.device), torch.ones_like(probabilities[:, 0]))]
    return [
        (torch.full((len(logits),), c, dtype=torch.long, device=logits.device), probabilities[:, c])
        for c in range(probabilities.shape[1])
        if bool((probabilities[:, c] > 0).any())
    ]


def site_fisher(
    model: LeveledModel,
    inputs: torch.Tensor,
    kinds: Iterable[str],
    *,
    samples: int = DEFAULT_FISHER_SAMPLES,
    labels: str = "auto",
    seed: int = 0,
    batch_size: int = 64,
    device: str | torch.device = "auto",
) -> dict[str, torch.Tensor]:
    """A site's Fisher information on up to ``samples`` of its ``inputs`` (0: all; module
    docstring): ``diagonal.<parameter>`` per parameter for ``"diagonal"``,
    ``kfac.<layer>.inputs`` and ``kfac.<layer>.outputs`` per covered layer for ``"kfac"``.
    ``labels``: ``"expected"`` (the exact expectation over the classes, weighted by the
    model's predicted probabilities), ``"sampled"`` (one label per row drawn from them), or
    ``"auto"`` (expected up to :data:`EXPECTED_MAX_CLASSES` classes). Float32, on the CPU."""
    kinds = set(kinds)
    unknown = kinds - set(FISHER_KINDS)
    if unknown or not kinds:
        raise ValueError(f"Fisher kinds must be among {FISHER_KINDS}, got {sorted(kinds)}")
    if labels not in FISHER_LABELS:
        raise ValueError(f"Fisher labels must be among {FISHER_LABELS}, got {labels!r}")
    generator = torch.Generator().manual_seed(seed)
    if 0 < samples < len(inputs):
        chosen = torch.randperm(len(inputs), generator=generator)[:samples].sort().values
        inputs = inputs[chosen]
    torch_device = resolve_device(device)
    model = model.to(torch_device).eval()
    if labels == "auto":
        classes = int(model.spec.num_classes) if hasattr(model, "spec") else None
        expected = classes is not None and classes <= EXPECTED_MAX_CLASSES
    else:
        expected = labels == "expected"
    draw = None if expected else generator
    result: dict[str, torch.Tensor] = {}
    if "diagonal" in kinds:
        result.update(_diagonal_fisher(model, inputs, draw, batch_size, torch_device))
    if "kfac" in kinds:
        result.update(_kfac_factors(model, inputs, draw, batch_size, torch_device))
    return {k: v.float().cpu() for k, v in result.items()}


def _diagonal_fisher(model, inputs, generator, batch_size, device) -> dict[str, torch.Tensor]:
    """Mean squared per-sample gradients of ``log p(y|x)``, over sampled or all labels
    weighted by their probabilities: those of every ``Linear``/``Conv2d`` from hooks
    (:func:`_layer_diagonal`), any other parameter's by ``torch.func`` (:func:`_vmap_diagonal`)."""
    layers = kfac_layers(model)
    covered = {f"{n}.{p}" for n, layer in layers.items() for p, _ in layer.named_parameters()}
    state = generator.get_state() if generator is not None else None
    result = _layer_diagonal(model, layers, inputs, generator, batch_size, device)
    if result is None:  # a layer called twice in one pass: its per-sample terms sum first
        covered, result = set(), {}
    rest = [n for n, _ in model.named_parameters() if n not in covered]
    if rest:
        if generator is not None:  # the same sampled labels for every parameter
            generator.set_state(state)
        result.update(_vmap_diagonal(model, rest, inputs, generator, batch_size, device))
    return {f"{DIAGONAL_PREFIX}{n}": result[n] / len(inputs) for n, _ in model.named_parameters()}


def _layer_diagonal(model, layers, inputs, generator, batch_size, device):
    """Summed squared per-sample gradients of each ``Linear``/``Conv2d``'s weight and bias,
    from its inputs (patches) and output gradients per sample: ``sum_t g_t a_t^T`` squared, as
    BackPACK computes them; None when a layer runs more than once in a forward pass."""
    captured: dict[str, list[torch.Tensor]] = {}
    unfolded: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    sums: dict[str, torch.Tensor] = {}

    def forward_hook(name):
        def hook(layer, args, output):
            captured.setdefault(name, []).append(args[0].detach())
            output.register_hook(lambda g: grads.__setitem__(name, g.detach()))

        return hook

    def rows(name, layer):
        """The layer's inputs as ``(B, fan_in, T)``, once per batch."""
        a = captured[name][0]
        if isinstance(layer, nn.Conv2d):
            return F.unfold(a, layer.kernel_size, layer.dilation, layer.padding, layer.stride)
        return a.reshape(len(a), -1, a.shape[-1]).transpose(1, 2)

    def accumulate(name, layer):
        if name not in unfolded:
            unfolded[name] = rows(name, layer)
        a, g = unfolded[name], grads.pop(name)
        g = g.flatten(2) if isinstance(layer, nn.Conv2d) else g.reshape(len(g), -1, g.shape[-1])
        g = g if isinstance(layer, nn.Conv2d) else g.transpose(1, 2)  # (B, out, T)
        for start in range(0, len(a), 16):  # per-sample (out, in) gradients, 16 at a time
            weight = torch.einsum("bot,bit->boi", g[start : start + 16], a[start : start + 16])
            key = f"{name}.weight"
            term = weight.square().sum(0, dtype=torch.float64).reshape(layer.weight.shape)
            sums[key] = sums[key] + term if key in sums else term
        if layer.bias is not None:
            key, term = f"{name}.bias", g.sum(2).square().sum(0, dtype=torch.float64)
            sums[key] = sums[key] + term if key in sums else term

    handles = [layer.register_forward_hook(forward_hook(n)) for n, layer in layers.items()]
    try:
        for batch in inputs.split(batch_size):
            captured.clear()
            unfolded.clear()
            logits = model(batch.to(device))
            if any(len(v) > 1 for v in captured.values()):
                return None
            draws = _label_weights(logits, generator)
            for index, (labels, weights) in enumerate(draws):
                losses = F.cross_entropy(logits, labels, reduction="none")
                last = index == len(draws) - 1
                (losses * weights.sqrt().to(losses.dtype)).sum().backward(retain_graph=not last)
                for name in list(grads):
                    accumulate(name, layers[name])
    finally:
        for handle in handles:
            handle.remove()
        model.zero_grad(set_to_none=True)
    return sums


def _vmap_diagonal(model, names, inputs, generator, batch_size, device) -> dict[str, torch.Tensor]:
    """Summed squared per-sample gradients of the parameters ``names`` (``torch.func``: one
    vectorised backward per batch and label)."""
    from torch.func import functional_call, grad, vmap

    params = {n: p.detach() for n, p in model.named_parameters() if n in names}
    fixed = {n: p.detach() for n, p in model.named_parameters() if n not in names}
    buffers = {n: b.detach() for n, b in model.named_buffers()}

    def nll(parameters, x, y):
        state = {**fixed, **parameters, **buffers}
        logits = functional_call(model, state, (x.unsqueeze(0),))
        return F.cross_entropy(logits, y.unsqueeze(0), reduction="sum")

    per_sample = vmap(grad(nll), in_dims=(None, 0, 0))
    sums = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()}
    with warnings.catch_warnings():  # attention has no batching rule yet: slower, still exact
        warnings.filterwarnings("ignore", message="There is a performance drop")
        for batch in inputs.split(batch_size):
            batch = batch.to(device)
            with torch.no_grad():
                draws = _label_weights(model(batch), generator)
            for labels, weights in draws:
                for name, gradient in per_sample(params, batch, labels).items():
                    shape = (-1,) + (1,) * (gradient.dim() - 1)
                    sums[name] += (gradient.double().square() * weights.view(shape)).sum(0)
    return sums


def _kfac_factors(model, inputs, generator, batch_size, device) -> dict[str, torch.Tensor]:
    """Each covered layer's ``A`` and ``G`` (module docstring), from hooks on one forward and
    one backward pass per batch and label of the summed ``log p(y|x)`` (each row's term scaled
    by the square root of its label's weight, so that ``G`` sums ``weight * g g^T``)."""
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
            draws = _label_weights(logits, generator)
            for index, (labels, weights) in enumerate(draws):
                losses = F.cross_entropy(logits, labels, reduction="none")
                last = index == len(draws) - 1
                (losses * weights.sqrt().to(losses.dtype)).sum().backward(retain_graph=not last)
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


def fisher_bytes(fisher: Mapping[str, torch.Tensor]) -> int:
    """Bytes of a site's Fisher upload."""
    return sum(t.numel() * t.element_size() for t in fisher.values())


__all__ = [
    "DEFAULT_FISHER_SAMPLES",
    "DIAGONAL_PREFIX",
    "EXPECTED_MAX_CLASSES",
    "FISHER_KINDS",
    "FISHER_LABELS",
    "KFAC_PREFIX",
    "check_fisher",
    "fisher_bytes",
    "fisher_entry_shapes",
    "fisher_kinds",
    "kfac_layers",
    "site_fisher",
]
