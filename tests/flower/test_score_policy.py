"""A site's policy judges its scores of models (``allow-statistics`` kind ``scores``): fedfuse's
real ClientApp handler refuses a scoring round it does not allow, naming the policy; the site is
asked no more, and ``auto`` ranks its candidates on the sites that scored them all.

The sites are the real handlers, called in-process by a stand-in Grid
(:class:`tests.fakes.SitesGrid`), as in ``test_site_policy.py``.
"""

from __future__ import annotations

import pytest

from fedfuse.federation.scenario import Scenario
from fedfuse.models import build_model
from fedfuse.strategies.statistics_rounds import FlowerSites
from tests.fakes import SitesGrid, hospital_files, run_hospitals
from tests.helpers import quick_site_settings

pytestmark = pytest.mark.usefixtures("task_identity", "one_thread")
SETTINGS = quick_site_settings()
REFUSAL = "site policy: scores of models are not in allow-statistics=grams,rounds"


def test_a_site_whose_policy_lacks_scores_refuses_to_score_naming_the_policy():
    fused = build_model(Scenario(SETTINGS, 2).model_spec(), seed=5).eval()
    nodes = {
        11: {"partition-id": 0, "num-partitions": 2, "allow-statistics": "grams,rounds"},
        12: {"partition-id": 1, "num-partitions": 2},
    }
    grid = SitesGrid(nodes, SETTINGS.to_config())
    sites = FlowerSites(grid, [fused, fused], list(nodes), ["site-11", "site-12"], timeout=30)
    refused, scored = sites.score(fused)
    assert refused is None and scored is not None and scored.examples > 0
    (problem,) = sites.problems
    assert problem.startswith("site-11: scoring round: refused: ") and REFUSAL in problem
    assert list(sites.unscored) == [0] and sites.can_score
    sites.score(fused)  # the refusing site is not asked again
    asked = [m.metadata.dst_node_id for m in grid.pushed if m.metadata.message_type == "evaluate"]
    assert asked == [11, 12, 12] and len(sites.problems) == 1


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The server's fusion and test files and three digits sites."""
    return hospital_files(tmp_path_factory.mktemp("score-policy"), 3)


def test_auto_over_flower_ranks_on_the_sites_that_allow_scores(files, tmp_path):
    """No candidate runs statistics rounds: a site that sends none but Grams and rounds takes
    part (nothing is refused before training), refuses to score, and auto ranks on the other
    two sites."""
    grid, report, _ = run_hospitals(
        files,
        tmp_path,
        3,
        {0: {"allow-statistics": "grams,rounds"}},
        methods="auto",
        fusion_options="auto.candidates=kf-linear,fedavg",
    )
    assert grid.trained() == [100, 101, 102]
    assert not any(m.metadata.message_type == "query.statistics" for m in grid.pushed)
    fusion = report["fusions"]["auto"]
    assert fusion["status"] == "ok", fusion.get("error")
    chosen = fusion["details"]["auto"]
    assert chosen["criterion"].startswith("the sites'") and chosen["scored_by_sites"] == [1, 2]
    assert any("hospital-0" in p and REFUSAL in p for p in chosen["site_problems"])
    assert any("hospital-0" in p and REFUSAL in p for p in report["rejected"])
