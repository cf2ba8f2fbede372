"""The ensemble reference point: the averaged predictions of several models.

Two averages: of the class *probabilities* (the mixture, the usual ensemble) or of the
*logits* (the softmax of the mean logits: a normalised geometric mean of the members'
distributions, what a fused model whose last level is the mean of the members' would compute).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

#: what :class:`Ensemble` averages
AVERAGES = ("probabilities", "logits")


class Ensemble(nn.Module):
    """Average the predictions of ``models`` (optionally weighted); returns log-probabilities.

    Args:
        models: the members, each mapping a batch to logits.
        weights: one non-negative weight per member (e.g. its site's sample count), normalised
            to sum to 1; None weighs them equally.
        average: ``"probabilities"``: ``log sum_m w_m softmax(z_m)``; ``"logits"``:
            ``log_softmax(sum_m w_m z_m)``.

    Returning log-probabilities keeps ``argmax`` and the NLL/cross-entropy of the averaged
    distribution correct, so an ensemble evaluates like any classifier.
    """

    def __init__(
        self,
        models: Sequence[nn.Module],
        weights: Sequence[float] | None = None,
        average: str = "probabilities",
    ) -> None:
        super().__init__()
        if not models:
            raise ValueError("an ensemble needs at least one model")
        if average not in AVERAGES:
            raise ValueError(f"ensemble average must be one of {AVERAGES}, got {average!r}")
        self.members = nn.ModuleList(models)
        self.average = average
        w = (
            torch.ones(len(models))
            if weights is None
            else torch.as_tensor(weights, dtype=torch.float)
        )
        if w.shape != (len(models),) or (w < 0).any() or w.sum() <= 0:
            raise ValueError(
                f"ensemble weights must be {len(models)} non-negative numbers, got {w}"
            )
        self.register_buffer("weights", w / w.sum())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.stack([m(x) for m in self.members])
        shape = (-1, *([1] * (logits.dim() - 1)))
        if self.average == "logits":
            return (logits * self.weights.view(shape)).sum(0).log_softmax(dim=-1)
        log_w = self.weights.log().view(shape)
        return torch.logsumexp(logits.log_softmax(dim=-1) + log_w, dim=0)
