"""Architecture specifications: the JSON-serialisable description every model is rebuilt from."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

#: bounds on a spec read from elsewhere (a file, a client): far above any real model, far below
#: what would exhaust memory, so a forged spec is refused before anything is built
MAX_LEVELS = 1024
MAX_SIZE = 1 << 20


@dataclass(frozen=True)
class ModelSpec:
    """What is needed to rebuild a model: architecture name, input shape, classes and widths.

    ``widths`` are the neuron counts of the hidden levels that own neurons (the output level is
    always ``num_classes`` wide). Two models with the same spec have identical parameter shapes;
    fusion into another width (K-means Fusion) only changes ``widths``.
    """

    arch: str
    input_shape: tuple[int, ...]
    num_classes: int
    widths: tuple[int, ...]
    options: dict[str, Any] = field(default_factory=dict)

    def with_widths(self, widths: tuple[int, ...] | list[int]) -> ModelSpec:
        """The same architecture with other hidden widths."""
        widths = tuple(int(w) for w in widths)
        if len(widths) != len(self.widths):
            raise ValueError(
                f"{self.arch} has {len(self.widths)} hidden widths, got {len(widths)}: {widths}"
            )
        return replace(self, widths=widths)

    def to_dict(self) -> dict[str, Any]:
        return {
            "arch": self.arch,
            "input_shape": list(self.input_shape),
            "num_classes": self.num_classes,
            "widths": list(self.widths),
            "options": dict(self.options),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        """Parse a spec written by :meth:`to_dict`; raises ValueError naming the bad field."""
        if not isinstance(data, dict):
            raise ValueError(f"model spec must be a mapping, got {type(data).__name__}")
        missing = {"arch", "input_shape", "num_classes", "widths"} - data.keys()
        if missing:
            raise ValueError(f"model spec lacks {sorted(missing)}")
        unknown = data.keys() - {"arch", "input_shape", "num_classes", "widths", "options"}
        if unknown:
            raise ValueError(f"model spec has unknown fields {sorted(unknown)}")
        try:
            spec = cls(
                arch=str(data["arch"]),
                input_shape=tuple(int(d) for d in data["input_shape"]),
                num_classes=int(data["num_classes"]),
                widths=tuple(int(w) for w in data["widths"]),
                options=dict(data.get("options") or {}),
            )
        except (TypeError, ValueError) as error:
            raise ValueError(f"model spec has a malformed field: {error}") from error
        if spec.num_classes < 1 or any(w < 1 for w in spec.widths):
            raise ValueError(f"model spec needs positive widths and classes, got {data}")
        if any(d < 1 for d in spec.input_shape):
            raise ValueError(f"model spec needs a positive input shape, got {spec.input_shape}")
        sizes = (spec.num_classes, *spec.widths, *spec.input_shape)
        if len(spec.widths) > MAX_LEVELS or max(sizes) > MAX_SIZE:
            raise ValueError(
                f"model spec is implausibly large ({len(spec.widths)} widths, largest size "
                f"{max(sizes)}; limits {MAX_LEVELS} widths and {MAX_SIZE} per size)"
            )
        return spec
