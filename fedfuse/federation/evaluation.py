"""Evaluation of a fusion run and the summary a person reads (Flower-free, every entry point).

:func:`evaluate_fusion` scores the base models, their ensembles (of probabilities, and of logits)
and each fused model on the test set; :func:`method_cost` says what each method cost the sites
(one upload, or how many statistics rounds, and the bytes); :func:`format_accuracy_table`
prints both (the probability ensemble as the reference), marks the best single model, and
:func:`summary_warnings` says when a fused model is at chance or below every base model, and
which methods do better on such splits.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from fedfuse.data import ImageDataset
from fedfuse.fusion import FUSION_METHODS, FusionResult
from fedfuse.fusion.base import SITE_NEEDS
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
    accuracy and are folded into the ensemble's running average of probabilities (``ensemble``,
    the reference the summary prints) and of logits (``logit_ensemble``, as
    :class:`~fedfuse.models.Ensemble` with ``average="logits"``), so a thousand base models cost
    a thousand forward passes and one model's worth of memory.
    """
    inputs, labels = test_set.inputs(), test_set.labels
    base: list[dict[str, float]] = []
    log_mixture: torch.Tensor | None = None
    logit_sum: torch.Tensor | None = None
    bar = tqdm(base_models, desc="evaluating base models", disable=None if progress else True)
    for model in bar:
        logits = predict(model, inputs, device=device)
        base.append(_scores(logits, labels))
        log_probs = logits.double().log_softmax(dim=-1)
        log_mixture = log_probs if log_mixture is None else torch.logaddexp(log_mixture, log_probs)
        logit_sum = logits.double() if logit_sum is None else logit_sum + logits.double()
        del model
    if log_mixture is None or logit_sum is None:
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
        "logit_ensemble": _scores(logit_sum / len(base), labels),
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


#: methods that do well where sites hold different classes (docs/results.md): the one-upload
#: method and the one with statistics rounds that lead the class-sharded settings
SKEW_ROBUST_METHODS = ("kf-sites", "regmean")
#: inputs whose sending reveals statistics of a site's data beyond its model (docs/privacy.md):
#: Grams, Fisher, statistics rounds and a site's scores of the models the server sends
DATA_STATISTICS = frozenset({"grams", "fisher"}) | SITE_NEEDS


@dataclass(frozen=True)
class MethodCost:
    """What one fusion method cost each site: its one upload, and its statistics rounds.

    ``upload_bytes`` is the mean over sites of the upload parts the method reads (weights, and
    scores, Grams or Fisher information when it uses them); ``round_bytes`` the largest round's
    mean over sites.
    """

    upload_bytes: float
    rounds: int = 0
    round_bytes: float = 0.0
    seconds: float | None = None
    sends_data_statistics: bool = False

    def describe(self) -> str:
        """``"1 upload, 2.7 MiB"`` or ``"1 upload, 2.7 MiB + 4 rounds of <= 6.3 MiB"``."""
        text = f"1 upload, {human_bytes(self.upload_bytes)}"
        if self.rounds:
            noun = "round" if self.rounds == 1 else "rounds"
            text += f" + {self.rounds} {noun} of <= {human_bytes(self.round_bytes)}"
        return text


def method_cost(
    needs: Iterable[str],
    clients: Sequence[Mapping[str, Any]],
    details: Mapping[str, Any] | None = None,
    seconds: float | None = None,
) -> MethodCost:
    """The cost of a method that reads ``needs`` (its :meth:`FusionMethod.needs`) from the
    sites' uploads (their facts: ``upload_parts`` per site) and ran the statistics rounds that
    its result ``details`` list (``rounds[i]["upload_bytes"][site]``)."""
    needs = frozenset(needs)
    parts = ["weights", *(part for part in ("scores", "grams", "fisher") if part in needs)]
    uploads = [sum(int(c.get("upload_parts", {}).get(part, 0)) for part in parts) for c in clients]
    rounds = list((details or {}).get("rounds", []))
    round_means = [
        sum(map(int, r.get("upload_bytes", {}).values())) / max(len(clients), 1) for r in rounds
    ]
    return MethodCost(
        upload_bytes=sum(uploads) / max(len(uploads), 1),
        rounds=len(rounds),
        round_bytes=max(round_means, default=0.0),
        seconds=seconds,
        sends_data_statistics=bool(needs & DATA_STATISTICS),
    )


def human_bytes(count: float | None) -> str:
    """``1536`` -> ``"1.5 KiB"`` (binary units); None -> ``"–"``."""
    if count is None:
        return "–"
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"  # pragma: no cover


def best_single_model(evaluation: Mapping[str, Any]) -> str | None:
    """The row label of the most accurate single model (a base or a fused model; the
    ensemble is not one model), as :func:`format_accuracy_table` labels its rows."""
    rows = [(f"base model {i}", r["accuracy"]) for i, r in enumerate(evaluation["base"])]
    rows += [(f"fused: {name}", r["accuracy"]) for name, r in evaluation.get("fused", {}).items()]
    return max(rows, key=lambda row: row[1])[0] if rows else None


