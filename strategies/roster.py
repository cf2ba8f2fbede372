"""The run's roster: every site that was asked to train, by name, and what became of it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from fedfuse.federation.uploads import StoredUpload


class SiteRoster:
    """The sites left out of a run (``refused``, ``failed``, ``rejected`` or ``silent``, with
    the reason), and the roster of all sites with their node ids: an operator's map from the
    names the sites give themselves to the SuperNodes Flower lists.

    A site is known by name and partition from its first answer (the data check before
    training, :meth:`enrol`), so a site that dies later, without a word, is still named; and a
    site asked to train that has no outcome when the run ends (stopped, failed) is listed as
    ``pending``, one that checked its data but was never asked as ``ready``.
    """

    def __init__(self) -> None:
        self.dropped: list[dict[str, Any]] = []
        #: partition id -> why a site that uploaded refused a statistics round (its policy)
        self.statistics_refused: dict[int, str] = {}
        #: node id -> (site name, partition id) as the site gave them in its first answer
        self.known: dict[int, tuple[str, int | None]] = {}
        #: the nodes sent the train message
        self.asked: list[int] = []

    def enrol(self, node: int, name: str, partition_id: int | None) -> None:
        """Record the name and partition a node's site gave in an answer."""
        self.known[node] = (name, partition_id)

    def describe(self, node: int) -> str:
        """``<name> (client <partition>, node <id>)`` as far as the site said who it is."""
        name, partition = self.known.get(node, ("", None))
        where = f"node {node}" if partition is None else f"client {partition}, node {node}"
        if name:
            return f"{name} ({where})"
        return where if partition is None else f"client {partition} (node {node})"

    def refuse_statistics(self, partition_id: int, reason: str) -> None:
        """Record that the site of ``partition_id`` refused a statistics round, and why."""
        self.statistics_refused.setdefault(partition_id, reason)

    def drop(
        self,
        status: str,
        reason: str,
        *,
        node: int | None,
        name: str = "",
        partition_id: int | None = None,
    ) -> None:
        """Record a site left out of the run; its name and partition, where the site's answer
        did not give them, from what it said earlier (:meth:`enrol`)."""
        known_name, known_partition = self.known.get(node, ("", None)) if node else ("", None)
        name = name or known_name
        partition_id = known_partition if partition_id is None else partition_id
        self.dropped.append(
            {
                "site": name,
                "partition_id": partition_id,
                "node_id": node,
                "status": status,
                "reason": reason,
            }
        )

    def sites(
        self, uploaded: Iterable[StoredUpload], node_of: Mapping[int, int]
    ) -> list[dict[str, Any]]:
        """Every site: those whose upload was kept (``uploaded``), then those left out."""
        kept = [
            {
                "site": entry.facts.get("site_name", ""),
                "partition_id": entry.partition_id,
                "node_id": node_of.get(entry.partition_id),
                "status": "uploaded",
                "num_examples": entry.num_examples,
                **({"ray_node": entry.facts["ray_node"]} if entry.facts.get("ray_node") else {}),
                **(
                    {"statistics": f"refused: {self.statistics_refused[entry.partition_id]}"}
                    if entry.partition_id in self.statistics_refused
                    else {}
                ),
            }
            for entry in uploaded
        ]
        accounted = {site["node_id"] for site in kept + self.dropped}
        unfinished = [
            self._unfinished(node, asked=True) for node in self.asked if node not in accounted
        ] + [
            self._unfinished(node, asked=False)
            for node in self.known
            if node not in accounted and node not in self.asked
        ]
        return kept + self.dropped + unfinished

    def _unfinished(self, node: int, *, asked: bool) -> dict[str, Any]:
        """A site with no outcome when the run ended: asked to train (``pending``) or only
        through the data check (``ready``)."""
        name, partition = self.known.get(node, ("", None))
        return {
            "site": name,
            "partition_id": partition,
            "node_id": node,
            "status": "pending" if asked else "ready",
            "reason": "asked to train; no answer when the run ended"
            if asked
            else "checked its data; the run ended before it was asked to train",
        }
