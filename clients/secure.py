"""The site's side of secure aggregation: Flower's SecAgg+ client mod on summed rounds.

Flower's ``secaggplus_mod`` takes over every train message, so the ClientApp wraps it:
:func:`secure_sums_mod` hands it only the messages of Flower's SecAgg+ workflow (those carrying
its ``secaggplus`` config record), and every other message goes on to the app's handlers as
before. In the stage where SecAgg+ collects the masked vectors, the mod asks
:func:`~fedfuse.clients.secure_terms.masked_terms` for the site's vector: the site's terms of
the summed round in the request's fixed units. SecAgg+ clips them to its range, quantises, masks
them, and clears the arrays before the reply leaves the site, so the server never sees them.

``FEDFUSE_SECURE_FAULT="<partition id>:<stage>"`` (test only) makes that site fail when the
SecAgg+ stage (``setup``, ``share_keys``, ``collect_masked_vectors``, ``unmask``) reaches it:
how the tests drop a site mid-protocol in a real simulation.
"""

from __future__ import annotations

import os

from flwr.app import Context, Message, MessageType
from flwr.client.mod import secaggplus_mod
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

#: the environment variable of the test-only fault (module docstring)
FAULT_VARIABLE = "FEDFUSE_SECURE_FAULT"


def is_secure_message(msg: Message) -> bool:
    """Whether ``msg`` belongs to Flower's SecAgg+ workflow."""
    return (
        msg.metadata.message_type == MessageType.TRAIN
        and RECORD_KEY_CONFIGS in msg.content.config_records
    )


def secure_sums_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """A ClientApp mod: SecAgg+ for the secure summed rounds, the app's handlers for the rest."""
    if not is_secure_message(msg):
        return call_next(msg, context)
    _inject_fault(msg, context)
    return secaggplus_mod(msg, context, _masked_terms)


def _inject_fault(msg: Message, context: Context) -> None:
    fault = os.environ.get(FAULT_VARIABLE, "")
    if not fault:
        return
    partition, _, stage = fault.partition(":")
    here = str(context.node_config.get("partition-id", ""))
    if partition == here and msg.content.config_records[RECORD_KEY_CONFIGS].get(Key.STAGE) == stage:
        raise RuntimeError(f"{FAULT_VARIABLE}: site {here} drops out at SecAgg+ stage {stage!r}")


def _masked_terms(msg: Message, context: Context) -> Message:
    from .secure_terms import masked_terms  # PyTorch: the collect stage only

    return masked_terms(msg, context)
