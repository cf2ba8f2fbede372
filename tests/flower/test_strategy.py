"""The server's handling of replies: validation, silent clients, one-shot fusion."""

import dataclasses
import math

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MessageType, RecordDict
from flwr.common.constant import ErrorCode

from fedfuse.clients.records import SCORES_KEY, WEIGHTS_KEY, pack_upload
from fedfuse.federation.site import SiteIdentity, train_site
from fedfuse.federation.uploads import UploadStore
from fedfuse.fusion import make_fusion_method
from fedfuse.io.validation import ContributionError
from fedfuse.strategies.messaging import stream_replies, wait_for_nodes
from fedfuse.strategies.one_shot import FusionAborted, OneShotFusion
from fedfuse.strategies.replies import decode_reply
from tests.fakes import NodesGrid, reply_from
from tests.helpers import quick_site_settings, run_upload_request

SETTINGS = quick_site_settings()


@pytest.fixture(scope="module")
def uploads():
    request = run_upload_request(SETTINGS)
    return [train_site(SETTINGS, SiteIdentity(pid, 2), request) for pid in range(2)]


pytestmark = pytest.mark.usefixtures("task_identity")


def test_valid_reply_round_trips(uploads):
    upload = uploads[1]
    decoded = decode_reply(
        reply_from(pack_upload(upload), 8), upload.model.spec, require_scores=True
    )
    assert decoded.partition_id == 1 and decoded.num_partitions == 2
    assert decoded.class_counts == upload.class_counts
    for a, b in zip(decoded.model.parameters(), upload.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert all(torch.equal(decoded.scores[k], upload.scores[k]) for k in upload.scores)
    assert decoded.ray_node == "" and "ray_node" not in decoded.facts()


def test_the_ray_node_a_simulated_site_ran_on_reaches_the_servers_facts(uploads):
    upload = dataclasses.replace(uploads[0], ray_node="a4fd5c13")
    decoded = decode_reply(reply_from(pack_upload(upload), 3), None, require_scores=False)
    assert decoded.facts()["ray_node"] == "a4fd5c13"


def test_nan_weights_are_named_with_client_and_tensor(uploads):
    content = pack_upload(uploads[1])
    state = content.array_records[WEIGHTS_KEY].to_torch_state_dict()
    state["levels.2.weight"][0, 0] = math.nan
    content[WEIGHTS_KEY] = ArrayRecord(state)
    with pytest.raises(ContributionError, match=r"client 1 \(node 8\): tensor 'levels.2.weight'"):
        decode_reply(reply_from(content, 8), uploads[1].model.spec, require_scores=True)


def test_missing_scores_wrong_architecture_and_client_errors(uploads):
    content = pack_upload(uploads[0])
    del content[SCORES_KEY]
    with pytest.raises(ContributionError, match=r"client 0 \(node 3\): sent no importance scores"):
        decode_reply(reply_from(content, 3), uploads[0].model.spec, require_scores=True)
    assert decode_reply(reply_from(content, 3), None, require_scores=False).scores == {}

    other = uploads[0].model.spec.with_widths([32])
    with pytest.raises(ContributionError, match="the server expects"):
        decode_reply(reply_from(pack_upload(uploads[0]), 3), other, require_scores=True)

    incoming = Message(content=RecordDict(), dst_node_id=5, message_type=MessageType.TRAIN)
    failed = Message(Error(code=0, reason="CUDA out of memory"), reply_to=incoming)
    with pytest.raises(ContributionError, match="node 5: the client failed: CUDA out of memory"):
        decode_reply(failed, None, require_scores=True)


def _strategy(directory, min_nodes=2, methods=("fedavg",)):
    return OneShotFusion(
        [make_fusion_method(name) for name in methods],
        store=UploadStore(directory),
        min_nodes=min_nodes,
        node_wait_timeout=0.2,
        fusion_set=None,
    )


def test_one_shot_fusion_fuses_valid_uploads(uploads, tmp_path):
    strategy = _strategy(tmp_path)
    strategy._sent = [3, 8]
    arrays, metrics = strategy.aggregate_train(
        1, [reply_from(pack_upload(uploads[1]), 8), reply_from(pack_upload(uploads[0]), 3)]
    )
    assert [e.partition_id for e in strategy.store.entries] == [0, 1]
    fused = arrays.to_torch_state_dict()
    total = sum(u.num_examples for u in uploads)
    expected = sum(
        u.model.state_dict()["levels.0.1.bias"] * u.num_examples / total for u in uploads
    )
    assert torch.allclose(fused["levels.0.1.bias"], expected, atol=1e-6)
    assert metrics["num-uploads"] == 2 and strategy.problems == []


def test_silent_and_bad_clients_abort_with_every_problem_named(uploads, tmp_path):
    strategy = _strategy(tmp_path)
    strategy._sent = [3, 8, 9]
    bad = pack_upload(uploads[1])
    state = bad.array_records[WEIGHTS_KEY].to_torch_state_dict()
    state["levels.2.bias"][:] = math.inf
    bad[WEIGHTS_KEY] = ArrayRecord(state)
    with pytest.raises(FusionAborted) as info:
        strategy.aggregate_train(1, [reply_from(pack_upload(uploads[0]), 3), reply_from(bad, 8)])
    message = str(info.value)
    assert "1 usable upload(s), 2 needed" in message
    assert "node 9: no reply before the reply timeout" in message
    assert "client 1 (node 8): tensor 'levels.2.bias' has 10 NaN/Inf values" in message


def test_waiting_for_nodes_times_out_with_counts(tmp_path):
    assert wait_for_nodes(NodesGrid([5, 2]), 2, timeout=0.1) == [2, 5]
    with pytest.raises(TimeoutError, match="only 1 of the 2 required SuperNodes"):
        wait_for_nodes(NodesGrid([5]), 2, timeout=0.1)
    messages = _strategy(tmp_path).configure_train(
        1, ArrayRecord(), ConfigRecord(), NodesGrid([4, 1])
    )
    assert sorted(m.metadata.dst_node_id for m in messages) == [1, 4]


class _WindowGrid:
    """A grid whose sites answer at once, except ``silent`` ones; records messages in flight."""

    def __init__(self, silent=()):
        self.silent = set(silent)
        self.outstanding: dict[str, Message] = {}
        self.most_in_flight = 0

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            mid = f"m{msg.metadata.dst_node_id}"
            self.outstanding[mid] = msg
            ids.append(mid)
        self.most_in_flight = max(self.most_in_flight, len(self.outstanding))
        return ids

    def pull_messages(self, message_ids):
        replies = []
        for mid in list(message_ids):
            msg = self.outstanding.get(mid)
            if msg is not None and msg.metadata.dst_node_id not in self.silent:
                del self.outstanding[mid]
                reply = reply_from(RecordDict(), msg.metadata.dst_node_id)
                reply.metadata.__dict__["_reply_to_message_id"] = mid
                replies.append(reply)
        return replies


def _drain(generator):
    yielded = []
    while True:
        try:
            yielded.append(next(generator))
        except StopIteration as done:
            return yielded, done.value


def test_stream_replies_keeps_a_window_and_names_the_silent_and_the_never_sent():
    messages = [
        Message(content=RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN)
        for node in range(1, 21)
    ]
    grid = _WindowGrid()
    replies, silent = _drain(stream_replies(grid, messages, 10, max_in_flight=4, poll_interval=0))
    assert len(replies) == 20 and silent == [] and grid.most_in_flight == 4

    # two sites never answer: they hold two of the three slots until the timeout
    grid = _WindowGrid(silent={2, 3})
    replies, silent = _drain(
        stream_replies(grid, messages, 0.3, max_in_flight=3, poll_interval=0.01)
    )
    assert len(replies) == 18 and silent == [2, 3]

    grid = _WindowGrid(silent={1, 2, 3})  # every slot blocked: the rest were never sent
    replies, silent = _drain(
        stream_replies(grid, messages, 0.2, max_in_flight=3, poll_interval=0.01)
    )
    assert replies == [] and silent == list(range(1, 21))


def test_the_strategy_completes_its_fusion_set_by_inversion(tmp_path):
    from fedfuse.fusion.inversion import InvertedFusionSet

    settings = quick_site_settings(model="resnet", model_options="width_multiplier=0.0625")
    request = run_upload_request(settings)
    resnets = [train_site(settings, SiteIdentity(pid, 2), request) for pid in range(2)]
    real = torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 3])
    inversion = InvertedFusionSet(samples=3, steps=2, device="cpu")
    method, seen = make_fusion_method("kf-linear"), []
    fuse = method.fuse
    method.fuse = lambda models, inputs, **kw: seen.append(inputs) or fuse(models, inputs, **kw)
    strategy = OneShotFusion(
        [method],
        store=UploadStore(tmp_path),
        min_nodes=2,
        node_wait_timeout=0.2,
        fusion_set=real,
        inversion=inversion,
    )
    strategy._sent = [3, 8]
    strategy.aggregate_train(
        1, [reply_from(pack_upload(resnets[0]), 3), reply_from(pack_upload(resnets[1]), 8)]
    )
    assert strategy.problems == [] and "kf-linear" in strategy.results
    (inputs,) = seen  # the 4 real rows first, then 3 inverted ones per site, for its classes
    assert inputs.data.shape == (4 + 2 * 3, 1, 8, 8) and torch.equal(inputs.data[:4], real[0])
    held = [set(torch.nonzero(torch.tensor(c)).flatten().tolist()) for c in inputs.class_counts]
    assert set(inputs.labels[4:7].tolist()) <= held[0]
    assert set(inputs.labels[7:].tolist()) <= held[1]


