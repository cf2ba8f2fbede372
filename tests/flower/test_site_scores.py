"""The sites of a Flower run score a model on their own labelled rows (``FlowerSites.score``,
Flower's federated evaluation, which ``auto`` ranks its candidates by): fedfuse's real ClientApp
handler answers as the model scores locally on the site's rows; a plain ClientApp with Flower's
stock ``@app.evaluate()`` handler answers unchanged; a site that fails, answers garbage or stays
silent is None and named."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedfuse.clients import client_app
from fedfuse.federation.scenario import Scenario
from fedfuse.fusion import LocalSites
from fedfuse.fusion.statistics.channels import SiteScore, SiteScoring
from fedfuse.models import build_model
from fedfuse.strategies import OneShotFusion
from fedfuse.strategies.statistics_rounds import FlowerSites
from tests.fakes import HeldReplies, SitesGrid
from tests.helpers import SMALL_NET_SHAPE, SmallNet, quick_site_settings

pytestmark = pytest.mark.usefixtures("task_identity", "one_thread")
SETTINGS = quick_site_settings()


def test_the_sites_score_a_model_as_it_scores_on_their_own_rows():
    scenario = Scenario(SETTINGS, 2)
    fused = build_model(scenario.model_spec(), seed=5).eval()
    nodes = {
        11: {"partition-id": 0, "num-partitions": 2},
        12: {"partition-id": 1, "num-partitions": 2},
    }
    grid = SitesGrid(nodes, SETTINGS.to_config())
    names = ["client 0 (node 11)", "client 1 (node 12)"]
    sites = FlowerSites(grid, [fused, fused], list(nodes), names, timeout=30)
    assert isinstance(sites, SiteScoring) and sites.can_score
    scores = sites.score(fused)
    assert not sites.problems
    data = [scenario.client_data(pid) for pid in (0, 1)]
    validation = [(d.inputs(), d.labels) for d in data]
    local = LocalSites([fused, fused], [x for x, _ in validation], validation=validation)
    expected = local.score(fused)
    for got, want in zip(scores, expected, strict=True):
        assert got is not None and got.examples == want.examples
        assert got.accuracy == pytest.approx(want.accuracy, abs=1e-12)
        assert got.loss == pytest.approx(want.loss, rel=1e-5)
    assert [s.examples for s in scores] == [len(d) for d in data]  # type: ignore[union-attr]
    # the message is Flower's stock evaluate message: arrays and a config with the round
    sent = [m for m in grid.pushed if m.metadata.message_type == "evaluate"]
    assert [m.metadata.dst_node_id for m in sent] == [11, 12]
    content = sent[0].content
    assert set(content.array_records) == {"arrays"} and "server-round" in content["config"]
    assert set(content["arrays"].to_torch_state_dict()) == set(fused.state_dict())


def _reply(msg: Message, **metrics) -> Message:
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)


#: each stand-in site's answer to the scoring message, by node (None: it never answers)
ANSWERS = {
    1: lambda msg: _reply(msg, eval_acc=0.5, eval_loss=1.25, **{"num-examples": 8}),
    2: lambda msg: _reply(msg, eval_acc=1.5, eval_loss=0.3, **{"num-examples": 8}),
    3: lambda msg: _reply(msg, accuracy=0.5, loss=0.3),
    4: lambda msg: _reply(msg, acc=0.5, loss=math.nan, **{"num-examples": 8}),
    5: lambda msg: _reply(msg, eval_acc=[0.5, 0.2], eval_loss=0.3, **{"num-examples": 8}),
    6: lambda msg: _reply(msg, eval_acc=0.5, eval_loss=0.3, **{"num-examples": 0}),
    7: lambda msg: _reply(msg, eval_loss=0.3, **{"num-examples": 8}),
    8: None,
    # fedfuse's ClientApp, through its routing, on a node that says not who it is
    10: lambda msg: client_app.app(msg, Context(1, 10, {}, RecordDict(), SETTINGS.to_config())),
}


class _AnsweringGrid(HeldReplies):
    """A Grid whose site on node ``n`` answers with ``answers[n](msg)``; an exception is an
    error reply, as Flower turns a ClientApp's exception into one."""

    def __init__(self, answers) -> None:
        super().__init__()
        self.answers = answers
        self.count = 0

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            self.count += 1
            mid = f"m{self.count}"
            msg.metadata.__dict__["_message_id"] = mid
            msg.content = copy.deepcopy(msg.content)
            answer = self.answers.get(msg.metadata.dst_node_id)
            if answer is not None:
                try:
                    self._outstanding[mid] = answer(msg)
                except Exception as error:
                    from flwr.app import Error

                    self._outstanding[mid] = Message(Error(0, f"Message: {error}"), reply_to=msg)
            ids.append(mid)
        return ids


