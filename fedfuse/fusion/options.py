"""A fusion method's options: parsed from ``key=value`` text, checked against its constructor's
type hints and bounds, and held as a frozen dataclass generated per method (its config)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import types
import typing
from collections.abc import Iterable
from dataclasses import field
from typing import Any

from fedfuse.fusion.bounds import check_option_bounds
from fedfuse.runtime import check_device

#: a fusion method's class (:class:`fedfuse.fusion.base.FusionMethod` or a subclass); typed
#: loosely here because the base class imports this module
MethodClass = Any

_LITERALS = {"true": True, "false": False, "null": None, "none": None}


def parse_options(assignments: str | Iterable[str]) -> dict[str, Any]:
    """``"ridge=0.1 n_init=4"`` (or a list of ``key=value``) as a dict.

    Values are decoded as JSON when they parse (numbers, quoted strings, lists); ``true``,
    ``false``, ``null``/``none`` in any case; anything else stays a string, so ``preset=setting2``
    works unquoted. Dashes in option names become underscores (a ``method.`` prefix keeps its
    own). A key given twice is an error.
    """
    items = assignments.split() if isinstance(assignments, str) else list(assignments)
    options: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        prefix, dot, name = key.strip().rpartition(".")
        key = prefix + dot + name.replace("-", "_")  # a method prefix keeps its dashes
        if not sep or not key:
            raise ValueError(f"fusion option {item!r} is not of the form key=value")
        if key in options:
            raise ValueError(f"fusion option {key!r} is given twice")
        if raw.strip().lower() in _LITERALS:
            options[key] = _LITERALS[raw.strip().lower()]
            continue
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        except RecursionError:
            raise ValueError(f"fusion option {key!r}: value is nested too deeply") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"fusion option {key}={raw!r} must be a finite number")
        options[key] = value
    return options


def forwards_options(init: Any) -> bool:
    """Whether the constructor ``init`` passes ``**`` options on (to its parent's)."""
    parameters = inspect.signature(init).parameters.values()
    return any(p.kind is p.VAR_KEYWORD for p in parameters)


def declared_options(init: Any) -> list[inspect.Parameter]:
    """The options the constructor ``init`` declares itself (not ``self``, not ``**``)."""
    parameters = inspect.signature(init).parameters.values()
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p for p in parameters if p.name != "self" and p.kind not in variadic]


def _option_types(cls: MethodClass) -> dict[str, Any]:
    """The type hints of ``cls``'s options, each from the constructor that declares it (the
    nearest, as :meth:`~fedfuse.fusion.base.FusionMethod.option_defaults`)."""
    types_of: dict[str, Any] = {}
    declared: set[str] = set()
    for init in cls.option_constructors():
        try:
            hints = typing.get_type_hints(init)
        except (NameError, TypeError):  # an unresolvable annotation: fall back to the defaults
            hints = {}
        for name in (p.name for p in declared_options(init)):
            if name not in declared and name in hints:
                types_of[name] = hints[name]
            declared.add(name)
    return types_of


def _matches(value: Any, hint: Any) -> bool:
    """Whether ``value`` fits the simple type ``hint`` (unknown hints: the constructor checks)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return True


def _describe_hint(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_describe_hint(arg) for arg in typing.get_args(hint))
    return "None" if hint is type(None) else getattr(hint, "__name__", str(hint))


def _check_option_types(cls: MethodClass, options: dict[str, Any]) -> None:
    """Reject values of another type than the option's annotation (``ridge="abc"``), or, for
    an unannotated option, than its default; and device names that are not devices."""
    hints = _option_types(cls)
    defaults = cls.option_defaults()
    for key, value in options.items():
        hint = hints.get(key)
        if hint is None:
            default = defaults.get(key)
            hint = type(default) if default is not None else None
        if hint is not None and not _matches(value, hint):
            raise ValueError(
                f"fusion method {cls.name!r}: option {key}={value!r} must be "
                f"{_describe_hint(hint)} (default {defaults.get(key)!r})"
            )
        if key == "device":
            try:
                check_device(value)
            except ValueError as error:
                raise ValueError(f"fusion method {cls.name!r}: option {error}") from None
    check_option_bounds(cls, options)


def check_options(cls: MethodClass, options: dict[str, Any]) -> None:
    """Reject options ``cls``'s constructor does not take, and values of the wrong type."""
    accepted = cls.accepted_options()
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(
            f"fusion method {cls.name!r} has no option(s) {unknown}; it accepts "
            f"{accepted or 'none'}"
        )
    _check_option_types(cls, options)


_CONFIG_CLASSES: dict[type, type] = {}


def config_values(config: Any) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def _config_from_values(cls: MethodClass, values: dict[str, Any]) -> Any:
    """Unpickle a config: rebuild it through its method class (the dataclass is generated)."""
    return cls.config_class()(**values)


def config_class_of(cls: MethodClass) -> type:
    """``cls``'s config dataclass, generated once per class."""
    config = _CONFIG_CLASSES.get(cls)
    if config is None:
        config = _CONFIG_CLASSES[cls] = _make_config_class(cls)
    return config


def _make_config_class(cls: MethodClass) -> type:
    hints = _option_types(cls)
    specs = []
    for name, default in cls.option_defaults().items():
        default_field = (
            dataclasses.field() if default is inspect.Parameter.empty else field(default=default)
        )
        specs.append((name, hints.get(name, Any), default_field))

    def __post_init__(self: Any) -> None:  # noqa: N807
        _check_option_types(cls, config_values(self))

    def __reduce__(self: Any) -> tuple[Any, ...]:  # noqa: N807
        return (_config_from_values, (cls, config_values(self)))

    name = f"{cls.__name__}Config"
    config = dataclasses.make_dataclass(
        name,
        specs,
        frozen=True,
        namespace={"__post_init__": __post_init__, "__reduce__": __reduce__},
    )
    config.__module__ = cls.__module__
    config.__doc__ = (
        f"The options of :class:`{cls.__module__}.{cls.__name__}` (fusion method "
        f"{getattr(cls, 'name', cls.__name__)!r}); see its docstring."
    )
    return config
