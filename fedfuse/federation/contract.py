"""The data contract of a run: what every site's data must look like before it trains.

The server derives it from its own fusion set (or, in a simulation, from the dataset) and sends
it in the train message. A site compares its data with it *before* training and refuses at once,
naming the mismatch, instead of training for an hour on images the federation cannot use.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fedfuse.data import ImageDataset

#: relative tolerance when two parties compare their normalisation (mean, std)
NORMALISATION_TOLERANCE = 1e-3
#: bounds on what a contract read from a message may hold
_MAX_CLASSES = 100_000
_MAX_NAME = 200


class SiteRefusal(ValueError):
    """A site's data does not match the run's data contract; the message names the mismatch."""


@dataclass(frozen=True)
class DataContract:
    """Input shape, classes and normalisation that every site's data must share."""

    input_shape: tuple[int, int, int]
    num_classes: int
    class_names: tuple[str, ...] | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None

    @classmethod
    def of(cls, dataset: ImageDataset) -> DataContract:
        """The contract that ``dataset`` (the server's fusion set) defines."""
        names = getattr(dataset, "class_names", None)
        return cls(
            input_shape=tuple(int(v) for v in dataset.input_shape),
            num_classes=int(dataset.num_classes),
            class_names=tuple(str(n) for n in names) if names else None,
            mean=tuple(float(m) for m in dataset.mean),
            std=tuple(float(s) for s in dataset.std),
        )

    def to_dict(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "input_shape": list(self.input_shape),
            "num_classes": self.num_classes,
        }
        if self.class_names is not None:
            document["class_names"] = list(self.class_names)
        if self.mean is not None and self.std is not None:
            document["mean"], document["std"] = list(self.mean), list(self.std)
        return document

    @classmethod
    def from_dict(cls, document: Mapping[str, Any], *, source: str) -> DataContract:
        """A contract from a message; anything malformed raises ValueError naming ``source``."""
        try:
            shape = tuple(int(v) for v in document["input_shape"])
            num_classes = int(document["num_classes"])
            names = document.get("class_names")
            names = tuple(str(n)[:_MAX_NAME] for n in names) if names is not None else None
            mean = document.get("mean")
            std = document.get("std")
            mean = tuple(float(v) for v in mean) if mean is not None else None
            std = tuple(float(v) for v in std) if std is not None else None
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{source}: malformed data contract ({error!r})") from None
        if len(shape) != 3 or min(shape) < 1 or not 1 <= num_classes <= _MAX_CLASSES:
            raise ValueError(
                f"{source}: implausible data contract: input shape {shape}, {num_classes} classes"
            )
        if names is not None and len(names) != num_classes:
            raise ValueError(f"{source}: {len(names)} class names for {num_classes} classes")
        return cls(shape, num_classes, names, mean, std)

    def mismatches(self, dataset: ImageDataset) -> list[str]:
        """Every way ``dataset`` breaks the contract (empty: it complies)."""
        problems = []
        shape = tuple(int(v) for v in dataset.input_shape)
        if shape != self.input_shape:
            problems.append(
                f"its images are {_shape(shape)}, the federation's are {_shape(self.input_shape)}"
            )
        if dataset.num_classes != self.num_classes:
            problems.append(
                f"it declares {dataset.num_classes} classes, the federation has {self.num_classes}"
            )
        names = getattr(dataset, "class_names", None)
        if self.class_names is not None and names and tuple(names) != self.class_names:
            differ = [
                f"{i}: {mine!r} != {theirs!r}"
                for i, (mine, theirs) in enumerate(zip(names, self.class_names, strict=False))
                if mine != theirs
            ]
            more = ", ..." if len(differ) > 3 else ""
            problems.append(
                f"its class names differ from the federation's ({', '.join(differ[:3])}{more})"
            )
        declared = self.mean is not None and self.std is not None and shape == self.input_shape
        if declared and not (_close(dataset.mean, self.mean) and _close(dataset.std, self.std)):
            problems.append(
                f"its normalisation is mean {_numbers(dataset.mean)}, std "
                f"{_numbers(dataset.std)}; the federation's is mean {_numbers(self.mean)}, "
                f"std {_numbers(self.std)}"
            )
        return problems

    def check(self, dataset: ImageDataset, *, source: str) -> None:
        """Raise :class:`SiteRefusal` naming every mismatch of ``dataset`` (from ``source``)."""
        problems = self.mismatches(dataset)
        if problems:
            raise SiteRefusal(f"{source}: " + "; ".join(problems))


def _shape(shape: Sequence[int]) -> str:
    return "x".join(str(v) for v in shape)


def _numbers(values: Sequence[float]) -> str:
    return "[" + ", ".join(f"{v:.4g}" for v in values) + "]"


def _close(a: Sequence[float], b: Sequence[float]) -> bool:
    return len(a) == len(b) and all(
        math.isclose(x, y, rel_tol=NORMALISATION_TOLERANCE, abs_tol=1e-6)
        for x, y in zip(a, b, strict=True)
    )
