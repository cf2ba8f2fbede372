"""The fine-tuning round after fusion, over Flower: one more round in which the sites train the
fused model on their own data and the server averages what comes back.

Every site that uploaded gets a ``train.finetune`` message with the fused model; it trains for
the run's ``finetune-epochs`` (:func:`fedfuse.federation.site.finetune_site`) and replies with its
copy. Replies are taken as they arrive, with the train round's reply timeout and flow control,
validated (architecture, finite weights) and folded into a running FedAvg weighted by the
sites' sample counts (every state-dict entry, BatchNorm statistics included). A site that
fails, answers garbage or stays silent is named in :attr:`SiteFinetuneRound.problems` and the
log, and the average goes on without it; only when no site answers does the round fail.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Sequence
from typing import Any

from flwr.app import Message
from flwr.serverapp import Grid

from fedfuse.clients.records import (
    FINETUNE_MESSAGE,
    pack_finetune_request,
    unpack_finetune_reply,
)
from fedfuse.models import LeveledModel
from fedfuse.training.averaging import WeightedAverage, state_bytes

from .messaging import replies_by_site
from .replies import short_reason

log = logging.getLogger(__name__)


class SiteFinetuneRound:
    """The sites of a run as fine-tuners: site ``i`` is ``nodes[i]``, named ``names[i]``, holds
    ``partition_ids[i]`` and weighs ``weights[i]`` (its sample count) in the average.

    Args:
        grid: the run's grid.
        nodes, names, partition_ids, weights: one per site that uploaded, as above.
        timeout: seconds to wait for the round's replies.
        max_in_flight: messages out at once (0: all), as for the train round.
    """

    def __init__(
        self,
        grid: Grid,
        nodes: Sequence[int],
        names: Sequence[str],
        partition_ids: Sequence[int],
        weights: Sequence[float],
        *,
        timeout: float,
        max_in_flight: int = 0,
    ) -> None:
        if not len(nodes) == len(names) == len(partition_ids) == len(weights):
            raise ValueError("SiteFinetuneRound: one name, partition id and weight per node")
        self.grid = grid
        self.nodes = list(nodes)
        self.names = list(names)
        self.partition_ids = list(partition_ids)
        self.weights = [float(w) for w in weights]
        self.timeout = timeout
        self.max_in_flight = max_in_flight
        self.problems: list[str] = []

    def run(self, model: LeveledModel, label: str = "") -> tuple[LeveledModel, dict[str, Any]]:
        """The sites' fine-tuned copies of ``model`` averaged into a new model (``model`` is
        unchanged), and the round's details: the sites that answered, their weights, upload
        bytes and metrics, the seconds it took.

        Raises:
            RuntimeError: no site returned a usable model (every problem named).
        """

        started = time.monotonic()
        messages = [
            Message(
                content=pack_finetune_request(model, label),
                message_type=FINETUNE_MESSAGE,
                dst_node_id=node,
            )
            for node in self.nodes
        ]
        average = WeightedAverage()
        answered: dict[int, dict[str, Any]] = {}
        log.info("fine-tuning round %s: sending the fused model to %d sites", label, len(messages))
        replies = replies_by_site(
            self.grid,
            messages,
            self.nodes,
            self.timeout,
            lambda index: self._note(index, "no fine-tuned model before the reply timeout"),
            max_in_flight=self.max_in_flight,
        )
        for index, reply in replies:
            if reply.has_error():
                self._note(index, f"the client failed: {short_reason(reply.error.reason)}")
                continue
            try:
                tuned, metrics = unpack_finetune_reply(
                    reply.content, model.spec, source=self.names[index]
                )
                average.add(tuned.state_dict(), self.weights[index])
            except ValueError as error:
                self._note(index, str(error).removeprefix(f"{self.names[index]}: "))
                continue
            answered[index] = {"upload_bytes": state_bytes(tuned), "metrics": metrics}
            del tuned  # one site's model in memory at a time, besides the running sum
        seconds = time.monotonic() - started
        if not answered:
            raise RuntimeError(
                f"no site returned a fine-tuned model: {'; '.join(self.problems) or 'no sites'}"
            )
        merged = copy.deepcopy(model)
        merged.load_state_dict(average.result())
        merged.eval()
        total = sum(self.weights[i] for i in answered)
        log.info(
            "fine-tuning round %s: %d of %d sites answered in %.1f s",
            label,
            len(answered),
            len(self.nodes),
            seconds,
        )
        details = {
            "sites": [self.partition_ids[i] for i in sorted(answered)],
            "weights": {str(self.partition_ids[i]): self.weights[i] / total for i in answered},
            "upload_bytes": {
                str(self.partition_ids[i]): answered[i]["upload_bytes"] for i in answered
            },
            "site_metrics": {str(self.partition_ids[i]): answered[i]["metrics"] for i in answered},
            "problems": list(self.problems),
            "seconds": seconds,
        }
        return merged, details

    def _note(self, index: int, problem: str) -> None:
        message = f"{self.names[index]}: fine-tuning round: {problem}"
        self.problems.append(message)
        log.error("%s", message)
