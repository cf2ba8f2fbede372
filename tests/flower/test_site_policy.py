"""A site's policy in its node config, with fedfuse's real ClientApp handlers and ServerApp:
a refusing site is named in ``results.json`` and the run goes on with the others.

The sites are the real handlers on real site files, called in-process by a stand-in Grid
(:class:`tests.fakes.SitesGrid`), as in ``test_run_outcomes.py``.
"""

from __future__ import annotations

import pytest

from tests.fakes import hospital_files, run_hospitals

pytestmark = pytest.mark.usefixtures("task_identity")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The server's fusion and test files and three digits sites."""
    return hospital_files(tmp_path_factory.mktemp("policy"), 3)


def _run(files, tmp_path, policies, methods, **changes):
    """Run the real ServerApp over three sites; ``policies[i]`` is site i's policy keys."""
    grid, report, _ = run_hospitals(files, tmp_path, 3, policies, methods=methods, **changes)
    return grid, report, {site["site"]: site for site in report["sites"]}


def test_a_site_that_does_not_allow_a_method_of_the_run_refuses_before_training(files, tmp_path):
    grid, report, sites = _run(
        files, tmp_path, {2: {"allow-methods": "fedavg,kf-linear"}}, "kf-linear,regmean"
    )
    assert grid.trained() == [100, 101]  # the check before training left hospital-2 out
    assert sites["hospital-2"]["status"] == "refused"
    assert "['regmean'] are not in allow-methods=fedavg,kf-linear" in sites["hospital-2"]["reason"]
    assert report["status"] == "partial"
    assert report["fusions"]["kf-linear"]["status"] == "ok"
    assert report["fusions"]["regmean"]["status"] == "ok"


def test_a_site_that_sends_no_grams_refuses_a_regmean_run_and_one_without_counts_takes_part(
    files, tmp_path
):
    policies = {0: {"allow-statistics": "rounds"}, 1: {"send-class-counts": "false"}}
    grid, report, sites = _run(files, tmp_path, policies, "regmean,fedavg")
    assert sites["hospital-0"]["status"] == "refused"
    assert "need ['grams'], not in allow-statistics=rounds" in sites["hospital-0"]["reason"]
    assert sites["hospital-1"]["status"] == sites["hospital-2"]["status"] == "uploaded"
    counts = {c["site_name"]: c.get("class_counts") for c in report["clients"]}
    assert counts["hospital-1"] is None and sum(counts["hospital-2"]) > 0
    assert report["fusions"]["regmean"]["status"] == "ok"


def test_a_site_answers_at_most_its_statistics_rounds_and_the_fit_goes_on_without_it(
    files, tmp_path
):
    """kf-sites on an MLP with two hidden levels asks three rounds; a site allowing one
    answers the first, refuses the second (named in ``results.json``) and is asked no more; the
    fit goes on with the other two, and says so (``partial``: it once said ``ok``)."""
    policies = {1: {"max-statistics-rounds": 1}}
    grid, report, sites = _run(files, tmp_path, policies, "kf-sites", mlp_widths="32,32")
    asked = [
        m.metadata.dst_node_id for m in grid.pushed if m.metadata.message_type == "query.statistics"
    ]
    assert asked.count(101) == 2 and asked.count(100) == asked.count(102) == 3
    assert sites["hospital-1"]["status"] == "uploaded"
    assert sites["hospital-1"]["statistics"].startswith("refused: site policy: ")
    assert "max-statistics-rounds=1" in sites["hospital-1"]["statistics"]
    assert any("hospital-1" in p and "max-statistics-rounds=1" in p for p in report["rejected"])
    # fitted on the other two sites from the second round on: a model, but not of every site
    kf_sites = report["fusions"]["kf-sites"]
    assert kf_sites["status"] == "partial" and kf_sites["missing_sites"] == [1]
    assert "fitted on 2 of 3 sites' statistics: sites [1] gave none" in kf_sites["error"]
    assert report["status"] == "partial" and "kf-sites" in report["accuracy"]["fused"]


def test_a_site_with_a_misspelt_policy_key_fails_naming_it(files, tmp_path):
    grid, report, sites = _run(files, tmp_path, {0: {"allow-method": "fedavg"}}, "fedavg")
    assert sites["hospital-0"]["status"] == "failed"
    assert "unknown policy key(s) ['allow-method']" in sites["hospital-0"]["reason"]
    assert report["fusions"]["fedavg"]["status"] == "ok"


def test_private_statistics_travel_as_a_mechanism_and_the_run_records_its_budget(files, tmp_path):
    """kf-sites with dp_epsilon through the real ClientApp: every statistics request carries
    the noise multiplier and clip (never a noise seed: the site draws its own noise), and
    results.json records the (epsilon, delta) the run spent."""
    grid, report, sites = _run(
        files, tmp_path, {}, "kf-sites", fusion_options="dp_epsilon=4 dp_noise_seed=1"
    )
    requests = [
        m.content.config_records["request"]
        for m in grid.pushed
        if m.metadata.message_type == "query.statistics"
    ]
    assert len(requests) == 3 * 2  # three sites, two rounds (one hidden level and the head)
    assert all(r["dp-noise-multiplier"] > 0 and r["dp-clip"] > 0 for r in requests)
    assert not any("seed" in key for r in requests for key in r if key.startswith("dp-"))
    budget = report["fusions"]["kf-sites"]["details"]["privacy"]
    assert budget["rounds"] == 2 and budget["delta"] == 1e-5
    assert budget["epsilon"] <= 4.0 + 1e-3
    assert report["fusions"]["kf-sites"]["status"] == "ok"


def test_sum_only_statistics_send_each_site_its_reading_through_the_real_client_app(
    files, tmp_path
):
    grid, report, sites = _run(files, tmp_path, {}, "kf-sites", fusion_options="statistics=sums")
    messages = [m for m in grid.pushed if m.metadata.message_type == "query.statistics"]
    with_reading = [m for m in messages if "reading" in m.content.array_records]
    assert len(messages) == 6 and len(with_reading) == 3  # the hidden level's round only
    assert report["fusions"]["kf-sites"]["status"] == "ok"
    levels = report["fusions"]["kf-sites"]["details"]["levels"]
    assert levels[0]["grouped_on"] == "the fusion set"
