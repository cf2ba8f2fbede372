"""Stand-ins for the parts of Flower that tests of our own logic touch (nothing else)."""

from __future__ import annotations

import copy

from flwr.app import Message, MessageType, RecordDict


class NodesGrid:
    """Only the part of a Flower ``Grid`` that waiting for nodes uses: the connected node ids."""

    def __init__(self, nodes):
        self.nodes = nodes

    def get_node_ids(self):
        return list(self.nodes)


def reply_from(content: RecordDict, node: int) -> Message:
    """A site's reply as the Grid hands it to the server: ``content`` answering a train message
    sent to ``node``."""
    incoming = Message(content=RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN)
    return Message(content=content, reply_to=incoming)


class HeldReplies:
    """What the fake Grids share: each reply held under its message id until the server pulls
    it; ``received`` lists every reply the server was handed, in order."""

    def __init__(self) -> None:
        self._outstanding: dict[str, Message] = {}
        self.received: list[Message] = []

    def push_messages(self, messages):
        raise NotImplementedError

    def send_and_receive(self, messages, *, timeout=None):
        """Flower's Grid.send_and_receive: push, then pull every reply (SecAgg+ uses it)."""
        return self.pull_messages(self.push_messages(list(messages)))

    def pull_messages(self, message_ids):
        replies = []
        for mid in message_ids:
            reply = self._outstanding.pop(mid, None)
            if reply is not None:
                reply.metadata.__dict__["_reply_to_message_id"] = mid
                replies.append(reply)
                self.received.append(reply)
        return replies


class SitesGrid(HeldReplies):
    """A Grid whose sites are fedfuse's real ClientApp handlers, called in this process.

    ``sites`` maps node ids to node configs; each pushed message is answered by the ClientApp's
    handler of its type (``train_and_upload``, ``check_contract``, ``statistics_round``,
    ``score_model``) with that node's config and ``run_config`` (``handler`` replaces the train
    handler).
    ``pushed`` records every message the server sent, so a test can tell that a check came
    before any site was asked to train.
    """

    def __init__(self, sites, run_config, run_id=7, handler=None):
        from flwr.app import Context

        self.sites = sites
        self.contexts = {
            node: Context(run_id, node, dict(config), RecordDict(), dict(run_config))
            for node, config in sites.items()
        }
        self.run = type("Run", (), {"run_id": run_id})()
        super().__init__()
        self.pushed: list[Message] = []
        self.handler = handler

    def get_node_ids(self):
        return list(self.sites)

    def trained(self) -> list[int]:
        """The nodes sent a train message."""
        return [m.metadata.dst_node_id for m in self.pushed if m.metadata.message_type == "train"]

    def push_messages(self, messages):
        from flwr.app import Error

        from fedfuse.clients.client_app import (
            check_contract,
            score_model,
            statistics_round,
            train_and_upload,
        )
        from fedfuse.clients.secure import secure_sums_mod

        ids = []
        for msg in messages:
            mid = f"m{len(self.pushed)}"
            msg.metadata.__dict__["_message_id"] = mid
            self.pushed.append(msg)
            if msg.metadata.message_type == "query.contract":
                handler = check_contract
            elif msg.metadata.message_type == "query.statistics":
                handler = statistics_round
            elif msg.metadata.message_type == "evaluate":
                handler = score_model
            else:
                handler = self.handler or train_and_upload
            context = self.contexts[msg.metadata.dst_node_id]
            msg.content = copy.deepcopy(msg.content)  # each site gets its own, as over a wire
            try:  # the ClientApp's mod first, as Flower calls it
                reply = secure_sums_mod(msg, context, handler)
            except Exception as error:  # Flower turns an exception into an error reply
                reply = Message(
                    Error(code=0, reason=f"{type(error).__name__}: {error}"), reply_to=msg
                )
            self._outstanding[mid] = reply
            ids.append(mid)
        return ids


def hospital_files(root, count, test_samples=200):
    """The server's fusion file (60 digits training images), its test file (``test_samples``
    digits test images) and ``count`` digits sites of an IID split, written under ``root``:
    the paths by ``"fusion"``, ``"test"`` and site index (what :func:`run_hospitals` reads)."""
    from fedfuse.data import load_dataset, save_npz_dataset
    from fedfuse.federation.scenario import Scenario
    from tests.helpers import quick_site_settings

    train = load_dataset("digits", "train")
    test = load_dataset("digits", "test").subset(range(test_samples))
    paths = {
        "fusion": save_npz_dataset(root / "fusion.npz", train.subset(range(60))),
        "test": save_npz_dataset(root / "test.npz", test),
    }
    scenario = Scenario(quick_site_settings(partitioner="iid"), count)
    for pid in range(count):
        paths[pid] = save_npz_dataset(root / f"site-{pid}.npz", scenario.client_data(pid))
    return paths


def run_hospitals(files, tmp_path, count, policies=None, handler=None, **changes):
    """Run fedfuse's real ServerApp over ``count`` in-process sites (:class:`SitesGrid`) named
    ``hospital-<i>`` on the site files ``files[i]``, with the server's ``files["fusion"]`` and
    ``files["test"]``; ``policies[i]`` adds site i's policy keys, ``handler`` replaces the
    sites' train handler, ``changes`` set run settings.
    Returns the grid, the run's ``results.json`` and the run folder."""
    import json

    from flwr.app import Context

    from fedfuse.strategies import server_app
    from tests.helpers import deployment_settings

    settings = deployment_settings(files, tmp_path, **changes)
    sites = {
        100 + i: {
            "partition-id": i,
            "site-name": f"hospital-{i}",
            "data-path": str(files[i]),
            **(policies or {}).get(i, {}),
        }
        for i in range(count)
    }
    run_config = settings.to_config()
    grid = SitesGrid(sites, run_config, handler=handler)
    server_app.main(grid, Context(7, 0, {}, RecordDict(), run_config))
    run = tmp_path / "outputs" / "latest"
    return grid, json.loads((run / "results.json").read_text()), run
