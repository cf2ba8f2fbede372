"""A federated scenario from one flat settings object: data, split, models, fusion set, test set.

The Flower apps (``fedfuse.clients``, ``fedfuse.strategies``), the CLI and the benchmarks all turn
their configuration into :class:`RunSettings` and ask a :class:`Scenario` for what they need, so
every entry point splits data, sizes models and samples the fusion set the same way.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import torch

from .data import ImageDataset, load_dataset, load_npz_dataset, resolve_data_root
from .fusion import FusionMethod, make_fusion_methods
from .models import ModelSpec, make_spec
from .partition_cache import PartitionCache
from .partitions import class_counts, partition_labels, sample_fusion_set
from .runtime import check_device
from .training import TrainConfig

log = logging.getLogger(__name__)

INIT_MODES = ("independent", "shared")


@dataclass(frozen=True)
class RunSettings:
    """Every knob of a one-shot federated fusion run (the Flower run config, key for key).

    Field ``foo_bar`` is run-config key ``foo-bar``; the defaults are the app's defaults in
    ``pyproject.toml`` (a test keeps the two identical).
    """

    dataset: str = "fashion-mnist"
    data_root: str = ""
    partitioner: str = "sharded"
    dirichlet_alpha_min: float = 1.0
    dirichlet_min_max_ratio: float = 0.2
    sharded_class_groups: str = ""
    train_samples: int = 0
    seed: int = 0
    model: str = "mlp"
    mlp_widths: str = "512,512,512"
    vgg_width_multiplier: float = 0.25
    init: str = "independent"
    local_epochs: int = 3
    batch_size: int = 128
    optimizer: str = "adamw"
    lr: float = 0.001
    weight_decay: float = 0.0001
    label_smoothing: float = 0.1
    score_method: str = "conductance"
    score_samples: int = 512
    score_steps: int = 16
    strategy: str = "kf-linear,fedavg"
    fusion_options: str = ""
    fusion_samples: int = 400
    fusion_source: str = "0"
    test_samples: int = 0
    fusion_data: str = ""
    test_data: str = ""
    min_nodes: int = 2
    node_wait_timeout: float = 120.0
    reply_timeout: float = 1800.0
    max_in_flight: int = 0
    output_dir: str = "outputs"
    site_cache: str = ""
    device: str = "auto"
    threads: int = 1
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.init not in INIT_MODES:
            raise ValueError(f"init must be one of {INIT_MODES}, got {self.init!r}")
        check_device(self.device)
        if self.fusion_source != "all" and not self.fusion_source.isdigit():
            raise ValueError(
                f"fusion-source must be a partition id or 'all', got {self.fusion_source!r}"
            )
        self.class_groups()

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, allow_unknown: bool = False) -> RunSettings:
        """Parse a run config (``key-with-dashes`` names); unknown keys are an error naming them."""
        fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "extra"}
        values: dict[str, Any] = {}
        unknown: dict[str, Any] = {}
        for key, value in config.items():
            name = key.replace("-", "_")
            if name not in fields:
                unknown[key] = value
                continue
            default = fields[name].default
            try:
                values[name] = (
                    type(default)(value) if not isinstance(default, bool) else bool(value)
                )
            except (TypeError, ValueError):
                raise ValueError(
                    f"run config key {key!r} must be a {type(default).__name__}, got {value!r}"
                ) from None
        if unknown and not allow_unknown:
            known = sorted(k.replace("_", "-") for k in fields)
            raise ValueError(f"unknown run config key(s) {sorted(unknown)}; known keys: {known}")
        return cls(**values, extra=unknown)

    def to_config(self) -> dict[str, Any]:
        """The settings as a run config (``key-with-dashes`` names)."""
        return {
            f.name.replace("_", "-"): getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "extra"
        }

    def class_groups(self) -> list[list[int]] | None:
        """``sharded-class-groups`` ("0,1,3;2,7": a group of classes per site) as lists."""
        if not self.sharded_class_groups.strip():
            return None
        try:
            groups = [
                [int(c) for c in group.split(",") if c.strip()]
                for group in self.sharded_class_groups.split(";")
            ]
        except ValueError:
            raise ValueError(
                "sharded-class-groups must be class ids, commas within a site's group and "
                f"semicolons between sites (e.g. '0,1,3;2,7'), got {self.sharded_class_groups!r}"
            ) from None
        owner: dict[int, int] = {}
        for index, group in enumerate(groups):
            if not group:
                raise ValueError(f"sharded-class-groups: group {index} is empty")
            for c in group:
                if c in owner:
                    raise ValueError(
                        f"sharded-class-groups: class {c} is in groups {owner[c]} and {index}"
                    )
                owner[c] = index
        return groups

    def train_config(self) -> TrainConfig:
        return TrainConfig(
            epochs=self.local_epochs,
            batch_size=self.batch_size,
            optimizer=self.optimizer,
            lr=self.lr,
            weight_decay=self.weight_decay,
            label_smoothing=self.label_smoothing,
            augment=self.dataset.startswith("cifar"),
        )

    def fusion_methods(self) -> list[FusionMethod]:
        """The run's fusion methods; the run's ``device`` reaches every method that takes one."""
        return make_fusion_methods(
            self.strategy, self.fusion_options, defaults={"device": self.device}
        )

    def model_spec_for(self, data: ImageDataset) -> ModelSpec:
        """The configured architecture for ``data``'s input shape and class count."""
        return make_spec(self.model, data.input_shape, data.num_classes, **self.model_options())

    def model_options(self) -> dict[str, Any]:
        if self.model == "mlp":
            try:
                widths = tuple(int(w) for w in self.mlp_widths.split(",") if w.strip())
            except ValueError:
                raise ValueError(
                    f"mlp-widths must be comma-separated integers, got {self.mlp_widths!r}"
                ) from None
            return {"widths": widths}
        if self.model == "vgg11":
            return {"width_multiplier": self.vgg_width_multiplier}
        raise ValueError(f"unknown model {self.model!r}; choose mlp or vgg11")


