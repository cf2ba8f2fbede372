"""How ``auto`` scores its candidates: on held-out rows of the server's labelled fusion set, or
on the sites' own labelled rows (:class:`~fedfuse.fusion.statistics.channels.SiteScoring`).

The fusion set of a one-shot server is small and often drawn from one site, so its held-out rows
show only that site's classes; the sites' scores, pooled by rows, show the federation's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from fedfuse.fusion.base import FusionInputs
from fedfuse.fusion.statistics.channels import SiteScore, SiteScoring, pooled_score
from fedfuse.models.capture import accuracy_and_loss

#: where ``auto`` scores its candidates (its ``score_on`` option)
SCORE_ON = ("auto", "sites", "fusion-set")


def stratified_split(
    labels: torch.Tensor, holdout: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fit, held_out)``: row indices of ``labels`` (each sorted), a share ``holdout`` of every
    class held out, drawn with ``seed``: per class (in increasing order) one ``randperm`` of its
    rows, of which the first ``round(holdout * rows)`` are held out, at most all but one."""
    if not 0 < holdout < 1:
        raise ValueError(f"holdout must be in (0, 1), got {holdout}")
    generator = torch.Generator().manual_seed(seed)
    labels = labels.cpu()
    fit, held = [], []
    for value in torch.unique(labels).tolist():
        rows = torch.nonzero(labels == value).flatten()
        rows = rows[torch.randperm(len(rows), generator=generator)]
        count = min(math.floor(holdout * len(rows) + 0.5), len(rows) - 1)
        held.append(rows[:count])
        fit.append(rows[count:])
    empty = torch.zeros(0, dtype=torch.long)
    return (
        torch.cat([empty, *fit]).sort().values,
        torch.cat([empty, *held]).sort().values,
    )


def held_out_scores(
    model: torch.nn.Module,
    data: torch.Tensor,
    labels: torch.Tensor,
    *,
    batch_size: int = 256,
    device: str = "auto",
) -> tuple[float, float]:
    """``(accuracy, mean cross-entropy)`` of ``model`` on held-out fusion rows."""
    return accuracy_and_loss(model, data, labels, batch_size=batch_size, device=device)


def scoring_sites(inputs: FusionInputs) -> SiteScoring | None:
    """The inputs' sites when they can score a model, else None."""
    sites = inputs.sites
    if isinstance(sites, SiteScoring) and sites.can_score:
        return sites
    return None


def sites_answering_all(trials: Sequence[Sequence[SiteScore | None]]) -> list[int]:
    """The sites (by index) that scored every trial: the candidates are compared on the same
    rows, whichever site stayed silent once."""
    if not trials:
        return []
    return [i for i in range(len(trials[0])) if all(t[i] is not None for t in trials)]


def pooled_on(scores: Sequence[SiteScore | None], sites: Sequence[int]) -> SiteScore:
    """The pooled score (:func:`pooled_score`) of the given ``sites``' scores."""
    return pooled_score([s for i, s in enumerate(scores) if i in sites and s is not None])


def unshown_classes(inputs: FusionInputs) -> list[int]:
    """The classes some site holds (its class counts) of which the labelled fusion set shows no
    row (empty without class counts or labels)."""
    if inputs.class_counts is None or inputs.labels is None:
        return []
    held = {c for counts in inputs.class_counts for c, n in enumerate(counts) if n > 0}
    return sorted(held - set(inputs.labels.tolist()))


def why_chosen(chosen: str, report: dict[str, dict[str, Any]], rows: str) -> str:
    """One sentence: why ``chosen`` won on ``rows`` (e.g. ``"120 held-out rows"``)."""
    mine = report[chosen]
    others = [(n, r) for n, r in report.items() if "accuracy" in r and n != chosen]
    said = f"{chosen} had the highest accuracy, {mine['accuracy']:.2%} on {rows}"
    if not others:
        return f"{chosen} was the only candidate scored ({mine['accuracy']:.2%} on {rows})"
    name, runner_up = max(others, key=lambda item: (item[1]["accuracy"], -item[1]["loss"]))
    if runner_up["accuracy"] < mine["accuracy"]:
        return f"{said} (next: {name} {runner_up['accuracy']:.2%})"
    if runner_up["loss"] > mine["loss"]:
        return (
            f"{chosen} tied with {name} on accuracy ({mine['accuracy']:.2%} on {rows}) and had "
            f"the lower loss ({mine['loss']:.4f} against {runner_up['loss']:.4f})"
        )
    return f"{chosen} tied with {name} on accuracy and loss, and comes first in the list"
