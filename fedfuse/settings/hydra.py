"""One source of truth for a run's settings: the Hydra config and the Flower run config.

``configs/`` (package ``fedfuse.configs``) holds the Hydra groups (dataset, model, partition,
training, scores, fusion_set, finetune, method, runner) and experiment presets;
``compare.yaml`` is the primary config. :func:`settings_from_config` turns a composed config
into the :class:`~fedfuse.settings.run.RunSettings` that the Flower apps read (run-config
keys), and :func:`overrides_from_settings` turns run settings back into Hydra overrides, so either
side can describe a run and ``compose(overrides_from_settings(s)) -> s`` holds. An unknown key is
an error on both sides: :meth:`RunSettings.from_config` rejects unknown run-config keys, and
:func:`settings_from_config` rejects any config key this module does not map.

A config reads a run default instead of repeating it with the resolver
``${fedfuse.default:<field>}`` (e.g. ``fusion_set.samples: ${fedfuse.default:fusion_samples}``):
the :class:`RunSettings` default of that field, registered when this module is imported.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib.resources import files
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from fedfuse import fusion
from fedfuse.fusion import FUSION_METHODS, FusionMethod, make_fusion_method, parse_options
from fedfuse.settings.run import RunSettings

CONFIG_MODULE = "fedfuse.configs"
PRIMARY_CONFIG = "compare"
#: keys of the primary config that only ``fedfuse compare`` reads (not part of a Flower run)
COMPARE_KEYS = ("name", "sites", "sweep", "output_dir", "cache_dir", "save_models")
#: run-config keys of a Flower run that a Hydra config does not describe (deployment and
#: server plumbing); ``fedfuse simulate`` takes them from ``--run-config``
FLOWER_ONLY_KEYS = (
    "test-data",
    "min-nodes",
    "node-wait-timeout",
    "reply-timeout",
    "max-in-flight",
    "output-dir",
    "site-cache",
)
#: method options that do not change the fused model (kept out of row keys and labels)
NON_RESULT_OPTIONS = frozenset({"device", "progress", "batch_size_capture"})
#: the resolver a config names a run default with, ``${fedfuse.default:fusion_samples}``
DEFAULT_RESOLVER = "fedfuse.default"


def run_default(name: str) -> Any:
    """The :class:`RunSettings` default of field ``name`` (the ``fedfuse.default`` resolver)."""
    fields = {f.name: f for f in dataclasses.fields(RunSettings) if f.name != "extra"}
    if name not in fields:
        raise ValueError(f"${{{DEFAULT_RESOLVER}:{name}}}: RunSettings has no field {name!r}")
    return fields[name].default


OmegaConf.register_new_resolver(DEFAULT_RESOLVER, run_default, replace=True)


def _widths_to_run(value: Any) -> str:
    return ",".join(str(int(w)) for w in value)


def _widths_from_run(value: str) -> list[int]:
    return [int(w) for w in value.split(",") if w.strip()]


def _groups_to_run(value: Any) -> str:
    if value is None:
        return ""
    return ";".join(",".join(str(int(c)) for c in group) for group in value)


def _groups_from_run(value: str) -> list[list[int]] | None:
    return RunSettings(sharded_class_groups=value).class_groups()


def _options_to_run(value: Any) -> str:
    """A model's options mapping as run-config text, ``"depth=10 width_multiplier=0.25"``."""
    if not value:
        return ""
    return " ".join(f"{k}={json.dumps(v)}" for k, v in value.items())


def _options_from_run(value: str) -> dict[str, Any]:
    return parse_options(value)


@dataclass(frozen=True)
class Key:
    """One config key (``group.key`` or a root key) and the run-config field it sets."""

    path: str
    field: str
    to_run: Callable[[Any], Any] = lambda v: v
    from_run: Callable[[Any], Any] = lambda v: v


