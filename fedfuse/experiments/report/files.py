"""What a report wrote, and what it skipped and why (a figure never sinks the report)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class ReportFiles:
    """What :func:`write_report` wrote, and what it skipped and why."""

    directory: Path
    markdown: Path
    csv: Path
    weight_stats_csv: Path | None = None
    figures: list[Path] = field(default_factory=list)
    landscapes: list[Path] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    rows: int = 0
    failed: int = 0

    def attempt(self, what: str, action: Callable[[], Any]) -> Any:
        """Run ``action()``; on failure log a warning, note it as skipped and return None."""
        try:
            return action()
        except Exception as error:  # a figure never sinks the report
            message = f"{what}: {type(error).__name__}: {error}"[:500]
            log.warning("skipped %s", message)
            self.skipped.append(message)
            return None
