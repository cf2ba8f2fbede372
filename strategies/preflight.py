"""What is checked before any site trains: the listed methods against the run, and every
site's data against the run's data contract.

In a deployment each site holds its own data file, and one with the wrong image shape, classes
or normalisation would otherwise train for nothing and be rejected only when its upload
arrives. One short query round first lets every site answer at once, so a site that refuses
trains nothing, and a run that would have too few sites left ends before any site trains.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

from flwr.app import Message
from flwr.serverapp import Grid

from fedfuse.clients.records import CONTRACT_MESSAGE, pack_contract_query
from fedfuse.federation.contract import DataContract
from fedfuse.federation.upload_request import UploadRequest
from fedfuse.fusion import FusionMethod
from fedfuse.models import ModelSpec

from .messaging import stream_replies
from .replies import SiteDidNotUpload, sender_name, sender_partition, short_reason, site_answer
from .roster import SiteRoster

log = logging.getLogger(__name__)

#: seconds the sites have to check their data before training (at most ``reply_timeout``)
CONTRACT_TIMEOUT = 300.0


class FusionAborted(RuntimeError):
    """Too few usable uploads arrived to fuse (or too few sites can take part); the message
    lists every site's problem."""


class MethodsUnfit(ValueError):
    """A listed fusion method cannot fuse this run; raised before any site trains."""


def check_methods(
    methods: Sequence[FusionMethod],
    num_sites: int,
    spec: ModelSpec | None,
    available: Iterable[str] | None = None,
    target: ModelSpec | None = None,
    *,
    hint: str = "",
    wording: Mapping[str, str] | None = None,
) -> None:
    """Raise :class:`MethodsUnfit` listing every method that cannot fuse this run (into
    ``target``, the fused model's spec; None: the sites'); ``hint`` ends the message;
    ``wording``: how a missing input reads for this caller (``FusionMethod.check_run``)."""
    available = None if available is None else set(available)
    problems = []
    for method in methods:
        try:
            method.check_run(num_sites, spec, available, target, wording=wording)
        except ValueError as error:
            problems.append(str(error))
    if problems:
        raise MethodsUnfit(
            f"{len(problems)} of the listed fusion methods cannot fuse this run of {num_sites} "
            "sites (checked before any site trains): " + "; ".join(problems) + hint
        )


def check_site_data(
    grid: Grid,
    nodes: Sequence[int],
    contract: DataContract,
    request: UploadRequest,
    timeout: float,
    *,
    roster: SiteRoster,
    problems: list[str],
    min_nodes: int,
    max_in_flight: int = 0,
) -> list[int]:
    """The nodes that may train: those that did not refuse (or fail) the :func:`contract_round`;
    each one left out is added to ``roster`` and ``problems``. Raises :class:`FusionAborted`
    when fewer than ``min_nodes`` are left, before any site trains."""
    answers = contract_round(
        grid, nodes, contract, request, timeout, max_in_flight=max_in_flight, roster=roster
    )
    for node, answer in answers.items():
        problems.append(str(answer))
        roster.drop(answer.kind, str(answer), node=node, name=answer.site)
    remaining = [node for node in nodes if node not in answers]
    if len(remaining) < min_nodes:
        raise FusionAborted(
            f"{len(answers)} site(s) cannot take part and {len(remaining)} can, {min_nodes} "
            "needed (checked before any site trains): " + "; ".join(problems)
        )
    return remaining


def contract_round(
    grid: Grid,
    nodes: Sequence[int],
    contract: DataContract,
    request: UploadRequest,
    timeout: float,
    *,
    max_in_flight: int = 0,
    roster: SiteRoster | None = None,
) -> dict[int, SiteDidNotUpload]:
    """Ask every node whether its data complies with ``contract`` and its policy allows what
    ``request`` will ask it to send; the nodes that cannot take part, with why. A node that
    does not answer, or whose app has no contract handler (a ClientApp of its own), is not
    refused here: the train message carries the contract and the request too. Each site that
    says who it is is enrolled in ``roster``, so it stays named if it dies later."""
    content = pack_contract_query(contract, request)
    messages = [
        Message(content=content, message_type=CONTRACT_MESSAGE, dst_node_id=node) for node in nodes
    ]
    log.info("checking %d sites' data against the run's data contract", len(messages))
    refusals: dict[int, SiteDidNotUpload] = {}
    replies = stream_replies(grid, messages, timeout, max_in_flight=max_in_flight)
    while True:
        try:
            reply = next(replies)
        except StopIteration as done:
            if done.value:
                log.warning("no answer to the data check from nodes %s", done.value)
            return refusals
        node = reply.metadata.src_node_id
        if reply.has_error():
            log.warning(
                "node %s could not check its data: %s", node, short_reason(reply.error.reason)
            )
            continue
        if roster is not None:
            roster.enrol(node, sender_name(reply), sender_partition(reply))
        answer = site_answer(reply)
        if answer is not None:
            refusals[node] = answer
            log.error("%s", answer)
