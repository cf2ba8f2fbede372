"""Stand-ins for the parts of Flower that tests of our own logic touch (nothing else)."""

from __future__ import annotations

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
