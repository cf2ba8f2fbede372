"""Client side (one per site): fedfuse's ``ClientApp``, and the one call any Flower ClientApp
makes to send what some fusion methods read from the sites (:func:`add_fusion_extras`).

The names are imported when first used: ``flwr run`` locates the ClientApp by importing this
package, and that should not load PyTorch into the CLI's process for the whole run.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedfuse.clients.extras import add_fusion_extras, requested_extras

__all__ = ["add_fusion_extras", "requested_extras"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("fedfuse.clients.extras"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
