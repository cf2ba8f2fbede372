"""A site's score of a model the server sends (federated evaluation, without Flower): how
``auto`` learns what each site sees of its candidates, where the server's fusion set shows only
some classes.

``clients/handlers.py`` wraps :func:`score_on_site` for the ClientApp's ``evaluate`` handler.
"""

from __future__ import annotations

import logging

from fedfuse.fusion.statistics.channels import SiteScore
from fedfuse.models import LeveledModel
from fedfuse.models.capture import accuracy_and_loss
from fedfuse.runtime import capped_threads
from fedfuse.settings.run import RunSettings

from .site import SiteIdentity
from .site_data import load_site_data

log = logging.getLogger(__name__)


def score_on_site(settings: RunSettings, model: LeveledModel, site: SiteIdentity) -> SiteScore:
    """``model``'s accuracy and mean cross-entropy on the site's validation rows: the share
    ``validation-share`` it held out of training, or, without one, its training rows (its
    ``.npz`` file or its partition, as :func:`~fedfuse.federation.site_data.load_site_data` loads
    them). Torch runs on the run's ``threads``; samples of another shape than the model's, or
    no row to score on, are a ValueError."""
    with capped_threads(settings.threads):
        data = load_site_data(
            settings, site.partition_id, site.num_partitions, site.data_path, part="validation"
        )
        if len(data) == 0:
            why = (
                f"validation-share={settings.validation_share} holds none out (each class "
                "keeps its only row)"
                if settings.validation_share
                else "its data has no rows"
            )
            raise ValueError(f"{site.label}: no row to score the model on: {why}")
        if tuple(data.input_shape) != tuple(model.spec.input_shape):
            raise ValueError(
                f"{site.label}: its data has samples of shape {tuple(data.input_shape)}, the "
                f"model to score takes {tuple(model.spec.input_shape)}"
            )
        accuracy, loss = accuracy_and_loss(
            model, data.inputs(), data.labels, device=settings.device
        )
    log.info("%s: scored the model on %d rows: accuracy %.4f", site.label, len(data), accuracy)
    return SiteScore(accuracy, loss, len(data))
