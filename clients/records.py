"""The wire format of a client's one upload: weights, importance scores and site facts.

Both sides use these helpers, so the record keys are defined once. Tensors travel as Flower
``ArrayRecord``s (numpy buffers, never pickles); the site facts as a ``ConfigRecord``.
"""

from __future__ import annotations

import json

import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedfuse.uploads import ClientUpload

WEIGHTS_KEY = "arrays"
SCORES_KEY = "scores"
METRICS_KEY = "metrics"
SITE_KEY = "site"
GRAMS_KEY = "grams"
CONFIG_KEY = "config"
#: metrics ``seconds-<phase>``: the wall time of a site's phases
SECONDS_PREFIX = "seconds-"


def pack_upload(upload: ClientUpload) -> RecordDict:
    """The reply content of a client's train message."""
    content = RecordDict(
        {
            WEIGHTS_KEY: ArrayRecord(upload.model.state_dict()),
            SCORES_KEY: ArrayRecord({str(k): v for k, v in upload.scores.items()}),
            METRICS_KEY: MetricRecord(
                {
                    "num-examples": upload.num_examples,
                    "train-loss": upload.train_loss,
                    **{f"{SECONDS_PREFIX}{k}": float(v) for k, v in upload.seconds.items()},
                }
            ),
            SITE_KEY: ConfigRecord(
                {
                    "partition-id": upload.partition_id,
                    "num-partitions": upload.num_partitions,
                    "class-counts": [int(c) for c in upload.class_counts],
                    "model-spec": json.dumps(upload.model.spec.to_dict()),
                    "score-method": upload.score_method,
                    "init": upload.init,
                }
            ),
        }
    )
    if upload.grams is not None:
        content[GRAMS_KEY] = ArrayRecord({str(k): v for k, v in upload.grams.items()})
    return content


def unpack_tensors(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """An ArrayRecord as a dict of CPU tensors."""
    return dict(record.to_torch_state_dict())
