"""What a site sends besides its weights and scores: the server derives it once from its methods'
needs (an UploadRequest), and the site sends exactly that, knowing nothing of the methods."""

from __future__ import annotations

import pytest

from fedfuse.federation.method_needs import upload_request_for
from fedfuse.federation.site import SiteIdentity, SiteSetup, TrainedSite, train_site
from fedfuse.federation.upload_request import UploadRequest
from fedfuse.fusion import make_fusion_methods
from fedfuse.fusion.statistics.class_gaussians import GaussianFusionSet
from fedfuse.settings.run import RunSettings
from tests.helpers import quick_site_settings


class _KeptInMemory:
    """A :class:`~fedfuse.federation.site.TrainedSiteCache` in memory: one training serves
    every request of a test."""

    def __init__(self) -> None:
        self.site: TrainedSite | None = None

    def load(self) -> TrainedSite | None:
        return self.site

    def save(self, site: TrainedSite) -> None:
        self.site = site


def test_the_request_follows_the_methods_needs():
    gaussians = GaussianFusionSet(20, rank=3)
    request = upload_request_for(make_fusion_methods("regmean,fedfisher-kfac"), gaussians)
    assert request == UploadRequest(grams=True, fisher=("kfac",), gaussian_rank=3)
    assert upload_request_for(make_fusion_methods("fedavg"), gaussians) == UploadRequest()
    kf_sites = upload_request_for(make_fusion_methods("kf-sites,kf-linear"), gaussians)
    assert kf_sites == UploadRequest(gaussian_rank=3, rounds="rounds")  # kf-linear reads a set
    assert upload_request_for(make_fusion_methods("kf-linear")).gaussian_rank == 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"grams": 1}, "grams must be a bool"),
        ({"fisher": ["diagonal"]}, "fisher must be a tuple"),
        ({"gaussian_rank": -1}, "gaussian_rank must be a whole number"),
        ({"gaussian_rank": True}, "gaussian_rank must be a whole number"),
        ({"rounds": "sums"}, "rounds must be one of"),
    ],
)
def test_a_malformed_request_is_refused_naming_its_field(fields, message):
    with pytest.raises((TypeError, ValueError), match=message):
        UploadRequest(**fields)


def test_a_site_sends_exactly_what_the_request_asks(monkeypatch):
    """The run's settings name methods that would ask for everything (Grams, both Fisher kinds,
    class Gaussians); the site has no way to build them and sends only what each request
    asks."""
    settings = quick_site_settings(
        methods="regmean,fedfisher-kfac,fedfisher-diag,kf-linear", fusion_gaussian_samples=20
    )

    def no_methods(self):
        raise AssertionError("a site must not build the run's fusion methods")

    monkeypatch.setattr(RunSettings, "fusion_methods", no_methods)
    setup = SiteSetup(cache=_KeptInMemory())
    site = SiteIdentity(0, 2)

    grams_only = train_site(settings, site, UploadRequest(grams=True), setup=setup)
    assert grams_only.grams is not None
    assert grams_only.fisher is None and grams_only.class_gaussians is None

    diagonal = train_site(settings, site, UploadRequest(fisher=("diagonal",)), setup=setup)
    assert diagonal.fisher is not None and diagonal.grams is None
    assert diagonal.class_gaussians is None
    assert all(key.startswith("diagonal") for key in diagonal.fisher)

    gaussians = train_site(settings, site, UploadRequest(gaussian_rank=2), setup=setup)
    assert gaussians.class_gaussians is not None
    assert gaussians.grams is None and gaussians.fisher is None

    nothing = train_site(settings, site, UploadRequest(), setup=setup)
    assert (nothing.grams, nothing.fisher, nothing.class_gaussians) == (None, None, None)
    assert nothing.scores  # the weights and scores always travel