#: every Hydra key that is part of a Flower run, and its RunSettings field
KEYS: tuple[Key, ...] = (
    Key("dataset.name", "dataset"),
    Key("dataset.root", "data_root"),
    Key("model.name", "model"),
    Key("model.widths", "mlp_widths", _widths_to_run, _widths_from_run),
    Key("model.width_multiplier", "vgg_width_multiplier"),
    Key("model.options", "model_options", _options_to_run, _options_from_run),
    Key("fused_widths", "fused_widths", str, str),
    Key("partition.name", "partitioner"),
    Key("partition.alpha_min", "dirichlet_alpha_min"),
    Key("partition.min_max_ratio", "dirichlet_min_max_ratio"),
    Key("partition.class_groups", "sharded_class_groups", _groups_to_run, _groups_from_run),
    Key("training.init", "init"),
    Key("training.epochs", "local_epochs"),
    Key("training.batch_size", "batch_size"),
    Key("training.optimizer", "optimizer"),
    Key("training.lr", "lr"),
    Key("training.weight_decay", "weight_decay"),
    Key("training.label_smoothing", "label_smoothing"),
    Key("training.train_samples", "train_samples"),
    Key("training.validation_share", "validation_share"),
    Key("scores.method", "score_method"),
    Key("scores.samples", "score_samples"),
    Key("scores.steps", "score_steps"),
    Key("fusion_set.samples", "fusion_samples"),
    Key("fusion_set.source", "fusion_source", str, str),
    Key("fusion_set.data", "fusion_data"),
    Key("fusion_set.augment_copies", "fusion_augment_copies"),
    Key("fusion_set.augment_flip", "fusion_augment_flip"),
    Key("fusion_set.augment_padding", "fusion_augment_padding"),
    Key("fusion_set.invert_samples", "fusion_invert_samples"),
    Key("fusion_set.invert_steps", "fusion_invert_steps"),
    Key("fusion_set.gaussian_samples", "fusion_gaussian_samples"),
    Key("fusion_set.gaussian_rank", "fusion_gaussian_rank"),
    Key("finetune.data", "finetune_data"),
    Key("finetune.epochs", "finetune_epochs"),
    Key("finetune.lr", "finetune_lr"),
    Key("finetune.min_lr", "finetune_min_lr"),
    Key("finetune.label_smoothing", "finetune_label_smoothing"),
    Key("finetune.restart_epochs", "finetune_restart_epochs"),
    Key("seed", "seed"),
    Key("device", "device"),
    Key("threads", "threads"),
    Key("test_samples", "test_samples"),
)
#: groups whose option is chosen by a run-config value (group -> the key naming the option)
SELECTING_KEYS = {"dataset": "dataset.name", "model": "model.name", "partition": "partition.name"}
RUNNER_KEYS = {
    "library": ("name",),
    "flower": ("name", "cpus_per_client", "timeout", "ray_address"),
}


def config_dir():
    """The packaged ``configs/`` directory (a Traversable)."""
    return files(CONFIG_MODULE)


def available_options(group: str) -> list[str]:
    """Names of the packaged options of config group ``group`` (e.g. every ``method``)."""
    directory = config_dir() / group
    if not directory.is_dir():
        return []
    return sorted(
        e.name.removesuffix(".yaml") for e in directory.iterdir() if e.name.endswith(".yaml")
    )


def compose(overrides: Sequence[str] = (), config_name: str = PRIMARY_CONFIG) -> DictConfig:
    """The primary config composed with Hydra ``overrides`` (``key=value``, ``group=option``).

    Hydra's own errors (an unknown group option, an override of a key that does not exist)
    pass through; :func:`validate_config` then rejects keys this module does not map.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():  # inside a Hydra app, or a test's context
        return hydra_compose(config_name=config_name, overrides=list(overrides))
    with initialize_config_module(config_module=CONFIG_MODULE, version_base=None):
        return hydra_compose(config_name=config_name, overrides=list(overrides))


def _leaves(node: Any, prefix: str = "") -> Iterable[tuple[str, Any]]:
    for key, value in node.items():
        path = f"{prefix}{key}"
        if isinstance(value, DictConfig | Mapping) and path.count(".") == 0 and key != "method":
            yield from _leaves(value, prefix=f"{path}.")
        else:
            yield path, value


def validate_config(cfg: DictConfig) -> None:
    """Raise ValueError naming every key of ``cfg`` that fedfuse does not know."""
    known = {k.path for k in KEYS} | set(COMPARE_KEYS) | {"method", "hydra"}
    runner = cfg.get("runner") or {}
    runner_name = runner.get("name", "library")
    if runner_name not in RUNNER_KEYS:
        raise ValueError(f"runner.name {runner_name!r} is unknown; choose {sorted(RUNNER_KEYS)}")
    known |= {f"runner.{k}" for k in RUNNER_KEYS[runner_name]}
    unknown = [path for path, _ in _leaves(cfg) if path not in known]
    if unknown:
        raise ValueError(
            f"unknown config key(s) {sorted(unknown)}; known keys: {sorted(known - {'hydra'})}"
        )


def _method_class(target: str) -> type[FusionMethod]:
    """The registered method class that ``_target_`` names (no other import is done)."""
    registered = list(FUSION_METHODS.values())
    exported = {
        f"fedfuse.fusion.{name}": getattr(fusion, name)
        for name in fusion.__all__
        if any(getattr(fusion, name) is cls for cls in registered)
    }
    if target in exported:
        return exported[target]
    for cls in registered:
        if target == f"{cls.__module__}.{cls.__qualname__}":
            return cls
    known = sorted(exported)
    raise ValueError(f"method._target_ {target!r} is not a fusion method; known: {known}")


def method_from_config(node: Mapping[str, Any] | DictConfig) -> FusionMethod:
    """The fusion method a ``method`` config node describes (``_target_`` plus its options);
    unknown options and wrong types are errors naming the method and the key."""
    data = (
        OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    )
    if not isinstance(data, dict) or "_target_" not in data:
        raise ValueError("the method config needs a _target_ naming a fusion method class")
    cls = _method_class(str(data.pop("_target_")))
    return make_fusion_method(cls.name, **data)


def method_label(method: FusionMethod) -> str:
    """A row label: the method's name and the options that differ from its defaults."""
    defaults = method.option_defaults()
    changed = {
        k: v
        for k, v in method.options().items()
        if k not in NON_RESULT_OPTIONS and k in defaults and v != defaults[k]
    }
    if not changed:
        return method.name
    return f"{method.name} ({', '.join(f'{k}={v}' for k, v in sorted(changed.items()))})"