class _LostWorkerGrid(_WindowGrid):
    """Like :class:`_WindowGrid`, but the first ``losses[node]`` answers of a node are Flower's
    error reply for a lost Ray worker (the ClientApp never ran), or ``crash`` for an error of
    the ClientApp itself."""

    def __init__(self, losses, crash=()):
        super().__init__()
        self.losses, self.crash, self.pushed = dict(losses), set(crash), []

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            self.pushed.append(msg.metadata.dst_node_id)
            mid = f"m{len(self.pushed)}"
            self.outstanding[mid] = msg
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids):
        replies = []
        for mid in list(message_ids):
            msg = self.outstanding.pop(mid, None)
            if msg is None:
                continue
            node = msg.metadata.dst_node_id
            if self.losses.get(node, 0) > 0 or node in self.crash:
                code, reason = (
                    (ErrorCode.CLIENT_APP_RAISED_EXCEPTION, "ValueError: site data is broken")
                    if node in self.crash
                    else (
                        ErrorCode.UNKNOWN,
                        "<class 'ray.exceptions.ActorUnavailableError'>:<'The actor is "
                        "temporarily unavailable: RpcError: Connection refused'>",
                    )
                )
                self.losses[node] = self.losses.get(node, 0) - 1
                reply = Message(Error(code=code, reason=reason), reply_to=msg)
            else:
                reply = reply_from(RecordDict(), node)
            reply.metadata.__dict__["_reply_to_message_id"] = mid
            replies.append(reply)
        return replies


