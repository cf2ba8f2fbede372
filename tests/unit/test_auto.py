"""``auto``: the candidate of the best held-out accuracy wins, scored on fusion rows alone; skips,
failures and the time budget are named; the split is seeded and stratified; plain modules come
back as their own class; the run asks the sites for what the candidates read."""

from __future__ import annotations

import copy
import time
from dataclasses import replace

import pytest
import torch
from torch import nn

import fedfuse.fusion.methods.selection.auto as auto_module
from fedfuse.federation.method_needs import upload_request_for
from fedfuse.fusion import FUSION_METHODS, FusionInputs, FusionMethod, make_fusion_method
from fedfuse.fusion.methods.regression.regmean import level_grams
from fedfuse.fusion.methods.selection.auto import Auto, _rows_of, stratified_split
from fedfuse.fusion.statistics.channels import LocalSites
from fedfuse.models import build_model, mlp_spec
from fedfuse.models.capture import accuracy_and_loss
from tests.helpers import randn

pytestmark = pytest.mark.usefixtures("one_thread")

SPEC = mlp_spec((1, 4, 4), 3, (8, 6))


def _teacher(x: torch.Tensor) -> torch.Tensor:
    return (x.flatten(1) @ randn(7, 16, 3)).argmax(1)


def _trained(seed: int, steps: int) -> nn.Module:
    model = build_model(SPEC, seed=seed)
    x = randn(100 + seed, 96, 1, 4, 4)
    for _ in range(steps):  # plain gradient steps (torch.optim's first step imports much)
        model.zero_grad()
        nn.functional.cross_entropy(model(x), _teacher(x)).backward()
        with torch.no_grad():
            for parameter in model.parameters():
                parameter -= 0.5 * parameter.grad
    return model.eval()


@pytest.fixture(scope="module")
def models():
    """Model 0 learnt the task, model 1 did not train."""
    return [_trained(0, 150), _trained(1, 0)]


@pytest.fixture(scope="module")
def inputs(models):
    data = randn(3, 60, 1, 4, 4)
    return FusionInputs(
        data=data,
        labels=_teacher(data),
        sample_counts=[40, 60],
        grams=[level_grams(m, randn(20 + k, 32, 1, 4, 4)) for k, m in enumerate(models)],
    )


class _Copy(FusionMethod):
    """A copy of model ``index``; records the fusion rows it was given."""

    requires = frozenset({"data"})
    index = 0
    seen: list[torch.Tensor] = []

    def _fuse(self, models, inputs, target):
        type(self).seen.append(inputs.data)
        return copy.deepcopy(models[self.index]), {"copied": self.index}


def _register(monkeypatch, name: str, **attributes) -> None:
    cls = type(f"_Test{len(FUSION_METHODS)}", (_Copy,), {"name": name, **attributes})
    monkeypatch.setitem(FUSION_METHODS, name, cls)


@pytest.fixture
def copies(monkeypatch):
    _Copy.seen = []
    _register(monkeypatch, "copy-trained", index=0)
    _register(monkeypatch, "copy-untrained", index=1)
    _register(monkeypatch, "copy-trained-again", index=0)


def test_the_best_held_out_accuracy_wins_whatever_its_place(copies, models, inputs):
    result = Auto(candidates="copy-untrained,copy-trained", device="cpu").fuse(models, inputs)
    report = result.details["auto"]
    scores = report["candidates"]
    assert scores["copy-trained"]["accuracy"] > scores["copy-untrained"]["accuracy"] + 0.2
    assert report["chosen"] == "copy-trained" and result.details["copied"] == 0
    assert "copy-trained had the highest accuracy" in report["why"]
    fused, trained = result.model.state_dict(), models[0].state_dict()
    assert all(torch.equal(fused[key], trained[key]) for key in trained)
    # a tie on accuracy and loss goes to the earlier candidate
    tied = Auto(candidates="copy-trained-again,copy-trained", device="cpu").fuse(models, inputs)
    assert tied.details["auto"]["chosen"] == "copy-trained-again"
    assert "comes first in the list" in tied.details["auto"]["why"]