def test_a_site_that_fails_answers_garbage_or_stays_silent_is_none_and_named():
    def crash(msg):
        raise RuntimeError("the site's disk is full")

    answers = {**ANSWERS, 9: crash}
    nodes = sorted(answers)
    fused = build_model(Scenario(SETTINGS, 2).model_spec(), seed=5)
    names = [f"site-{node}" for node in nodes]
    grid = _AnsweringGrid(answers)
    sites = FlowerSites(grid, [fused] * len(nodes), nodes, names, timeout=1.0)
    scores = dict(zip(nodes, sites.score(fused), strict=True))
    assert scores[1] == SiteScore(0.5, 1.25, 8)
    assert all(scores[node] is None for node in nodes if node != 1)
    problems = {int(p.split(":")[0].removeprefix("site-")): p for p in sites.problems}
    assert sorted(problems) == [node for node in nodes if node != 1]
    assert all(p.startswith(f"site-{n}: scoring round: ") for n, p in problems.items())
    assert "eval_acc=1.5 is not an accuracy in [0, 1]" in problems[2]
    assert "'num-examples'" in problems[3]
    assert "loss=nan is not a loss" in problems[4]
    assert "eval_acc is not a number" in problems[5]
    assert "num-examples must be >= 1, got 0" in problems[6]
    assert "none of the metrics ['eval_acc', 'accuracy', 'acc']" in problems[7]
    assert "no score before the reply timeout" in problems[8]
    assert "the client failed: the site's disk is full" in problems[9]
    assert "failed: ValueError" in problems[10] and "partition-id" in problems[10]
    # the next model goes to the site that scored only: no other is asked, or named, again
    sent = grid.count
    assert sites.score(fused)[nodes.index(1)] == SiteScore(0.5, 1.25, 8)
    assert grid.count == sent + 1 and len(sites.problems) == len(problems) and sites.can_score
    alone = FlowerSites(grid, [fused], [9], ["site-9"], timeout=1.0)
    assert alone.score(fused) == [None] and not alone.can_score


# --------------------------------------------------------------------------- a plain ClientApp
SHAPE = SMALL_NET_SHAPE
Net = SmallNet  # a user's own small CNN, as Flower's template writes one


def _loader(node: int) -> DataLoader:
    generator = torch.Generator().manual_seed(node)
    rows = 24 + node
    data = TensorDataset(torch.randn(rows, *SHAPE, generator=generator), torch.arange(rows) % 3)
    return DataLoader(data, batch_size=8)


def _test(net: nn.Module, loader: DataLoader) -> tuple[float, float]:
    """The template's ``test``: mean batch loss and accuracy."""
    criterion, correct, loss = nn.CrossEntropyLoss(), 0, 0.0
    with torch.no_grad():
        for images, labels in loader:
            outputs = net(images)
            loss += criterion(outputs, labels).item()
            correct += (torch.max(outputs.data, 1)[1] == labels).sum().item()
    return loss / len(loader), correct / len(loader.dataset)


#: a plain ClientApp: Flower's PyTorch template, its handlers as the template writes them
plain_app = ClientApp()


@plain_app.train()
def train(msg: Message, context: Context) -> Message:
    torch.manual_seed(context.node_id)
    model = Net()  # "trained": each site's own weights
    metrics = MetricRecord(
        {"train_loss": 1.0, "num-examples": len(_loader(context.node_id).dataset)}
    )
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)


@plain_app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    valloader = _loader(context.node_id)
    eval_loss, eval_acc = _test(model, valloader)
    metrics = {"eval_loss": eval_loss, "eval_acc": eval_acc, "num-examples": len(valloader.dataset)}
    return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)


def test_a_plain_app_with_the_stock_evaluate_handler_scores_the_fused_model(tmp_path):
    contexts = {node: Context(7, node, {"partition-id": node}, RecordDict(), {}) for node in (3, 4)}
    grid = _AnsweringGrid({n: lambda msg, n=n: plain_app(msg, contexts[n]) for n in contexts})
    grid.get_node_ids = lambda: sorted(contexts)
    strategy = OneShotFusion("fedavg", model_fn=Net, input_shape=SHAPE, store=tmp_path)
    strategy.start(grid, ArrayRecord(Net().state_dict()))
    fused = strategy.results["fedavg"].model.eval()  # the user's own class
    assert type(fused) is Net
    sites = strategy._statistics_channel(strategy.store.models())
    leveled = strategy.adapter.adapt(fused)  # as fusion methods hold it
    scores = sites.score(leveled)
    assert not sites.problems
    for node, score in zip(sorted(contexts), scores, strict=True):
        loss, accuracy = _test(fused, _loader(node))
        assert score == SiteScore(accuracy, pytest.approx(loss, rel=1e-6), 24 + node)
    assert sites.score(fused) == scores  # the user's class itself goes as it is
