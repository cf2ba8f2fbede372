"""Server side: the one-shot fusion strategy for any Flower ServerApp, and fedfuse's own ServerApp.

``from fedfuse.strategies import OneShotFusion`` in a ServerApp of any Flower app (see
``docs/flower-apps.md``); fedfuse's own app is :mod:`fedfuse.strategies.server_app`.
"""

from fedfuse.strategies.one_shot import OneShotFusion
from fedfuse.strategies.preflight import FusionAborted, MethodsUnfit

__all__ = ["FusionAborted", "MethodsUnfit", "OneShotFusion"]
