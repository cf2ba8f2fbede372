"""What a run's fusion methods need from the sites, derived once: the
:class:`~fedfuse.federation.upload_request.UploadRequest` the server sends every site.

The ServerApp's strategy, ``fedfuse compare``'s library runner and the plain ClientApp's extras
all ask here; a site only reads the request it is sent.
"""

from __future__ import annotations

from collections.abc import Iterable

from fedfuse.federation.upload_request import UploadRequest
from fedfuse.federation.uploads import needs_grams
from fedfuse.fusion.base import FusionMethod
from fedfuse.fusion.statistics.class_gaussians import GaussianFusionSet, upload_rank
from fedfuse.fusion.statistics.fisher import fisher_kinds


def upload_request_for(
    methods: Iterable[FusionMethod],
    gaussians: GaussianFusionSet | None = None,
    *,
    secure: bool = False,
) -> UploadRequest:
    """What the sites send for ``methods`` besides their weights and scores, as the methods'
    declared needs say: Grams and Fisher kinds when a method reads them, the class Gaussians of
    ``gaussians``' rank when the run completes its fusion set from them and a method reads a
    fusion set, and the statistics rounds of site-fitted methods (as secure sums when
    ``secure``): ``"sites"`` only. The sites' scores of models (``"site_scores"``, ``auto``)
    ask no rounds: a site's policy judges them when they are asked (``"scores"``)."""
    methods = list(methods)
    site_rounds = any("sites" in method.needs() for method in methods)
    return UploadRequest(
        grams=needs_grams(methods),
        fisher=fisher_kinds(methods),
        gaussian_rank=upload_rank(gaussians, methods),
        rounds=("secure-sums" if secure else "rounds") if site_rounds else "",
    )
