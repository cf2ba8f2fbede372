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

from fedfuse.data import ImageDataset, load_dataset, load_npz_dataset, resolve_data_root
from fedfuse.data.augmentation import augment_dataset
from fedfuse.data.partition_cache import PartitionCache
from fedfuse.fusion import FusionMethod, make_fusion_methods
from fedfuse.models import ModelSpec, build_model, make_spec
from fedfuse.partitions import class_counts, partition_labels, sample_fusion_set
from fedfuse.runtime import check_device
from fedfuse.training.finetune import FINETUNE_DATA
from fedfuse.training.loop import TrainConfig

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
    model_options: str = ""
    fused_widths: str = ""
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
    fusion_augment_copies: int = 0
    fusion_augment_flip: bool = True
    fusion_augment_padding: int = 4
    test_samples: int = 0
    fusion_data: str = ""
    test_data: str = ""
    min_nodes: int = 2
    node_wait_timeout: float = 120.0
    reply_timeout: float = 1800.0
    max_in_flight: int = 0
    output_dir: str = "outputs"
    site_cache: str = ""
    finetune_epochs: int = 0
    finetune_data: str = "fusion-set"
    finetune_lr: float = 0.0003
    finetune_min_lr: float = 1e-06
    finetune_label_smoothing: float = 0.1
    finetune_restart_epochs: int = 0
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
        if self.fusion_augment_copies < 0 or self.fusion_augment_padding < 0:
            raise ValueError(
                "fusion-augment-copies and fusion-augment-padding must be >= 0, got "
                f"{self.fusion_augment_copies} and {self.fusion_augment_padding}"
            )
        if self.finetune_data not in FINETUNE_DATA:
            raise ValueError(
                f"finetune-data must be one of {FINETUNE_DATA}, got {self.finetune_data!r}"
            )
        if self.finetune_epochs < 0 or self.finetune_restart_epochs < 0:
            raise ValueError(
                "finetune-epochs and finetune-restart-epochs must be >= 0, got "
                f"{self.finetune_epochs} and {self.finetune_restart_epochs}"
            )
        if not self.finetune_lr > 0 or not 0 <= self.finetune_min_lr <= self.finetune_lr:
            raise ValueError(
                "fine-tuning needs finetune-lr > 0 and 0 <= finetune-min-lr <= finetune-lr, got "
                f"{self.finetune_lr} and {self.finetune_min_lr}"
            )
        if not 0 <= self.finetune_label_smoothing < 1:
            raise ValueError(
                f"finetune-label-smoothing must be in [0, 1), got {self.finetune_label_smoothing}"
            )

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
                    _as_bool(value) if isinstance(default, bool) else type(default)(value)
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

    def finetune_options(self) -> dict[str, Any]:
        """The fine-tuning keys (``finetune-*``) of the run, by their short names."""
        return {
            "data": self.finetune_data,
            "epochs": self.finetune_epochs,
            "lr": self.finetune_lr,
            "min_lr": self.finetune_min_lr,
            "label_smoothing": self.finetune_label_smoothing,
            "restart_epochs": self.finetune_restart_epochs,
        }

    def finetune_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :func:`fedfuse.training.finetune.finetune` for this run: the
        fine-tuning keys, and the sites' recipe for the rest (their optimizer, weight decay, batch
        size and augmentation, as the paper fine-tunes with the base models' optimizer)."""
        train = self.train_config()
        return {
            "epochs": self.finetune_epochs,
            "lr": self.finetune_lr,
            "min_lr": self.finetune_min_lr,
            "label_smoothing": self.finetune_label_smoothing,
            "restart_epochs": self.finetune_restart_epochs,
            "optimizer": train.optimizer,
            "weight_decay": train.weight_decay,
            "momentum": train.momentum,
            "batch_size": train.batch_size,
            "augment": train.augment,
            "device": self.device,
        }

    def fusion_augment_options(self) -> dict[str, Any] | None:
        """The fusion-set augmentation of the run (None when it has none)."""
        if not self.fusion_augment_copies:
            return None
        return {
            "copies": self.fusion_augment_copies,
            "flip": self.fusion_augment_flip,
            "padding": self.fusion_augment_padding,
        }

    def augment_label(self) -> str:
        """``+aug(xN)`` (with ``noflip`` / ``pad=P`` where they differ from the defaults) for a
        result row whose fusion set was augmented; ``""`` otherwise."""
        if not self.fusion_augment_copies:
            return ""
        parts = [f"x{self.fusion_augment_copies}"]
        default = RunSettings()
        if self.fusion_augment_flip != default.fusion_augment_flip:
            parts.append("flip" if self.fusion_augment_flip else "noflip")
        if self.fusion_augment_padding != default.fusion_augment_padding:
            parts.append(f"pad={self.fusion_augment_padding}")
        return f"+aug({','.join(parts)})"

    def finetune_label(self) -> str:
        """``+ft(<data>,<E>ep)`` (with the fine-tuning keys that differ from the defaults) for a
        fine-tuned result; ``""`` when the run does not fine-tune."""
        if not self.finetune_epochs:
            return ""
        parts = [self.finetune_data, f"{self.finetune_epochs}ep"]
        default = RunSettings()
        for name, short in (
            ("finetune_lr", "lr"),
            ("finetune_min_lr", "min_lr"),
            ("finetune_label_smoothing", "ls"),
            ("finetune_restart_epochs", "restart"),
        ):
            if getattr(self, name) != getattr(default, name):
                parts.append(f"{short}={getattr(self, name):g}")
        return f"+ft({','.join(parts)})"

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
        return make_spec(
            self.model, data.input_shape, data.num_classes, **self.architecture_options()
        )

    def architecture_options(self) -> dict[str, Any]:
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
        if self.model in ("resnet", "vit"):
            from fedfuse.fusion.base import (
                parse_options,  # local: fusion imports the scenario's data
            )

            try:
                return parse_options(self.model_options)
            except ValueError as error:
                raise ValueError(f"model-options {self.model_options!r}: {error}") from None
        raise ValueError(f"unknown model {self.model!r}; choose mlp, vgg11, resnet or vit")

    def fused_spec(self, spec: ModelSpec) -> ModelSpec | None:
        """The fused model's spec for sites of ``spec`` (run key ``fused-widths``): None for the
        sites' own; ``"0.5x"`` scales every hidden width; ``"w,w,..."`` gives them all."""
        text = self.fused_widths.strip()
        if not text:
            return None
        try:
            if text.endswith("x"):
                scale = float(text[:-1])
                if not 0 < scale <= 64:
                    raise ValueError("a scale must be in (0, 64]")
                widths = [max(1, round(w * scale)) for w in spec.widths]
            else:
                widths = [int(w) for w in text.split(",")]
            target = spec.with_widths(widths)
            build_model(target, device="meta")
        except (ValueError, TypeError) as error:
            raise ValueError(
                f"fused-widths {text!r} does not fit the sites' {spec.arch} "
                f"(widths {list(spec.widths)}): {error}"
            ) from None
        return None if target == spec else target


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


