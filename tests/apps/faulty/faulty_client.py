"""fedfuse's ClientApp with real faults, by partition id: 1 raises mid-round, 2 hangs, 3 trains
but raises in the statistics rounds after the first (for methods fitted on the sites' data) and
in the fine-tuning round after fusion."""

from __future__ import annotations

import time

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedfuse.clients.client_app import finetune_round, statistics_round, train_and_upload

app = ClientApp()

#: seconds site 2 sleeps: far past the app's reply-timeout
HANG_SECONDS = 600


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Site 1 fails while training, site 2 never replies in time, the others behave."""
    partition_id = int(context.node_config["partition-id"])
    if partition_id == 1:
        raise RuntimeError("site 1 crashed mid-round (fault injected by the test app)")
    if partition_id == 2:
        time.sleep(HANG_SECONDS)
    return train_and_upload(msg, context)


@app.query("statistics")
def statistics(msg: Message, context: Context) -> Message:
    """Site 3 answers the first statistics round only."""
    if int(context.node_config["partition-id"]) == 3 and int(msg.content["request"]["level"]) > 0:
        raise RuntimeError("site 3 crashed in a statistics round (fault injected by the test app)")
    return statistics_round(msg, context)


@app.train("finetune")
def finetune(msg: Message, context: Context) -> Message:
    """Site 3 fails the fine-tuning round; the others fine-tune."""
    if int(context.node_config["partition-id"]) == 3:
        raise RuntimeError(
            "site 3 crashed in the fine-tuning round (fault injected by the test app)"
        )
    return finetune_round(msg, context)
