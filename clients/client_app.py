"""The site's Flower ``ClientApp``: train locally once, score neurons locally, upload both;
then, for methods fitted on the sites' data, answer one statistics query per level; and, when
the run fine-tunes on the sites (``finetune-data="sites"``), train the fused model on the site's
data once more and send it back (``train.finetune``); and score any model the server sends on
the site's training rows (``evaluate``: ``auto`` ranks its candidates by the sites' scores).

Simulation: a site's data is its partition (``partition-id`` / ``num-partitions``, set by Flower)
of the configured dataset. Deployment: start the SuperNode with
``--node-config "partition-id=<site id> site-name='<name>' data-path='/path/site.npz'"`` (see
:mod:`fedfuse.data.arrays` for the file). Run config keys are those of ``RunSettings``.

A site checks its data against the run's data contract (in the train message) before it trains.
When it cannot upload, it still answers, at once: a ``no-upload`` reply that says whether it
refused (its data breaks the contract) or failed, why, and which site it is, so the server names
it in the run's status.

This module is the app's Flower surface only: it imports Flower, and each handler hands its
message to :mod:`fedfuse.clients.handlers`, imported with the first message that needs it. A
SuperNode starts a ClientApp process for every message, and three of SecAgg+'s four stages only
exchange keys and shares: those processes start without PyTorch (about 2-3 s sooner each).
"""

from __future__ import annotations

from types import ModuleType

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from .secure import secure_sums_mod

#: secure aggregation (SecAgg+) for the summed rounds; every other message goes to the handlers
app = ClientApp(mods=[secure_sums_mod])


def _handlers() -> ModuleType:
    from . import handlers  # PyTorch and the site's work: loaded by the first message

    return handlers


@app.train()
def train_and_upload(msg: Message, context: Context) -> Message:
    """Train on the site's data, compute importance scores, reply with weights + scores and
    whatever else the server's message asks for (Grams, Fisher, class Gaussians)."""
    return _handlers().train_and_upload(msg, context)


@app.query("contract")
def check_contract(msg: Message, context: Context) -> Message:
    """The check before training: does the site's data match the run's data contract, and does
    its policy allow what the run will ask it to send? The site answers that it is ready, or
    refuses (or failed) and says why."""
    return _handlers().check_contract(msg, context)


@app.query("statistics")
def statistics_round(msg: Message, context: Context) -> Message:
    """One statistics round: the site's statistics of the fused prefix and its own model on
    its own data, for the level the server asks (site-statistics fusion, e.g. ``kf-sites``)."""
    return _handlers().statistics_round(msg, context)


@app.evaluate()
def score_model(msg: Message, context: Context) -> Message:
    """Federated evaluation: the accuracy, loss and row count of the model the server sent, on
    the site's training rows (a site holds no held-out split), as Flower's templates reply."""
    return _handlers().score_model(msg, context)


@app.train("finetune")
def finetune_round(msg: Message, context: Context) -> Message:
    """The fine-tuning round after fusion: the fused model the server sent, trained on the
    site's own data for ``finetune-epochs`` and sent back for averaging."""
    return _handlers().finetune_round(msg, context)
