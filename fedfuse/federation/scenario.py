"""A federated scenario from the run's settings: data, split, models, fusion set, test set.

The Flower apps (``fedfuse.clients``, ``fedfuse.strategies``), the CLI and the benchmarks all turn
their configuration into :class:`~fedfuse.settings.run.RunSettings` and ask a :class:`Scenario`
for what they need, so every entry point splits data, sizes models and samples the fusion set the
same way.
"""

from __future__ import annotations

import logging
from functools import cached_property
from typing import Any

import numpy as np

from fedfuse.data import ImageDataset, load_dataset, load_npz_dataset, resolve_data_root
from fedfuse.data.augmentation import augment_dataset
from fedfuse.data.partition_cache import PartitionCache
from fedfuse.models import ModelSpec
from fedfuse.partitions import class_counts, partition_labels, sample_fusion_set
from fedfuse.settings.run import RunSettings

log = logging.getLogger(__name__)


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
        (:mod:`fedfuse.data.partition_cache`), written once by the first site that needs it; the
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
        from one client's partition (skewed, as in the paper) or from all training data; with
        ``fusion-augment-copies`` > 0, followed by that many randomly cropped (and flipped)
        copies of it (:func:`~fedfuse.data.augmentation.augment_dataset`)."""
        s = self.settings
        if s.fusion_data:
            return self._augmented(load_npz_dataset(s.fusion_data))
        if s.synthetic_fusion_set:
            raise ValueError(
                "fusion-source='synthetic': the fusion set is generated from the sites' "
                "uploaded models (fedfuse.fusion.methods.trained.dense.SyntheticFusionSet), "
                "not sampled"
            )
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
        return self._augmented(self.train_set.subset(index))

    def _augmented(self, fusion_set: ImageDataset) -> ImageDataset:
        """The fusion set with its ``fusion-augment-copies`` crops and flips appended."""
        s = self.settings
        if not s.fusion_augment_copies:
            return fusion_set
        augmented = augment_dataset(
            fusion_set,
            copies=s.fusion_augment_copies,
            seed=s.seed + 3,
            flip=s.fusion_augment_flip,
            crop_padding=s.fusion_augment_padding,
        )
        log.info(
            "fusion set: %d samples and %d augmented copies (flips %s, crops up to %d px): %d",
            len(fusion_set),
            s.fusion_augment_copies,
            "on" if s.fusion_augment_flip else "off",
            s.fusion_augment_padding,
            len(augmented),
        )
        return augmented

    def model_spec(self) -> ModelSpec:
        """The clients' architecture (sized by the fusion-set file in a deployment)."""
        fusion_data = self.settings.fusion_data
        reference = load_npz_dataset(fusion_data) if fusion_data else self.train_set
        return self.settings.model_spec_for(reference)
