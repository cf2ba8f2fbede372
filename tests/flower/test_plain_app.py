"""OneShotFusion behind any Flower app: a template ClientApp's replies, the optional extras, the
checks before training, and the user's own model back."""

from __future__ import annotations

import copy

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedfuse.clients import add_fusion_extras, requested_extras
from fedfuse.experiments.plain_models import TemplateNet
from fedfuse.fusion import FusionInputs, make_fusion_method
from fedfuse.fusion.methods.regression.regmean import level_grams
from fedfuse.models import ModelAdapter
from fedfuse.strategies import MethodsUnfit, OneShotFusion
from tests.fakes import NodesGrid, reply_from

pytestmark = pytest.mark.usefixtures("task_identity", "one_thread")
NODES = [3, 8]


def _net(seed: int) -> TemplateNet:
    torch.manual_seed(seed)
    return TemplateNet()


def _data(seed: int, n: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 28, 28, generator=generator), torch.arange(n) % 10


def _template_content(net: nn.Module, num_examples: int) -> RecordDict:
    """What Flower's PyTorch template's ClientApp replies with."""
    metrics = MetricRecord({"train_loss": 0.25, "num-examples": num_examples})
    return RecordDict({"arrays": ArrayRecord(net.state_dict()), "metrics": metrics})


def _replies_with_extras(nets, site_data, messages: list[Message]) -> list[Message]:
    """Each template site's reply with the extras its train message asks for."""
    replies = []
    for net, (x, y), msg in zip(nets, site_data, messages, strict=True):
        content = _template_content(net, len(y))
        add_fusion_extras(content, msg, net, DataLoader(TensorDataset(x, y), batch_size=16))
        replies.append(reply_from(content, msg.metadata.dst_node_id))
    return replies


def _train_messages(strategy: OneShotFusion) -> list[Message]:
    initial = ArrayRecord(TemplateNet().state_dict())
    return list(strategy.configure_train(1, initial, ConfigRecord({"lr": 0.01}), NodesGrid(NODES)))


def _assert_serves(strategy: OneShotFusion, method: str, expected: nn.Module) -> None:
    """The strategy serves ``method``'s fusion as the user's own net, with ``expected``'s
    weights."""
    served = strategy.results[method].model
    assert isinstance(served, TemplateNet)
    expected_state = expected.state_dict()
    for name, tensor in served.state_dict().items():
        assert torch.allclose(tensor, expected_state[name], atol=1e-5), name


def test_template_replies_are_fused_into_the_users_own_model(tmp_path):
    nets, counts = [_net(0), _net(1)], [100, 300]
    strategy = OneShotFusion(
        "fedavg,kf-linear", model_fn=TemplateNet, fusion_set=_data(9), store=tmp_path
    )
    messages = _train_messages(strategy)
    config = messages[0].content["config"]
    assert config["lr"] == 0.01 and "fusion-extras" not in config  # the app's own config
    assert requested_extras(messages[0]) == []
    assert set(messages[0].content["arrays"].to_torch_state_dict()) == set(nets[0].state_dict())
    replies = [
        reply_from(_template_content(n, c), node)
        for n, c, node in zip(nets, counts, NODES, strict=True)
    ]
    arrays, metrics = strategy.aggregate_train(1, replies[::-1])
    fused = arrays.to_torch_state_dict()
    assert set(fused) == set(TemplateNet().state_dict())
    expected = (nets[0].conv1.weight * 100 + nets[1].conv1.weight * 300) / 400
    assert torch.allclose(fused["conv1.weight"], expected, atol=1e-6)
    assert isinstance(strategy.results["kf-linear"].model, TemplateNet)
    assert metrics["num-examples"] == 400 and strategy.problems == []
    assert [e.partition_id for e in strategy.store.entries] == [0, 1]  # by node order
    assert strategy.store.directory.parent == tmp_path  # a fresh folder per run