class Scenario:
    """Lazily loaded data and splits of a simulated federation of ``num_clients`` sites.

    ``num_clients=0`` describes a deployment: the sites hold their own data files, so there is no
    simulated split (only the test set, the model spec and a ``fusion-data`` file).
    """

    def __init__(
        self, settings: RunSettings, num_clients: int, *, train_set: ImageDataset | None = None
    ) -> None:
        if num_clients < 0:
            raise ValueError(f"num_clients must be >= 0, got {num_clients}")
        self.settings = settings
        self.num_clients = num_clients
        if train_set is not None:  # already loaded by another scenario of the same run
            self.__dict__["train_set"] = train_set

    def with_clients(self, num_clients: int) -> Scenario:
        """The same run split over another number of sites, sharing the data already loaded."""
        return Scenario(self.settings, num_clients, train_set=self.__dict__.get("train_set"))

    @cached_property
    def train_set(self) -> ImageDataset:
        return load_dataset(self.settings.dataset, "train", root=self.settings.data_root or None)

    @cached_property
    def test_set(self) -> ImageDataset:
        """The configured dataset's test split, or the ``test-data`` file when one is given."""
        if self.settings.test_data:
            test = load_npz_dataset(self.settings.test_data)
        else:
            test = load_dataset(self.settings.dataset, "test", root=self.settings.data_root or None)
        n = self.settings.test_samples
        if 0 < n < len(test):
            index = np.random.default_rng(self.settings.seed).choice(len(test), n, replace=False)
            test = test.subset(np.sort(index))
        return test

    @cached_property
    def partitions(self) -> list[np.ndarray]:
        """Training-set indices of every client (identical on every process for one seed)."""
        s = self.settings
        if self.num_clients == 0:
            raise ValueError("a deployment scenario (num_clients=0) has no simulated partitions")
        labels = self.train_set.labels.numpy()
        options = self._partitioner_options()
        parts = partition_labels(s.partitioner, labels, self.num_clients, seed=s.seed, **options)
        if s.train_samples > 0:
            rng = np.random.default_rng(s.seed + 1)
            parts = [
                np.sort(rng.choice(p, s.train_samples, replace=False))
                if len(p) > s.train_samples
                else p
                for p in parts
            ]
        return parts

    def _partitioner_options(self) -> dict[str, Any]:
        s = self.settings
        if s.partitioner == "dirichlet":
            return {"alpha_min": s.dirichlet_alpha_min, "min_max_ratio": s.dirichlet_min_max_ratio}
        if s.partitioner == "sharded" and s.sharded_class_groups:
            return {"class_groups": s.class_groups()}
        return {}

    def cache_fields(self) -> dict[str, Any]:
        """Everything that determines this scenario's split (the partition cache's key)."""
        s = self.settings
        return {
            "dataset": s.dataset,
            "data_root": str(resolve_data_root(s.data_root or None).resolve()),
            "partitioner": s.partitioner,
            "options": self._partitioner_options(),
            "seed": s.seed,
            "num_clients": self.num_clients,
            "train_samples": s.train_samples,
        }

    def client_data(self, partition_id: int, *, cached: bool = True) -> ImageDataset:
        """Site ``partition_id``'s training data.

        With ``cached`` (a site of a simulation), from the split's memory-mapped partition cache
        (:mod:`fedfuse.partition_cache`), written once by the first site that needs it; the
        site never loads the whole training set.
        """
        if not 0 <= partition_id < self.num_clients:
            raise ValueError(f"partition-id {partition_id} is outside 0..{self.num_clients - 1}")
        if not cached:
            return self.train_set.subset(self.partitions[partition_id])
        cache = PartitionCache.open_or_build(
            self.cache_fields(), lambda: (self.train_set, self.partitions)
        )
        return cache.client_data(partition_id)

    def class_counts(self) -> np.ndarray:
        """Clients x classes table of training samples."""
        return class_counts(
            self.train_set.labels.numpy(), self.partitions, self.train_set.num_classes
        )

    def fusion_set(self) -> ImageDataset:
        """The server's fusion set: the ``fusion-data`` file when one is given, else sampled
        from one client's partition (skewed, as in the paper) or from all training data."""
        s = self.settings
        if s.fusion_data:
            return load_npz_dataset(s.fusion_data)
        source: int | str = "all" if s.fusion_source == "all" else int(s.fusion_source)
        if isinstance(source, int) and source >= self.num_clients:
            raise ValueError(
                f"fusion-source {source} is not a client (there are {self.num_clients})"
            )
        try:
            index = sample_fusion_set(
                self.train_set.labels.numpy(),
                self.partitions,
                s.fusion_samples,
                source=source,
                seed=s.seed + 2,
            )
        except ValueError as error:
            raise ValueError(
                f"fusion set: {error} (lower fusion-samples, or use more training data)"
            ) from None
        return self.train_set.subset(index)

    def model_spec(self) -> ModelSpec:
        """The clients' architecture (sized by the fusion-set file in a deployment)."""
        reference = self.fusion_set() if self.settings.fusion_data else self.train_set
        return self.settings.model_spec_for(reference)


def client_seed(settings: RunSettings, partition_id: int) -> int:
    """Seed of a client's initialisation and training: its own in ``independent`` mode."""
    return settings.seed * 1000 + partition_id + 1


def initial_seed(settings: RunSettings) -> int:
    """Seed of the server's initial model (the common start in ``shared`` mode)."""
    return settings.seed * 1000


def scores_sample(dataset: ImageDataset, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``n`` samples of ``dataset`` (inputs, labels) for computing importance scores."""
    index = np.arange(len(dataset))
    if 0 < n < len(dataset):
        index = np.sort(np.random.default_rng(seed).choice(len(dataset), n, replace=False))
    return dataset.inputs(index), dataset.labels[index]
