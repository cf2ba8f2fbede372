"""Evaluation of a fusion run and its result files (Flower-free, shared by every entry point)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from fedfuse.data import ImageDataset
from fedfuse.fusion import FUSION_METHODS, FusionResult
from fedfuse.models.capture import predict


def evaluate_fusion(
    base_models: Sequence[nn.Module],
    fused: Mapping[str, nn.Module] | None,
    test_set: ImageDataset,
    *,
    device: str = "auto",
    progress: bool = False,
) -> dict[str, Any]:
    """Accuracy and loss on ``test_set`` of each base model, their ensemble and each fused model.

    ``fused`` maps a label (the fusion method) to its fused model. One pass over the base models
    (which may be a lazy sequence of memory-mapped models): each model's logits give its own
    accuracy and are folded into the ensemble's running average of probabilities, so a thousand
    base models cost a thousand forward passes and one model's worth of memory.
    """
    inputs, labels = test_set.inputs(), test_set.labels
    base: list[dict[str, float]] = []
    log_mixture: torch.Tensor | None = None
    bar = tqdm(base_models, desc="evaluating base models", disable=None if progress else True)
    for model in bar:
        logits = predict(model, inputs, device=device)
        base.append(_scores(logits, labels))
        log_probs = logits.double().log_softmax(dim=-1)
        log_mixture = log_probs if log_mixture is None else torch.logaddexp(log_mixture, log_probs)
        del model
    if log_mixture is None:
        raise ValueError("evaluate_fusion needs at least one base model")
    ensemble = _scores(log_mixture - math.log(len(base)), labels)
    fused_results = {
        name: _scores(predict(model, inputs, device=device), labels)
        for name, model in (fused or {}).items()
    }
    return {
        "base": base,
        "base_mean_accuracy": sum(r["accuracy"] for r in base) / len(base),
        "ensemble": ensemble,
        "fused": fused_results,
        "test_examples": len(test_set),
    }


def _scores(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Top-1 accuracy and mean cross-entropy of ``logits`` (log-probabilities work too)."""
    return {
        "accuracy": (logits.argmax(1) == labels).double().mean().item(),
        "loss": F.cross_entropy(logits.double(), labels).item(),
    }


def describe_method(name: str) -> str:
    """``name``, and its kind unless it is a zero-shot fusion (KD trains on the fusion set)."""
    method = FUSION_METHODS.get(name)
    return f"{name} ({method.kind})" if method is not None and method.kind != "fusion" else name


def format_accuracy_table(evaluation: dict[str, Any]) -> str:
    """A plain-text table: one row per base model, the ensemble and each fused model."""
    rows = [(f"base model {i}", r) for i, r in enumerate(evaluation["base"])]
    rows.append(("ensemble (not a single model)", evaluation["ensemble"]))
    rows += [
        (f"fused: {describe_method(name)}", r) for name, r in evaluation.get("fused", {}).items()
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{'model':<{width}}  accuracy    loss", f"{'-' * width}  --------  ------"]
    lines += [f"{name:<{width}}  {r['accuracy'] * 100:7.2f}%  {r['loss']:6.3f}" for name, r in rows]
    lines.append(f"(test set: {evaluation['test_examples']} examples)")
    return "\n".join(lines)


_LEVEL_COLUMNS = (
    ("representation_cost", "repr. cost", "{:.4g}"),
    ("approximation_error", "approx. err", "{:.4g}"),
    ("grouping_error", "grouping err", "{:.4g}"),
    ("projected_grouping_error", "proj. grouping", "{:.4g}"),
    ("unreachable_error", "unreachable", "{:.4g}"),
    ("validation_mse", "val mse", "{:.4g}"),
    ("epochs_run", "epochs", "{:.0f}"),
    ("rank", "rank", "{}"),
    ("route", "route", "{}"),
    ("seconds", "seconds", "{:.3f}"),
)


def format_level_summary(result: FusionResult) -> str:
    """A plain-text table of the method's per-level details and the total fusion time.

    Columns appear only when some level reports them: the Theorem 1 terms (representation
    cost = approximation + grouping error, per fusion-set row), and for the Linear variants the
    projected grouping and unreachable errors, rank and route; for the Gradient variants the
    validation MSE and epochs.
    """
    details = result.details or {}
    levels = [level for level in details.get("levels", []) if isinstance(level, dict)]
    lines = []
    if "variant" in details:
        lines.append(f"variant: {details['variant']}")
    if levels:
        columns = [c for c in _LEVEL_COLUMNS if any(c[0] in level for level in levels)]
        header = ["level", *(title for _, title, _ in columns)]
        rows = [
            [
                str(level.get("level", index)),
                *(
                    _format_cell(level.get(key), fmt) if key in level else "-"
                    for key, _, fmt in columns
                ),
            ]
            for index, level in enumerate(levels)
        ]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

        def line(cells: list[str]) -> str:
            first, *rest = cells
            rest = [c.rjust(w) for c, w in zip(rest, widths[1:], strict=True)]
            parts = [first.ljust(widths[0]), *rest]
            return "  ".join(parts).rstrip()

        lines += [line(header), line(["-" * w for w in widths])]
        lines += [line(r) for r in rows]
    else:
        lines.append("(no per-level details for this method)")
    for key, value in details.items():
        if key not in ("variant", "levels"):
            lines.append(f"{key}: {json.dumps(value, default=str)}")
    lines.append(f"fusion time: {result.seconds:.3f} s")
    return "\n".join(lines)


def _format_cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    try:
        return fmt.format(value)
    except (TypeError, ValueError):
        return str(value)