def test_candidates_fit_on_part_of_the_fusion_set_and_are_scored_on_the_rest(
    copies, models, inputs, monkeypatch
):
    scored: list[torch.Tensor] = []
    score = auto_module.held_out_scores

    def recording(model, data, labels, **options):
        scored.append(data)
        return score(model, data, labels, **options)

    monkeypatch.setattr(auto_module, "held_out_scores", recording)
    result = Auto(candidates="copy-untrained,copy-trained", refit=False).fuse(models, inputs)
    fit, held = _Copy.seen[0], scored[0]
    assert len(fit) + len(held) == len(inputs.data) == 60 and 15 <= len(held) <= 21
    assert all(torch.equal(d, fit) for d in _Copy.seen) and all(
        torch.equal(d, held) for d in scored
    )
    rows = {tuple(r.flatten().tolist()) for r in inputs.data}
    fit_rows = {tuple(r.flatten().tolist()) for r in fit}
    held_rows = {tuple(r.flatten().tolist()) for r in held}
    assert fit_rows | held_rows == rows and not fit_rows & held_rows  # fusion rows only, apart
    assert result.details["auto"]["fit_rows"] == len(fit) and not result.details["auto"]["refit"]
    # with refit the winner fuses once more, on every fusion row
    _Copy.seen.clear()
    Auto(candidates="copy-untrained,copy-trained").fuse(models, inputs)
    assert [len(d) for d in _Copy.seen] == [len(fit), len(fit), 60]


def test_the_split_is_seeded_and_stratified():
    labels = torch.tensor([0] * 10 + [1] * 20 + [2] * 1 + [3] * 2)
    fit, held = stratified_split(labels, 0.3, seed=4)
    assert torch.equal(torch.sort(torch.cat([fit, held])).values, torch.arange(len(labels)))
    assert torch.bincount(labels[held], minlength=4).tolist() == [3, 6, 0, 1]
    again = stratified_split(labels, 0.3, seed=4)
    assert torch.equal(again[1], held)
    assert not torch.equal(stratified_split(labels, 0.3, seed=5)[1], held)


def test_a_seeded_auto_fusion_is_repeatable(models, inputs):
    method = Auto(candidates="hf-linear,regmean,fedavg", device="cpu")
    first, second = method.fuse(models, inputs), method.fuse(models, inputs)
    for key, value in first.model.state_dict().items():
        assert torch.equal(value, second.model.state_dict()[key]), key
    strip = {"seconds"}
    for result in (first, second):
        for entry in result.details["auto"]["candidates"].values():
            for key in strip:
                entry.pop(key, None)
    assert first.details["auto"] == second.details["auto"]


def test_skips_and_failures_are_named(copies, models, inputs, monkeypatch):
    def broken(self, models, inputs, target):
        raise ValueError("no convergence")

    monkeypatch.setattr(FUSION_METHODS["copy-untrained"], "_fuse", broken)
    no_grams = FusionInputs(data=inputs.data, labels=inputs.labels, sample_counts=[40, 60])
    method = Auto(candidates="regmean,copy-untrained,fedavg,copy-trained", device="cpu")
    report = method.fuse(models, no_grams).details["auto"]
    assert report["candidates"]["regmean"] == {
        "skipped": "needs the sites' Gram matrices, not given"
    }
    assert report["candidates"]["copy-untrained"] == {"failed": "ValueError: no convergence"}
    assert report["chosen"] == "copy-trained"
    nothing = Auto(candidates="regmean,kf-linear")
    named = r"these inputs: regmean: needs the sites' Gram.*kf-linear: needs a fusion set"
    with pytest.raises(ValueError, match=rf"auto: none of its candidates can fuse {named}"):
        nothing.fuse(models, FusionInputs(sample_counts=[40, 60]))


def test_methods_that_lose_unshown_classes_are_left_out_when_a_class_is_unshown(models, inputs):
    shown = FusionInputs(
        data=inputs.data, labels=inputs.labels, class_counts=[[5, 5, 5], [5, 5, 0]]
    )
    method = Auto(candidates="kf-trust,vanilla", device="cpu")
    assert "accuracy" in method.fuse(models, shown).details["auto"]["candidates"]["kf-trust"]
    first = inputs.labels != 0
    unshown = FusionInputs(
        data=inputs.data[first], labels=inputs.labels[first], class_counts=[[5, 5, 5], [5, 5, 0]]
    )
    report = method.fuse(models, unshown).details["auto"]
    assert report["candidates"]["kf-trust"]["skipped"].startswith(
        "the fusion set shows no row of class(es) [0], which sites hold"
    )
    assert report["chosen"] == "vanilla" and report["unshown_classes"] == [0]
    # scored by the sites too: they would see the loss, at the cost of a fusion
    by_sites = method.fuse(models, replace(unshown, sites=_sites(models))).details["auto"]
    assert by_sites["candidates"]["kf-trust"] == {
        "skipped": "the fusion set shows no row of class(es) [0], which sites hold: it loses them"
    }
    assert by_sites["chosen"] == "vanilla" and by_sites["scored_by_sites"] == [0, 1]


