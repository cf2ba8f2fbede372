"""The run's roster: every site that was asked to train, by name, and what became of it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from fedfuse.federation.uploads import StoredUpload


class SiteRoster:
    """The sites left out of a run (``refused``, ``failed``, ``rejected`` or ``silent``, with
    the reason), and the roster of all sites with their node ids: an operator's map from the
    names the sites give themselves to the SuperNodes Flower lists."""

    def __init__(self) -> None:
        self.dropped: list[dict[str, Any]] = []
        #: partition id -> why a site that uploaded refused a statistics round (its policy)
        self.statistics_refused: dict[int, str] = {}

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
        return kept + self.dropped
