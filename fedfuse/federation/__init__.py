"""Sites and runs around the fusion methods, Flower-free: what a site computes on its own data
(:func:`site_fusion_inputs`, :func:`compute_site_extras`), uploads, scenarios, evaluation.

The public names below are loaded on first use, so that the CLI's light modules of this package
(e.g. ``flower_state``) do not import torch and the fusion methods.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "EXTRAS": "fedfuse.federation.plain_site",
    "SiteExtras": "fedfuse.federation.plain_site",
    "compute_site_extras": "fedfuse.federation.plain_site",
    "extras_for": "fedfuse.federation.plain_site",
    "site_fusion_inputs": "fedfuse.federation.plain_site",
}


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)


__all__ = sorted(_PUBLIC)
