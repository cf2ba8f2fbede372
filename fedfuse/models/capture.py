"""Activation capture: the inputs and outputs of a model's levels and submodules on a batch of data.

Every fusion method that looks at representations (neuron interpolation, OTFusion, Git Re-Basin,
FS-Merge, RegMean's Grams, BatchNorm statistics) reads them through this module, so batching,
device placement, no-grad, forward hooks and restoring the modules' train/eval modes live here
once: :func:`evaluating` (eval mode on a device, everything restored), :func:`hooked` (forward
hooks on given submodules for the length of a block), :func:`run_batches` (the batched forward
pass), and on top of them :func:`capture_levels`, :func:`capture_modules` and :func:`predict`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from fedfuse.models import LeveledModel
from fedfuse.runtime import resolve_device

Key = TypeVar("Key", bound=Hashable)


@dataclass(frozen=True)
class LevelIO:
    """What one level saw and produced on the captured batch."""

    inputs: torch.Tensor
    outputs: torch.Tensor


def _modes(model: torch.nn.Module) -> list[bool]:
    return [module.training for module in model.modules()]


def _restore(model: torch.nn.Module, modes: list[bool]) -> None:
    """Put every submodule back in the train/eval mode it had (a container's mode may differ)."""
    for module, mode in zip(model.modules(), modes, strict=True):
        module.training = mode


@contextmanager
def evaluating(
    model: torch.nn.Module, device: str | torch.device = "auto"
) -> Iterator[torch.device]:
    """``model`` in eval mode on ``device`` (``"auto"``: CUDA when present) for the block, which
    receives the device; afterwards, also on an error, the model is back on the device it was on
    and every submodule in the train/eval mode it had."""
    compute = resolve_device(device)
    modes = _modes(model)
    home = next(model.parameters()).device
    model.eval()
    try:
        model.to(compute)
        yield compute
    finally:
        model.to(home)
        _restore(model, modes)


@contextmanager
def hooked(
    modules: Mapping[Key, torch.nn.Module],
    record: Callable[[Key, torch.nn.Module, tuple[Any, ...], Any], None],
    *,
    before: bool = False,
) -> Iterator[None]:
    """For the block, call ``record(key, module, args, output)`` after every forward call of each
    ``modules[key]`` (a forward hook; ``before``: ``record(key, module, args, None)`` before the
    call, a forward pre-hook), in the order the calls happen. The hooks are removed afterwards,
    also on an error."""
    handles = []
    try:
        for key, module in modules.items():
            if before:

                def pre_hook(m: torch.nn.Module, args: tuple[Any, ...], key: Key = key) -> None:
                    record(key, m, args, None)

                handles.append(module.register_forward_pre_hook(pre_hook))
            else:

                def hook(
                    m: torch.nn.Module, args: tuple[Any, ...], output: Any, key: Key = key
                ) -> None:
                    record(key, m, args, output)

                handles.append(module.register_forward_hook(hook))
        yield
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def run_batches(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    *,
    batch_size: int = 1024,
    device: str | torch.device = "auto",
    training: Iterable[torch.nn.Module] = (),
) -> None:
    """Run ``model`` on ``inputs``, ``batch_size`` samples at a time, without gradients, in eval
    mode on ``device`` (:func:`evaluating`) but for the submodules ``training``, which run in
    train mode (BatchNorm layers that re-estimate their running statistics); what it computes is
    read by :func:`hooked` hooks, or kept in those modules' buffers."""
    with evaluating(model, device) as compute:
        for module in training:
            module.train()
        for start in range(0, len(inputs), batch_size):
            model(inputs[start : start + batch_size].to(compute))


@torch.no_grad()
def capture_levels(
    model: LeveledModel,
    inputs: torch.Tensor,
    levels: Iterable[int] | None = None,
    *,
    batch_size: int = 1024,
    device: str | torch.device = "auto",
    store_device: str | torch.device = "cpu",
    keep_inputs: bool = True,
) -> dict[int, LevelIO]:
    """Run ``model`` on ``inputs`` and keep the inputs/outputs of the requested levels.

    Args:
        model: the model; it is put in eval mode for the capture and restored afterwards.
        inputs: a batch ``(N, ...)`` in the model's input format.
        levels: level indices to keep (default: all levels).
        batch_size: rows per forward pass, to bound peak memory.
        device: where to compute (``"auto"``: CUDA when present).
        store_device: where the captured tensors are kept.
        keep_inputs: also keep each level's inputs (else ``LevelIO.inputs`` is empty).

    Returns:
        ``{level: LevelIO}`` with tensors of ``N`` rows each.
    """
    wanted = set(range(model.num_levels)) if levels is None else set(levels)
    invalid = sorted(i for i in wanted if not 0 <= i < model.num_levels)
    if invalid:
        raise ValueError(f"levels {invalid} do not exist; the model has {model.num_levels}")
    chunks: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {i: ([], []) for i in wanted}
    with evaluating(model, device) as compute:
        for start in range(0, len(inputs), batch_size):
            x = inputs[start : start + batch_size].to(compute)
            for index, level in enumerate(model.levels):
                y = level(x)
                if index in wanted:
                    if keep_inputs:
                        chunks[index][0].append(x.to(store_device))
                    chunks[index][1].append(y.to(store_device))
                x = y
    return {
        i: LevelIO(torch.cat(ins) if ins else torch.empty(0), torch.cat(outs))
        for i, (ins, outs) in chunks.items()
    }


class LevelStream:
    """One model's level inputs and outputs on a batch, a level at a time and in order.

    :func:`capture_levels` keeps every requested level of a model at once; a fusion of a
    thousand models that fits one level after the other needs only the current level of each.
    :meth:`level` runs the model from the last level it reached to the one asked for and keeps
    only that level's tensors (and, to go on from, nothing else), so the memory is one level's
    outputs per model. The batches are those of :func:`capture_levels`, so are the values.
    """

    def __init__(
        self,
        model: LeveledModel,
        inputs: torch.Tensor,
        *,
        batch_size: int = 1024,
        device: str | torch.device = "auto",
        store_device: str | torch.device = "cpu",
        keep_inputs: bool = True,
    ) -> None:
        self.model = model
        self.batch_size = batch_size
        self.device = device
        self.store_device = store_device
        self.keep_inputs = keep_inputs
        self._inputs = inputs
        self._reached = 0  # the next level to run

    def keep(self, outputs: torch.Tensor) -> None:
        """Go on from ``outputs`` instead (the last level's values, moved, e.g. into a tensor
        shared with other models)."""
        self._inputs = outputs

    @torch.no_grad()
    def level(self, index: int, out: torch.Tensor | None = None) -> LevelIO:
        """The inputs (when kept) and outputs of level ``index``; levels come in order. With
        ``out`` (for example a model's columns of one tensor holding every model's outputs),
        the outputs are written there and ``out`` is what is returned and kept."""
        if not self._reached <= index < self.model.num_levels:
            raise ValueError(
                f"level {index} cannot be streamed: levels come in order, the next is "
                f"{self._reached} of {self.model.num_levels}"
            )
        x = self._inputs
        with evaluating(self.model, self.device) as compute:
            for number in range(self._reached, index + 1):
                level, seen = self.model.levels[number], x
                chunks = [
                    level(chunk.to(compute)).to(self.store_device)
                    for chunk in x.split(self.batch_size)
                ]
                if number == index and out is not None:
                    start = 0
                    for chunk in chunks:
                        out[start : start + len(chunk)] = chunk
                        start += len(chunk)
                    x = out
                else:
                    x = torch.cat(chunks)
        self._inputs, self._reached = x, index + 1
        return LevelIO(seen if self.keep_inputs else torch.empty(0), x)


def predict(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    *,
    batch_size: int = 1024,
    device: str | torch.device = "auto",
) -> torch.Tensor:
    """Model outputs (logits) for ``inputs``, computed in eval mode in batches without gradients
    (:func:`run_batches`), returned on CPU."""
    outputs: list[torch.Tensor] = []

    def record(_key: str, _module: torch.nn.Module, _args: tuple[Any, ...], output: Any) -> None:
        outputs.append(output.cpu())

    with hooked({"model": model}, record):
        run_batches(model, inputs, batch_size=batch_size, device=device)
    return torch.cat(outputs)


@torch.no_grad()
def accuracy_and_loss(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    *,
    batch_size: int = 1024,
    device: str | torch.device = "auto",
) -> tuple[float, float]:
    """``(accuracy, mean cross-entropy)`` of ``model`` on labelled rows (:func:`predict`); a loss
    that is not finite is ``inf``, so it still compares."""
    logits = predict(model, inputs, batch_size=batch_size, device=device).double()
    labels = labels.cpu().long()
    accuracy = (logits.argmax(1) == labels).double().mean().item()
    loss = torch.nn.functional.cross_entropy(logits, labels).item()
    return accuracy, loss if math.isfinite(loss) else math.inf


_ACTIVATIONS = (
    torch.nn.ReLU,
    torch.nn.GELU,
    torch.nn.SiLU,
    torch.nn.Tanh,
    torch.nn.Sigmoid,
    torch.nn.LeakyReLU,
    torch.nn.ELU,
)


@torch.no_grad()
def capture_modules(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    probes: Iterable[tuple[str, int]],
    *,
    batch_size: int = 1024,
    device: str | torch.device = "auto",
    store_device: str | torch.device = "cpu",
    pre_activation: bool = False,
) -> dict[tuple[str, int], torch.Tensor]:
    """Run ``model`` on ``inputs`` and keep the outputs of named submodules as feature rows.

    Args:
        model: the model; it is put in eval mode for the capture and restored afterwards.
        inputs: a batch ``(N, ...)`` in the model's input format.
        probes: ``(module name, channel dim)`` pairs, as in
            :attr:`fedfuse.models.symmetry.FeatureSpace.probes`: the output of the module named
            (as in ``model.named_modules()``) holds the features along ``channel dim``. A name
            ``"<module>#in_proj:<input>:<start>:<stop>"`` reads rows ``start:stop`` of an
            ``nn.MultiheadAttention``'s packed projection of its positional input ``input``
            (its queries, keys or values, which no submodule outputs).
        batch_size: samples per forward pass, to bound peak memory.
        device: where to compute (``"auto"``: CUDA when present).
        store_device: where the captured rows are kept.
        pre_activation: for a probe that is an elementwise activation module (ReLU, GELU, ...),
            keep its input instead (the same features before the nonlinearity: dead units of a
            ReLU stay distinguishable).

    Returns:
        ``{(name, dim): rows}``, ``rows`` of shape ``(R, channels)``: the channel dim moved last
        and every other dim (samples, positions, tokens) pooled into rows, like
        :func:`fedfuse.models.affine.output_rows` does for level outputs.
    """
    wanted = list(dict.fromkeys((str(name), int(dim)) for name, dim in probes))
    modules = dict(model.named_modules())
    missing = sorted({name.split("#")[0] for name, _ in wanted} - modules.keys())
    if missing:
        raise ValueError(f"the model has no modules named {missing}")
    chunks: dict[tuple[str, int], list[torch.Tensor]] = {probe: [] for probe in wanted}

    def record(name: str, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        if pre_activation and isinstance(module, _ACTIVATIONS):
            output = args[0]
        for probe in wanted:
            if probe[0].split("#")[0] == name:
                rows = _projected(module, args, probe[0]) if "#" in probe[0] else output
                rows = rows.detach().movedim(probe[1], -1)
                chunks[probe].append(rows.reshape(-1, rows.shape[-1]).to(store_device))

    names = dict.fromkeys(name.split("#")[0] for name, _ in wanted)
    with hooked({name: modules[name] for name in names}, record):
        run_batches(model, inputs, batch_size=batch_size, device=device)
    return {probe: torch.cat(rows) for probe, rows in chunks.items()}


def _projected(module: torch.nn.Module, args: tuple, probe: str) -> torch.Tensor:
    """The rows of a packed attention projection a ``#in_proj`` probe names."""
    _, _, spec = probe.partition("#in_proj:")
    position, start, stop = (int(part) for part in spec.split(":"))
    weight, bias = module.in_proj_weight[start:stop], module.in_proj_bias
    return torch.nn.functional.linear(
        args[position], weight, bias[start:stop] if bias is not None else None
    )
