"""Taking the sites' train replies in: each validated, stored at once, or named and left out.

:class:`UploadIntake` is the part of :class:`~.one_shot.OneShotFusion` that turns replies into
entries of the run's :class:`~fedfuse.federation.uploads.UploadStore`: a bad reply, a silent
site and a site whose ``num-partitions`` disagrees with the majority are each written to the
strategy's ``problems`` and its :class:`~.roster.SiteRoster`, never raised, so that one site
cannot cost the others their work. It lives apart from the strategy's Flower hooks because it
is the one place that decides which uploads are fused.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from flwr.app import Message

from fedfuse.federation.upload_request import UploadRequest
from fedfuse.federation.uploads import StoredUpload, UploadStore
from fedfuse.io.validation import ContributionError
from fedfuse.models import ModelAdapter

from .replies import (
    SiteDidNotUpload,
    decode_plain_reply,
    decode_reply,
    describe_sender,
    sender_name,
)
from .roster import SiteRoster

log = logging.getLogger(__name__)


class UploadIntake:
    """Validates and stores train replies; a mixin of the strategy, whose state it shares."""

    store: UploadStore
    roster: SiteRoster
    problems: list[str]
    timings: dict[str, float]
    adapter: ModelAdapter | None
    require_scores: bool
    on_upload: Callable[[StoredUpload], None] | None
    num_partitions: int
    _sent: list[int]
    upload_request: UploadRequest
    _extras: list[str]
    _node_of: dict[int, int]  # partition id -> node id of its accepted upload

    def accept(self, msg: Message) -> StoredUpload | None:
        """Validate one reply and store it; a bad one is named in :attr:`problems`."""
        node = msg.metadata.src_node_id
        source = describe_sender(msg, self._known(node))
        started = time.monotonic()
        try:
            upload = self._decode(msg)
            entry = self.store.add(upload, source=source)
        except ContributionError as error:
            self.problems.append(str(error))
            kind = error.kind if isinstance(error, SiteDidNotUpload) else "rejected"
            self.roster.drop(kind, str(error), node=node, name=sender_name(msg))
            log.error("%s upload: %s", "no" if kind in ("refused", "failed") else "rejected", error)
            return None
        finally:
            elapsed = time.monotonic() - started
            self.timings["handle_uploads"] = self.timings.get("handle_uploads", 0.0) + elapsed
        self._node_of[entry.partition_id] = node
        log.info(
            "stored the upload of %s (%d examples): %d of %d sites",
            source,
            entry.num_examples,
            len(self.store),
            len(self._sent) or len(self.store),
        )
        if self.on_upload is not None:
            self.on_upload(entry)
        return entry

    def _decode(self, msg: Message) -> Any:
        """The upload of one reply: fedfuse's ClientApp's, or a plain one's (by its node)."""
        node = msg.metadata.src_node_id
        if self.adapter is None:
            return decode_reply(
                msg,
                self.store.expected_spec,
                require_scores=self.require_scores,
                known=self._known(node),
            )
        if node not in self._sent:
            raise ContributionError(f"node {node}: replied without being asked to train")
        return decode_plain_reply(
            msg,
            self.adapter,
            partition_id=self._sent.index(node),
            num_partitions=len(self._sent),
            wanted=[
                *self._extras,
                *(["class-gaussians"] * bool(self.upload_request.gaussian_rank)),
            ],
            known=self._known(node),
        )

    def _known(self, node: int) -> str:
        """How the site of ``node`` named itself before this reply, or "" if it never did."""
        return self.roster.describe(node) if node in self.roster.known else ""

    def note_silent(self, nodes: Iterable[int]) -> None:
        """Name the sites that did not reply before the timeout."""
        for node in nodes:
            problem = f"{self.roster.describe(node)}: no reply before the reply timeout"
            self.problems.append(problem)
            self.roster.drop("silent", problem, node=node)
            log.error("%s", problem)

    def sites(self) -> list[dict[str, Any]]:
        """Every site of the run by name, node id and status (:class:`SiteRoster`)."""
        return self.roster.sites(self.store.entries, self._node_of)

    def _agree_on_partitions(self) -> None:
        """Keep the uploads whose ``num-partitions`` is the majority's; name the others."""
        counts = Counter(entry.num_partitions for entry in self.store.entries)
        if not counts:
            return
        # the most common value; on a tie, the smallest (a deterministic choice)
        self.num_partitions = min(counts, key=lambda n: (-counts[n], n))
        for entry in self.store.entries:
            if entry.num_partitions != self.num_partitions:
                problem = (
                    f"{entry.source}: reports num-partitions {entry.num_partitions}, "
                    f"{counts[self.num_partitions]} other site(s) report {self.num_partitions}"
                )
                self.problems.append(problem)
                self.roster.drop(
                    "rejected",
                    problem,
                    node=self._node_of.pop(entry.partition_id, None),
                    name=entry.facts.get("site_name", ""),
                    partition_id=entry.partition_id,
                )
                self.store.discard(entry.partition_id, problem)
