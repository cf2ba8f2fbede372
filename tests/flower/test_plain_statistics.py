"""Statistics rounds in a plain ClientApp: ``fedfuse.clients.answer_statistics`` in a template
app's query handler lets ``OneShotFusion(model_fn=..., client_statistics=True)`` run kf-sites and
hf-sites, computing on each site's own data what the library computes in-process; a refusal or
a failure is answered by name, as fedfuse's own ClientApp answers it."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedfuse.clients import answer_statistics
from fedfuse.clients.records import (
    pack_statistics_request,
    unpack_statistics,
    unpack_statistics_request,
)
from fedfuse.experiments.user_models import GREY_28, torchvision_vit
from fedfuse.fusion import FusionInputs, LocalSites, make_fusion_method
from fedfuse.fusion.statistics.on_site import site_statistics
from fedfuse.fusion.statistics.rounds import StatisticsRequest
from fedfuse.models import ModelAdapter
from fedfuse.strategies import MethodsUnfit, OneShotFusion
from tests.fakes import HeldReplies
from tests.helpers import SMALL_NET_SHAPE, SmallNet

pytestmark = pytest.mark.usefixtures("task_identity", "one_thread")
SHAPE = SMALL_NET_SHAPE


class ResidualNet(nn.Module):
    """A user's CNN with BatchNorm and a residual add, as torchvision's ResNets are written."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(x + self.bn2(self.conv2(x)))
        return self.fc(x.mean((2, 3)))


class OtherNet(SmallNet):
    """Another class, whose weights have the same shapes."""


def _net(seed: int, net: Callable[[], nn.Module] = SmallNet) -> nn.Module:
    torch.manual_seed(seed)
    model = net()
    for norm in model.modules():  # running statistics as training leaves them, not 0 and 1
        if isinstance(norm, nn.BatchNorm2d):
            norm.running_mean.normal_()
            norm.running_var.uniform_(0.5, 2.0)
    return model.eval()


def _site_data(
    seed: int, n: int = 40, shape: tuple[int, ...] = SHAPE
) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=generator), torch.arange(n) % 3


def _context(node: int, **node_config) -> Context:
    return Context(7, node, {"partition-id": node % 10, **node_config}, RecordDict(), {})


class _PlainAppGrid(HeldReplies):
    """A Grid whose sites are a template ClientApp: they answer the train message with their
    net's weights and ``num-examples``, and statistics rounds with ``answer_statistics`` on
    their own data (a ``DataLoader``); each site's Context persists, as Flower's does."""

    def __init__(
        self,
        nets: dict[int, nn.Module],
        data: dict[int, tuple],
        net: Callable[[], nn.Module] = SmallNet,
        **node_config,
    ) -> None:
        self.nets, self.data, self.net = nets, data, net
        self.contexts = {node: _context(node, **node_config) for node in nets}
        super().__init__()
        self.statistics_replies: list[Message] = []
        self._count = 0

    def get_node_ids(self) -> list[int]:
        return sorted(self.nets)

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            mid = f"m{self._count}"
            self._count += 1
            msg.metadata.__dict__["_message_id"] = mid
            msg.content = copy.deepcopy(msg.content)  # as over a wire
            if msg.metadata.message_type == "query.statistics":
                loader = DataLoader(TensorDataset(*self.data[node]), batch_size=16, shuffle=True)
                reply = answer_statistics(msg, self.contexts[node], self.net, loader)
                self.statistics_replies.append(reply)
            else:
                metrics = MetricRecord({"num-examples": len(self.data[node][1])})
                content = RecordDict(
                    {"arrays": ArrayRecord(self.nets[node].state_dict()), "metrics": metrics}
                )
                reply = Message(content=content, reply_to=msg)
            self._outstanding[mid] = reply
            ids.append(mid)
        return ids