def test_the_time_budget_skips_and_names_the_later_candidates(copies, models, inputs, monkeypatch):
    def slow(self, models, inputs, target):
        time.sleep(0.3)
        return copy.deepcopy(models[1]), {}

    monkeypatch.setattr(FUSION_METHODS["copy-untrained"], "_fuse", slow)
    method = Auto(candidates="copy-untrained,copy-trained,fedavg", time_budget=0.1)
    report = method.fuse(models, inputs).details["auto"]
    assert report["chosen"] == "copy-untrained"  # the first always runs
    for name in ("copy-trained", "fedavg"):
        assert report["candidates"][name]["skipped"].startswith("time budget of 0.1 s spent")


def test_without_labels_the_first_candidate_that_can_run_is_the_fallback(models, inputs):
    unlabelled = FusionInputs(data=inputs.data, sample_counts=[40, 60])
    result = Auto(candidates="regmean,fedavg,hf-linear", device="cpu").fuse(models, unlabelled)
    report = result.details["auto"]
    assert report["chosen"] == "fedavg" and report["criterion"] == "fallback: list order"
    assert report["why"].startswith("no fusion-set labels to score the candidates on")
    assert report["candidates"]["regmean"]["skipped"].startswith("needs the sites' Gram")
    assert report["candidates"]["hf-linear"] == {"skipped": "not tried: no fusion-set labels"}
    expected = make_fusion_method("fedavg").fuse(models, unlabelled).model
    for key, value in expected.state_dict().items():
        assert torch.equal(value, result.model.state_dict()[key])


class PlainNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))

    def forward(self, x):
        return self.body(x)


def test_plain_modules_come_back_as_their_own_class(inputs):
    nets = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        nets.append(PlainNet().eval())
    plain = FusionInputs(data=inputs.data, labels=inputs.labels, sample_counts=[40, 60])
    result = Auto(candidates="hf-linear,fedavg", device="cpu").fuse(nets, plain)
    assert type(result.model) is PlainNet
    assert set(result.details["auto"]["candidates"]) == {"hf-linear", "fedavg"}
    assert result.model(inputs.data[:5]).shape == (5, 3)


def test_needs_are_the_candidates_and_the_run_asks_the_sites_for_them():
    method = Auto(candidates="kf-linear,regmean,fedavg")
    assert method.needs() >= {"data", "labels", "grams", "sample_counts", "scores"}
    assert method.requirements() == frozenset()
    assert upload_request_for([method]).grams
    assert not upload_request_for([Auto(candidates="kf-linear,fedavg")]).grams
    method.check_run(3, SPEC, available={"sample_counts"})  # fedavg can run
    named = r"this run: kf-linear: needs a fusion set.*regmean: needs the sites' Gram"
    with pytest.raises(ValueError, match=rf"auto: none of its candidates can fuse {named}"):
        Auto(candidates="kf-linear,regmean").check_run(3, SPEC, available={"sample_counts"})


def test_bad_options_are_named():
    with pytest.raises(ValueError, match=r"auto: candidates \['nope', 'auto'\] are not fusion"):
        Auto(candidates="kf-linear,nope,auto")
    with pytest.raises(ValueError, match=r"'auto': option holdout=0.95 is out of range"):
        Auto(holdout=0.95)
    with pytest.raises(ValueError, match=r"kf-linear"):
        Auto(candidates="kf-linear,kf-linear")


def _sites(models, *, wrong: bool = False) -> LocalSites:
    """Two in-process sites whose validation rows follow the teacher (or not, ``wrong``)."""
    rows = [randn(30 + k, 50, 1, 4, 4) for k in range(2)]
    labelled = [(x, (_teacher(x) + int(wrong)) % 3) for x in rows]
    return LocalSites(models, rows, validation=labelled, device="cpu")


def test_the_sites_scores_decide_where_they_can_score(copies, models, inputs):
    """The fusion set's labels here point the wrong way: scored on it ``auto`` keeps the
    untrained copy, scored by the sites the trained one; the pooled score is the sites'."""
    misleading = replace(inputs, labels=(inputs.labels + 1) % 3, sites=_sites(models))
    method = Auto(candidates="copy-untrained,copy-trained", device="cpu")
    report = method.fuse(models, misleading).details["auto"]
    assert report["chosen"] == "copy-trained" and report["scored_by_sites"] == [0, 1]
    assert "on the 100 rows of all 2 sites" in report["why"]
    assert report["criterion"].startswith("the sites' accuracy")
    trained = report["candidates"]["copy-trained"]
    sites = misleading.sites.validation
    expected = [accuracy_and_loss(models[0], x, y)[0] for x, y in sites]
    assert [s["accuracy"] for s in trained["site_scores"]] == pytest.approx(expected)
    assert trained["accuracy"] == pytest.approx((expected[0] * 50 + expected[1] * 50) / 100)
    by_fusion_set = Auto(candidates="copy-untrained,copy-trained", score_on="fusion-set")
    assert by_fusion_set.fuse(models, misleading).details["auto"]["chosen"] == "copy-untrained"
    assert "site_scores" in method.needs() and "site_scores" not in by_fusion_set.needs()
    assert "labels" not in Auto(candidates="fedavg", score_on="sites").needs()


