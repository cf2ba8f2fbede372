"""Neuron importance scores (paper Sec. 2.2, App. F.4), computed where the data lives.

A level's score vector has one entry per neuron (output channel): the mean absolute attribution
over samples and spatial positions. ``uniform`` gives every neuron ``1/n``; ``conductance``
(Dhamdhere et al., 2018) and ``deeplift`` (Shrikumar et al., 2017) use Captum's layer methods on
the level's output, attributing the logit of each sample's label (or of the predicted class when no
labels are given) against an all-zero input baseline.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable

import torch
from torch import fx
from tqdm.auto import tqdm

from fedfuse.models.leveled import LeveledModel
from fedfuse.runtime import resolve_device

log = logging.getLogger(__name__)

SCORE_METHODS = ("uniform", "conductance", "deeplift")

Scores = dict[int, torch.Tensor]
"""Importance scores by level index: a 1-D non-negative tensor of the level's width."""


def uniform_scores(model: LeveledModel, levels: Iterable[int] | None = None) -> Scores:
    """``1/n`` for each of the ``n`` neurons of every (requested) neuron level."""
    chosen = model.neuron_levels if levels is None else list(levels)
    return {i: torch.full((model.level_width(i),), 1.0 / model.level_width(i)) for i in chosen}


def importance_scores(
    model: LeveledModel,
    inputs: torch.Tensor,
    targets: torch.Tensor | None = None,
    *,
    method: str = "conductance",
    levels: Iterable[int] | None = None,
    n_steps: int = 16,
    batch_size: int = 64,
    device: str | torch.device = "auto",
    progress: bool = False,
) -> Scores:
    """Score every neuron of the neuron levels of ``model`` on ``inputs``.

    Args:
        model: the model to explain (DeepLIFT explains a copy in which a module called more
            than once, as torchvision's ResNet blocks call one ``ReLU`` twice, is one per call).
        inputs: samples ``(N, ...)``; the clients use their own training data.
        targets: class index per sample whose logit is explained (default: the predicted class).
        method: one of :data:`SCORE_METHODS`.
        levels: neuron levels to score (default: all of them).
        n_steps: integration steps of conductance (it costs about ``n_steps + 1`` forward and
            backward passes per sample and level).
        batch_size: samples per attribution call.
        device: where to compute.
        progress: show a progress bar over levels.

    Returns:
        ``{level: scores}``, each a float32 CPU tensor of the level's width.
    """
    if method not in SCORE_METHODS:
        raise ValueError(f"unknown importance method {method!r}; choose one of {SCORE_METHODS}")
    chosen = model.neuron_levels if levels is None else list(levels)
    no_neurons = [i for i in chosen if not model.has_neurons(i)]
    if no_neurons:
        raise ValueError(f"levels {no_neurons} have no neurons to score")
    if method == "uniform":
        return uniform_scores(model, chosen)
    if len(inputs) == 0:
        raise ValueError("importance scores need at least one input sample")

    if method == "deeplift":
        model = _one_module_per_call(model)
    compute = resolve_device(device)
    model_device = next(model.parameters()).device
    was_training = model.training
    model.eval().to(compute)
    try:
        if targets is None:
            with torch.no_grad():
                targets = torch.cat(
                    [
                        model(inputs[s : s + 256].to(compute)).argmax(1).cpu()
                        for s in range(0, len(inputs), 256)
                    ]
                )
        if len(targets) != len(inputs):
            raise ValueError(f"{len(targets)} targets for {len(inputs)} inputs")
        totals = {i: torch.zeros(model.level_width(i), dtype=torch.float64) for i in chosen}
        layers = [model.levels[i] for i in chosen]
        batches = range(0, len(inputs), batch_size)
        for start in tqdm(batches, desc=f"{method} scores", disable=not progress, leave=False):
            x = inputs[start : start + batch_size].to(compute)
            t = targets[start : start + batch_size].to(compute)
            if method == "conductance":
                attributions = layer_conductances(model, layers, x, t, n_steps=n_steps)
            else:
                attributions = layer_deeplifts(model, layers, x, t)
            for index, attribution in zip(chosen, attributions, strict=True):
                # mean |attribution| over spatial positions, summed over the samples of the batch
                per_sample = _channels_first(attribution.detach().abs(), len(totals[index]))
                if per_sample.dim() > 2:
                    per_sample = per_sample.flatten(2).mean(2)
                totals[index] += per_sample.sum(0).double().cpu()
        scores: Scores = {i: (total / len(inputs)).float() for i, total in totals.items()}
        for index, vector in scores.items():
            log.debug("level %d: %s scores, mean %.3g", index, method, vector.mean())
        return scores
    finally:
        model.to(model_device)
        model.train(was_training)


def _channels_first(values: torch.Tensor, width: int) -> torch.Tensor:
    """``values`` with the level's ``width`` neurons on dim 1: a traced model's token sequence
    ``(N, tokens, d)`` (torchvision's ViT) holds them on its last dim."""
    if values.dim() > 2 and values.shape[1] != width and values.shape[-1] == width:
        return values.movedim(-1, 1)
    return values


