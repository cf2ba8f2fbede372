"""Talking to the sites through Flower's Grid: waiting for nodes, and streaming their replies.

Every round of the server (train, statistics, fine-tuning) sends its messages and reads the
replies through :func:`replies_by_site`, so flow control, timeouts and silent sites are
handled in one place.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Generator, Sequence

from flwr.app import Message
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

log = logging.getLogger(__name__)


def wait_for_nodes(grid: Grid, minimum: int, timeout: float) -> list[int]:
    """Node ids once at least ``minimum`` SuperNodes are connected; TimeoutError otherwise."""
    deadline = time.monotonic() + timeout
    while len(nodes := list(grid.get_node_ids())) < minimum:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"only {len(nodes)} of the {minimum} required SuperNodes connected within "
                f"{timeout:.0f} s (raise node-wait-timeout, or start more SuperNodes)"
            )
        log.info("waiting for SuperNodes: %d of %d connected", len(nodes), minimum)
        time.sleep(1.0)
    return sorted(nodes)


#: what Ray says when the worker that ran a site's ClientApp is gone (its node died or was
#: cut off), as Flower's simulation engine passes it on in an error reply's reason
LOST_WORKER = re.compile(
    r"ray\.exceptions\.|ActorUnavailableError|ActorDiedError|RayActorError|WorkerCrashedError"
    r"|NodeDiedError|Connection refused"
)
#: how often one message is sent again after its worker was lost
LOST_WORKER_RETRIES = 2


def lost_worker(reply: Message) -> bool:
    """Whether ``reply`` is an error of the simulation's infrastructure (a Ray worker or node
    lost), not of the ClientApp: the site did nothing wrong, and the message can be sent again
    (Ray runs it on a worker that is still up)."""
    if not reply.has_error():
        return False
    error = reply.error
    return error.code != ErrorCode.CLIENT_APP_RAISED_EXCEPTION and bool(
        LOST_WORKER.search(str(error.reason))
    )


def stream_replies(
    grid: Grid,
    messages: Sequence[Message],
    timeout: float,
    *,
    max_in_flight: int = 0,
    poll_interval: float = 0.5,
    retries: int = LOST_WORKER_RETRIES,
) -> Generator[Message, None, list[int]]:
    """Push ``messages`` and yield each reply as soon as it is available, until all replied or
    ``timeout`` seconds passed; the generator returns the destination nodes that never replied.

    With ``max_in_flight > 0`` at most that many messages are out at once, the next one pushed
    as a reply comes back. Flower's simulation engine scans every undelivered message for every
    node ten times a second, so a thousand messages at once keep a core busy that the sites
    need; a deployment sends to every site at once (0).

    A reply that says the Ray worker running the site was lost (:func:`lost_worker`) is not
    yielded: the message is sent again, up to ``retries`` times per message, and only the last
    such error is yielded. It is held until another site answers: Flower's actor pool hands
    the next message to the actor that returned last, which is the dead one right after its
    failure, and a live one once another site answered. When nothing else is out, two copies
    go at once (one reaches the dead actor and fails, the other a live one), and the first
    answer that is not a lost worker counts.
    """
    queue = list(messages)[::-1]
    pending: dict[str, Message] = {}
    unsent: list[int] = []
    resent: dict[int, int] = {}  # node -> times its message was sent again
    held: list[Message] = []  # to send again once a live worker is back in Flower's pool

    def push(count: int) -> None:
        batch = [queue.pop() for _ in range(min(count, len(queue)))]
        if batch:
            for mid, msg in zip(grid.push_messages(batch), batch, strict=True):
                if mid:
                    pending[mid] = msg
                else:
                    unsent.append(msg.metadata.dst_node_id)

    def copies_out(node: int) -> list[str]:
        return [mid for mid, msg in pending.items() if msg.metadata.dst_node_id == node]

    push(max_in_flight if max_in_flight > 0 else len(queue))
    deadline = time.monotonic() + timeout
    while (pending or queue or held) and time.monotonic() < deadline:
        # one request for every pending reply (the SuperLink returns those that arrived), each
        # handled before the next is looked at
        replies = list(grid.pull_messages(list(pending)))[::-1] if pending else []
        while replies:
            reply = replies.pop()  # dropped here once handled: one model in memory at a time
            sent = pending.pop(reply.metadata.reply_to_message_id, None)
            if sent is None:
                continue
            node = sent.metadata.dst_node_id
            reply = _from_destination(reply, sent)
            lost = lost_worker(reply)
            if lost and copies_out(node):
                continue  # its other copy may still reach a live worker
            if lost and resent.get(node, 0) < retries:
                resent[node] = resent.get(node, 0) + 1
                log.warning(
                    "node %s: its worker was lost (%s); sending its message again (%d of %d)",
                    node,
                    str(reply.error.reason)[:200],
                    resent[node],
                    retries,
                )
                held.append(sent)
                continue
            for mid in copies_out(node):  # the first answer counts; a later one is dropped
                del pending[mid]
            if not lost:
                queue.extend(_again(msg) for msg in held)  # a worker is back, next in line
                held.clear()
            yield reply
        if held and not pending and not queue:
            queue.extend(_again(msg) for msg in held for _ in range(2))
            held.clear()
        push(max_in_flight - len(pending) if max_in_flight > 0 else len(queue))
        time.sleep(poll_interval)
    never_sent = [msg.metadata.dst_node_id for msg in [*reversed(queue), *held]]
    out = sorted({msg.metadata.dst_node_id for msg in pending.values()})
    return out + unsent + [node for node in dict.fromkeys(never_sent) if node not in out]


def _from_destination(reply: Message, sent: Message) -> Message:
    """``reply``, as from the node ``sent`` went to. The SuperLink answers for a node that
    stopped sending heartbeats (its SuperNode died) with an error reply from itself (node
    ``SUPERLINK_NODE_ID``): that error is the destination's answer, so that the site is named
    by its own node, as it named itself earlier, rather than as an unknown node 1."""
    if reply.metadata.src_node_id == sent.metadata.dst_node_id or not reply.has_error():
        return reply
    answer = Message(reply.error, reply_to=sent)
    answer.metadata.__dict__["_reply_to_message_id"] = reply.metadata.reply_to_message_id
    return answer


def _again(sent: Message) -> Message:
    """A new message with the content, type and destination of ``sent`` (a pushed message
    carries its id, so it cannot be pushed twice)."""
    return Message(
        content=sent.content,
        message_type=sent.metadata.message_type,
        dst_node_id=sent.metadata.dst_node_id,
        group_id=sent.metadata.group_id,
    )


def replies_by_site(
    grid: Grid,
    messages: Sequence[Message],
    nodes: Sequence[int],
    timeout: float,
    on_silent: Callable[[int], None],
    *,
    max_in_flight: int = 0,
) -> Generator[tuple[int, Message], None, None]:
    """``(site index, reply)`` for each reply of the sites ``nodes`` (as :func:`stream_replies`
    yields them); ``on_silent(index)`` for each site that never answered. Replies from nodes
    not asked are dropped."""
    index_of = {node: index for index, node in enumerate(nodes)}
    replies = stream_replies(grid, messages, timeout, max_in_flight=max_in_flight)
    while True:
        try:
            reply = next(replies)
        except StopIteration as done:
            for node in done.value:
                on_silent(index_of[node])
            return
        index = index_of.get(reply.metadata.src_node_id)
        if index is not None:
            yield index, reply
