"""A site's policy (its node config): parsed strictly, and every limit refuses with its reason."""

from __future__ import annotations

import pytest

from fedfuse.federation.contract import SiteRefusal
from fedfuse.federation.method_needs import upload_request_for
from fedfuse.federation.policy import SitePolicy
from fedfuse.federation.site import SiteIdentity, SiteSetup, train_site
from fedfuse.federation.upload_request import UploadRequest
from fedfuse.fusion import make_fusion_methods
from fedfuse.io.grams import is_gram_factor
from tests.helpers import quick_site_settings, run_upload_request


def test_a_node_config_without_policy_keys_allows_everything():
    policy = SitePolicy.from_node_config({"partition-id": 0, "data-path": "/x.npz"})
    assert policy == SitePolicy()
    policy.check_run(["kf-sites", "regmean"], {"grams", "rounds"}, samples=1)
    policy.check_statistic("a Gram", samples=1, rows=1, columns=785)
    policy.check_round("rounds", answered=10_000)


def test_policy_keys_are_parsed_from_node_config_values():
    policy = SitePolicy.from_node_config(
        {
            "allow-methods": "fedavg, kf-sites",
            "allow-statistics": "rounds",
            "max-statistics-rounds": 4,
            "min-statistic-rows": "200",
            "refuse-grams-below-fan-in": "true",
            "send-class-counts": False,
        }
    )
    assert policy.methods == {"fedavg", "kf-sites"}
    assert policy.statistics == {"rounds"}
    assert (policy.max_statistics_rounds, policy.min_statistic_rows) == (4, 200)
    assert policy.refuse_grams_below_fan_in and not policy.send_class_counts
    assert SitePolicy.from_node_config({"allow-statistics": "none"}).statistics == frozenset()
    assert policy.describe()["allow-methods"] == "fedavg,kf-sites"


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"allow-method": "fedavg"}, r"unknown policy key\(s\) \['allow-method'\]"),
        ({"allow-methods": "fedavg,fedprox"}, r"unknown method\(s\) \['fedprox'\]"),
        ({"allow-statistics": "grams,logits"}, r"allow-statistics names \['logits'\]"),
        ({"max-statistics-rounds": "-1"}, "max-statistics-rounds must be a whole number"),
        ({"min-statistic-rows": 2.5}, "min-statistic-rows must be a whole number"),
        ({"send-class-counts": "maybe"}, "send-class-counts must be true or false"),
    ],
)
def test_a_malformed_policy_is_named_by_its_key(config, message):
    with pytest.raises(ValueError, match=message) as error:
        SitePolicy.from_node_config(config, where="node 7: node config")
    assert str(error.value).startswith("node 7: node config")


def test_a_run_outside_the_policy_is_refused_with_the_reason():
    only_fedavg = SitePolicy(methods=frozenset({"fedavg"}))
    with pytest.raises(SiteRefusal, match=r"method\(s\) \['regmean'\] are not in allow-methods"):
        only_fedavg.check_run(["fedavg", "regmean"], set(), samples=100)
    no_grams = SitePolicy(statistics=frozenset({"rounds"}))
    with pytest.raises(SiteRefusal, match=r"need \['grams'\], not in allow-statistics=rounds"):
        no_grams.check_run(["regmean"], {"grams"}, samples=100)
    large = SitePolicy(min_statistic_rows=500)
    with pytest.raises(SiteRefusal, match="holds 100 samples, fewer than min-statistic-rows=500"):
        large.check_run(["kf-sites"], {"rounds"}, samples=100)
    large.check_run(["fedavg"], set(), samples=100)  # no statistics: the minimum does not apply


def test_statistics_and_rounds_outside_the_policy_are_refused():
    policy = SitePolicy(max_statistics_rounds=2, refuse_grams_below_fan_in=True)
    policy.check_round("rounds", answered=1)
    with pytest.raises(SiteRefusal, match="max-statistics-rounds=2 answered already"):
        policy.check_round("rounds", answered=2)
    with pytest.raises(SiteRefusal, match="has 40 rows, fewer than its 65 columns"):
        policy.check_statistic("the Gram of level 0", samples=40, rows=40, columns=65)
    policy.check_statistic("the Gram of level 0", samples=40, rows=80, columns=65)
    with pytest.raises(SiteRefusal, match="not in allow-statistics=grams"):
        SitePolicy(statistics=frozenset({"grams"})).check_round("rounds", answered=0)


def _asked(methods: str, *, secure: bool = False) -> frozenset[str]:
    return upload_request_for(make_fusion_methods(methods), secure=secure).statistics()


def test_the_statistics_a_run_asks_follow_its_methods():
    assert _asked("fedavg,kf-linear") == set()
    assert _asked("regmean") == {"grams"}
    assert _asked("kf-sites,regmean") == {"grams", "rounds"}
    assert _asked("kf-sites", secure=True) == {"secure-sums"}


def test_the_policy_judges_the_request_it_is_sent():
    no_grams = SitePolicy(statistics=frozenset({"rounds"}))
    no_grams.check_request(["regmean"], UploadRequest(rounds="rounds"), samples=100)
    with pytest.raises(SiteRefusal, match=r"need \['grams'\], not in allow-statistics=rounds"):
        no_grams.check_request(["regmean"], UploadRequest(grams=True), samples=100)
    with pytest.raises(SiteRefusal, match=r"need \['class-gaussians', 'fisher'\]"):
        no_grams.check_request(["fedavg"], UploadRequest(fisher=("kfac",), gaussian_rank=2), 100)


def test_a_site_refuses_before_training_and_keeps_its_counts_and_small_grams():
    """train_site with a real site: a barred method stops it before training; a small site's
    Gram (a factor: fewer rows than columns) is refused; class counts stay home."""
    settings = quick_site_settings(methods="regmean,fedavg")
    request = run_upload_request(settings)
    only_fedavg = SiteSetup(policy=SitePolicy(methods=frozenset({"fedavg"})))
    with pytest.raises(SiteRefusal, match="allow-methods=fedavg"):
        train_site(settings, SiteIdentity(0, 2), request, setup=only_fedavg)
    private = SiteSetup(policy=SitePolicy(send_class_counts=False))
    upload = train_site(settings, SiteIdentity(0, 2), request, setup=private)
    assert upload.class_counts is None and upload.grams is not None
    assert not any(is_gram_factor(g) for g in upload.grams.values())  # enough rows here
    tiny = quick_site_settings(methods="regmean", partitioner="iid")  # 40 sites of 30-40 rows
    upload = train_site(tiny, SiteIdentity(0, 40), run_upload_request(tiny))
    assert any(is_gram_factor(g) for g in upload.grams.values())
    refuse_factors = SiteSetup(policy=SitePolicy(refuse_grams_below_fan_in=True))
    with pytest.raises(SiteRefusal, match=r"Gram of level 0 has \d\d rows, fewer than its 65 col"):
        train_site(tiny, SiteIdentity(0, 40), run_upload_request(tiny), setup=refuse_factors)
