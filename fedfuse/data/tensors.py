"""Samples from whatever a user's code holds them in: tensors, a pair of tensors, a DataLoader.

Flower apps keep their data in ``DataLoader``\\ s whose batches are ``(inputs, labels)`` pairs
(torchvision) or dicts (HuggingFace ``datasets``, as Flower's templates load them), already in
the app's own normalisation. :func:`collect_samples` turns any of these into one input tensor
and one label tensor, so fedfuse uses the samples exactly as the user's model sees them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

#: what :func:`collect_samples` takes
SampleSource = torch.Tensor | Sequence[torch.Tensor] | Iterable[Any]


def collect_samples(
    source: SampleSource,
    *,
    limit: int | None = None,
    keys: tuple[str, str] | None = None,
    what: str = "the data",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(inputs, labels)`` from ``source``: at most ``limit`` inputs (None: all) and every label.

    Args:
        source: a tensor of inputs (no labels), an ``(inputs, labels)`` pair of tensors, or an
            iterable of batches (a ``DataLoader``), each an ``(inputs, labels)`` pair or a dict.
        limit: keep only the first ``limit`` inputs (labels are still read to the end, so class
            counts see the whole set).
        keys: the dict keys of inputs and labels in dict batches (default: the one floating
            tensor and the one integer tensor of the batch).
        what: how error messages name ``source``.

    Raises ValueError, naming ``what``, for batches it cannot read.
    """
    if isinstance(source, torch.Tensor):
        return _floats(source[:limit], what), None
    if _is_pair(source):
        inputs, labels = source  # type: ignore[misc]
        return _floats(inputs[:limit], what), _labels(labels, what)
    inputs_parts: list[torch.Tensor] = []
    label_parts: list[torch.Tensor] = []
    kept = 0
    for index, batch in enumerate(source):  # type: ignore[union-attr]
        inputs, labels = _split_batch(batch, keys, f"{what}, batch {index}")
        if limit is None or kept < limit:
            take = inputs if limit is None else inputs[: limit - kept]
            inputs_parts.append(take.detach().cpu())
            kept += len(take)
        if labels is not None:
            label_parts.append(_labels(labels, f"{what}, batch {index}"))
        elif label_parts:
            raise ValueError(f"{what}, batch {index}: has no labels, the batches before did")
    if not inputs_parts:
        raise ValueError(f"{what}: holds no samples")
    collected = _floats(torch.cat(inputs_parts), what)
    return collected, torch.cat(label_parts) if label_parts else None


def _is_pair(source: Any) -> bool:
    return (
        isinstance(source, tuple | list)
        and len(source) == 2
        and all(isinstance(part, torch.Tensor) for part in source)
        and len(source[0]) == len(source[1])
        and source[1].dim() == 1
    )


def _split_batch(
    batch: Any, keys: tuple[str, str] | None, where: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(batch, torch.Tensor):
        return batch, None
    if isinstance(batch, tuple | list) and len(batch) >= 2:
        return batch[0], batch[1]
    if isinstance(batch, Mapping):
        if keys is not None:
            missing = [key for key in keys if key not in batch]
            if missing:
                raise ValueError(f"{where}: no key(s) {missing} in a batch with {sorted(batch)}")
            return batch[keys[0]], batch[keys[1]]
        tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        floats = [k for k, v in tensors.items() if v.is_floating_point()]
        integers = [k for k, v in tensors.items() if not v.is_floating_point() and v.dim() == 1]
        if len(floats) == 1 and len(integers) <= 1:
            return tensors[floats[0]], tensors[integers[0]] if integers else None
        raise ValueError(
            f"{where}: cannot tell inputs from labels among the keys {sorted(batch)}; "
            "say which with keys=('<inputs key>', '<labels key>')"
        )
    raise ValueError(
        f"{where}: a batch must be a tensor, an (inputs, labels) pair or a dict, "
        f"got {type(batch).__name__}"
    )


def _floats(inputs: Any, what: str) -> torch.Tensor:
    if not isinstance(inputs, torch.Tensor) or not inputs.is_floating_point():
        found = inputs.dtype if isinstance(inputs, torch.Tensor) else type(inputs).__name__
        raise ValueError(
            f"{what}: inputs must be a float tensor in the model's normalisation, got {found}"
        )
    return inputs.detach().cpu().float()


def _labels(labels: Any, what: str) -> torch.Tensor:
    if isinstance(labels, Sequence) and not isinstance(labels, torch.Tensor):
        labels = torch.as_tensor(labels)
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.dim() != 1:
        found = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ValueError(f"{what}: labels must be a 1-D tensor of class indices, got {found}")
    return labels.detach().cpu().long()