def test_client_extras_travel_and_feed_the_methods(tmp_path):
    nets = [_net(0), _net(1)]
    site_data = [_data(1), _data(2)]
    fusion = _data(9)
    strategy = OneShotFusion(
        "regmean,kf-linear", model_fn=TemplateNet, fusion_set=fusion, client_extras=True
    )
    messages = _train_messages(strategy)
    assert requested_extras(messages[0]) == ["scores", "class-counts", "grams"]
    strategy.aggregate_train(1, _replies_with_extras(nets, site_data, messages))
    assert strategy.problems == [] and strategy.failures == {}
    adapter = ModelAdapter(TemplateNet, (1, 28, 28))
    leveled = [adapter.adapt(net) for net in nets]
    grams = [level_grams(model, x) for model, (x, _) in zip(leveled, site_data, strict=True)]
    direct = make_fusion_method("regmean").fuse(
        leveled, FusionInputs(grams=grams, sample_counts=[48, 48])
    )
    _assert_serves(strategy, "regmean", adapter.export(direct.model))
    assert all(entry.scores is not None for entry in strategy.store.entries)


def test_one_upload_site_statistics_fuse_a_users_own_net_without_a_fusion_set(tmp_path):
    """kf-grams over Flower: the sites' Grams and scores come with the one upload, and the
    server fuses the user's TemplateNet from them alone (no fusion set, no round)."""
    nets = [_net(0), _net(1)]
    site_data = [_data(1), _data(2)]
    strategy = OneShotFusion(
        "kf-grams", model_fn=TemplateNet, input_shape=(1, 28, 28), client_extras=True
    )
    messages = _train_messages(strategy)
    assert "grams" in requested_extras(messages[0])
    strategy.aggregate_train(1, _replies_with_extras(nets, site_data, messages))
    assert strategy.problems == [] and strategy.failures == {}
    adapter = ModelAdapter(TemplateNet, (1, 28, 28))
    leveled = [adapter.adapt(net) for net in nets]
    grams = [level_grams(model, x) for model, (x, _) in zip(leveled, site_data, strict=True)]
    scores = [entry.scores for entry in strategy.store.entries]
    direct = make_fusion_method("kf-grams").fuse(leveled, FusionInputs(grams=grams, scores=scores))
    _assert_serves(strategy, "kf-grams", adapter.export(direct.model))


def test_a_users_own_net_sends_the_fisher_kind_the_run_reads_and_is_fused_from_it(tmp_path):
    """FedFisher(K-FAC) over Flower with a plain ClientApp: the train message asks for the K-FAC
    factors only, add_fusion_extras computes them on the site's data, and the server's merge
    equals the library's on the same factors."""
    base = _net(0)
    nets = [base, copy.deepcopy(base)]
    with torch.no_grad():
        nets[1].fc1.weight.add_(0.05)
    site_data = [_data(1), _data(2)]
    strategy = OneShotFusion(
        "fedfisher-kfac", model_fn=TemplateNet, input_shape=(1, 28, 28), client_extras=True
    )
    messages = _train_messages(strategy)
    assert requested_extras(messages[0]) == ["fisher-kfac"]
    strategy.aggregate_train(1, _replies_with_extras(nets, site_data, messages))
    assert strategy.problems == [] and strategy.failures == {}
    adapter = ModelAdapter(TemplateNet, (1, 28, 28))
    leveled = [adapter.adapt(net) for net in nets]
    uploaded = strategy.store.fisher()
    assert uploaded is not None and len(uploaded) == 2
    assert all(set(f) and all(k.startswith("kfac.") for k in f) for f in uploaded)
    direct = make_fusion_method("fedfisher-kfac").fuse(
        leveled, FusionInputs(fisher=list(uploaded), sample_counts=[48, 48])
    )
    _assert_serves(strategy, "fedfisher-kfac", adapter.export(direct.model))


def test_a_missing_extra_or_foreign_weights_name_the_node(tmp_path):
    strategy = OneShotFusion(
        "regmean", model_fn=TemplateNet, fusion_set=_data(9), client_extras=True
    )
    _train_messages(strategy)
    renamed = {k.replace("conv1", "first"): v for k, v in _net(0).state_dict().items()}
    foreign = RecordDict(
        {"arrays": ArrayRecord(renamed), "metrics": MetricRecord({"num-examples": 10})}
    )
    no_count = RecordDict({"arrays": ArrayRecord(_net(1).state_dict())})
    strategy.accept(reply_from(foreign, 3))
    strategy.accept(reply_from(no_count, 8))
    strategy.accept(reply_from(_template_content(_net(1), 10), 8))
    assert strategy.problems[0].startswith("node 3: its 'arrays' weights are not a TemplateNet's")
    assert "missing ['conv1.bias', 'conv1.weight']" in strategy.problems[0]
    assert "node 8: reply has no 'num-examples' metric" in strategy.problems[1]
    assert "node 8: sent no grams, which the server asked for" in strategy.problems[2]
    assert "add_fusion_extras" in strategy.problems[2] and len(strategy.store) == 0


