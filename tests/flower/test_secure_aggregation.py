"""Secure aggregation (Flower's SecAgg+) of the rounds summed over sites, with fedfuse's real
ServerApp, ClientApp handlers and client mod: the server receives and stores sums only, a
site that drops out mid-protocol is named and the round completes, and the fused models equal
those of the same sums in the clear.

The sites are the real handlers on real site files, called in-process by a stand-in Grid
(:class:`tests.fakes.SitesGrid`); Flower's own ``SecAggPlusWorkflow`` drives the four stages
through it. A real ``flwr run`` with a dropout is in ``tests/e2e/test_e2e_simulation.py``.
"""

from __future__ import annotations

import pytest

from fedfuse.clients.records import GRAMS_KEY, STATISTICS_KEY
from fedfuse.clients.secure import FAULT_VARIABLE
from fedfuse.federation import site
from fedfuse.io.checkpoint import load_checkpoint
from tests.fakes import hospital_files, run_hospitals

pytestmark = pytest.mark.usefixtures("task_identity")
METHODS = "kf-sites,regmean"
SUMS = "kf-sites.statistics=sums regmean.grams=sums"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The server's fusion and test files and four digits sites."""
    return hospital_files(tmp_path_factory.mktemp("secure"), 4, test_samples=300)


def _run(files, tmp_path, policies=None, **changes):
    return run_hospitals(files, tmp_path, 4, policies, methods=METHODS, **changes)


def _fused_state(report, method):
    return load_checkpoint(report["fusions"][method]["checkpoint"]).model.state_dict()


def test_a_secure_run_hands_the_server_sums_only_and_fuses_as_in_the_clear(
    files, tmp_path, monkeypatch
):
    computed = []
    original = site.site_sources
    monkeypatch.setattr(
        site, "site_sources", lambda *a, **k: computed.append(1) or original(*a, **k)
    )
    grid, report, run = _run(
        files, tmp_path / "secure", fusion_options=SUMS, secure_aggregation=True
    )
    assert report["status"] == "ok", report
    assert all(report["fusions"][m]["status"] == "ok" for m in ("kf-sites", "regmean"))
    # what the server received: the uploads (weights and scores, no Grams), then SecAgg+'s
    # stages, whose replies carry masked integers in a config record and no arrays at all
    details = report["fusions"]["kf-sites"]["details"]
    levels = [level for level in details["levels"] if "sites" in level]
    secure = [r for r in grid.received if "secaggplus_configs" in r.content.config_records]
    # sites x SecAgg+ stages x 2 sums (norms, terms) per round of kf-sites and regmean's one
    assert len(secure) == 4 * 4 * 2 * (len(details["rounds"]) + 1)
    for reply in grid.received:
        assert STATISTICS_KEY not in reply.content.array_records
        assert GRAMS_KEY not in reply.content.array_records
    for reply in secure:
        assert all(len(record) == 0 for record in reply.content.array_records.values())
    # what it stored: the uploads without Grams, and no statistics anywhere in the run's files
    stored = {p.name for p in run.rglob("*") if p.is_file()}
    assert not any("gram" in name or "statistic" in name for name in stored), stored
    # each site computed each sum's numbers once, for its norms and its terms
    assert len(computed) == 4 * (len(details["rounds"]) + 1)
    # every round's sum holds the 4 sites
    assert [level["sites"] for level in levels] == [[0, 1, 2, 3]] * len(levels)

    _, plain, _ = _run(files, tmp_path / "plain", fusion_options="kf-sites.statistics=sums")
    for method in ("kf-sites", "regmean"):
        secure_state, plain_state = _fused_state(report, method), _fused_state(plain, method)
        for name, value in plain_state.items():
            difference = float((secure_state[name] - value).abs().max())
            assert difference <= 1e-4 * float(value.abs().max()) + 1e-7, (method, name)
        assert report["accuracy"]["fused"][method]["accuracy"] == pytest.approx(
            plain["accuracy"]["fused"][method]["accuracy"], abs=0.004
        )


def test_a_site_dropping_out_mid_protocol_is_named_and_the_sums_go_on(files, tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_VARIABLE, "2:unmask")  # after sending its masked terms
    _, report, _ = _run(files, tmp_path, fusion_options=SUMS, secure_aggregation=True)
    assert report["fusions"]["kf-sites"]["status"] == "ok", report
    assert report["fusions"]["regmean"]["status"] == "ok", report
    # its terms arrived before it dropped, so they count: SecAgg+ rebuilt its masks
    levels = [lv for lv in report["fusions"]["kf-sites"]["details"]["levels"] if "sites" in lv]
    assert [level["sites"] for level in levels] == [[0, 1, 2, 3]] * len(levels)
    dropped = [p for p in report["rejected"] if "dropped out of the secure" in p]
    assert dropped and all("hospital-2" in p and "stage unmask" in p for p in dropped), dropped

    monkeypatch.setenv(FAULT_VARIABLE, "2:collect_masked_vectors")  # before sending them
    _, report, _ = _run(files, tmp_path / "early", fusion_options=SUMS, secure_aggregation=True)
    # the sums hold 3 of the 4 sites: a model, but not of every site, and it says which
    assert report["fusions"]["kf-sites"]["status"] == "partial", report
    assert report["fusions"]["kf-sites"]["missing_sites"] == [2]
    levels = [lv for lv in report["fusions"]["kf-sites"]["details"]["levels"] if "sites" in lv]
    assert [level["sites"] for level in levels] == [[0, 1, 3]] * len(levels)
    assert any("dropped out of the secure" in p for p in report["rejected"]), report["rejected"]


def test_a_secure_run_refuses_a_method_that_reads_each_site_before_any_site_trains(files, tmp_path):
    with pytest.raises(Exception, match="kf-sites-sums"):
        _run(files, tmp_path, secure_aggregation=True)


def test_a_site_that_sends_statistics_only_as_secure_sums_refuses_a_run_in_the_clear(
    files, tmp_path
):
    policy = {3: {"allow-statistics": "secure-sums"}}
    grid, report, _ = _run(files, tmp_path / "clear", policy, fusion_options=SUMS.split()[0])
    sites = {site["site"]: site for site in report["sites"]}
    assert sites["hospital-3"]["status"] == "refused"
    assert (
        "need ['grams', 'rounds'], not in allow-statistics=secure-sums"
        in sites["hospital-3"]["reason"]
    )
    assert 103 not in grid.trained()

    _, report, _ = _run(
        files, tmp_path / "secure", policy, fusion_options=SUMS, secure_aggregation=True
    )
    assert report["status"] == "ok", report
    levels = [lv for lv in report["fusions"]["kf-sites"]["details"]["levels"] if "sites" in lv]
    assert all(level["sites"] == [0, 1, 2, 3] for level in levels)


def test_differentially_private_secure_sums_noise_each_sites_numbers_once(files, tmp_path, caplog):
    options = f"{SUMS} kf-sites.dp_epsilon=8 regmean.dp_epsilon=8"
    _, report, _ = _run(files, tmp_path, fusion_options=options, secure_aggregation=True)
    assert report["status"] == "ok", report
    for method in ("kf-sites", "regmean"):
        privacy = report["fusions"][method]["details"]["privacy"]
        assert privacy["epsilon"] <= 8.0001 and privacy["accountant"] == "Opacus RDP"
    assert "noised anew" not in caplog.text  # the terms step read the norms step's numbers