def test_a_message_whose_ray_worker_was_lost_is_sent_again_a_bounded_number_of_times():
    messages = [
        Message(content=RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN)
        for node in (1, 2, 3, 4)
    ]
    # node 2 lost its worker once, node 3 on every try; node 4's ClientApp itself failed
    grid = _LostWorkerGrid({2: 1, 3: 99}, crash={4})
    replies, silent = _drain(stream_replies(grid, messages, 10, max_in_flight=2, poll_interval=0))
    by_node = {r.metadata.src_node_id: r for r in replies}
    assert silent == [] and sorted(by_node) == [1, 2, 3, 4]
    assert not by_node[2].has_error()  # answered on its second try
    assert by_node[3].has_error() and "ActorUnavailableError" in by_node[3].error.reason
    assert by_node[4].has_error()  # an error of the site's own app is not sent again
    assert sorted(grid.pushed) == [1, 2, 2, 3, 3, 3, 4]  # node 3: the first try and 2 more
    # without retries (SecAgg+'s stages), the first error is the answer
    grid = _LostWorkerGrid({2: 1})
    replies, _ = _drain(stream_replies(grid, messages, 10, poll_interval=0, retries=0))
    assert [r.metadata.src_node_id for r in replies if r.has_error()] == [2]


def test_a_lone_message_whose_worker_was_lost_goes_twice_and_the_live_answer_counts():
    """With nothing else out, Flower's pool would hand the message straight back to the dead
    actor: two copies go, the one on the dead actor fails, the other answers."""
    message = Message(content=RecordDict(), dst_node_id=7, message_type=MessageType.TRAIN)
    grid = _LostWorkerGrid({7: 2})  # the first try and one of the two copies hit the dead actor
    replies, silent = _drain(stream_replies(grid, [message], 10, poll_interval=0))
    assert silent == [] and grid.pushed == [7, 7, 7]
    assert len(replies) == 1 and not replies[0].has_error()


class _OfflineGrid(_WindowGrid):
    """Like :class:`_WindowGrid`, but the SuperLink answers for the ``offline`` nodes (their
    SuperNode died): Flower's own error reply, from the SuperLink's node."""

    def __init__(self, offline):
        super().__init__()
        self.offline = set(offline)

    def pull_messages(self, message_ids):
        from flwr.server.superlink.linkstate.utils import (
            create_message_error_unavailable_res_message,
        )

        replies = []
        for mid in list(message_ids):
            msg = self.outstanding.get(mid)
            if msg is not None and msg.metadata.dst_node_id in self.offline:
                del self.outstanding[mid]
                msg.metadata.__dict__["_message_id"] = mid
                replies.append(create_message_error_unavailable_res_message(msg.metadata, ""))
        return replies + super().pull_messages(list(self.outstanding))


def test_the_superlinks_answer_for_a_dead_supernode_is_that_nodes_answer():
    messages = [
        Message(content=RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN)
        for node in (11, 12)
    ]
    replies, silent = _drain(stream_replies(_OfflineGrid({12}), messages, 10, poll_interval=0))
    by_node = {r.metadata.src_node_id: r for r in replies}
    assert silent == [] and sorted(by_node) == [11, 12]  # not the SuperLink's node 1
    assert by_node[12].error.code == ErrorCode.NODE_UNAVAILABLE
    assert by_node[12].metadata.reply_to_message_id == "m12"
    with pytest.raises(ContributionError, match="^hospital-2 .*: its SuperNode went offline: "):
        decode_reply(by_node[12], None, require_scores=True, known="hospital-2 (client 2)")
