"""The registry that names the fusion methods, and methods built from names and options.

A method registers itself with :func:`register_fusion_method`; :func:`make_fusion_method` and
:func:`make_fusion_methods` build them from a name (or a comma list) and ``key=value`` options,
whose errors name the method, the option and the accepted ones.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from fedfuse.fusion.base import FusionMethod
from fedfuse.fusion.options import check_options, parse_options

FUSION_METHODS: dict[str, type[FusionMethod]] = {}


def register_fusion_method(cls: type[FusionMethod]) -> type[FusionMethod]:
    """Class decorator adding ``cls`` to :data:`FUSION_METHODS` under ``cls.name``."""
    if cls.name in FUSION_METHODS:
        raise ValueError(f"fusion method {cls.name!r} is registered twice")
    FUSION_METHODS[cls.name] = cls
    return cls


def make_fusion_method(name: str, **options: Any) -> FusionMethod:
    """Instantiate the method registered as ``name``; unknown names or options are errors."""
    try:
        cls = FUSION_METHODS[name]
    except KeyError:
        raise ValueError(
            f"unknown fusion method {name!r}; known: {sorted(FUSION_METHODS)}"
        ) from None
    check_options(cls, options)
    return cls(**options)


def parse_method_names(names: str) -> list[str]:
    """The method names of a comma list, ``"kf-linear, otfusion"`` -> ``["kf-linear",
    "otfusion"]`` (blanks dropped; the names are not looked up). The one place such a list is
    split: the run config's ``strategy``, ``fedfuse speed --methods``. A name listed twice is
    an error (it would fuse the same uploads twice, under one name)."""
    listed = [n.strip() for n in names.split(",") if n.strip()]
    twice = sorted(name for name, count in Counter(listed).items() if count > 1)
    if twice:
        raise ValueError(f"fusion methods listed more than once: {', '.join(twice[:5])}")
    return listed


def make_fusion_methods(
    names: str, options: str = "", *, defaults: dict[str, Any] | None = None
) -> list[FusionMethod]:
    """Several methods from ``"kf-linear,otfusion"`` and options ``"ridge=0.1 otfusion.reg=0.05"``.

    An unprefixed option goes to every listed method that accepts it (it is an error if none
    does); ``method.key=value`` goes to that method only. ``defaults`` (e.g. the run's
    ``device``) go to every method that accepts them, unless an option sets them.
    """
    listed = parse_method_names(names)
    if not listed:
        raise ValueError("no fusion method named")
    per_method = split_method_options(listed, options, defaults=defaults)
    return [make_fusion_method(name, **per_method[name]) for name in listed]


def as_fusion_methods(
    methods: str | FusionMethod | Sequence[str | FusionMethod],
) -> list[FusionMethod]:
    """Fusion methods from a comma list (``"kf-linear,regmean"``), names or instances."""
    if isinstance(methods, str):
        return make_fusion_methods(methods)
    if isinstance(methods, FusionMethod):
        return [methods]
    return [m if isinstance(m, FusionMethod) else make_fusion_method(m) for m in methods]


def split_method_options(
    names: Sequence[str], options: str, *, defaults: dict[str, Any] | None = None
) -> dict[str, dict[str, Any]]:
    """Per method of ``names``, its options from ``"k=v method.k=v ..."``: an unprefixed option
    goes to every listed method that accepts it (an error if none does), ``method.key`` to that
    method only (an error for a method not listed); ``defaults`` to every method that accepts
    them, unless an option sets them. Unknown method names get what is addressed to them."""
    shared: dict[str, Any] = {}
    specific: dict[str, dict[str, Any]] = {name: {} for name in names}
    for key, value in (parse_options(options) if options else {}).items():
        method, dot, option = key.rpartition(".")
        if not dot:
            shared[key] = value
        elif method in specific:
            specific[method][option] = value
        else:
            raise ValueError(
                f"fusion option {key!r} names {method!r}, which is not in {list(names)}"
            )
    for key in shared:
        if not any(
            key in FUSION_METHODS[n].accepted_options() for n in names if n in FUSION_METHODS
        ):
            raise ValueError(f"fusion option {key!r} is accepted by none of {list(names)}")
    result = {}
    for name in names:
        accepted = FUSION_METHODS[name].accepted_options() if name in FUSION_METHODS else []
        applicable = {k: v for k, v in (defaults or {}).items() if k in accepted}
        applicable.update({k: v for k, v in shared.items() if k in accepted})
        applicable.update(specific[name])
        result[name] = applicable
    return result
