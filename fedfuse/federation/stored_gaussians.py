"""Fusion-set rows drawn from the class Gaussians kept beside saved uploads (``fedfuse fuse``).

A run whose sites sent class Gaussians (run config ``fusion-gaussian-samples`` > 0,
:mod:`fedfuse.fusion.statistics.class_gaussians`) keeps each site's in its file, as the
``gaussians.<key>`` tensors of ``clients/client_<id>.safetensors`` (:mod:`fedfuse.io.checkpoint`).
Fusing offline, :func:`draw_stored_gaussians` reads them (safetensors only, checked as an
untrusted upload is) and draws ``samples`` rows per site, labelled with their classes, as the
online run does (:class:`~fedfuse.fusion.statistics.class_gaussians.GaussianFusionSet`: the
site at position ``k`` draws from ``seed + k``), so that the same count and seed give the same
rows. They complete the given fusion set, or are the whole fusion set when none is given.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from fedfuse.fusion import FusionMethod
from fedfuse.fusion.statistics.class_gaussians import ClassGaussians, GaussianFusionSet
from fedfuse.io.checkpoint import CheckpointError
from fedfuse.models import ModelSpec

log = logging.getLogger(__name__)

#: rows drawn per site when neither the option nor the run's config says (the library default)
DEFAULT_GAUSSIAN_SAMPLES = GaussianFusionSet().samples

_PREFIX = "gaussians."


@dataclass(frozen=True)
class GaussianRows:
    """Rows drawn from the sites' stored class Gaussians, in the models' (normalised) input
    space: site by site in input order, each spread over its classes by their counts."""

    inputs: torch.Tensor
    labels: torch.Tensor
    #: rows drawn per site that carries Gaussians, by its name
    per_site: dict[str, int]
    #: the sites that carry none
    lacking: list[str] = field(default_factory=list)
    samples: int = 0
    seed: int = 0

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def describe(self) -> str:
        """One line: how many rows came from which site, and the sites that gave none."""
        sites = ", ".join(f"{name}: {rows}" for name, rows in self.per_site.items())
        text = f"{len(self)} rows from class Gaussians (seed {self.seed}; {sites})"
        if self.lacking:
            text += f"; none from {', '.join(self.lacking)} (no class Gaussians stored)"
        return text

    def summary(self) -> dict[str, object]:
        """What a fused checkpoint's metadata records of the rows."""
        return {
            "samples_per_site": self.samples,
            "seed": self.seed,
            "rows": dict(self.per_site),
            "sites_without_gaussians": list(self.lacking),
        }


def reads_fusion_set(fusion: FusionMethod) -> bool:
    """Whether ``fusion`` (as configured) reads a fusion set at all."""
    return bool(fusion.needs() & {"data", "labels"})


def read_class_gaussians(path: str | Path, spec: ModelSpec) -> ClassGaussians | None:
    """The class Gaussians stored in the site file at ``path`` (None: it holds none), checked
    against the models' ``spec``. Reads only those tensors, through safetensors.

    Raises:
        CheckpointError: naming the file, when it cannot be read or its Gaussians are unusable.
    """
    try:
        with safe_open(str(path), framework="pt") as handle:
            names = [n for n in handle.keys() if n.startswith(_PREFIX)]  # noqa: SIM118
            tensors = {n.removeprefix(_PREFIX): handle.get_tensor(n) for n in names}
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{path}: not a readable safetensors file ({error})") from error
    if not tensors:
        return None
    try:
        return ClassGaussians.from_tensors(
            tensors, spec.input_shape, num_classes=spec.num_classes, source=str(path)
        )
    except ValueError as error:
        raise CheckpointError(str(error)) from None


def draw_stored_gaussians(
    paths: Sequence[str | Path],
    spec: ModelSpec,
    samples: int,
    *,
    seed: int = 0,
    names: Sequence[str] | None = None,
    required: bool = False,
) -> GaussianRows | None:
    """``samples`` rows per site drawn from the class Gaussians stored in the site files at
    ``paths`` (module docstring); the site at position ``k`` draws with seed ``seed + k``.

    Sites without Gaussians are named in a warning (and in :attr:`GaussianRows.lacking`); the
    others still give their rows. None when no site carries Gaussians, or ``samples`` is 0.

    Args:
        paths: the site files (checkpoints written by an upload store or ``save_checkpoint``).
        spec: the models' architecture (input shape and classes the Gaussians must have).
        samples: rows per site (>= 0).
        seed: the draws' seed.
        names: how the log names each site (default: its path).
        required: raise, instead of returning None, when no site carries Gaussians.

    Raises:
        ValueError: ``samples`` is negative, or ``required`` and no site carries Gaussians.
        CheckpointError: a file is unreadable or its Gaussians are unusable (named).
    """
    if samples < 0:
        raise ValueError(f"rows per site from class Gaussians must be >= 0, got {samples}")
    labels_of = [str(n) for n in names] if names is not None else [str(p) for p in paths]
    if samples == 0:
        return None
    stored = [read_class_gaussians(path, spec) for path in paths]
    lacking = [name for name, site in zip(labels_of, stored, strict=True) if site is None]
    if len(lacking) == len(stored):
        if required:
            raise ValueError(
                f"none of the {len(stored)} inputs carries class Gaussians (a run's sites store "
                "them when its config sets fusion-gaussian-samples > 0): "
                f"{', '.join(labels_of)}"
            )
        return None
    if lacking:
        log.warning(
            "%d of %d sites carry no class Gaussians, so the fusion set has no rows drawn for "
            "them: %s",
            len(lacking),
            len(stored),
            ", ".join(lacking),
        )
    inputs, labels, per_site = [], [], {}
    for k, (name, site) in enumerate(zip(labels_of, stored, strict=True)):
        if site is None:
            continue
        drawn, classes = site.sample(samples, generator=torch.Generator().manual_seed(seed + k))
        inputs.append(drawn)
        labels.append(classes)
        per_site[name] = len(classes)
        log.info(
            "drew %d fusion-set rows from the class Gaussians of %s (%d classes, seed %d)",
            len(classes),
            name,
            int(classes.unique().numel()),
            seed + k,
        )
    return GaussianRows(
        torch.cat(inputs), torch.cat(labels), per_site, lacking, samples=samples, seed=seed
    )


__all__ = [
    "DEFAULT_GAUSSIAN_SAMPLES",
    "GaussianRows",
    "draw_stored_gaussians",
    "read_class_gaussians",
    "reads_fusion_set",
]