def client_seed(settings: RunSettings, partition_id: int) -> int:
    """Seed of a client's initialisation and training: its own in ``independent`` mode."""
    return settings.seed * 1000 + partition_id + 1


def initial_seed(settings: RunSettings) -> int:
    """Seed of the server's initial model (the common start in ``shared`` mode)."""
    return settings.seed * 1000


def finetune_seed(settings: RunSettings, partition_id: int | None = None) -> int:
    """Seed of fine-tuning after fusion: on the fusion set (``partition_id`` None) or on a site."""
    base = initial_seed(settings) if partition_id is None else client_seed(settings, partition_id)
    return 1_000_000_007 + base


def _as_bool(value: Any) -> bool:
    """A run-config boolean: a bool, 0/1, or true/false/yes/no/on/off in any case."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _BOOLEAN_WORDS:
        return _BOOLEAN_WORDS[value.strip().lower()]
    raise ValueError(f"not a boolean: {value!r}")


_BOOLEAN_WORDS = {
    "true": True,
    "false": False,
    "yes": True,
    "no": False,
    "on": True,
    "off": False,
    "1": True,
    "0": False,
}


def scores_sample(dataset: ImageDataset, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``n`` samples of ``dataset`` (inputs, labels) for computing importance scores."""
    index = np.arange(len(dataset))
    if 0 < n < len(dataset):
        index = np.sort(np.random.default_rng(seed).choice(len(dataset), n, replace=False))
    return dataset.inputs(index), dataset.labels[index]
