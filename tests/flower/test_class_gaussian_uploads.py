"""Class Gaussians over Flower, with fedfuse's real ClientApp handlers and ServerApp: the sites
upload them once, with their models, when the run completes its fusion set from them and a
method reads one; nothing otherwise; a site whose policy keeps them refuses before training; a
broken upload is named with its site and left out."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord

from fedfuse.clients.records import GAUSSIANS_KEY, SEND_GAUSSIANS_KEY
from fedfuse.federation.uploads import UploadStore
from tests.fakes import hospital_files, run_hospitals

pytestmark = pytest.mark.usefixtures("task_identity")

#: per class of digits: a count, a variance, a mean and 3 loadings of 64 pixels
SENT = 10 * 8 + 10 * 4 + 10 * 64 * 4 + 10 * 64 * 3 * 4


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The server's fusion and test files and three digits sites."""
    return hospital_files(tmp_path_factory.mktemp("gaussians"), 3)


def _asked(grid) -> set[int]:
    train = [m for m in grid.pushed if m.metadata.message_type == "train"]
    return {int(m.content.config_records["config"][SEND_GAUSSIANS_KEY]) for m in train}


def test_sites_upload_their_class_gaussians_and_the_fusion_set_is_completed(files, tmp_path):
    grid, report, _ = run_hospitals(
        files,
        tmp_path,
        3,
        methods="kf-trust,fedavg",
        fusion_gaussian_samples=20,
        fusion_gaussian_rank=3,
    )
    assert _asked(grid) == {3}
    assert report["fusions"]["kf-trust"]["status"] == "ok", report["fusions"]["kf-trust"]
    assert report["phases"]["gaussian_fusion_set"] >= 0
    assert [c["upload_parts"]["class_gaussians"] for c in report["clients"]] == [SENT] * 3
    stored = UploadStore.open(tmp_path / "outputs" / "latest" / "clients").class_gaussians()
    assert [int(g.counts.sum()) for g in stored] == [c["num_examples"] for c in report["clients"]]


def test_no_class_gaussians_are_sent_when_no_method_reads_a_fusion_set(files, tmp_path):
    grid, report, _ = run_hospitals(
        files, tmp_path, 3, methods="fedavg", init="shared", fusion_gaussian_samples=20
    )
    assert _asked(grid) == {0}
    assert all(c["upload_parts"]["class_gaussians"] == 0 for c in report["clients"])


def test_a_site_whose_policy_keeps_its_class_gaussians_refuses_before_training(files, tmp_path):
    policies = {1: {"allow-statistics": "grams,rounds"}}
    grid, report, _ = run_hospitals(
        files, tmp_path, 3, policies, methods="kf-linear", fusion_gaussian_samples=20
    )
    sites = {site["site"]: site for site in report["sites"]}
    assert sites["hospital-1"]["status"] == "refused"
    assert "need ['class-gaussians'], not in allow-statistics" in sites["hospital-1"]["reason"]
    assert 101 not in grid.trained()


def test_a_site_with_too_few_samples_of_a_class_refuses_to_send_its_mean(files, tmp_path, trained):
    policies = {0: {"min-statistic-rows": 60}}  # 479 samples, about 48 a class
    _, report, _ = run_hospitals(
        files, tmp_path, 3, policies, methods="kf-linear", fusion_gaussian_samples=20
    )
    sites = {site["site"]: site for site in report["sites"]}
    assert sites["hospital-0"]["status"] == "refused"
    assert "the Gaussian of class" in sites["hospital-0"]["reason"]
    assert "hospital-0" not in trained  # refused before it trained anything


def test_a_site_sending_broken_class_gaussians_is_named_and_left_out(files, tmp_path):
    from fedfuse.clients.client_app import train_and_upload

    def poisoned(msg, context):
        reply = train_and_upload(msg, context)
        if context.node_config.get("site-name") == "hospital-2":
            state = reply.content.array_records[GAUSSIANS_KEY].to_torch_state_dict()
            state["factors"] = torch.full_like(state["factors"], float("inf"))
            reply.content[GAUSSIANS_KEY] = ArrayRecord(state)
        return reply

    _, report, _ = run_hospitals(
        files, tmp_path, 3, methods="kf-linear", fusion_gaussian_samples=20, handler=poisoned
    )
    rejected = " ".join(report["rejected"])
    assert "hospital-2" in rejected and "'factors' has NaN or Inf" in rejected
    assert report["fusions"]["kf-linear"]["status"] == "ok"
    assert len(report["clients"]) == 2