def _fusion_options(method: FusionMethod) -> str:
    defaults = method.option_defaults()
    return " ".join(
        f"{k}={json.dumps(v)}"
        for k, v in method.options().items()
        if k != "device" and k in defaults and v != defaults[k]
    )


def settings_from_config(cfg: DictConfig, method: FusionMethod | None = None) -> RunSettings:
    """The Flower run settings a composed config describes (validated both ways); ``method`` is
    the config's method when the caller built it already (:func:`method_from_config`)."""
    validate_config(cfg)
    values: dict[str, Any] = {}
    for key in KEYS:
        node = OmegaConf.select(cfg, key.path, throw_on_missing=True)
        if node is None and key.path != "partition.class_groups":
            continue  # a group option without this key (e.g. iid has no alpha_min)
        if isinstance(node, DictConfig | ListConfig):
            node = OmegaConf.to_container(node, resolve=True)
        try:
            values[key.field.replace("_", "-")] = key.to_run(node)
        except (TypeError, ValueError) as error:
            raise ValueError(f"config key {key.path}={node!r}: {error}") from None
    if method is None:
        method = method_from_config(cfg.method)
    values["strategy"] = method.name
    values["fusion-options"] = _fusion_options(method)
    values["min-nodes"] = int(cfg.sites)
    try:
        return RunSettings.from_config(values)
    except ValueError as error:  # name the Hydra key the user wrote
        text = str(error)
        paths = [k.path for k in KEYS if f" {k.field.replace('_', '-')}=" in text]
        raise ValueError(f"config key {paths[0]}: {text}" if paths else text) from None


def overrides_from_settings(settings: RunSettings, sites: int | None = None) -> list[str]:
    """Hydra overrides of the primary config that describe ``settings`` (one method).

    Group options are chosen by name where a packaged option exists (``partition=dirichlet``),
    then every mapped key is set, so the composed config gives back ``settings``.
    """
    methods = settings.method_names()
    if len(methods) != 1:
        raise ValueError(
            f"a Hydra config holds one method, the run config names {methods}; "
            "sweep several with fedfuse compare -m method=a,b"
        )
    overrides = []
    for group, path in SELECTING_KEYS.items():
        value = getattr(settings, next(k.field for k in KEYS if k.path == path))
        if value in available_options(group):
            overrides.append(f"{group}={value}")
    overrides.append(f"method={methods[0]}")
    for key in KEYS:
        value = key.from_run(getattr(settings, key.field))
        if key.path.startswith("partition.") and key.path != "partition.name":
            own = {"dirichlet": ("alpha_min", "min_max_ratio"), "sharded": ("class_groups",)}
            if key.path.split(".")[1] not in own.get(settings.partitioner, ()):
                continue
        if key.path.startswith("model.") and key.path != "model.name":
            own_model = {
                "mlp": ("widths",),
                "vgg11": ("width_multiplier",),
                "resnet": ("options",),
                "vit": ("options",),
                "lenet5": ("options",),
            }
            if key.path.split(".")[1] not in own_model.get(settings.model, ()):
                continue
        overrides.append(f"{key.path}={_override_value(value)}")
    for name, value in parse_options(settings.fusion_options).items():
        if "." in name:
            raise ValueError(f"fusion option {name!r}: a Hydra config holds one method")
        overrides.append(f"method.{name}={_override_value(value)}")
    if sites is not None:
        overrides.append(f"sites={sites}")
    return overrides


