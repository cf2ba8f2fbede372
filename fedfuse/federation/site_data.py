"""A site's own rows, as every step of a site reads them: what it trains on, uploads from and
computes statistics of, and what it scores the server's models on."""

from __future__ import annotations

from fedfuse.data import ImageDataset, load_npz_dataset
from fedfuse.federation.scenario import Scenario
from fedfuse.fusion.methods.selection.criteria import stratified_split
from fedfuse.settings.run import RunSettings, client_seed


def load_site_data(
    settings: RunSettings,
    partition_id: int,
    num_partitions: int,
    data_path: str | None = None,
    *,
    part: str = "train",
) -> ImageDataset:
    """The site's own data: its ``.npz`` file (a deployment) or its partition, split by
    :func:`site_part` (``part``: ``"train"`` or ``"validation"``)."""
    if data_path:
        data = load_npz_dataset(data_path)
    else:
        data = Scenario(settings, num_partitions).client_data(partition_id)
    return site_part(data, settings, partition_id, part)


def site_part(
    data: ImageDataset, settings: RunSettings, partition_id: int, part: str = "train"
) -> ImageDataset:
    """``"train"``: the rows a site trains on, uploads from and computes every statistic of;
    ``"validation"``: the rows it scores the server's models on (``auto``'s candidates).

    With ``validation-share`` > 0 the site holds that share of each of its classes out of
    training (drawn with its own seed; a class of one row stays in training), so its scores
    are of rows no model was fitted to: on its training rows a site favours the methods that
    fit them closest (RegMean's Grams of 300 rows of 784 pixels reproduce those rows, not the
    test set). With 0 (default) both parts are every row.
    """
    if part not in ("train", "validation"):
        raise ValueError(f"part must be 'train' or 'validation', got {part!r}")
    if settings.validation_share <= 0:
        return data
    seed = client_seed(settings, partition_id) + 7919  # not the training's own stream
    train, validation = stratified_split(data.labels, settings.validation_share, seed)
    return data.subset(train if part == "train" else validation)
