r"""Neuron interpolation on the fusion set, each row fitted to the models that know its label.

``kf-linear`` and ``hf-linear`` fit every fusion-set row to the same mix of the base models: the
importance-weighted centre of each group of neurons. Models trained on different classes are
experts on different rows, and on a row of a class it never saw a model's neurons carry noise
that the mix passes on to the fused model. The labelled fusion set says which model to trust
where: model :math:`k`'s probability of the row's label, :math:`p_k(y_i \mid x_i)`.

Each fused level is fitted as ``kf-sites`` fits it
(:mod:`fedfuse.fusion.methods.neuron_interpolation.sites`), with the fusion set playing every site:
model :math:`k`'s *reading* of fused neuron :math:`c` (its own neurons of group :math:`c`,
importance-weighted, or its nearest neuron where the group has none of its neurons: the matrix
:math:`P_k`) is the target on row :math:`i` with weight

.. math::

    w_{ki} = \frac{p_k(y_i \mid x_i)^a}{\sum_j p_j(y_i \mid x_i)^a},

the posterior probability that model :math:`k` is the expert of row :math:`i` under a uniform
prior (:math:`a = 1`, the default, fixed by this reading and not tuned); :math:`a = 0` gives
every model the same weight on every row, and :math:`a = \infty` routes each row to the model
most confident in its label. Bottom-up, on the fused prefix's design rows :math:`x_i`:

.. math::

    W = \arg\min_W \sum_k \sum_i w_{ki} \lVert x_i W - z_{ki} P_k^\top \rVert^2
      + \lambda \lVert W \rVert^2,

in closed form from the weighted statistics
(:func:`~fedfuse.fusion.statistics.on_site.site_statistics` with ``sample_weights``), the ridge
:math:`\lambda` by GCV, neurons grouped by their translations into the fused inputs (K-means
or Hungarian) as ``kf-sites`` groups them. Inside ResNet and ViT blocks every linear piece is
fitted this way. The server computes everything on the fusion set it holds: one upload per
site, no statistics rounds.

**What it needs.** Labels, and a fusion set that shows the classes the sites hold: where it
shows no row of a class, no model is trusted on that class and what the site that holds it
knows of it is not carried over. On a fusion set drawn from one site of a class-sharded split
this loses the other sites' classes (``docs/results.md``); a run whose fusion set misses a
class some site holds (the sites' class counts) is warned about, naming the classes.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Any

import torch

from fedfuse.fusion.base import FusionInputs
from fedfuse.fusion.blocks.whitening import WHITEN_RCOND
from fedfuse.fusion.methods.neuron_interpolation.options import fixed_variant
from fedfuse.fusion.methods.neuron_interpolation.sites import SiteInterpolation
from fedfuse.fusion.registry import register_fusion_method
from fedfuse.fusion.statistics.channels import LocalSites
from fedfuse.models import LeveledModel, ModelSpec
from fedfuse.runtime import resolve_device

log = logging.getLogger(__name__)


@torch.no_grad()
def label_beliefs(
    models: list[LeveledModel],
    data: torch.Tensor,
    labels: torch.Tensor,
    *,
    batch_size: int = 256,
    device: str | torch.device = "auto",
) -> torch.Tensor:
    """``(models, rows)``: each model's log-probability of each row's label."""
    run_on = resolve_device(device)
    beliefs = []
    for model in models:
        was_training, home = model.training, next(model.parameters()).device
        model.eval().to(run_on)
        rows = []
        for start in range(0, len(data), batch_size):
            logits = model(data[start : start + batch_size].to(run_on)).float()
            wanted = labels[start : start + batch_size].to(run_on).long()[:, None]
            rows.append(logits.log_softmax(1).gather(1, wanted).squeeze(1).cpu())
        model.train(was_training).to(home)
        beliefs.append(torch.cat(rows))
    return torch.stack(beliefs)


def trust_weights(beliefs: torch.Tensor, exponent: float) -> torch.Tensor:
    """``(models, rows)`` weights ``p_k^a / sum_j p_j^a`` from log-probabilities ``beliefs``;
    ``exponent = inf``: 1 for the most confident model of each row (the first on ties)."""
    if math.isinf(exponent):
        return torch.nn.functional.one_hot(beliefs.argmax(0), len(beliefs)).T.float()
    return (exponent * beliefs.double()).softmax(0).float()


class TrustedInterpolation(SiteInterpolation):
    """Neuron interpolation fitted on the fusion set with each row's target taken from the
    models in proportion to their belief in its label (module docstring). The shared base of
    :class:`KFTrust` and :class:`HFTrust`.

    Args:
        grouping: ``"hungarian"`` (models of the target's width) or ``"kmeans"``.
        trust_exponent: :math:`a` in the weights ``p_k(y|x)^a``: 1 the posterior of the expert
            (default), 0 the same weight for every model, ``inf`` each row to the most
            confident model.
        use_scores: weight neurons by the sites' importance scores (else uniformly).
        score_normalization: per model and level, ``"sum"``, ``"max"`` or ``"none"``.
        ridge: relative ridge of every level's fit; None: chosen per level by GCV.
        whiten_rcond: the cut of the attention fits' whitening (as ``kf-sites``).
        fit_bias: whether an affine level's fit has an intercept (``"auto"``: where its layer
            has a bias).
        match_rounds: Hungarian, more than two models: most rounds of re-matching.
        n_init, max_iter, tol: K-means restarts, Lloyd iterations and relative tolerance.
        kmeans_variance: K-means on the principal coordinates keeping this share of the
            variance (``"auto"``: as ``kf-sites``).
        batch_size: fusion-set rows per forward pass.
        device: where the fusion set's passes run (``"auto"``: CUDA when available).
        seed: seeds k-means and the fused model's unused parameters.
        progress: show a progress bar over levels.
    """

    name = "trusted-interpolation"
    requires = frozenset({"data", "labels"})
    #: loses what the sites know of a class the fusion set shows no row of, so a score on
    #: fusion rows cannot see that loss (``auto`` then leaves it out)
    needs_every_class = True

    def __init__(
        self,
        grouping: str = "kmeans",
        *,
        trust_exponent: float = 1.0,
        use_scores: bool = True,
        score_normalization: str = "sum",
        ridge: float | None = None,
        whiten_rcond: float = WHITEN_RCOND,
        fit_bias: bool | str = "auto",
        match_rounds: int = 50,
        n_init: int = 1,
        kmeans_variance: float | str = "auto",
        max_iter: int = 100,
        tol: float = 1e-4,
        batch_size: int = 256,
        device: str = "auto",
        seed: int = 0,
        progress: bool = False,
    ) -> None:
        if not trust_exponent >= 0:
            raise ValueError(f"trust_exponent must be >= 0 (or inf), got {trust_exponent}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        super().__init__(
            grouping,
            use_scores=use_scores,
            score_normalization=score_normalization,
            ridge=ridge,
            whiten_rcond=whiten_rcond,
            fit_bias=fit_bias,
            match_rounds=match_rounds,
            n_init=n_init,
            kmeans_variance=kmeans_variance,
            max_iter=max_iter,
            tol=tol,
            seed=seed,
            progress=progress,
        )
        self.trust_exponent = float(trust_exponent)
        self.batch_size = batch_size
        self.device = device

    def cost_with_many_sites(self, num_models: int) -> str | None:
        own = (
            f"fits every level to each of the {num_models} models' readings on every fusion-set row"
        )
        matching = super().cost_with_many_sites(num_models)
        return f"{matching} and {own}" if matching else own

    def needs(self) -> frozenset[str]:
        return super().needs() | {"class_counts"}

    def _fuse(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec
    ) -> tuple[LeveledModel, dict[str, Any]]:
        assert inputs.data is not None and inputs.labels is not None  # requirements
        self._warn_missing_classes(inputs)
        beliefs = label_beliefs(
            models, inputs.data, inputs.labels, batch_size=self.batch_size, device=self.device
        )
        weights = trust_weights(beliefs, self.trust_exponent)
        rows = LocalSites(
            models,
            [inputs.data] * len(models),
            batch_size=self.batch_size,
            device=self.device,
            sample_weights=list(weights),
        )
        fused, details = super()._fuse(models, replace(inputs, sites=rows), target)
        details["variant"] = f"{self.grouping}-trust"
        details["fits"] = details.pop("rounds")  # on the server's fusion set, not rounds
        details["trust"] = {
            "exponent": self.trust_exponent,
            "rows_per_model": [round(float(w), 2) for w in weights.sum(1)],
        }
        return fused, details

    def _warn_missing_classes(self, inputs: FusionInputs) -> None:
        if inputs.class_counts is None or inputs.labels is None:
            return
        held = {c for counts in inputs.class_counts for c, n in enumerate(counts) if n > 0}
        missing = sorted(held - set(inputs.labels.tolist()))
        if missing:
            log.warning(
                "%s: the fusion set shows no row of class(es) %s, which sites hold: no model is "
                "trusted on them and what their sites know of them is lost; give a fusion set "
                "that shows every class (e.g. fusion_set=balanced)",
                self.name,
                missing,
            )


@register_fusion_method
@fixed_variant("kmeans", without=("match_rounds",))
class KFTrust(TrustedInterpolation):
    """K-means Fusion fitted on the fusion set, each row to the models that know its label:
    any number of models, any width."""

    name = "kf-trust"


@register_fusion_method
@fixed_variant("hungarian", without=("n_init", "max_iter", "tol", "kmeans_variance"))
class HFTrust(TrustedInterpolation):
    """Hungarian Fusion fitted on the fusion set, each row to the models that know its label:
    models of the target's width, one neuron of each per group."""

    name = "hf-trust"


__all__ = ["HFTrust", "KFTrust", "TrustedInterpolation", "label_beliefs", "trust_weights"]
