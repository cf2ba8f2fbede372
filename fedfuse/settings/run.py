"""A run's settings: one flat object, key for key the Flower run config, and the seeds it derives.

Every entry point (the Flower apps, ``fedfuse simulate``, ``fedfuse compare`` through
:mod:`fedfuse.settings.hydra`, the benchmarks) turns its configuration into :class:`RunSettings`;
:meth:`RunSettings.fusion_methods` is the one place a run's fusion methods are built from it, and
:meth:`RunSettings.method_names` the one place its comma list of methods is read.
:class:`~fedfuse.federation.scenario.Scenario` (one floor up) turns the settings into data,
splits and models. What each key may hold, and how a run-config value is read, is
:mod:`fedfuse.settings.run_config`.

Defaults written once: :data:`DEFAULT_FUSION_SAMPLES` is the fusion set's size (written in
:mod:`fedfuse.settings.defaults`, which the command line reads without PyTorch). The Hydra
configs read it (``${fedfuse.default:fusion_samples}``, a resolver of
:mod:`fedfuse.settings.hydra`); the Flower app's ``pyproject.toml`` cannot import, so
``tests/test_settings.py`` keeps its ``[tool.flwr.app.config]`` identical to these defaults.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fedfuse.data import ImageDataset
from fedfuse.fusion.base import FusionMethod
from fedfuse.fusion.inversion import InvertedFusionSet
from fedfuse.fusion.options import parse_options
from fedfuse.fusion.registry import make_fusion_methods, parse_method_names
from fedfuse.fusion.statistics.class_gaussians import GaussianFusionSet
from fedfuse.models import ModelSpec, build_model, make_spec
from fedfuse.runtime import check_device
from fedfuse.settings.bounds import (
    DEFAULT_MAX_FUSED_PARAMETERS,
    Range,
    check_model_size,
    closest,
    parse_widths,
)
from fedfuse.settings.defaults import DEFAULT_FUSION_SAMPLES
from fedfuse.settings.run_config import (
    MODELS,
    RUN_CONFIG_KEY,
    check_field,
    convert_value,
    run_config_key,
)
from fedfuse.training.loop import TrainConfig


@dataclass(frozen=True)
class RunSettings:
    """Every knob of a one-shot federated fusion run (the Flower run config, key for key).

    Field ``foo_bar`` is run-config key ``foo-bar`` (``methods`` is ``strategy``); the defaults
    are the app's defaults in ``pyproject.toml`` (a test keeps the two identical).
    """

    dataset: str = "fashion-mnist"
    data_root: str = ""
    partitioner: str = "sharded"
    dirichlet_alpha_min: float = 1.0
    dirichlet_min_max_ratio: float = 0.2
    sharded_class_groups: str = ""
    train_samples: int = 0
    validation_share: float = 0.0
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
    #: the run's fusion methods, a comma list; its run-config key is ``strategy``, the name
    #: Flower users know (read it through :meth:`method_names` / :meth:`fusion_methods`)
    methods: str = field(default="auto,fedavg", metadata={RUN_CONFIG_KEY: "strategy"})
    fusion_options: str = ""
    fusion_samples: int = DEFAULT_FUSION_SAMPLES
    fusion_source: str = "0"
    fusion_augment_copies: int = 0
    fusion_augment_flip: bool = True
    fusion_augment_padding: int = 4
    fusion_invert_samples: int = 0
    fusion_invert_steps: int = 200
    fusion_gaussian_samples: int = 0
    fusion_gaussian_rank: int = 64
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
    secure_aggregation: bool = False
    secure_threshold: float = 0.5
    device: str = "auto"
    threads: int = 1
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        """Check every value (type, range or choice), naming its run-config key."""
        for settings_field in dataclasses.fields(self):
            if settings_field.name != "extra":
                check_field(settings_field, getattr(self, settings_field.name))
        from fedfuse.partitions import PARTITIONERS

        if self.partitioner not in PARTITIONERS:
            raise ValueError(
                f"run config key partitioner={self.partitioner!r} is unknown; choose from: "
                + ", ".join(sorted(PARTITIONERS))
            )
        check_device(self.device)
        if self.fusion_source not in ("all", "synthetic") and not self.fusion_source.isdigit():
            raise ValueError(
                "fusion-source must be a partition id, 'all' or 'synthetic', got "
                f"{self.fusion_source!r}"
            )
        if self.synthetic_fusion_set and self.fusion_data:
            raise ValueError("fusion-source='synthetic' and a fusion-data file: choose one")
        if self.synthetic_fusion_set and self.finetune_epochs and self.finetune_data != "sites":
            raise ValueError(
                "fusion-source='synthetic' has no real fusion set to fine-tune on; use "
                "finetune-data='sites'"
            )
        for key in ("fusion_invert_samples", "fusion_gaussian_samples"):
            if getattr(self, key) and self.synthetic_fusion_set:
                raise ValueError(
                    f"{key.replace('_', '-')} completes the real fusion set, and fusion-source="
                    "'synthetic' has none: choose one"
                )
        self.class_groups()
        self.architecture_options()
        self.fused_widths_request()
        if self.finetune_min_lr > self.finetune_lr:
            raise ValueError(
                "fine-tuning needs finetune-min-lr <= finetune-lr, got "
                f"{self.finetune_min_lr} and {self.finetune_lr}"
            )

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, allow_unknown: bool = False) -> RunSettings:
        """Parse a run config (``key-with-dashes`` names); unknown keys are an error naming them."""
        fields = {run_config_key(f): f for f in dataclasses.fields(cls) if f.name != "extra"}
        values: dict[str, Any] = {}
        unknown: dict[str, Any] = {}
        for key, value in config.items():
            if key not in fields:
                unknown[key] = value
                continue
            values[fields[key].name] = convert_value(key, fields[key].default, value)
        if unknown and not allow_unknown:
            key = sorted(unknown)[0]
            more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
            raise ValueError(f"unknown run config key {key!r}{more}; {closest(key, fields)}")
        return cls(**values, extra=unknown)

    def to_config(self) -> dict[str, Any]:
        """The settings as a run config (``key-with-dashes`` names)."""
        return {
            run_config_key(f): getattr(self, f.name)
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
        flip = []
        if self.fusion_augment_flip != RunSettings().fusion_augment_flip:
            flip.append("flip" if self.fusion_augment_flip else "noflip")
        changed = self._changed_keys({"fusion_augment_padding": "pad"})
        return _row_label("aug", f"x{self.fusion_augment_copies}", *flip, *changed)

    def fusion_inversion(self) -> InvertedFusionSet | None:
        """The run's fusion-set completion by BatchNorm inversion (None when it has none)."""
        if not self.fusion_invert_samples:
            return None
        return InvertedFusionSet(
            self.fusion_invert_samples,
            steps=self.fusion_invert_steps,
            seed=self.seed + 2,
            device=self.device,
        )

    def fusion_gaussians(self) -> GaussianFusionSet | None:
        """The run's fusion-set completion from the sites' class Gaussians (None when it has
        none)."""
        if not self.fusion_gaussian_samples:
            return None
        return GaussianFusionSet(
            self.fusion_gaussian_samples, rank=self.fusion_gaussian_rank, seed=self.seed + 3
        )

    def gaussian_label(self) -> str:
        """``+gauss(xN)`` (with ``rank=R`` where it differs from the default) for a result row
        whose fusion set was completed from the sites' class Gaussians; ``""`` otherwise."""
        if not self.fusion_gaussian_samples:
            return ""
        changed = self._changed_keys({"fusion_gaussian_rank": "rank"})
        return _row_label("gauss", f"x{self.fusion_gaussian_samples}", *changed)

    def widths_label(self) -> str:
        """``widths(2x)`` (or ``widths(w,w,...)``) for a result row fused into other widths than
        the sites' (``fused-widths``); ``""`` for the sites' own (``""`` or ``1x``)."""
        text = self.fused_widths.strip()
        same = not text or self.fused_widths_request() == 1.0
        return "" if same else f"widths({text.replace(' ', '')})"

    def fusion_set_label(self) -> str:
        """What a result row's label adds for its fusion set (:meth:`augment_label`, then
        :meth:`invert_label`, :meth:`gaussian_label`, space-separated); ``""`` for the plain one."""
        labels = (self.augment_label(), self.invert_label(), self.gaussian_label())
        return " ".join(label for label in labels if label)

    def invert_label(self) -> str:
        """``+inv(xN)`` (with ``steps=S`` where it differs from the default) for a result row
        whose fusion set was completed by BatchNorm inversion; ``""`` otherwise."""
        if not self.fusion_invert_samples:
            return ""
        changed = self._changed_keys({"fusion_invert_steps": "steps"})
        return _row_label("inv", f"x{self.fusion_invert_samples}", *changed)

    def finetune_label(self) -> str:
        """``+ft(<data>,<E>ep)`` (with the fine-tuning keys that differ from the defaults) for a
        fine-tuned result; ``""`` when the run does not fine-tune."""
        if not self.finetune_epochs:
            return ""
        changed = self._changed_keys(
            {
                "finetune_lr": "lr",
                "finetune_min_lr": "min_lr",
                "finetune_label_smoothing": "ls",
                "finetune_restart_epochs": "restart",
            },
            number_format="g",
        )
        return _row_label("ft", self.finetune_data, f"{self.finetune_epochs}ep", *changed)

    def _changed_keys(self, shorts: Mapping[str, str], *, number_format: str = "") -> list[str]:
        """``short=value`` for each field of ``shorts`` (field name -> short name in a result
        row's label) whose value differs from its default, in ``shorts``' order."""
        default = RunSettings()
        return [
            f"{short}={format(getattr(self, name), number_format)}"
            for name, short in shorts.items()
            if getattr(self, name) != getattr(default, name)
        ]

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

    def method_names(self) -> list[str]:
        """The names of the run's fusion methods (run config ``strategy``), in order."""
        return parse_method_names(self.methods)

    @property
    def synthetic_fusion_set(self) -> bool:
        """Whether the server's fusion set is generated from the uploaded models
        (``fusion-source=synthetic``,
        :class:`~fedfuse.fusion.methods.trained.dense.SyntheticFusionSet`)."""
        return self.fusion_source == "synthetic"

    def fusion_methods(self) -> list[FusionMethod]:
        """The run's fusion methods, configured with ``fusion-options``; the run's ``device``
        reaches every method that takes one. The one construction of a run's methods (the
        server, ``fedfuse simulate``'s check, and the library runner all call it)."""
        return make_fusion_methods(
            self.methods, self.fusion_options, defaults={"device": self.device}
        )

    def model_spec_for(self, data: ImageDataset) -> ModelSpec:
        """The configured architecture for ``data``'s input shape and class count."""
        return make_spec(
            self.model, data.input_shape, data.num_classes, **self.architecture_options()
        )

    def architecture_options(self) -> dict[str, Any]:
        if self.model == "mlp":
            return {"widths": tuple(parse_widths(self.mlp_widths, "mlp-widths"))}
        if self.model == "vgg11":
            return {"width_multiplier": self.vgg_width_multiplier}
        if self.model in ("resnet", "vit", "lenet5"):
            try:
                return parse_options(self.model_options)
            except ValueError as error:
                raise ValueError(f"model-options {self.model_options!r}: {error}") from None
        raise ValueError(f"unknown model {self.model!r}; choose from: {', '.join(MODELS)}")

    def fused_widths_request(self) -> float | list[int] | None:
        """``fused-widths`` checked on its own (no sites' spec needed): None (the sites'
        widths), a scale of every width (``"0.5x"``), or the widths (``"w,w,..."``)."""
        text = self.fused_widths.strip()
        if not text:
            return None
        if not text.endswith("x"):
            return parse_widths(text, "fused-widths")
        scale = Range(0, 64, integer=False, open_low=True)
        try:
            return scale.check("fused-widths scale", float(text[:-1]))
        except ValueError as error:
            raise ValueError(f"fused-widths {text!r}: {error}") from None

    def fused_spec(
        self, spec: ModelSpec, *, max_parameters: int = DEFAULT_MAX_FUSED_PARAMETERS
    ) -> ModelSpec | None:
        """The fused model's spec for sites of ``spec`` (run key ``fused-widths``): None for the
        sites' own; ``"0.5x"`` scales every hidden width; ``"w,w,..."`` gives them all. Its
        widths and parameter count (at most ``max_parameters``) are checked on the meta
        device, before anything is allocated."""
        request = self.fused_widths_request()
        if request is None:
            return None
        text = self.fused_widths.strip()
        if isinstance(request, float):
            widths = [max(1, round(w * request)) for w in spec.widths]
        else:
            widths = request
        try:
            target = spec.with_widths(widths)
            build_model(target, device="meta")
        except (ValueError, TypeError) as error:
            raise ValueError(
                f"fused-widths {text!r} does not fit the sites' {spec.arch} "
                f"(widths {list(spec.widths)}): {error}"
            ) from None
        check_model_size(
            target,
            max_parameters,
            f"fused-widths {text!r}: the fused {spec.arch}",
            "max_parameters, fedfuse fuse --max-parameters",
        )
        return None if target == spec else target


def _row_label(tag: str, *parts: str) -> str:
    """A result row's label part for one feature of the run: ``+tag(part,part,...)``."""
    return f"+{tag}({','.join(parts)})"


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