def _one_module_per_call(model: LeveledModel) -> LeveledModel:
    """``model`` itself, or a copy of it in which each parameter-free module that a traced
    level calls again (torchvision's ``BasicBlock`` calls its ``relu`` twice) is a module of its
    own at every call after the first, held only where it is called, and none works in place:
    DeepLIFT's hooks keep one input and output per module, and refuse a module run twice."""
    calls: set[int] = set()
    repeated = False
    for level in model.levels:
        for node in level.graph.nodes if isinstance(level, fx.GraphModule) else ():
            if node.op == "call_module":
                module = level.get_submodule(str(node.target))
                repeated |= id(module) in calls
                calls.add(id(module))
    if not repeated and not any(getattr(m, "inplace", False) for m in model.modules()):
        return model
    model = copy.deepcopy(model)
    calls.clear()
    for level in model.levels:
        for module in level.modules():
            if getattr(module, "inplace", False):
                module.inplace = False
        if not isinstance(level, fx.GraphModule):
            continue
        for node in level.graph.nodes:
            if node.op != "call_module":
                continue
            module = level.get_submodule(str(node.target))
            if id(module) in calls and next(module.parameters(), None) is None:
                name = f"{str(node.target).replace('.', '_')}_call_{node.name}"
                level.add_submodule(name, copy.deepcopy(module))
                node.target = name
            calls.add(id(module))
        level.delete_all_unused_submodules()  # Captum hooks a module once per place it is held
        level.recompile()
    return model


def layer_conductances(
    model: torch.nn.Module,
    layers: list[torch.nn.Module],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    n_steps: int = 16,
) -> list[torch.Tensor]:
    """Layer conductance (Dhamdhere et al., 2018) of several layers from one batch of passes.

    Captum's ``LayerConductance`` computes, for one layer, the gradient of the target logit with
    respect to the layer's output at ``n_steps + 1`` points on the path from an all-zero baseline
    to each input (Gauss-Legendre points), times the change of the layer's output between
    consecutive points, summed over the path. The forward and backward passes along the path do
    not depend on the layer, so here Captum's own ``compute_layer_gradients_and_eval`` takes
    every layer at once: one set of ``n_steps + 1`` passes instead of one per layer, with the
    same result (a test compares it with ``LayerConductance`` layer by layer).
    """
    from captum._utils.gradient import compute_layer_gradients_and_eval
    from captum.attr._utils.approximation_methods import approximation_parameters

    count = len(inputs)
    _, alphas_for = approximation_parameters("gausslegendre")
    baseline = torch.zeros_like(inputs)
    path = torch.cat(
        [baseline + alpha * (inputs - baseline) for alpha in alphas_for(n_steps + 1)]
    ).requires_grad_()
    gradients, evaluations = compute_layer_gradients_and_eval(
        model, layers, path, target_ind=targets.repeat(n_steps + 1)
    )
    conductances = []
    for (gradient,), (evaluation,) in zip(gradients, evaluations, strict=True):
        steps = (evaluation[count:] - evaluation[:-count]) * gradient[:-count]
        conductances.append(steps.reshape(n_steps, count, *evaluation.shape[1:]).sum(0))
    return conductances


def layer_deeplifts(
    model: torch.nn.Module,
    layers: list[torch.nn.Module],
    inputs: torch.Tensor,
    targets: torch.Tensor,
) -> list[torch.Tensor]:
    """Layer DeepLIFT (Shrikumar et al., 2017; rescale rule, all-zero baseline) of several
    layers from one forward and one backward pass.

    Captum's ``LayerDeepLift`` runs the inputs and the baselines through the model with its
    rescale hooks on the nonlinearities, takes the gradient of the target logit with respect to
    the layer's output and multiplies it by the change of that output from the baseline. The
    hooked passes do not depend on the layer, so here every layer's gradient comes from the
    same backward pass (Captum's ``compute_layer_gradients_and_eval`` over a list of layers):
    the same result (a test compares it with ``LayerDeepLift`` layer by layer) at one pass
    instead of one per layer, eleven times fewer for a ResNet-18.
    """
    from captum._utils.gradient import compute_layer_gradients_and_eval
    from captum.attr import LayerDeepLift

    hooks = LayerDeepLift(model, layers[0])  # its rescale hooks, as its attribute() sets them
    registered = []
    try:
        registered = hooks._hook_main_model()  # runs inputs and baselines as one batch
        model.apply(lambda module: hooks._register_hooks(module, attribute_to_layer_input=False))
        forward = hooks._construct_forward_func(
            model, ((inputs,), (torch.zeros_like(inputs),)), torch.cat([targets, targets])
        )
        gradients, evaluations = compute_layer_gradients_and_eval(
            forward, layers, (inputs,), output_fn=lambda out: tuple(t.chunk(2) for t in out)
        )
    finally:
        hooks._remove_hooks(registered)
    # each layer's one output, split into the inputs' half and the baselines' half
    return [
        (evaluation[0] - evaluation[1]) * gradient[0]
        for (gradient,), (evaluation,) in zip(gradients, evaluations, strict=True)
    ]


def normalize_scores(scores: Scores, mode: str = "sum") -> Scores:
    """Rescale each level's scores: ``"sum"`` (to sum to 1), ``"max"`` (max 1) or ``"none"``.

    All-zero levels (no attribution flowed) fall back to uniform so no neuron is ignored entirely.
    """
    if mode not in ("sum", "max", "none"):
        raise ValueError(f"unknown score normalisation {mode!r}; choose sum, max or none")
    result: Scores = {}
    for level, s in scores.items():
        s = s.float()
        denominator = s.sum() if mode == "sum" else s.max()
        if mode == "none":
            result[level] = s
        elif denominator > 0:
            result[level] = s / denominator
        else:
            result[level] = torch.full_like(s, 1.0 / len(s) if mode == "sum" else 1.0)
    return result
