"""The neuron-interpolation variants' choices, and the constructors of its fixed variants,
each option and its default written once.

A registered variant (``HFLinear``, ``KFSites``, ...) is its base class with the leading
positional choices fixed (grouping, approximation) and only the keyword options that apply to
it. :func:`fixed_variant` gives it an ``__init__`` whose signature and annotations are the
base's, less the options it does not take, so :func:`inspect.signature`, ``help()`` and the
typed configs (:meth:`~fedfuse.fusion.base.FusionMethod.config_class`) read them as before.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

C = TypeVar("C", bound=type)

#: how a level is fitted to its groups' targets
APPROXIMATIONS = ("linear", "gradient")

#: the options only one grouping or approximation reads (a variant takes the others' too)
VARIANT_OPTIONS: dict[str, tuple[str, ...]] = {
    "hungarian": ("match_rounds",),
    "kmeans": ("n_init", "max_iter", "tol", "local_search_swaps", "kmeans_variance"),
    "linear": ("ridge", "ridge_prior", "rcond", "whiten_rcond", "fit_bias", "gram_precision"),
    "gradient": (
        "preset",
        "epochs",
        "last_epochs",
        "lr",
        "last_lr",
        "epsilon",
        "batch_size",
        "patience",
        "weighted_loss",
        "start",
    ),
}


#: where a Gradient variant's descent starts, per level
STARTS = ("base", "closed-form")


def fixed_variant(*fixed: Any, without: Iterable[str] = ()) -> Callable[[C], C]:
    """Class decorator: the class's ``__init__`` calls its base's with the positional
    arguments ``fixed`` and takes the base's keyword-only options, except ``without``."""
    excluded = frozenset(without)

    def decorate(cls: C) -> C:
        base_init = cls.__mro__[1].__init__
        signature = inspect.signature(base_init)
        self_parameter, *parameters = signature.parameters.values()
        unknown = excluded - {p.name for p in parameters}
        if unknown:
            raise ValueError(f"{cls.__name__}: the base takes no option(s) {sorted(unknown)}")
        options = [p for p in parameters if p.kind is p.KEYWORD_ONLY and p.name not in excluded]
        names = frozenset(p.name for p in options)

        def __init__(self: Any, **kwargs: Any) -> None:  # noqa: N807
            for key in kwargs:
                if key not in names:
                    raise TypeError(
                        f"{type(self).__name__}.__init__() got an unexpected keyword argument "
                        f"{key!r}"
                    )
            base_init(self, *fixed, **kwargs)

        hints = typing.get_type_hints(base_init)
        __init__.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=[self_parameter, *options]
        )
        __init__.__annotations__ = {p.name: hints[p.name] for p in options if p.name in hints}
        if "return" in hints:
            __init__.__annotations__["return"] = hints["return"]
        __init__.__qualname__ = f"{cls.__qualname__}.__init__"
        __init__.__module__ = cls.__module__
        cls.__init__ = __init__  # type: ignore[misc]
        return cls

    return decorate
