"""What a fused checkpoint records about the run that made it, so that it stands alone.

A fused model travels further than its run directory: to a hospital's inference service, to a
colleague, into a paper's supplement. Its metadata therefore says what went into it (the sites
by name with their sample and class counts, the server's data files with their sha256, the
method and its options, the fedfuse and Flower versions) and what is needed to use it (the
class names and the input normalisation), without the simulation defaults that a deployment
never used.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from importlib import metadata as package_metadata
from pathlib import Path
from typing import Any

from fedfuse import __version__
from fedfuse.federation.contract import DataContract
from fedfuse.settings.run import RunSettings

#: run-config keys that only shape a simulated federation (its dataset, split and sampled
#: fusion set); a deployment's sites and server read files instead, so these are left out
SIMULATION_KEYS = (
    "dataset",
    "data-root",
    "partitioner",
    "dirichlet-alpha-min",
    "dirichlet-min-max-ratio",
    "sharded-class-groups",
    "train-samples",
    "fusion-samples",
    "fusion-source",
    "site-cache",
)
#: run-config keys naming the server's data files (recorded with their sha256)
DATA_FILE_KEYS = ("fusion-data", "test-data")


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    """The hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def settings_used(settings: RunSettings) -> dict[str, Any]:
    """The run config as the run used it: without the simulation keys when the server read
    its fusion set from a file (a deployment)."""
    config = settings.to_config()
    if settings.fusion_data:
        config = {k: v for k, v in config.items() if k not in SIMULATION_KEYS}
    return config


def data_files(settings: RunSettings) -> dict[str, dict[str, str]]:
    """The server's data files (``fusion-data``, ``test-data``) with their sha256."""
    files = {}
    for key in DATA_FILE_KEYS:
        path = settings.to_config().get(key)
        if path:
            resolved = Path(str(path)).expanduser().resolve()
            files[key] = {"path": str(resolved), "sha256": sha256_file(resolved)}
    return files


def flower_version() -> str:
    try:
        return package_metadata.version("flwr")
    except package_metadata.PackageNotFoundError:
        return "not installed"


def fused_model_metadata(
    settings: RunSettings,
    *,
    method: str,
    options: Mapping[str, Any],
    sites: Sequence[Mapping[str, Any]],
    contract: DataContract | None,
    files: Mapping[str, Any],
    run_id: int | None = None,
) -> dict[str, Any]:
    """The metadata of a fused checkpoint: how it was made and how to use it.

    ``sites`` are the fused sites' facts (``site_name``, ``partition_id``, ``num_examples``,
    ``class_counts``); ``files`` is :func:`data_files` (computed once per run).
    """
    document: dict[str, Any] = {
        "strategy": method,
        "method_options": dict(options),
        "sites": [
            {
                "name": site.get("site_name") or f"client {site.get('partition_id')}",
                "partition_id": site.get("partition_id"),
                "num_examples": site.get("num_examples"),
                "class_counts": site.get("class_counts"),
            }
            for site in sites
        ],
        "data_files": dict(files),
        "init": settings.init,
        "settings": settings_used(settings),
        "fedfuse_version": __version__,
        "flower_version": flower_version(),
    }
    if run_id is not None:
        document["run_id"] = run_id
    if contract is not None:
        document["input_shape"] = list(contract.input_shape)
        if contract.class_names is not None:
            document["class_names"] = list(contract.class_names)
        if contract.mean is not None and contract.std is not None:
            document["normalisation"] = {"mean": list(contract.mean), "std": list(contract.std)}
    return document
