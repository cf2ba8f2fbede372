"""``auto``'s need of the sites' scores (``"site_scores"``): every runner gives it the sites
(:func:`fedfuse.fusion.base.reads_sites`), the upload request asks no statistics rounds for it,
and a site's policy judges the scores on their own (``allow-statistics`` kind ``scores``)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from fedfuse.experiments import compare
from fedfuse.federation import site_fusion_inputs
from fedfuse.federation.contract import SiteRefusal
from fedfuse.federation.method_needs import upload_request_for
from fedfuse.federation.policy import POLICY_KEYS, STATISTICS_KINDS, SitePolicy
from fedfuse.federation.upload_inputs import fusion_inputs
from fedfuse.fusion import Auto, LocalSites, make_fusion_method
from fedfuse.fusion.base import INPUT_NEEDS, SITE_NEEDS, reads_sites

#: candidates none of which runs statistics rounds: only the scores reach the sites
NO_ROUNDS = "kf-linear,fedavg"


def test_the_sites_are_given_for_statistics_rounds_or_scores_and_rounds_asked_for_rounds_only():
    assert SITE_NEEDS.issubset(INPUT_NEEDS)
    scoring = Auto(candidates=NO_ROUNDS)
    assert "site_scores" in scoring.needs() and "sites" not in scoring.needs()
    assert reads_sites(scoring.needs()) and reads_sites({"sites"})
    assert not reads_sites(make_fusion_method("fedavg").needs())
    request = upload_request_for([scoring])
    assert request.rounds == "" and request.statistics() == frozenset()
    assert upload_request_for([Auto()]).rounds == "rounds"  # its default list has kf-sites
    assert upload_request_for([Auto()], secure=True).rounds == "secure-sums"
    # fusion_inputs keeps the sites for either need, and drops them for neither
    kept = fusion_inputs([], sites="the sites", needs=scoring.needs())
    assert kept.sites == "the sites"
    assert fusion_inputs([], sites="the sites", needs={"data"}).sites is None


def _site(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(30, 1, 4, 4, generator=generator), torch.arange(30) % 3


def test_site_fusion_inputs_give_auto_sites_that_score_and_auto_ranks_by_them():
    nets = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        nets.append(nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3)))
    sites = [_site(0), _site(1)]
    method = Auto(candidates=NO_ROUNDS, device="cpu")
    inputs = site_fusion_inputs(nets, sites, [method], data=sites[0][0], labels=sites[0][1])
    assert isinstance(inputs.sites, LocalSites) and inputs.sites.can_score
    assert [len(y) for _, y in inputs.sites.validation] == [30, 30]
    report = method.fuse(nets, inputs).details["auto"]
    assert report["criterion"].startswith("the sites'")
    assert report["scored_by_sites"] == [0, 1]
    # a method that reads neither gets no sites
    assert site_fusion_inputs(nets, sites, "fedavg").sites is None


def test_compare_library_runner_gives_auto_the_sites_scores(tmp_path):
    overrides = [
        "dataset=digits",
        "model.widths=[16]",
        "training.epochs=1",
        "scores.samples=32",
        "method=auto",
        f"method.candidates='{NO_ROUNDS}'",
        f"output_dir={tmp_path}",
    ]
    assert compare.main(overrides) == 0
    (row,) = [json.loads(p.read_text()) for p in (tmp_path / "default" / "rows").glob("*.json")]
    assert row["status"] == "ok", row.get("error")
    report = row["details"]["auto"]
    assert report["criterion"].startswith("the sites'"), report
    assert report["scored_by_sites"] == list(range(row["sites"]))


def test_scores_are_a_statistics_kind_allowed_by_default_and_refused_by_a_policy_without_it():
    assert "scores" in STATISTICS_KINDS and "'scores'" in POLICY_KEYS["allow-statistics"]
    SitePolicy().check_scores()
    SitePolicy.from_node_config({}).check_scores()
    rounds_only = SitePolicy.from_node_config({"allow-statistics": "rounds"})
    with pytest.raises(SiteRefusal, match="site policy: scores of models are not in allow-st"):
        rounds_only.check_scores()
    with pytest.raises(SiteRefusal, match="allow-statistics=none"):
        SitePolicy.from_node_config({"allow-statistics": "none"}).check_scores()
    # scoring does not count toward max-statistics-rounds, and is checked on its own
    capped = SitePolicy.from_node_config({"max-statistics-rounds": 0})
    capped.check_scores()
    with pytest.raises(SiteRefusal, match="max-statistics-rounds=0"):
        capped.check_round("rounds", answered=0)
    with pytest.raises(ValueError, match="use 'grams', .* 'scores' or 'none'"):
        SitePolicy.from_node_config({"allow-statistics": "score"})