def _override_value(value: Any) -> str:
    """``value`` in Hydra's override grammar (quoted strings, JSON-like lists, null)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, list | tuple):
        return "[" + ",".join(_override_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_override_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


#: Hydra's command-line flags that take a value (the value is no override)
_VALUE_FLAGS = frozenset(
    {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn"}
    | {"--config-dir", "-cd", "--experimental-rerun"}
)
#: flags after which Hydra only prints help: nothing is composed, so nothing is checked
_HELP_FLAGS = frozenset({"--help", "-h", "--hydra-help", "--shell-completion", "-sc", "--info"})


def config_groups() -> list[str]:
    """The packaged config groups (``dataset``, ``method``, ``experiment``, ...)."""
    return sorted(
        e.name for e in config_dir().iterdir() if e.is_dir() and not e.name.startswith("_")
    )


def _paths(node: Any, prefix: str = "") -> Iterable[str]:
    """Every key path of a config, inner nodes included."""
    for key, value in node.items():
        yield f"{prefix}{key}"
        if isinstance(value, DictConfig):
            yield from _paths(value, f"{prefix}{key}.")


def _method_options(name: str) -> list[str]:
    node = compose([f"method={name}"]).method
    return _method_class(str(node["_target_"])).accepted_options()


def validate_overrides(arguments: Sequence[str]) -> list[str]:
    """Check the overrides among Hydra command-line ``arguments`` before Hydra composes them.

    Raises ValueError in one line for an override that does not parse, an unknown group option
    (naming the options), an unknown key (naming the closest known ones) or a method option
    that a chosen method does not take. Returns ``arguments`` with each override of a method
    option its yaml does not list written ``++method.<option>=...`` (added, else changed).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from fedfuse.settings.bounds import closest

    arguments = list(arguments)
    if _HELP_FLAGS & set(arguments):
        return arguments
    positions, skip = [], False
    for index, argument in enumerate(arguments):
        if skip or argument.startswith("-"):
            skip = not skip and argument in _VALUE_FLAGS
            continue
        positions.append(index)
    parser = OverridesParser.create()
    overrides = {}
    for index in positions:
        try:
            overrides[index] = parser.parse_override(arguments[index])
        except HydraException as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else "syntax error"
            raise ValueError(f"cannot parse override {arguments[index]!r}: {first}") from None
    groups = config_groups()
    chosen: dict[str, list[str]] = {}
    for override in overrides.values():
        group = override.key_or_group
        if group not in groups or override.package is not None or override.is_delete():
            continue
        values = (
            list(override.sweep_string_iterator())
            if override.is_sweep_override()
            else [override.value()]
        )
        options = available_options(group)
        for value in values:
            if value is not None and str(value) not in options:
                raise ValueError(f"unknown {group} {value!r}; choose from: {', '.join(options)}")
        chosen[group] = [str(v) for v in values if v is not None]
    try:
        cfg = compose([f"{group}={values[0]}" for group, values in chosen.items() if values])
    except HydraException as error:
        raise ValueError(str(error).strip().splitlines()[0]) from None
    known = set(_paths(cfg))
    fedfuse_keys = {k.path for k in KEYS} | set(COMPARE_KEYS)
    if "method" in chosen:
        accepted_by = {m: _method_options(m) for m in chosen["method"]}
    else:
        cls = _method_class(str(cfg.method["_target_"]))
        accepted_by = {cls.name: cls.accepted_options()}
    for index, override in overrides.items():
        key = override.key_or_group
        if key in groups or key.split(".")[0].split("/")[0] == "hydra":
            continue
        if key.startswith("method."):
            option = key.removeprefix("method.")
            for method, accepted in accepted_by.items():
                if option not in accepted:
                    raise ValueError(
                        f"method {method!r} has no option {option!r}; {closest(option, accepted)}"
                    )
            if override.type.name == "CHANGE":
                arguments[index] = "++" + arguments[index]
            continue
        if key in known or (override.is_add() and key in fedfuse_keys):
            continue
        depth = key.count(".")
        candidates = [k for k in known if k.count(".") == depth] + ([] if depth else groups)
        raise ValueError(f"unknown config key {key!r}; {closest(key, candidates)}")
    return arguments