def test_a_train_message_asking_for_a_malformed_rank_is_refused():
    from flwr.app import ConfigRecord

    from fedfuse.clients.records import pack_train_request, unpack_train_request
    from fedfuse.federation.upload_request import UploadRequest

    request = UploadRequest(gaussian_rank=3)
    content = pack_train_request(ArrayRecord(), ConfigRecord(), request=request)
    assert unpack_train_request(content).upload.gaussian_rank == 3
    content.config_records["config"][SEND_GAUSSIANS_KEY] = -1
    with pytest.raises(ValueError, match="class Gaussians of rank -1"):
        unpack_train_request(content)


def test_class_gaussians_are_refused_under_secure_aggregation_and_without_a_plain_apps_extras():
    from fedfuse.fusion.statistics.class_gaussians import GaussianFusionSet
    from fedfuse.strategies import OneShotFusion
    from fedfuse.strategies.secure_sums import SecureSettings

    with pytest.raises(ValueError, match="not under secure aggregation"):
        OneShotFusion("fedavg", secure=SecureSettings(0.5, 60.0), gaussians=GaussianFusionSet())
    with pytest.raises(ValueError, match="add_fusion_extras call sends them; pass client_extras"):
        OneShotFusion(
            "fedavg",
            model_fn=lambda: torch.nn.Linear(4, 2),
            input_shape=(4,),
            gaussians=GaussianFusionSet(),
        )


def test_a_plain_app_sends_class_gaussians_from_add_fusion_extras_and_they_complete_the_fusion_set(
    tmp_path,
):
    from flwr.app import ConfigRecord, MetricRecord, RecordDict
    from torch import nn

    from fedfuse.clients import add_fusion_extras
    from fedfuse.fusion.statistics.class_gaussians import GaussianFusionSet, fit_class_gaussians
    from fedfuse.strategies import OneShotFusion
    from tests.fakes import NodesGrid, reply_from

    torch.manual_seed(0)
    nets = [nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)) for _ in range(2)]
    template = nets[0]
    site_data = [(torch.randn(30, 4) + k, torch.arange(30) % 3) for k in range(2)]
    fusion_set = (torch.randn(12, 4), torch.arange(12) % 3)
    completion = GaussianFusionSet(samples=9, rank=2)

    def plain_strategy(methods: str, store) -> OneShotFusion:
        return OneShotFusion(
            methods,
            model_fn=lambda: type(template)(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)),
            fusion_set=fusion_set,
            client_extras=True,
            gaussians=completion,
            store=store,
        )

    strategy = plain_strategy("kf-linear,fedavg", tmp_path)
    nodes = [3, 8]
    initial = ArrayRecord(template.state_dict())
    messages = list(strategy.configure_train(1, initial, ConfigRecord(), NodesGrid(nodes)))
    assert {int(m.content["config"][SEND_GAUSSIANS_KEY]) for m in messages} == {2}
    replies = []
    for net, (x, y), msg, node in zip(nets, site_data, messages, nodes, strict=True):
        metrics = MetricRecord({"num-examples": len(y)})
        content = RecordDict({"arrays": ArrayRecord(net.state_dict()), "metrics": metrics})
        add_fusion_extras(content, msg, net, (x, y))
        assert GAUSSIANS_KEY in content.array_records
        replies.append(reply_from(content, node))
    strategy.aggregate_train(1, replies)
    assert strategy.problems == [] and strategy.failures == {}
    sent = strategy.store.class_gaussians()
    expected = fit_class_gaussians(*site_data[1], 3, rank=2)
    assert torch.allclose(sent[1].means, expected.means.to(sent[1].means.dtype))
    assert completion.seconds is not None  # the fusion set was completed from them
    # a site that sends none, when asked, is named and left out
    strategy = plain_strategy("kf-linear", tmp_path / "again")
    messages = list(strategy.configure_train(1, initial, ConfigRecord(), NodesGrid(nodes)))
    metrics = MetricRecord({"num-examples": 30})
    bare = RecordDict({"arrays": ArrayRecord(nets[0].state_dict()), "metrics": metrics})
    assert strategy.accept(reply_from(bare, nodes[0])) is None
    assert "sent no class-gaussians" in strategy.problems[0]