@pytest.mark.parametrize(
    ("method", "net", "shape"),
    [
        ("kf-sites", SmallNet, SHAPE),
        ("hf-sites", SmallNet, SHAPE),
        ("kf-sites", ResidualNet, SHAPE),
        ("kf-sites", torchvision_vit, GREY_28),  # torchvision's VisionTransformer
    ],
    ids=["kf-sites", "hf-sites", "kf-sites-residual-batchnorm", "kf-sites-torchvision-vit"],
)
def test_a_plain_app_answers_statistics_rounds_as_the_library_computes_them(
    tmp_path, method, net, shape
):
    nets = {3: _net(0, net), 8: _net(1, net)}
    data = {3: _site_data(0, shape=shape), 8: _site_data(1, shape=shape)}
    strategy = OneShotFusion(
        method, model_fn=net, input_shape=shape, client_statistics=True, store=tmp_path
    )
    grid = _PlainAppGrid(nets, data, net)
    result = strategy.start(grid, ArrayRecord(net().state_dict()))
    assert not strategy.failures and not strategy.problems
    assert grid.statistics_replies and all(
        "statistics" in r.content.array_records for r in grid.statistics_replies
    )
    fused = strategy.results[method].model
    assert type(fused) is type(net())
    expected = (
        make_fusion_method(method)
        .fuse(
            [nets[3], nets[8]],
            FusionInputs(sites=LocalSites([nets[3], nets[8]], [data[3][0], data[8][0]])),
        )
        .model
    )
    # the same function (an attention head's query and key rows may both flip sign)
    x = torch.cat([data[3][0], data[8][0]])
    with torch.no_grad():
        got, want = fused.eval()(x), expected.eval()(x)
    assert torch.allclose(got, want, atol=1e-4 * float(want.abs().max())), (got - want).abs().max()
    assert set(result.arrays.to_torch_state_dict()) == set(net().state_dict())


def test_without_client_statistics_the_refusal_says_what_to_add():
    with pytest.raises(MethodsUnfit, match="kf-sites: needs the sites themselves") as info:
        OneShotFusion("kf-sites", model_fn=SmallNet, input_shape=SHAPE)
    message = str(info.value)
    assert '@app.query("statistics")' in message and "answer_statistics" in message
    assert "client_statistics=True" in message
    with pytest.raises(ValueError, match="client_statistics is for a plain ClientApp"):
        OneShotFusion("kf-sites", client_statistics=True)


def _request(site: nn.Module, level: int = 0) -> Message:
    """The server's statistics request of ``level`` to a site whose model is ``site``."""
    adapter = ModelAdapter(SmallNet, SHAPE).register()
    fused = adapter.adapt(_net(5))
    request = StatisticsRequest(level, fused, None, "float64", 0)
    content = pack_statistics_request(request, adapter.adapt(site))
    return Message(content=content, dst_node_id=3, message_type="query.statistics")


def _no_upload(reply: Message) -> tuple[str, str, str]:
    record = reply.content.config_records["no-upload"]
    return str(record["kind"]), str(record["reason"]), str(record["site-name"])


def test_refusals_and_failures_are_answered_by_name_not_raised():
    x, y = _site_data(0)
    # the site's policy: one statistics round in this run, the second refused
    context = _context(3, **{"site-name": "clinic-a", "max-statistics-rounds": 1})
    assert "statistics" in answer_statistics(_request(_net(0)), context, SmallNet, (x, y)).content
    kind, reason, name = _no_upload(answer_statistics(_request(_net(0)), context, SmallNet, (x, y)))
    assert (kind, name) == ("refused", "clinic-a") and "max-statistics-rounds" in reason
    # a policy that never sends statistics rounds
    context = _context(3, **{"site-name": "clinic-b", "allow-statistics": "grams"})
    kind, reason, _ = _no_upload(answer_statistics(_request(_net(0)), context, SmallNet, (x, y)))
    assert kind == "refused" and "allow-statistics" in reason
    # another model class than the server's, data of another shape, a request without the
    # site's model: failures named by the site (its node when it has no name)
    context = _context(4)
    kind, reason, name = _no_upload(answer_statistics(_request(_net(0)), context, OtherNet, (x, y)))
    assert (kind, name) == ("failed", "node 4") and "OtherNet" in reason and "model_fn" in reason
    wrong = torch.randn(8, 1, 5, 5)
    kind, reason, _ = _no_upload(answer_statistics(_request(_net(0)), context, SmallNet, wrong))
    assert kind == "failed" and "node 4: its data has samples of shape (1, 5, 5)" in reason
    msg = _request(_net(0))
    del msg.content.array_records["arrays"]
    kind, reason, _ = _no_upload(answer_statistics(msg, context, SmallNet, (x, y)))
    assert kind == "failed" and "malformed statistics request" in reason


def test_the_reply_is_the_site_statistics_of_its_own_data():
    x, y = _site_data(0)
    site = _net(0)
    msg = _request(site, level=2)
    request, model = unpack_statistics_request(msg.content)
    expected = site_statistics(model, x, request, device="cpu")
    reply = answer_statistics(msg, _context(3), SmallNet, (x, y), device="cpu")
    statistics = unpack_statistics(reply.content, source="site")
    assert statistics.rows == len(x) == expected.rows and statistics.level == 2
    for name in ("gram", "cross", "target_gram", "translation"):
        assert torch.allclose(getattr(statistics, name), getattr(expected, name)), name
