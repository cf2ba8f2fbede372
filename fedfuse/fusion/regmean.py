r"""RegMean: merge each affine level by the least-squares fit of all clients' outputs (Jin et al.).

For a neuron level with client weights ``W_i`` (``(fan_in + 1, out)``, bias row included, see
:mod:`fedfuse.models.affine`) and client ``i``'s design matrix ``X_i`` (the level's inputs on
its own training data, with a trailing 1; unfolded patches for convolutions), RegMean picks the
weights whose outputs are closest to every client's own outputs on that client's inputs:

.. math::

    W^* = \arg\min_W \sum_i \lVert X_i W - X_i W_i \rVert_F^2
        = \Big(\sum_i G_i\Big)^{-1} \sum_i G_i W_i, \qquad G_i = X_i^\top X_i .

Only the Gram matrices ``G_i`` are needed, so the server needs no data and each client sends,
per level, a ``(fan_in + 1)^2`` matrix (:func:`level_grams` computes them client-side). A layer
without a bias is merged without intercept (``fit_bias``): the same formula on the Grams' leading
``fan_in x fan_in`` block (the Grams of the design without its 1) and the weights without their
bias row, so the clients' uploads keep one format. The paper
regularises by shrinking the non-diagonal entries,
``\tilde G_i = \alpha G_i + (1 - \alpha)\,\mathrm{diag}(G_i)``, which interpolates between the
exact fit (``alpha = 1``) and a per-input-coordinate weighted average (``alpha = 0``). Clients
with more data have larger Grams and so weigh more, with no need for sample counts.

RegMean merges every level independently, coordinate by coordinate of the neurons, so like
FedAvg it assumes the clients' neurons already correspond (a shared initialisation, as in
FedAvg-style training); it does not align them. With independently initialised clients neuron
``k`` of one client is merged with the unrelated neuron ``k`` of another: on IID clients (alike
Grams) the first level then outputs roughly the average of the clients' outputs, exactly as
weight averaging does, and deeper levels see features no client produced. It is a
(Gram-weighted) averaging baseline in that case, though empirically a much better one than
plain weight averaging (4 IID Fashion-MNIST MLP clients, independent init: 0.76 test accuracy
against 0.37 for weight averaging and 0.79 for the ensemble; its logits were 0.57 (relative)
from the clients' mean logits, weight averaging's 0.99). Align the models first to merge
matching neurons.

Levels that are not affine (a ResNet's stem and residual blocks with their BatchNorms, a ViT's
patch embedding and encoder blocks) are merged module by module, as the paper does for
transformers: every ``nn.Linear`` and ``nn.Conv2d`` inside the level (a *mergeable module*) by
the same closed form with the Gram of its own inputs (unfolded patches for convolutions; a
trailing 1 only when the module has a bias), and every other parameter and buffer (LayerNorm and
BatchNorm affine parameters and running statistics, class token, position embedding) by the
plain average. Modules that read the same tensor the same way (a ViT's ``q``, ``k`` and ``v``)
share one Gram. So that such a level still travels as one ``{level: Gram}`` entry (the upload,
checkpoint and validation formats are unchanged), its modules' Grams are packed into one
block-diagonal matrix, in the order :func:`module_grams_layout` gives; a block-diagonal of Grams
is itself the Gram of a (block-structured) design matrix, symmetric and positive semi-definite,
so the sites' uploads are validated as before. The zero blocks cost memory (about twice the
blocks' own size for a ResNet block, four times for a ViT block).

Reference:
    X. Jin, X. Ren, D. Preotiuc-Pietro, P. Cheng. *Dataless Knowledge Fusion by Merging Weights
    of Language Models*, ICLR 2023.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from fedfuse.fusion.base import FusionInputs, FusionMethod, register_fusion_method
from fedfuse.io.grams import full_gram, gram_factor
from fedfuse.models import LeveledModel, ModelSpec, build_model
from fedfuse.models.affine import (
    _patches,
    affine_view,
    check_fit_bias,
    fit_intercept,
    output_rows,
)
from fedfuse.models.capture import hooked, run_batches

log = logging.getLogger(__name__)

#: rows of the design matrix multiplied at once in :func:`level_grams` (bounds memory for convs)
_ROW_BUDGET = 1 << 14


@dataclass(frozen=True)
class GramBlock:
    """One Gram of a non-affine level: the mergeable modules reading one input the same way.

    Attributes:
        modules: the modules' qualified names inside the level (``"attention.q"``, ``"conv1"``).
        size: the Gram's side: the modules' fan-in, plus one when they have a bias.
        bias: whether the design rows carry the trailing 1 (the modules have biases).
    """

    modules: tuple[str, ...]
    size: int
    bias: bool


def mergeable(module: nn.Module) -> bool:
    """Whether RegMean merges ``module`` by its Gram: an ``nn.Linear``, or an ``nn.Conv2d``
    without groups, dilation-free or not, zero-padded by explicit amounts."""
    if isinstance(module, nn.Linear):
        return True
    return (
        isinstance(module, nn.Conv2d)
        and module.groups == 1
        and module.padding_mode == "zeros"
        and isinstance(module.padding, tuple)
    )


def _mergeable_modules(level: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in level.named_modules() if name and mergeable(m)]


def _reading(module: nn.Module) -> tuple[Any, ...]:
    """How a module turns its input into design rows (equal: the rows are equal)."""
    if isinstance(module, nn.Conv2d):
        return ("conv", module.kernel_size, module.stride, module.padding, module.dilation)
    return ("linear", module.in_features)


def _has_bias(module: nn.Module) -> bool:
    return getattr(module, "bias", None) is not None


def _block_size(module: nn.Module) -> int:
    return module.weight[0].numel() + int(_has_bias(module))


@torch.no_grad()
def module_grams_layout(model: LeveledModel) -> dict[int, list[GramBlock]]:
    """The Gram blocks of every non-affine neuron level of ``model``, in packing order.

    Found by one forward pass of a zero input through ``model`` (on its device, in eval mode)
    with hooks on the mergeable modules: those that receive the very same input tensor and read
    it the same way (same kernel, stride, padding, or both linear; both biased or both not)
    share a block. Modules the forward never calls get no block (they are averaged).
    """
    levels = [i for i in model.neuron_levels if affine_view(model.levels[i]) is None]
    seen: dict[tuple[int, str], torch.Tensor] = {}  # the inputs are kept alive: ids stay unique

    def record(key: tuple[int, str], _module: nn.Module, args: tuple[Any, ...], _: None) -> None:
        seen.setdefault(key, args[0])

    watched = {
        (level, name): module
        for level in levels
        for name, module in _mergeable_modules(model.levels[level])
    }
    device = next(model.parameters()).device
    probe = torch.zeros(1, *model.spec.input_shape, device=device)
    with hooked(watched, record, before=True):
        run_batches(model, probe, batch_size=1, device=device)
    layout: dict[int, list[GramBlock]] = {}
    for level in levels:
        groups: dict[tuple[Any, ...], list[str]] = {}
        sizes: dict[tuple[Any, ...], tuple[int, bool]] = {}
        for name, module in _mergeable_modules(model.levels[level]):
            if (level, name) not in seen:
                continue
            key = (id(seen[level, name]), _reading(module), _has_bias(module))
            groups.setdefault(key, []).append(name)
            sizes[key] = (_block_size(module), _has_bias(module))
        layout[level] = [GramBlock(tuple(names), *sizes[key]) for key, names in groups.items()]
    return layout


def _design_rows(module: nn.Module, x: torch.Tensor, bias: bool) -> torch.Tensor:
    if isinstance(module, nn.Conv2d):
        rows = _patches(x, module)
    else:
        rows = x.reshape(-1, module.in_features)
    if bias:
        rows = torch.cat([rows, rows.new_ones(len(rows), 1)], 1)
    return rows


def _accumulate(module: nn.Module, x: torch.Tensor, bias: bool, gram: torch.Tensor) -> None:
    """Add the design Gram of the inputs ``x`` of ``module`` to ``gram`` (CPU, float64)."""
    if isinstance(module, nn.Conv2d):
        positions = 1  # output positions per sample (calling the module would re-enter hooks)
        for size, kernel, stride, pad, dilation in zip(
            x.shape[2:], module.kernel_size, module.stride, module.padding, module.dilation,
            strict=True,
        ):  # fmt: skip
            positions *= max(1, (size + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1)
        step = max(1, _ROW_BUDGET // positions)
        for chunk in range(0, len(x), step):
            design = _design_rows(module, x[chunk : chunk + step], bias).double()
            gram += (design.T @ design).cpu()
        return
    rows = x.reshape(-1, module.in_features)
    for chunk in range(0, len(rows), _ROW_BUDGET):
        design = _design_rows(module, rows[chunk : chunk + _ROW_BUDGET], bias).double()
        gram += (design.T @ design).cpu()


@torch.no_grad()
def level_grams(
    model: LeveledModel, data: torch.Tensor, *, batch_size: int = 256, factor: bool = False
) -> dict[int, torch.Tensor]:
    """Client side of RegMean: each neuron level's design Gram ``X^T X`` over ``data``, float64.

    For an affine level, ``X`` holds the level's design rows (:meth:`AffineLevel.design`: the
    level's inputs computed by ``model`` itself, flattened or unfolded into patches, with a
    trailing 1 for the bias), so the Gram has shape ``(fan_in + 1, fan_in + 1)``. For any other
    level it is the block-diagonal packing of its mergeable modules' Grams (module docstring,
    :func:`module_grams_layout`), each collected by a hook on the module's input
    (:func:`~fedfuse.models.capture.hooked`). The model runs in eval mode on its current device
    and is restored afterwards.

    Args:
        model: the client's model.
        data: the client's training inputs ``(N, ...)``, normalised like the training data.
        batch_size: samples per forward pass; design rows are further chunked to bound memory.
        factor: give an affine level with fewer design rows than columns as its exact factor
            ``R`` (``rows x columns``, ``R^T R = X^T X``; :mod:`fedfuse.io.grams`), which is
            what a site with few samples uploads: a fraction of the matrix's size.

    Returns:
        ``{neuron level index: Gram}`` on the CPU, as :attr:`FusionInputs.grams` expects.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if len(data) == 0:
        raise ValueError("level_grams needs at least one sample")
    views = {i: affine_view(model.levels[i]) for i in model.neuron_levels}
    views = {i: v for i, v in views.items() if v is not None}
    layout = module_grams_layout(model)
    grams: dict[int, torch.Tensor] = {
        index: torch.zeros(view.fan_in, view.fan_in, dtype=torch.float64)
        for index, view in views.items()
    }
    # design rows kept while a level has fewer than its columns (then its Gram is sent as R)
    kept: dict[int, list[torch.Tensor] | None] = {i: [] if factor else None for i in views}
    blocks: dict[tuple[int, int], torch.Tensor] = {}
    block_modules: dict[tuple[int, int], nn.Module] = {}
    for level, level_blocks in layout.items():
        modules = dict(model.levels[level].named_modules())
        for number, block in enumerate(level_blocks):
            blocks[level, number] = torch.zeros(block.size, block.size, dtype=torch.float64)
            block_modules[level, number] = modules[block.modules[0]]

    def record_level(index: int, _level: nn.Module, args: tuple[Any, ...], y: torch.Tensor) -> None:
        x, view = args[0], views[index]
        rows_per_sample = max(1, len(output_rows(y[:1])))
        step = max(1, _ROW_BUDGET // rows_per_sample)
        for chunk in range(0, len(x), step):
            design = view.design(x[chunk : chunk + step]).double()
            grams[index] += (design.T @ design).cpu()
            rows = kept[index]
            if rows is not None:
                rows.append(design.cpu())
                if sum(len(r) for r in rows) >= view.fan_in:
                    kept[index] = None

    def record_block(
        key: tuple[int, int], module: nn.Module, args: tuple[Any, ...], _: None
    ) -> None:
        _accumulate(module, args[0], layout[key[0]][key[1]].bias, blocks[key])

    with (
        hooked(block_modules, record_block, before=True),
        hooked({index: model.levels[index] for index in views}, record_level),
    ):
        run_batches(model, data, batch_size=batch_size, device=next(model.parameters()).device)
    for level, level_blocks in layout.items():
        grams[level] = torch.block_diag(*(blocks[level, n] for n in range(len(level_blocks))))
    for index, rows in kept.items():
        if rows:
            grams[index] = gram_factor(torch.cat(rows))
    return dict(sorted(grams.items()))


def _module_matrix(module: nn.Module, bias: bool) -> torch.Tensor:
    """A mergeable module's parameters as ``(fan_in[+1], out)``, the bias as the last row."""
    weight = module.weight.detach().flatten(1)
    if bias:
        weight = torch.cat([weight, module.bias.detach()[:, None]], 1)
    return weight.T


@torch.no_grad()
def _set_module_matrix(module: nn.Module, w: torch.Tensor, bias: bool) -> None:
    weight = module.weight
    rows = w[:-1] if bias else w
    weight.copy_(rows.T.reshape(weight.shape).to(weight.dtype))
    if bias:
        module.bias.copy_(w[-1].to(weight.dtype))


def _average_state(models: list[LeveledModel]) -> dict[str, torch.Tensor]:
    """The plain average of the floating-point state; other entries (BatchNorm's batch
    counters) from model 0."""
    state = {}
    for key, value in models[0].state_dict().items():
        if value.is_floating_point():
            total = sum(m.state_dict()[key].double().cpu() for m in models)
            state[key] = (total / len(models)).to(value.dtype)
        else:
            state[key] = value.clone()
    return state


@register_fusion_method
class RegMean(FusionMethod):
    r"""RegMean (Jin et al., 2023) as a one-shot federated method: per neuron level (or, in a
    level that is not affine, per Linear/Conv2d module),
    ``W* = (sum_i G~_i + lambda I)^{-1} (sum_i G~_i W_i + lambda mean_i W_i)`` from the clients'
    Grams (:attr:`FusionInputs.grams`, see :func:`level_grams`); every other parameter and
    buffer (normalisation layers, embeddings) is averaged. No fusion set.

    Args:
        alpha: non-diagonal shrinkage, ``G~ = alpha G + (1 - alpha) diag(G)``, in ``[0, 1]``.
            Default 0.9, the paper's recommended value (1: the exact least-squares fit of all
            clients' outputs; 0: a per-coordinate weighted average).
        jitter: the ridge ``lambda`` relative to the mean diagonal of ``sum_i G~_i``; tiny, it
            only fixes directions no client's data reaches (e.g. dead ReLU inputs, or a constant
            input collinear with the bias), which it sets to the plain average instead of leaving
            them undetermined. Raised tenfold while the solve reports a singular system.
        fit_bias: whether an affine level's merge has an intercept (the Grams' constant 1):
            ``"auto"`` exactly when its layer has a bias, True always (an error names a level
            whose layer has none), False never (a layer's bias is set to 0). A level that is not
            affine merges each module with its own bias, or without when it has none.

    The system is solved in float64 with :func:`torch.linalg.solve_ex` (LU).
    """

    name = "regmean"
    requires = frozenset({"grams"})

    def __init__(
        self, alpha: float = 0.9, jitter: float = 1e-9, fit_bias: bool | str = "auto"
    ) -> None:
        check_fit_bias(fit_bias, self.name)
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"regmean: alpha must be in [0, 1], got {alpha}")
        if not jitter >= 0:
            raise ValueError(f"regmean: jitter must be >= 0, got {jitter}")
        self.alpha = float(alpha)
        self.jitter = float(jitter)
        self.fit_bias = fit_bias

    def check_architecture(self, model: LeveledModel) -> None:
        """Every neuron level must be affine or hold at least one Linear/Conv2d to merge."""
        for index in model.neuron_levels:
            level = model.levels[index]
            view = affine_view(level)
            if view is None and not _mergeable_modules(level):
                raise ValueError(
                    f"level {model.level_name(index)} is neither affine nor holds a Linear or "
                    "Conv2d (groups=1, zero padding) to merge by its input Gram"
                )
            if view is not None:
                where = f"{self.name}: level {model.level_name(index)}"
                fit_intercept(view.layer, self.fit_bias, where=where)

    def _gram(
        self, grams: dict[int, torch.Tensor], client: int, level: int, name: str, size: int
    ) -> torch.Tensor:
        if level not in grams:
            raise ValueError(
                f"{self.name}: FusionInputs.grams[{client}] has no Gram for level {name} "
                f"(has levels {sorted(grams)}); compute them with "
                "fedfuse.fusion.regmean.level_grams"
            )
        gram = full_gram(torch.as_tensor(grams[level]))
        if gram.shape != (size, size) or not torch.isfinite(gram).all():
            raise ValueError(
                f"{self.name}: FusionInputs.grams[{client}][{level}] must be a finite "
                f"({size}, {size}) matrix for level {name}, got shape {tuple(gram.shape)}"
            )
        return gram

    def _shrink(self, gram: torch.Tensor) -> torch.Tensor:
        shrunk = self.alpha * gram
        shrunk.diagonal().add_((1.0 - self.alpha) * gram.diagonal())
        return shrunk

    def _fuse(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec
    ) -> tuple[LeveledModel, dict[str, Any]]:
        fused = build_model(target)
        fused.load_state_dict(_average_state(models))  # what no Gram merges is averaged
        views = {i: affine_view(fused.levels[i]) for i in fused.neuron_levels}
        layout = module_grams_layout(fused)
        # One system per affine level, or per block of a non-affine level (its modules' weight
        # matrices side by side as the right-hand side): key (level, block or -1).
        systems: dict[tuple[int, int], tuple[str, list[nn.Module], bool, int]] = {}
        for level, view in views.items():
            if view is not None:  # the Grams have the 1; a fit without intercept drops it
                name = fused.level_name(level)
                bias = fit_intercept(view.layer, self.fit_bias, where=f"{self.name}: level {name}")
                systems[level, -1] = (name, [view.layer], bias, view.fan_in - int(not bias))
        for level, blocks in layout.items():
            modules = dict(fused.levels[level].named_modules())
            for number, block in enumerate(blocks):
                name = f"{fused.level_name(level)}/{'+'.join(block.modules)}"
                members = [modules[m] for m in block.modules]
                systems[level, number] = (name, members, block.bias, block.size)
        sizes = {
            level: (views[level].fan_in if views[level] is not None else None)
            for level in fused.neuron_levels
        }
        for level, blocks in layout.items():
            sizes[level] = sum(b.size for b in blocks)
        # Stream over the clients: one client's Grams in memory at a time (they may be
        # memory-mapped files of a thousand sites), the per-system sums accumulated.
        totals, rhs, means = {}, {}, {}
        for key, (_, members, _, size) in systems.items():
            out = sum(m.weight.shape[0] for m in members)
            totals[key] = torch.zeros(size, size, dtype=torch.float64)
            rhs[key] = torch.zeros(size, out, dtype=torch.float64)
            means[key] = torch.zeros(size, out, dtype=torch.float64)
        assert inputs.grams is not None
        for client, (model, grams) in enumerate(zip(models, inputs.grams, strict=True)):
            client_modules = {level: dict(model.levels[level].named_modules()) for level in layout}
            for level in fused.neuron_levels:
                gram = self._gram(grams, client, level, fused.level_name(level), sizes[level])
                if views[level] is not None:
                    weights = affine_view(model.levels[level]).weights().double().cpu()
                    if not systems[level, -1][2]:  # without intercept: drop the 1 and the bias
                        gram, weights = gram[:-1, :-1], weights[:-1]
                    self._add(totals, rhs, means, (level, -1), gram, weights, len(models))
                    continue
                offset = 0
                for number, block in enumerate(layout[level]):
                    part = gram[offset : offset + block.size, offset : offset + block.size]
                    offset += block.size
                    weights = torch.cat(
                        [
                            _module_matrix(client_modules[level][m], block.bias)
                            for m in block.modules
                        ],
                        1,
                    )
                    self._add(
                        totals, rhs, means, (level, number), part, weights.double().cpu(),
                        len(models),
                    )  # fmt: skip
            del grams
        ridges: dict[str, float] = {}
        for key, (name, members, bias, _) in systems.items():
            merged, relative = _solve_regularised(
                totals[key], rhs[key], means[key], self.jitter, name
            )
            if key[1] == -1:
                replace(views[key[0]], bias=bias).set_weights(merged)
            else:
                column = 0
                for module in members:
                    out = module.weight.shape[0]
                    _set_module_matrix(module, merged[:, column : column + out], bias)
                    column += out
            ridges[name] = relative
            log.debug("regmean %s: ridge %.1e (relative)", name, relative)
        return fused.eval(), {"alpha": self.alpha, "ridge": ridges}

    def _add(
        self,
        totals: dict,
        rhs: dict,
        means: dict,
        key: tuple[int, int],
        gram: torch.Tensor,
        weights: torch.Tensor,
        count: int,
    ) -> None:
        shrunk = self._shrink(gram)
        totals[key] += shrunk
        rhs[key] += shrunk @ weights
        means[key] += weights / count


def _solve_regularised(
    total: torch.Tensor, rhs: torch.Tensor, mean: torch.Tensor, jitter: float, name: str
) -> tuple[torch.Tensor, float]:
    """``(total + lambda I)^{-1} (rhs + lambda mean)``, lambda relative to the mean diagonal,
    raised tenfold (from at least 1e-12) while the solve fails or returns non-finite values."""
    scale = float(total.diagonal().mean())
    if not scale > 0:
        raise ValueError(
            f"regmean: the clients' Grams of level {name} are all zero (no data reached it?)"
        )
    eye = torch.eye(len(total), dtype=total.dtype)
    relative = jitter
    for _ in range(14):
        penalty = relative * scale
        solution, info = torch.linalg.solve_ex(total + penalty * eye, rhs + penalty * mean)
        if int(info) == 0 and bool(torch.isfinite(solution).all()):
            return solution, relative
        relative = max(relative * 10, 1e-12)
    raise ValueError(f"regmean: the Gram system of level {name} stays singular (NaN inputs?)")


__all__ = ["GramBlock", "RegMean", "level_grams", "mergeable", "module_grams_layout"]
