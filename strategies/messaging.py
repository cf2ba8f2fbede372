"""Talking to the sites through Flower's Grid: waiting for nodes, and streaming their replies.

Every round of the server (train, statistics, fine-tuning) sends its messages and reads the
replies through :func:`replies_by_site`, so flow control, timeouts and silent sites are
handled in one place.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Sequence

from flwr.app import Message
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


def stream_replies(
    grid: Grid,
    messages: Sequence[Message],
    timeout: float,
    *,
    max_in_flight: int = 0,
    poll_interval: float = 0.5,
) -> Generator[Message, None, list[int]]:
    """Push ``messages`` and yield each reply as soon as it is available, until all replied or
    ``timeout`` seconds passed; the generator returns the destination nodes that never replied.

    With ``max_in_flight > 0`` at most that many messages are out at once, the next one pushed
    as a reply comes back. Flower's simulation engine scans every undelivered message for every
    node ten times a second, so a thousand messages at once keep a core busy that the sites
    need; a deployment sends to every site at once (0).
    """
    queue = list(messages)[::-1]
    pending: dict[str, int] = {}
    unsent: list[int] = []

    def push(count: int) -> None:
        batch = [queue.pop() for _ in range(min(count, len(queue)))]
        if batch:
            for mid, msg in zip(grid.push_messages(batch), batch, strict=True):
                if mid:
                    pending[mid] = msg.metadata.dst_node_id
                else:
                    unsent.append(msg.metadata.dst_node_id)

    push(max_in_flight if max_in_flight > 0 else len(queue))
    deadline = time.monotonic() + timeout
    while (pending or queue) and time.monotonic() < deadline:
        # one request for every pending reply (the SuperLink returns those that arrived), each
        # handled before the next is looked at
        replies = list(grid.pull_messages(list(pending)))[::-1] if pending else []
        while replies:
            reply = replies.pop()  # dropped here once handled: one model in memory at a time
            if pending.pop(reply.metadata.reply_to_message_id, None) is not None:
                yield reply
        if max_in_flight > 0:
            push(max_in_flight - len(pending))
        time.sleep(poll_interval)
    never_sent = [msg.metadata.dst_node_id for msg in reversed(queue)]
    return sorted(pending.values()) + unsent + never_sent


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
