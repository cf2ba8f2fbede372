"""Server side: the one-shot fusion strategy for any Flower ServerApp, and fedfuse's own ServerApp.

``from fedfuse.strategies import OneShotFusion`` in a ServerApp of any Flower app (see
``docs/flower-apps.md``); fedfuse's own app is :mod:`fedfuse.strategies.server_app`.

The names are imported when first used: ``flwr run`` locates the ServerApp by importing this
package, and that should not load PyTorch into the CLI's process for the whole run.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedfuse.strategies.one_shot import OneShotFusion
    from fedfuse.strategies.preflight import FusionAborted, MethodsUnfit

__all__ = ["FusionAborted", "MethodsUnfit", "OneShotFusion"]

_HOMES = {
    "OneShotFusion": "fedfuse.strategies.one_shot",
    "FusionAborted": "fedfuse.strategies.preflight",
    "MethodsUnfit": "fedfuse.strategies.preflight",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