def format_accuracy_table(
    evaluation: Mapping[str, Any],
    costs: Mapping[str, MethodCost] | None = None,
    ensemble_cost: MethodCost | None = None,
) -> str:
    """A plain-text table: one row per base model, the ensemble and each fused model.

    With ``costs`` (by method name), each fused row also says what every site sent (one upload,
    or how many statistics rounds, and the bytes) and how long the fusion took; the best single
    model is marked, and a last line points to docs/privacy.md when a listed method sends
    statistics of the sites' data.
    """
    best = best_single_model(evaluation) if costs is not None else None
    rows: list[tuple[str, Mapping[str, float], MethodCost | None]] = [
        (f"base model {i}", r, None) for i, r in enumerate(evaluation["base"])
    ]
    rows.append(("ensemble (not a single model)", evaluation["ensemble"], ensemble_cost))
    for name, r in evaluation.get("fused", {}).items():
        rows.append((f"fused: {name}", r, (costs or {}).get(name)))

    def label(row_label: str) -> str:
        name = row_label.removeprefix("fused: ")
        return f"fused: {describe_method(name)}" if row_label.startswith("fused: ") else row_label

    width = max(len(label(name)) for name, _, _ in rows)
    header = f"{'model':<{width}}  accuracy    loss"
    rule = f"{'-' * width}  --------  ------"
    sends = [cost.describe() if cost else "" for _, _, cost in rows]
    if costs is not None:
        sends_width = max(len("each site sends"), *(len(s) for s in sends))
        header += f"  {'each site sends':<{sends_width}}  fusion"
        rule += f"  {'-' * sends_width}  -------"
    lines = [header, rule]
    for (name, r, cost), sent in zip(rows, sends, strict=True):
        line = f"{label(name):<{width}}  {r['accuracy'] * 100:7.2f}%  {r['loss']:6.3f}"
        if costs is not None:
            seconds = f"{cost.seconds:6.2f}s" if cost and cost.seconds is not None else ""
            line += f"  {sent:<{sends_width}}  {seconds:>7}"
            if name == best:
                line += "  <- best single model"
        lines.append(line.rstrip())
    lines.append(f"(test set: {evaluation['test_examples']} examples)")
    revealing = [name for name, cost in (costs or {}).items() if cost.sends_data_statistics]
    if revealing:
        lines.append(
            f"{', '.join(revealing)}: the sites also send statistics of their data (Gram "
            "matrices, Fisher information, statistics rounds or scores of models); what that "
            "reveals: docs/privacy.md"
        )
    return "\n".join(lines)


def summary_warnings(evaluation: Mapping[str, Any], num_classes: int) -> list[str]:
    """A line for each fused model that is at chance or below every base model, naming the
    methods that do better on such splits (where this run has them, with their accuracy)."""
    chance = 1.0 / max(num_classes, 1)
    fused = dict(evaluation.get("fused", {}))
    worst_base = min((r["accuracy"] for r in evaluation["base"]), default=0.0)
    warnings = []
    for name, r in fused.items():
        accuracy = r["accuracy"]
        if accuracy < 1.5 * chance:
            problem = f"is at chance ({accuracy * 100:.2f}%; chance is {chance * 100:.2f}%)"
        elif accuracy < worst_base:
            problem = f"is below every base model ({accuracy * 100:.2f}% < {worst_base * 100:.2f}%)"
        else:
            continue
        better = [
            f"{other} ({fused[other]['accuracy'] * 100:.2f}% here)" if other in fused else other
            for other in SKEW_ROBUST_METHODS
            if other != name and fused.get(other, {"accuracy": 1.0})["accuracy"] > accuracy
        ]
        advice = (
            f"; on splits where sites hold different classes, {' and '.join(better)} do better "
            "(docs/results.md)"
            if better
            else ""
        )
        warnings.append(f"warning: fused model {name} {problem}{advice}")
    return warnings


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


def format_run_summary(report: Mapping[str, Any]) -> str:
    """The accuracy table of a run's ``results.json`` document, with each method's cost to the
    sites, the best single model marked, and the warnings of :func:`summary_warnings`."""
    clients = report.get("clients", [])
    costs = {
        name: method_cost(
            fusion.get("needs", ()), clients, fusion.get("details"), fusion.get("seconds")
        )
        for name, fusion in report.get("fusions", {}).items()
        if fusion.get("status") in ("ok", "partial")  # partial: a model of fewer sites
    }
    evaluation = report["accuracy"]
    text = format_accuracy_table(evaluation, costs, method_cost((), clients))
    counts = report.get("class_counts") or [c.get("class_counts") for c in clients]
    sent = [c for c in counts if c]  # a site's policy may keep its counts
    num_classes = len(sent[0]) if sent else 0
    warnings = summary_warnings(evaluation, num_classes) if num_classes else []
    return "\n".join([text, *selection_lines(report), *warnings])


def selection_lines(report: Mapping[str, Any]) -> list[str]:
    """One line per method of the run that chose among candidates (``auto``): what it chose
    and why, in its own words."""
    lines = []
    for name, fusion in report.get("fusions", {}).items():
        chose = (fusion.get("details") or {}).get("auto")
        if isinstance(chose, Mapping) and chose.get("chosen"):
            lines.append(f"{name} chose {chose['chosen']}: {chose.get('why', '')}".rstrip(": "))
    return lines
