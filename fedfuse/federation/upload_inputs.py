"""The fusion methods' inputs built from the sites' uploads, and the fusion set completed from them.

:func:`fusion_inputs` is the one place the server's :class:`~fedfuse.fusion.FusionInputs` are
built from uploads (a run's :class:`~fedfuse.federation.uploads.UploadStore`, the uploads
themselves, or the facts read from checkpoint files) and its fusion set;
:func:`complete_fusion_set` adds the rows a run derives from the uploads (BatchNorm inversion,
class Gaussians). Kept apart from :mod:`fedfuse.federation.uploads`, which says what a site sends
and how it is kept, because this is what the server makes of it for the methods.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from fedfuse.data import ImageDataset
from fedfuse.federation.uploads import ClientUpload, UploadStore
from fedfuse.fusion import FusionInputs
from fedfuse.fusion.base import reads_sites
from fedfuse.fusion.inversion import InvertedFusionSet
from fedfuse.fusion.statistics.class_gaussians import ClassGaussians, GaussianFusionSet
from fedfuse.models.importance import Scores

T = TypeVar("T")


@dataclass(frozen=True)
class UploadFacts:
    """What the server knows of the sites besides their models, one entry per site (None where
    not every site has it): importance scores, sample and class counts, Gram matrices."""

    scores: Sequence[Scores] | None
    sample_counts: Sequence[int] | None
    class_counts: Sequence[Sequence[int]] | None
    grams: Sequence[dict[int, torch.Tensor]] | None = None
    fisher: Sequence[dict[str, torch.Tensor]] | None = None


def upload_facts(uploads: UploadStore | Sequence[ClientUpload] | UploadFacts) -> UploadFacts:
    """The sites' facts from a run's store (scores and Grams None unless every site sent them;
    Grams loaded one site at a time), from the uploads in memory, or as given."""
    if isinstance(uploads, UploadFacts):
        return uploads
    if isinstance(uploads, UploadStore):
        entries = uploads.entries
        return UploadFacts(
            scores=uploads.scores(),
            sample_counts=[e.num_examples for e in entries],
            class_counts=_all_or_none([e.class_counts for e in entries]),
            grams=uploads.grams(),
            fisher=uploads.fisher(),
        )
    return UploadFacts(
        scores=[u.scores for u in uploads],
        sample_counts=[u.num_examples for u in uploads],
        class_counts=_all_or_none([u.class_counts for u in uploads]),
        grams=[u.grams for u in uploads] if all(u.grams for u in uploads) else None,
        fisher=[u.fisher for u in uploads] if all(u.fisher for u in uploads) else None,
    )


def uploaded_class_gaussians(
    uploads: UploadStore | Sequence[ClientUpload],
) -> list[ClassGaussians] | None:
    """Every site's class Gaussians, by partition id (a store) or in order; None unless every
    site sent them."""
    if isinstance(uploads, UploadStore):
        return uploads.class_gaussians()
    return _all_or_none([u.class_gaussians for u in uploads])


def complete_fusion_set(
    models: Sequence[nn.Module],
    inputs: FusionInputs,
    uploads: UploadStore | Sequence[ClientUpload],
    *,
    inversion: InvertedFusionSet | None = None,
    gaussians: GaussianFusionSet | None = None,
) -> FusionInputs:
    """``inputs`` with the fusion set completed as the run asks: rows inverted from the
    uploaded models' BatchNorm statistics, then rows drawn from the sites' uploaded class
    Gaussians (either None: not). Unchanged without a fusion set.

    Raises:
        ValueError: the run draws from class Gaussians and a site sent none.
    """
    if inputs.data is None:
        return inputs
    if inversion is not None:
        inputs = inversion.complete_inputs(models, inputs, upload_facts(uploads).class_counts)
    if gaussians is not None:
        sent = uploaded_class_gaussians(uploads)
        if sent is None:
            raise ValueError(
                "the fusion set is completed from the sites' class Gaussians "
                "(fusion-gaussian-samples), and not every site sent them"
            )
        inputs = gaussians.complete_inputs(inputs, sent)
    return inputs


def _all_or_none(values: list[T | None]) -> list[T] | None:
    return None if any(v is None for v in values) else values  # type: ignore[return-value]


def fusion_inputs(
    uploads: UploadStore | Sequence[ClientUpload] | UploadFacts,
    fusion_set: ImageDataset | tuple[torch.Tensor, torch.Tensor | None] | None = None,
    *,
    sites: Any = None,
    needs: Iterable[str] | None = None,
) -> FusionInputs:
    """The :class:`~fedfuse.fusion.FusionInputs` of a fusion: the fusion set's inputs and labels
    (None without one; an ``ImageDataset``, or ``(inputs, labels)`` already normalised), the
    sites' facts (:func:`upload_facts`) and ``sites``, the channel of statistics rounds and
    scores (None: none). With ``needs`` (a method's :meth:`~fedfuse.fusion.FusionMethod.needs`),
    the other fields are left None (``sites`` is kept for either need it serves:
    :func:`~fedfuse.fusion.base.reads_sites`)."""
    facts = upload_facts(uploads)
    if isinstance(fusion_set, ImageDataset):
        data, labels = fusion_set.inputs(), fusion_set.labels
    else:
        data, labels = fusion_set if fusion_set is not None else (None, None)
    fields: dict[str, Any] = {
        "data": data,
        "labels": labels,
        "scores": facts.scores,
        "sample_counts": facts.sample_counts,
        "class_counts": facts.class_counts,
        "grams": facts.grams,
        "fisher": facts.fisher,
        "sites": sites,
    }
    if needs is not None:
        wanted = set(needs) | ({"sites"} if reads_sites(needs) else set())
        fields = {k: v for k, v in fields.items() if k in wanted}
    return FusionInputs(**fields)
