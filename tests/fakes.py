"""Stand-ins for the parts of Flower that tests of our own logic touch (nothing else)."""

from __future__ import annotations


class NodesGrid:
    """Only the part of a Flower ``Grid`` that waiting for nodes uses: the connected node ids."""

    def __init__(self, nodes):
        self.nodes = nodes

    def get_node_ids(self):
        return list(self.nodes)
