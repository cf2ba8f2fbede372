"""Client side (one per site): fedfuse's ``ClientApp``, the one call any Flower ClientApp makes
to send what some fusion methods read from the sites (:func:`add_fusion_extras`), and the one
its query handler makes to answer statistics rounds (:func:`answer_statistics`).

The names are imported when first used: ``flwr run`` locates the ClientApp by importing this
package, and that should not load PyTorch into the CLI's process for the whole run.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedfuse.clients.extras import add_fusion_extras, requested_extras
    from fedfuse.clients.plain_statistics import answer_statistics

#: each public name and its module
_MODULES = {
    "add_fusion_extras": "fedfuse.clients.extras",
    "requested_extras": "fedfuse.clients.extras",
    "answer_statistics": "fedfuse.clients.plain_statistics",
}
__all__ = ["add_fusion_extras", "answer_statistics", "requested_extras"]


def __getattr__(name: str) -> Any:
    if name in _MODULES:  # the names of __all__
        return getattr(importlib.import_module(_MODULES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