class _SilentOnce:
    """Sites of which site 1 does not score the second model it is asked about."""

    can_score = True

    def __init__(self, sites: LocalSites) -> None:
        self.sites, self.asked, self.problems = sites, 0, []

    def __len__(self) -> int:
        return len(self.sites)

    def score(self, model):
        self.asked += 1
        scores = self.sites.score(model)
        if self.asked == 2:
            scores[1] = None
            self.problems.append("site 1: no answer")
        return scores


def test_candidates_are_compared_on_the_sites_that_scored_them_all(copies, models, inputs):
    sites = _SilentOnce(_sites(models))
    method = Auto(candidates="copy-untrained,copy-trained", device="cpu")
    report = method.fuse(models, replace(inputs, sites=sites)).details["auto"]
    assert report["scored_by_sites"] == [0] and report["site_problems"] == ["site 1: no answer"]
    only_site_0 = sites.sites.validation[0]
    expected = accuracy_and_loss(models[0], *only_site_0)[0]
    assert report["candidates"]["copy-trained"]["accuracy"] == pytest.approx(expected)
    with pytest.raises(ValueError, match="score_on='sites', but the inputs' sites cannot score"):
        Auto(candidates="fedavg", score_on="sites").fuse(models, inputs)
    with pytest.raises(ValueError, match="score_on must be one of"):
        Auto(score_on="test-set")


class _CannotLoadUntrained(_SilentOnce):
    """Sites that cannot load the untrained copy (as a plain app, a model of another width)."""

    def score(self, model):
        if torch.equal(model.state_dict()["levels.0.1.weight"], self.untrained):
            raise ValueError("Net cannot load a model of widths (9, 6)")
        return self.sites.score(model)


def test_a_candidate_the_sites_cannot_score_is_named_and_the_others_compete(copies, models, inputs):
    sites = _CannotLoadUntrained(_sites(models))
    sites.untrained = models[1].state_dict()["levels.0.1.weight"]
    method = Auto(candidates="copy-untrained,copy-trained", device="cpu")
    report = method.fuse(models, replace(inputs, sites=sites)).details["auto"]
    assert report["candidates"]["copy-untrained"] == {
        "failed": "the sites cannot score it: Net cannot load a model of widths (9, 6)"
    }
    assert report["chosen"] == "copy-trained" and report["scored_by_sites"] == [0, 1]


def test_past_max_costly_sites_the_hungarian_and_trust_candidates_are_skipped_and_named(
    models, inputs
):
    three = [models[0], models[1], copy.deepcopy(models[0])]
    counts = replace(inputs, sample_counts=[40, 60, 40], grams=None)
    listed = "hf-linear,kf-trust,kf-linear,fedavg"
    method = Auto(candidates=listed, max_costly_sites=2, score_on="fusion-set", device="cpu")
    report = method.fuse(three, counts).details["auto"]["candidates"]
    assert report["hf-linear"] == {
        "skipped": "matches the neurons of 3 models one to one, past max_costly_sites=2 "
        "(its cost grows with the sites)"
    }
    assert report["kf-trust"] == {
        "skipped": "fits every level to each of the 3 models' readings on every fusion-set "
        "row, past max_costly_sites=2 (its cost grows with the sites)"
    }
    assert "accuracy" in report["kf-linear"] and "accuracy" in report["fedavg"]
    unlimited = Auto(candidates=listed, max_costly_sites=0, score_on="fusion-set", device="cpu")
    tried = unlimited.fuse(three, counts).details["auto"]["candidates"]
    assert "accuracy" in tried["hf-linear"] and "skipped" not in tried["kf-trust"]


def test_the_reason_names_the_sites_that_scored_briefly():
    assert _rows_of(600, [0, 1], 2) == "the 600 rows of all 2 sites"
    assert _rows_of(600, [0, 2], 3) == "the 600 rows of sites [0, 2]"
    assert _rows_of(600, list(range(12)), 20) == "the 600 rows of sites 12 of the 20"
