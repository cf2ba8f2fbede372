"""What each run-config key may hold, and how a run-config value is read.

:class:`~fedfuse.settings.run.RunSettings` declares the keys (one field a key, its default the
app's default); this module holds the rules its fields are checked against (:data:`RANGES`,
:data:`CHOICES`, the field's type) and the conversion of a run-config value (a Flower run config
may give ``"3"`` for 3, ``"true"`` for True) into the field's type. Every error names the
run-config key, as the user wrote it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fedfuse.models.importance import SCORE_METHODS
from fedfuse.settings.bounds import Range
from fedfuse.training.finetune import FINETUNE_DATA
from fedfuse.training.loop import OPTIMIZERS

INIT_MODES = ("independent", "shared")
MODELS = ("mlp", "vgg11", "resnet", "vit", "lenet5")
#: a field's metadata key for a run-config key other than its name with dashes
RUN_CONFIG_KEY = "run_config_key"

#: the allowed values of every numeric field (a test keeps every one listed)
RANGES: dict[str, Range] = {
    "dirichlet_alpha_min": Range(0, 1e6, integer=False, open_low=True),
    "dirichlet_min_max_ratio": Range(0, 1, integer=False, open_low=True),
    "train_samples": Range(0, 10**9),
    "validation_share": Range(0, 0.9, integer=False),
    "seed": Range(0, 10**6),
    "vgg_width_multiplier": Range(0, 64, integer=False, open_low=True),
    "local_epochs": Range(0, 10_000),
    "batch_size": Range(1, 2**20),
    "lr": Range(0, 100, integer=False, open_low=True),
    "weight_decay": Range(0, 100, integer=False),
    "label_smoothing": Range(0, 0.999, integer=False),
    "score_samples": Range(1, 10**7),
    "score_steps": Range(1, 10_000),
    "fusion_samples": Range(1, 10**7),
    "fusion_augment_copies": Range(0, 1_000),
    "fusion_augment_padding": Range(0, 1_000),
    "fusion_invert_samples": Range(0, 10**6),
    "fusion_invert_steps": Range(1, 10**6),
    "fusion_gaussian_samples": Range(0, 10**6),
    "fusion_gaussian_rank": Range(0, 10**5),
    "test_samples": Range(0, 10**9),
    "min_nodes": Range(1, 10**6),
    "node_wait_timeout": Range(0, 10**7, integer=False, open_low=True),
    "reply_timeout": Range(0, 10**7, integer=False, open_low=True),
    "max_in_flight": Range(0, 10**6),
    "finetune_epochs": Range(0, 10_000),
    "finetune_lr": Range(0, 100, integer=False, open_low=True),
    "finetune_min_lr": Range(0, 100, integer=False),
    "finetune_label_smoothing": Range(0, 0.999, integer=False),
    "finetune_restart_epochs": Range(0, 10_000),
    "threads": Range(0, 1_024),
    "secure_threshold": Range(0, 1, integer=False, open_low=True),
}
#: the allowed values of the fields that name a choice
CHOICES: dict[str, tuple[str, ...]] = {
    "model": MODELS,
    "init": INIT_MODES,
    "optimizer": OPTIMIZERS,
    "score_method": SCORE_METHODS,
    "finetune_data": FINETUNE_DATA,
}


def run_config_key(settings_field: dataclasses.Field) -> str:
    """The run-config key of a :class:`~fedfuse.settings.run.RunSettings` field."""
    return settings_field.metadata.get(RUN_CONFIG_KEY, settings_field.name.replace("_", "-"))


def convert_value(key: str, default: Any, value: Any) -> Any:
    """A run-config value as its field's type (the default's); an error names the key."""
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    try:
        if isinstance(default, bool):
            return _as_bool(value)
        if isinstance(value, bool):
            pass  # a boolean is no number
        elif isinstance(default, int) and (
            isinstance(value, str | int) or isinstance(value, float) and value.is_integer()
        ):
            return int(value)
        elif isinstance(default, float) and isinstance(value, int | float | str):
            return float(value)
        if isinstance(default, str | dict):
            return type(default)(value)
    except (TypeError, ValueError):
        pass
    raise ValueError(
        f"run config key {key}={value!r} must be {kind.get(type(default), type(default).__name__)}"
    )


def check_field(settings_field: dataclasses.Field, value: Any) -> None:
    """Raise ValueError naming the run-config key unless ``value`` has the field's type and
    lies in its :data:`RANGES` or :data:`CHOICES`."""
    key = run_config_key(settings_field)
    default = settings_field.default
    if isinstance(default, bool):
        fits = isinstance(value, bool)
    elif isinstance(default, int):
        fits = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        fits = isinstance(value, int | float) and not isinstance(value, bool)
    else:
        fits = isinstance(value, type(default))
    if not fits:
        raise ValueError(f"run config key {key}={value!r} must be a {type(default).__name__}")
    bound = RANGES.get(settings_field.name)
    if bound is not None and not bound.contains(value):
        raise ValueError(f"run config key {key}={value!r} is out of range; allowed: {bound}")
    choices = CHOICES.get(settings_field.name)
    if choices is not None and value not in choices:
        raise ValueError(
            f"run config key {key}={value!r} is unknown; choose from: {', '.join(choices)}"
        )


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
