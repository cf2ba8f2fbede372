r"""RegMean: merge each affine level by the least-squares fit of all clients' outputs (Jin et al.).

For a neuron level with client weights ``W_i`` (``(fan_in + 1, out)``, bias row included, see
:mod:`fedfuse.models.affine`) and client ``i``'s design matrix ``X_i`` (the level's inputs on
its own training data, with a trailing 1; unfolded patches for convolutions), RegMean picks the
weights whose outputs are closest to every client's own outputs on that client's inputs:

.. math::

    W^* = \arg\min_W \sum_i \lVert X_i W - X_i W_i \rVert_F^2
        = \Big(\sum_i G_i\Big)^{-1} \sum_i G_i W_i, \qquad G_i = X_i^\top X_i .

Only the Gram matrices ``G_i`` are needed, so the server needs no data and each client sends,
per level, a ``(fan_in + 1)^2`` matrix (:func:`level_grams` computes them client-side). A layer
without a bias is merged without intercept (``fit_bias``): the same formula on the Grams' leading
``fan_in x fan_in`` block (the Grams of the design without its 1) and the weights without their
bias row, so the clients' uploads keep one format. The paper
regularises by shrinking the non-diagonal entries,
``\tilde G_i = \alpha G_i + (1 - \alpha)\,\mathrm{diag}(G_i)``, which interpolates between the
exact fit (``alpha = 1``) and a per-input-coordinate weighted average (``alpha = 0``). Clients
with more data have larger Grams and so weigh more, with no need for sample counts.

RegMean merges every level independently, coordinate by coordinate of the neurons, so like
FedAvg it assumes the clients' neurons already correspond (a shared initialisation, as in
FedAvg-style training); it does not align them. With independently initialised clients neuron
``k`` of one client is merged with the unrelated neuron ``k`` of another: on IID clients (alike
Grams) the first level then outputs roughly the average of the clients' outputs, exactly as
weight averaging does, and deeper levels see features no client produced. It is a
(Gram-weighted) averaging baseline in that case, though empirically a much better one than
plain weight averaging (4 IID Fashion-MNIST MLP clients, independent init: 0.76 test accuracy
against 0.37 for weight averaging and 0.79 for the ensemble; its logits were 0.57 (relative)
from the clients' mean logits, weight averaging's 0.99). ``align="activations"`` aligns them
first: every feature space permuted onto one order by matching activations on the fusion set,
and each site's Grams permuted with its model (a permutation of a module's inputs permutes its
Gram's rows and columns), so the merge is of matching neurons.

Levels that are not affine (a ResNet's stem and residual blocks with their BatchNorms, a ViT's
patch embedding and encoder blocks) are merged module by module, as the paper does for
transformers: every ``nn.Linear`` and ``nn.Conv2d`` inside the level (a *mergeable module*) by
the same closed form with the Gram of its own inputs (unfolded patches for convolutions; a
trailing 1 only when the module has a bias), and every other parameter and buffer (LayerNorm and
BatchNorm affine parameters and running statistics, class token, position embedding) by the
average, weighted by the sites' sample counts when they are given (plain otherwise). A user's
own model (:class:`~fedfuse.models.ModelAdapter`, e.g. a CNN with BatchNorm and residual adds)
is merged the same way, by parameter name: a level that holds no Linear or Conv2d (a BatchNorm
cut as a level of its own) has no Gram and is averaged whole. An ``nn.MultiheadAttention``
(torchvision's ViT) applies its packed ``q``/``k``/``v`` projection and ``out_proj`` as
functions; in self-attention both inputs are recorded from the module's own
(:mod:`fedfuse.models.packed_attention`), so they are merged by Grams as fedfuse's ViT's
``q``, ``k``, ``v`` and ``out`` Linears are (an attention that cannot be packed so is averaged,
named in ``details["averaged_attention"]``). Modules that read the same tensor
the same way (a ViT's ``q``, ``k`` and ``v``) share one Gram. So that such a level still travels
as one ``{level: Gram}`` entry (the upload, checkpoint and validation formats are unchanged),
its modules' Grams are packed into one block-diagonal matrix, in the order
:func:`module_grams_layout` gives; a block-diagonal of Grams is itself the Gram of a
(block-structured) design matrix, symmetric and positive semi-definite, so the sites' uploads
are validated as before. The zero blocks cost memory (about twice the blocks' own size for a
ResNet block, four times for a ViT block).

Reference:
    X. Jin, X. Ren, D. Preotiuc-Pietro, P. Cheng. *Dataless Knowledge Fusion by Merging Weights
    of Language Models*, ICLR 2023.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from fedfuse.fusion.base import FusionInputs, FusionMethod
from fedfuse.fusion.blocks.pieces import check_affine_intercept
from fedfuse.fusion.blocks.space_alignment import check_feature_spaces
from fedfuse.fusion.inputs import sample_counts
from fedfuse.fusion.methods.regression.regmean_sums import (
    GramTermsRequest,
    level_mechanisms,
    site_terms,
    summed_terms,
)
from fedfuse.fusion.methods.regression.regmean_systems import (
    average_state,
    client_parts,
    client_weights,
    load_merged,
    merge_systems,
    solve_regularised,
    system_key,
)
from fedfuse.fusion.registry import register_fusion_method
from fedfuse.fusion.statistics.budget import PrivacyBudget
from fedfuse.fusion.statistics.grams import (
    GramBlock,
    align_sites,
    gram_levels,
    level_grams,
    mergeable,
    module_grams_layout,
)
from fedfuse.fusion.statistics.privacy import check_dp_options
from fedfuse.fusion.statistics.summed_terms import SiteSums, check_statistics_mode
from fedfuse.models import LeveledModel, ModelSpec, build_model
from fedfuse.models.affine import affine_view, check_fit_bias
from fedfuse.models.packed_attention import IN_PROJ

log = logging.getLogger(__name__)


def averaged_attention(model: LeveledModel) -> list[str]:
    """The names of ``model``'s ``nn.MultiheadAttention`` modules whose projections RegMean
    averages instead of merging by Grams: those without a Gram block (not
    :func:`~fedfuse.models.packed_attention.packable`, or not attending over one tensor)."""
    merged = {
        (level, name)
        for level, blocks in module_grams_layout(model).items()
        for block in blocks
        for name in block.modules
    }
    names = [
        name or model.level_name(index)
        for index, level in enumerate(model.levels)
        for name, module in level.named_modules()
        if isinstance(module, nn.MultiheadAttention)
        and (index, f"{name}.{IN_PROJ}" if name else IN_PROJ) not in merged
    ]
    return list(dict.fromkeys(names))


@register_fusion_method
class RegMean(FusionMethod):
    r"""RegMean (Jin et al., 2023) as a one-shot federated method: per neuron level (or, in a
    level that is not affine, per Linear/Conv2d module),
    ``W* = (sum_i G~_i + lambda I)^{-1} (sum_i G~_i W_i + lambda mean_i W_i)`` from the clients'
    Grams (:attr:`FusionInputs.grams`, see :func:`level_grams`); every other parameter and
    buffer (normalisation layers, embeddings) is averaged. No fusion set.

    Args:
        alpha: non-diagonal shrinkage, ``G~ = alpha G + (1 - alpha) diag(G)``, in ``[0, 1]``.
            Default 0.9, the paper's recommended value (1: the exact least-squares fit of all
            clients' outputs; 0: a per-coordinate weighted average).
        jitter: the ridge ``lambda`` relative to the mean diagonal of ``sum_i G~_i``; tiny, it
            only fixes directions no client's data reaches (e.g. dead ReLU inputs, or a constant
            input collinear with the bias), which it sets to the plain average instead of leaving
            them undetermined. Raised tenfold while the solve reports a singular system.
        fit_bias: whether an affine level's merge has an intercept (the Grams' constant 1):
            ``"auto"`` exactly when its layer has a bias, True always (an error names a level
            whose layer has none), False never (a layer's bias is set to 0). A level that is not
            affine merges each module with its own bias, or without when it has none.
        grams: ``"per-site"``: each site uploads its level Grams with its weights
            (:attr:`FusionInputs.grams`); ``"sums"``: the server asks the sites
            (:attr:`FusionInputs.sites`) for the sums over sites of ``G~_k`` and ``G~_k W_k``
            alone (:meth:`site_terms`), which a secure channel (SecAgg+) hands over without any
            site's own; the merge is the same.
        dp_epsilon, dp_delta: differentially private Grams (``grams="sums"``, affine levels):
            each site clips each sample's design rows and noises its Gram of every level
            (:mod:`fedfuse.fusion.statistics.privacy`), the noise calibrated so that all levels
            spend at most this budget. None: exact; ``inf``: clipping only.
        dp_clip: bound on a sample's design rows' norm (after the per-column scaling chosen on
            the fusion set); None: each level's median on the fusion set, which is then needed.
        dp_noise_seed: seeds the noise with in-process sites (reproducible simulations; a
            Flower site draws its own).
        align: ``"none"`` (the paper's: neuron ``i`` of every model is merged with neuron
            ``i``, right for sites from one shared initialisation); ``"activations"``: first
            permute every feature space of each model onto one order by matching activations on
            the fusion set (Git Re-Basin's MergeMany, :func:`match_spaces`; any architecture
            with described symmetries), and each site's Grams with it (:func:`align_grams`),
            so independently initialised sites merge matching neurons. Per-site Grams only.

    The system is solved in float64 with :func:`torch.linalg.solve_ex` (LU).
    """

    name = "regmean"
    requires = frozenset({"grams"})

    def __init__(
        self,
        alpha: float = 0.9,
        jitter: float = 1e-9,
        fit_bias: bool | str = "auto",
        grams: str = "per-site",
        dp_epsilon: float | None = None,
        dp_delta: float = 1e-5,
        dp_clip: float | None = None,
        dp_noise_seed: int | None = None,
        align: str = "none",
    ) -> None:
        check_fit_bias(fit_bias, self.name)
        if align not in ("none", "activations"):
            raise ValueError(f"regmean: align must be 'none' or 'activations', got {align!r}")
        if align != "none" and grams != "per-site":
            raise ValueError(
                "regmean: align permutes each site's own Grams, which grams='sums' never shows "
                "the server; use grams='per-site'"
            )
        self.align = align
        check_statistics_mode("regmean: grams", grams)
        self.grams = grams
        if dp_epsilon is not None and grams != "sums":
            raise ValueError(
                "regmean: dp_epsilon noises the Grams of a summed round; set grams='sums'"
            )
        self.dp_epsilon = check_dp_options(dp_epsilon, dp_delta, dp_clip, self.name)
        self.dp_delta = dp_delta
        self.dp_clip = dp_clip
        self.dp_noise_seed = dp_noise_seed
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"regmean: alpha must be in [0, 1], got {alpha}")
        if not jitter >= 0:
            raise ValueError(f"regmean: jitter must be >= 0, got {jitter}")
        self.alpha = float(alpha)
        self.jitter = float(jitter)
        self.fit_bias = fit_bias

    def requirements(self) -> frozenset[str]:
        if self.grams == "per-site":
            return frozenset({"grams"} | ({"data"} if self.align != "none" else set()))
        return frozenset({"sites"} | ({"data"} if self.dp_epsilon and not self.dp_clip else set()))

    def needs(self) -> frozenset[str]:
        # a secure channel's fixed units come from the fusion set and the sample counts; the
        # parameters no Gram merges are averaged weighted by the sample counts when given
        extra = {"data", "sample_counts"} if self.grams == "sums" else {"sample_counts"}
        return self.requirements() | extra

    def check_architecture(self, model: LeveledModel) -> None:
        """Some neuron level must be affine or hold a Linear/Conv2d to merge (a level with
        neither, e.g. a user's BatchNorm cut as a level of its own, is averaged); with
        ``align``, the architecture's symmetries must be described."""
        if self.align != "none":
            check_feature_spaces(model)
        grams = set(gram_levels(model))
        if not grams:
            raise ValueError(
                "no level is affine or holds a Linear or Conv2d (groups=1, zero padding) to "
                "merge by its input Gram"
            )
        for index in model.neuron_levels:
            level = model.levels[index]
            view = affine_view(level)
            if view is None and self.dp_epsilon is not None:
                raise ValueError(
                    f"{self.name} with dp_epsilon noises affine levels' Grams only; "
                    f"{model.spec.arch} level {model.level_name(index)} is not affine"
                )
            check_affine_intercept(model, index, self.fit_bias, self.name)

    def _shrink(self, gram: torch.Tensor) -> torch.Tensor:
        shrunk = self.alpha * gram
        shrunk.diagonal().add_((1.0 - self.alpha) * gram.diagonal())
        return shrunk

    def site_terms(
        self, model: LeveledModel, grams: dict[int, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """What one site adds to the sums RegMean solves from (``grams="sums"``):
        :func:`~.regmean_sums.site_terms` under this instance's ``fit_bias``."""
        return site_terms(model, grams, self.fit_bias, self.name)

    def site_norms(
        self, model: LeveledModel, grams: dict[int, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Step 1 of a secure sum of :meth:`site_terms`: :func:`~.regmean_sums.site_terms`'s
        norms."""
        return site_terms(model, grams, self.fit_bias, self.name, norms=True)

    def _summed_terms(
        self, models: list[LeveledModel], inputs: FusionInputs, details: dict[str, Any]
    ) -> tuple[SiteSums, dict[int, int]]:
        """The sums of :meth:`site_terms` over the sites (:func:`~.regmean_sums.summed_terms`),
        each level's Gram noised for ``dp_epsilon`` (one release per level, composed by
        Opacus's RDP accountant)."""
        mechanisms = None
        if self.dp_epsilon is not None:
            releases = len(models[0].neuron_levels)
            budget = PrivacyBudget(self.dp_epsilon, self.dp_delta, releases, self.dp_noise_seed)
            mechanisms = level_mechanisms(models, inputs.data, budget, self.dp_clip)
            details["privacy"] = budget.account()
        request = GramTermsRequest(self.fit_bias, mechanisms)
        return summed_terms(models, inputs, request, self.name)

    def _counts(self, inputs: FusionInputs, sites: list[int]) -> list[float] | None:
        """The sample counts of ``sites`` (None: not given, or all zero: a plain average)."""
        if inputs.sample_counts is None:
            return None
        counts = sample_counts(self.name, inputs, len(inputs.sample_counts))
        chosen = [counts[site] for site in sites]
        return chosen if sum(chosen) > 0 else None

    def _fuse(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec
    ) -> tuple[LeveledModel, dict[str, Any]]:
        fused = build_model(target)
        sites = list(range(len(models)))
        systems = merge_systems(fused, self.fit_bias, self.name)
        totals, rhs = {}, {}
        details: dict[str, Any] = {"alpha": self.alpha}
        if self.grams == "sums":
            sums, sent = self._summed_terms(models, inputs, details)
            sites = list(sums.sites)
            models = [models[m] for m in sites]
            for key in systems:
                name = system_key(key)
                totals[key] = self._shrink(sums.terms[f"{name}/gram"])
                rhs[key] = self.alpha * sums.terms[f"{name}/rhs"]
                rhs[key] += (1 - self.alpha) * sums.terms[f"{name}/diag_rhs"]
            details["sites"] = sums.sites
            # one round (two steps when secure) of every level's terms
            bytes_sent = {str(m): size for m, size in sent.items()}
            details["rounds"] = [{"level": "all levels", "upload_bytes": bytes_sent}]
        else:
            # Stream over the clients: one client's Grams in memory at a time (they may be
            # memory-mapped files of a thousand sites), the per-system sums accumulated.
            assert inputs.grams is not None
            site_grams = list(inputs.grams)
            if self.align != "none":
                assert inputs.data is not None
                models, site_grams, details["align"] = align_sites(models, site_grams, inputs.data)
            for client, (model, grams) in enumerate(zip(models, site_grams, strict=True)):
                for key, gram, weights in client_parts(model, grams, client, systems, self.name):
                    shrunk = self._shrink(gram)
                    totals[key] = totals[key] + shrunk if key in totals else shrunk
                    product = shrunk @ weights
                    rhs[key] = rhs[key] + product if key in rhs else product
                del grams
        # what no Gram merges (normalisation, embeddings) is averaged, by sample counts if given
        fused.load_state_dict(average_state(models, self._counts(inputs, sites)))
        attention = averaged_attention(fused)
        if attention:
            details["averaged_attention"] = attention
            log.warning(
                "%s: the projections of %s are averaged, not merged by their Grams: an "
                "nn.MultiheadAttention is merged by Grams only in self-attention with one packed "
                "q/k/v projection of the embedding, without bias_k/bias_v or add_zero_attn",
                self.name,
                ", ".join(attention),
            )
        means = {key: torch.zeros_like(rhs[key]) for key in systems}
        for model in models:
            for key, weights in client_weights(model, systems).items():
                means[key] += weights / len(models)
        ridges: dict[str, float] = {}
        for key, system in systems.items():
            merged, relative = solve_regularised(
                totals[key], rhs[key], means[key], self.jitter, system.name
            )
            load_merged(fused, key, system, merged)
            ridges[system.name] = relative
            log.debug("regmean %s: ridge %.1e (relative)", system.name, relative)
        details["ridge"] = ridges
        return fused.eval(), details


__all__ = [
    "GramBlock",
    "RegMean",
    "level_grams",
    "mergeable",
    "module_grams_layout",
]
