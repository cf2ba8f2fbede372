"""Who a site is and what it allows, from its Flower ``Context``: its partition and data file,
its name, its policy (:mod:`fedfuse.federation.policy`), and the statistics rounds it answered
in this run."""

from __future__ import annotations

from flwr.app import ConfigRecord, Context

from fedfuse.federation.policy import SitePolicy
from fedfuse.federation.site import SiteIdentity

#: node-config key of a site's name, shown in the server's logs, results and checkpoints
SITE_NAME_KEY = "site-name"


def site_name(context: Context) -> str:
    """The site's name from its node config (``site-name``), or "" when it gave none."""
    return str(context.node_config.get(SITE_NAME_KEY, "")).strip()[:200]


def site_identity(context: Context) -> tuple[int, int, str | None]:
    """(partition id, number of partitions or 0, data file or None) from the node config."""
    config = context.node_config
    data_path = str(config["data-path"]) if config.get("data-path") else None
    try:
        partition_id = int(config["partition-id"])
        num_partitions = int(config.get("num-partitions", 0))
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(
            f"node {context.node_id}: node config needs an integer partition-id ({error!r}); "
            "start the SuperNode with --node-config \"partition-id=<i> data-path='<file.npz>'\""
        ) from None
    if data_path is None and num_partitions < 1:
        raise ValueError(
            f"node {context.node_id}: node config has neither data-path nor num-partitions"
        )
    return partition_id, num_partitions, data_path


def site_of(context: Context) -> SiteIdentity:
    """Who the site is (:func:`site_identity` and its :func:`site_name`)."""
    partition_id, num_partitions, data_path = site_identity(context)
    return SiteIdentity(partition_id, num_partitions, site_name(context), data_path)


def site_policy(context: Context) -> SitePolicy:
    """What the site agrees to send, from its node config
    (:class:`~fedfuse.federation.policy.SitePolicy`; everything when it states nothing)."""
    return SitePolicy.from_node_config(
        context.node_config, where=f"node {context.node_id}: node config"
    )


#: where a site counts the statistics rounds it answered in this run (its Context's state)
_ROUNDS_RECORD = "fedfuse.policy"


def count_round(context: Context, *, count: bool = True) -> int:
    """The statistics rounds this site answered in this run before this one; counts this one
    unless ``count`` is False."""
    record = context.state.config_records.get(_ROUNDS_RECORD)
    answered = int(record["statistics-rounds"]) if record is not None else 0
    if count:
        context.state.config_records[_ROUNDS_RECORD] = ConfigRecord(
            {"statistics-rounds": answered + 1}
        )
    return answered