class _BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.norm = nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 26 * 26, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.conv(x)).flatten(1))


class _GroupNormNet(_BatchNormNet):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(2, 4)


def test_what_a_plain_app_cannot_give_is_refused_when_the_strategy_is_built():
    fusion = _data(9)
    with pytest.raises(MethodsUnfit, match="regmean: needs the sites' Gram matrices") as info:
        OneShotFusion("regmean", model_fn=TemplateNet, fusion_set=fusion)
    assert "add_fusion_extras" in str(info.value) and "client_extras=True" in str(info.value)
    with pytest.raises(MethodsUnfit, match="kf-sites: needs the sites themselves"):
        OneShotFusion("kf-sites", model_fn=TemplateNet, fusion_set=fusion, client_extras=True)
    with pytest.raises(MethodsUnfit, match="kf-linear: needs a fusion set"):
        OneShotFusion("kf-linear", model_fn=TemplateNet, input_shape=(1, 28, 28))
    with pytest.raises(ValueError, match="needs the model's input shape"):
        OneShotFusion("fedavg", model_fn=TemplateNet)
    # a BatchNorm model is averaged by parameter name and fitted with the conv its BatchNorm
    # reads; a GroupNorm one is averaged, and a Linear fit refuses it, naming the level
    OneShotFusion("fedavg,kf-linear", model_fn=_BatchNormNet, fusion_set=fusion)
    OneShotFusion("fedavg", model_fn=_GroupNormNet, fusion_set=fusion)
    with pytest.raises(MethodsUnfit, match="kf-linear: cannot fuse .* level 1:norm .*GroupNorm"):
        OneShotFusion("kf-linear", model_fn=_GroupNormNet, fusion_set=fusion)
    with pytest.raises(ValueError, match="client_extras is for a plain ClientApp"):
        OneShotFusion("fedavg", client_extras=True)


class _AnsweringGrid(NodesGrid):
    """A grid whose sites answer each train message at once with a template reply."""

    def __init__(self, nets: dict[int, nn.Module]) -> None:
        super().__init__(sorted(nets))
        self.nets = nets
        self.replies: list[Message] = []

    def push_messages(self, messages):
        for msg in messages:
            reply = reply_from(_template_content(self.nets[msg.metadata.dst_node_id], 50), 0)
            reply.metadata.__dict__["_src_node_id"] = msg.metadata.dst_node_id
            reply.metadata.__dict__["_reply_to_message_id"] = f"m{msg.metadata.dst_node_id}"
            self.replies.append(reply)
        return [f"m{msg.metadata.dst_node_id}" for msg in messages]

    def pull_messages(self, message_ids):
        ready, self.replies = self.replies, []
        return ready


def test_start_evaluates_every_fused_model_with_the_apps_evaluate_fn():
    x, y = _data(9)
    seen: list[set[str]] = []

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        net = TemplateNet()
        net.load_state_dict(arrays.to_torch_state_dict())  # the app's own names load as they are
        seen.append(set(arrays))
        accuracy = (net(x).argmax(1) == y).float().mean().item()
        return MetricRecord({"accuracy": accuracy})

    strategy = OneShotFusion("fedavg,otfusion", model_fn=TemplateNet, fusion_set=(x, y))
    grid = _AnsweringGrid({3: _net(0), 8: _net(1)})
    result = strategy.start(grid, ArrayRecord(TemplateNet().state_dict()), evaluate_fn=evaluate_fn)
    assert sorted(strategy.evaluations) == ["fedavg", "otfusion"] and len(seen) == 2
    assert result.evaluate_metrics_serverapp[1] == strategy.evaluations["fedavg"]
    assert "otfusion" in strategy.format_results()
    with pytest.raises(ValueError, match="exactly one round, not 3"):
        strategy.start(grid, ArrayRecord(), num_rounds=3)
