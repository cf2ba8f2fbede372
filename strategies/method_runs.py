"""Running every fusion method over the same uploads, each failure kept instead of raised.

One method's error must not cost the others their results: :func:`fuse_each_method` records it
as a :class:`MethodFailure` and goes on, and :func:`format_method_results` reports both kinds in
one line per method. Kept apart from the strategy so that the policy for a failing method is
stated once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flwr.app import MetricRecord
from torch import nn

from fedfuse.fusion import FusionMethod, FusionResult
from fedfuse.models import LeveledModel, ModelSpec

log = logging.getLogger(__name__)


@dataclass
class MethodFailure:
    """A fusion method that raised while fusing (the other methods still ran)."""

    error: str
    seconds: float


def fuse_each_method(
    methods: Sequence[FusionMethod],
    models: Sequence[LeveledModel],
    inputs: Any,
    *,
    results: dict[str, FusionResult],
    failures: dict[str, MethodFailure],
    target: Callable[[ModelSpec], ModelSpec | None] | None = None,
    export: Callable[[nn.Module], nn.Module] | None = None,
    on_fused: Callable[[str, FusionResult], None] | None = None,
) -> None:
    """Fuse ``models`` with each method in turn, into ``results`` or ``failures`` by name.

    Args:
        target: given the sites' spec, the fused model's (None: the sites').
        export: turns a fused model into the app's own (None: kept as fused).
        on_fused: called with each method's name and result as soon as it has fused.
    """
    for method in methods:
        started = time.monotonic()
        try:
            fused_spec = None if target is None else target(models[0].spec)
            result = method.fuse(models, inputs, target=fused_spec)
            if export is not None:  # the app gets its own model, under its own names
                result.model = export(result.model)
        except Exception as error:  # one method's failure must not cost the others
            seconds = time.monotonic() - started
            failures[method.name] = MethodFailure(f"{type(error).__name__}: {error}", seconds)
            log.exception("fusion method %s failed; the other methods go on", method.name)
            continue
        results[method.name] = result
        if on_fused is not None:  # e.g. saved now, before anything else can fail
            on_fused(method.name, result)


def format_method_results(
    methods: Sequence[FusionMethod],
    results: Mapping[str, FusionResult],
    failures: Mapping[str, MethodFailure],
    evaluations: Mapping[str, MetricRecord],
) -> str:
    """One line per method: its fusion time and server-side metrics, or its error."""
    lines = []
    for method in methods:
        name = method.name
        if name in results:
            metrics = ", ".join(
                f"{key} {value:.4f}" if isinstance(value, float) else f"{key} {value}"
                for key, value in evaluations.get(name, {}).items()
            )
            seconds = results[name].seconds
            lines.append(f"  {name:<16} fused in {seconds:7.2f} s  {metrics}".rstrip())
        elif name in failures:
            lines.append(f"  {name:<16} FAILED: {failures[name].error}")
    return "\n".join(lines)
