"""Allowed ranges of the fusion methods' count options, checked when a method is built.

One table, :data:`OPTION_BOUNDS`, bounds every option that sizes work or memory (restarts,
iterations, epochs, batch sizes, widths, ranks, model indices) by its name, for every method
that takes it; a method narrows or widens one with its class attribute ``option_bounds``.
:class:`~fedfuse.fusion.base.FusionMethod` wraps each constructor with :func:`bounds_checked`,
so a method built directly, from a config or from the registry fails in one line naming the
method, the option and the range before it runs (``n_init=1000000000000`` would hang).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any

#: allowed ranges of the methods' counts (restarts, iterations, epochs, sizes, widths, indices),
#: shared by every method that takes the option (:attr:`FusionMethod.option_bounds` overrides)
OPTION_BOUNDS: dict[str, tuple[float, float]] = {
    "n_init": (1, 1_000),
    "max_iter": (1, 100_000),
    "iterations": (0, 1_000),
    "match_rounds": (0, 1_000),
    "local_search_swaps": (0, 1_000_000),
    "epochs": (0, 10_000),
    "last_epochs": (0, 10_000),
    "patience": (0, 10_000),
    "eval_points": (1, 100_000),
    "batch_size": (1, 2**20),
    "batch_size_capture": (1, 2**20),
    "max_samples": (1, 10**9),
    "gram_rank": (1, 65_536),
    "rank": (-1, 65_536),
    "max_width": (0, 65_536),
    "width_factor": (1, 64),
    "reference": (0, 100_000),
    "body": (0, 100_000),
    "seed": (0, 2**32 - 1),
    "whiten_rcond": (0, 1),
    "dp_noise_seed": (0, 2**63 - 1),
    "generator_steps": (1, 100_000),
    "student_steps": (1, 100_000),
    "memory": (1, 100_000),
    "latent": (1, 65_536),
    "folds": (2, 100),
}


def check_option_bounds(cls: Any, options: Mapping[str, Any]) -> None:
    """Raise ValueError, naming the method, the option and its range, for a number outside
    :meth:`FusionMethod.option_range` (values of other types are left to the type check)."""
    for key, value in options.items():
        bounds = cls.option_range(key)
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if bounds is not None and number and not bounds[0] <= value <= bounds[1]:
            raise ValueError(
                f"fusion method {cls.name!r}: option {key}={value!r} is out of range; "
                f"allowed: {bounds[0]} to {bounds[1]}"
            )


def bounds_checked(init: Any) -> Any:
    """``init`` preceded by :func:`check_option_bounds` on the options it is given."""
    signature = inspect.signature(init)

    @functools.wraps(init)
    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        given = signature.bind_partial(self, *args, **kwargs).arguments
        check_option_bounds(type(self), {k: v for k, v in given.items() if k != "self"})
        init(self, *args, **kwargs)

    checked._checks_bounds = True  # type: ignore[attr-defined]
    return checked
