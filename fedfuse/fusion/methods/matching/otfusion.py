r"""OTFusion (Singh & Jaggi, 2020): align neurons by optimal transport, then average.

Every model other than the reference is aligned to the reference level by level, bottom-up.
At hidden neuron level :math:`\ell`, with the reference's neurons :math:`i = 1..n` and the
model's neurons :math:`j = 1..m`, marginals :math:`\mu \in \Delta_n, \nu \in \Delta_m` (uniform,
or the neurons' importance scores, normalised to sum to 1 per model and level: the paper's
App. C) and a ground cost :math:`C_{ij}`, the transport plan :math:`P^\ast` is the coupling of
:math:`\mu` and :math:`\nu` of least cost, exact (EMD) or entropic (Sinkhorn, on
:math:`C / \max C`), as :mod:`fedfuse.fusion.blocks.transport` states it.

The ground cost is the squared Euclidean distance between the neurons' *pre-activations* (the
level outputs on the fusion set, over samples and spatial positions, divided by the number of
rows; ``ground_metric="activations"``) or between their incoming weight rows, bias included,
after the incoming side was realigned with the previous level's map (``"weights"``). The plan
(:func:`~fedfuse.fusion.blocks.transport.transport_plan`, POT) is turned into the row-stochastic
map :math:`T = \operatorname{diag}(P^\ast \mathbf{1})^{-1} P^\ast` (rows = reference neurons;
:math:`P^\ast \mathbf{1} = \mu` for EMD, and dividing by the actual row sums makes Sinkhorn's
plan exactly row-stochastic too), and applied to the model: its neurons become
:math:`W_\ell \leftarrow T W_\ell` (weights and bias) and the next level's inputs are
re-expressed, :math:`W_{\ell+1} \leftarrow W_{\ell+1} T^\top` (per input channel, so
convolution -> flatten -> linear works). The classifier's outputs (the classes) are never
transported. The fused model is then the average of the reference and the aligned models,
uniform or weighted by sample counts; optionally followed by
:func:`~fedfuse.fusion.blocks.repair.repair`.

Choices the paper leaves open are options, each with an ``"auto"`` rule that fuses with every
candidate and keeps the first, in order of preference (the value taken without labels), that no
other candidate beats significantly in accuracy on the labelled fusion set
(:func:`~fedfuse.fusion.blocks.selection.best_on_fusion_set`; never the test set: the loss alone
preferred flat-predicting uniform averages on confident sites, issue 52): the ground cost
(``ground_metric``), the reference model (``reference``) and the averaging weights
(``weighted_average``; the authors' code has ``ensemble_step``, the weight of the reference
model, for data split unevenly). The activations are captured once and each alignment is
averaged with every candidate weighting, so ``"auto"`` weights cost one more average and one
more fusion-set evaluation per alignment.

With uniform marginals on equal widths, EMD's plan is a permutation (divided by ``n``), so this
is then the same as a Hungarian matching on the same cost. Activations are those of the
*original* models (as in the authors' activation-based variant): for a permutation they equal
those of the realigned model; for a soft map they are a cheaper proxy.

Architectures. Models whose neuron levels are all affine (MLP, VGG) take the level path above,
with every option. Any other model whose neuron symmetries
:func:`~fedfuse.models.symmetry.feature_spaces` describes (ResNet, ViT) takes the feature-space
path (:mod:`fedfuse.fusion.blocks.space_alignment`), as in Imfeld et al. (2023) for Transformers:
each feature space gets *one* transport map, applied consistently on every axis it indexes. For the
ViT residual stream that is the patch embedding, class token and position embedding, every
LayerNorm's parameters, the input side of Q/K/V and of the MLP, the output side of the attention
projection and of the MLP, and the head; Q/K (jointly) and V/O are transported within each
attention head (block-diagonal maps); the MLP hidden units by themselves. For a ResNet, each
residual stream (conv, shortcut and BatchNorm parameters and buffers) and each block interior.
The ground cost is the squared distance of the activations (``ground_metric="activations"``),
summed over the space's probes (every module output holding its features), with uniform
marginals. On that path ``ground_metric="weights"``, ``use_scores`` and ``repair`` are refused
by :meth:`OTFusion.check_architecture`; models of different widths are never fused (the base
models share one spec and the fused model has it).

BatchNorm: with ``reset_batchnorm`` (default), the fused model's BatchNorm running statistics
are recomputed on the fusion set
(:func:`~fedfuse.fusion.blocks.batchnorm.reset_batchnorm_statistics`): a soft transport map mixes
the running variances linearly, which is only right for a permutation. Models without BatchNorm are
unaffected.

The alignment step is in :mod:`fedfuse.fusion.methods.matching.otfusion_transport`; what OTFusion
shares with Git Re-Basin (options, capture, averaging, REPAIR and BatchNorm reset) in
:mod:`fedfuse.fusion.methods.matching.aligned_average`.

References: S. P. Singh, M. Jaggi. "Model Fusion via Optimal Transport". NeurIPS 2020.
M. Imfeld, J. Graldi, M. Giordano, T. Hofmann, S. Anagnostidis, S. P. Singh. "Transformer
Fusion with Optimal Transport". ICLR 2024 (arXiv:2310.05719, 2023).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

from fedfuse.fusion.base import FusionInputs
from fedfuse.fusion.blocks.selection import Fused, best_on_fusion_set
from fedfuse.fusion.blocks.transport import SOLVERS
from fedfuse.fusion.inputs import averaging_candidates, check_levels, sample_counts
from fedfuse.fusion.methods.matching.aligned_average import AlignedAverage
from fedfuse.fusion.methods.matching.otfusion_transport import Transport
from fedfuse.fusion.registry import register_fusion_method
from fedfuse.models import LeveledModel, ModelSpec
from fedfuse.runtime import resolve_device

log = logging.getLogger(__name__)

GROUND_METRICS = ("auto", "activations", "weights")
#: the ``reference`` rules besides a model index
REFERENCE_RULES = ("largest", "auto")


@register_fusion_method
class OTFusion(AlignedAverage):
    """OTFusion: transport every model's neurons onto a reference model's, then average.

    Args:
        reference: the reference model, whose neurons the others are transported onto (the
            paper aligns to "one of the models", leaving which open): its index (default 0);
            ``"largest"``, the model with the most training samples (needs the sample counts);
            or ``"auto"``, every model in turn, keeping the fused model of higher
            fusion-set accuracy (one alignment per model; without a labelled fusion set,
            the largest, or model 0 without sample counts). The default stays 0: where the
            weight cost wins (sites from one initialisation) every reference gives the same
            identity transport, and ``"auto"`` costs N alignments.
        ground_metric: ``"activations"`` (pre-activations on the fusion set) or ``"weights"``
            (realigned incoming weights and bias; needs no fusion set); ``"auto"`` (default):
            on affine models, both, the activations preferred, keeping the better on the
            labelled fusion set (the paper leaves the cost open, and neither wins everywhere:
            activations on independently trained sites, weights on sites that share their
            initialisation); activations elsewhere, weights without a fusion set.
        solver: ``"emd"`` (exact) or ``"sinkhorn"`` (entropic).
        reg: Sinkhorn regularisation, relative to the level's largest ground cost.
        max_iter: Sinkhorn iterations at most.
        use_scores: use importance scores as the OT marginals (else uniform).
        fallback_scores: score method on the fusion set when scores are used but none given.
        weighted_average: the weights of the average of the aligned models: ``False``
            uniform (the paper's ``ensemble_step=0.5`` for two models), ``True`` by sample
            counts (FedAvg's), or ``"auto"`` (default): both, the counts preferred, keeping the
            better on the labelled fusion set (the paper leaves the proportions to
            the user; sites of unequal sizes favour the counts, sites of equal skill uniform).
            The transport does not depend on them, so the aligned models are averaged twice,
            not realigned. Without labels, the sample counts; without sample counts, uniform.
        repair: apply REPAIR (Jordan et al., 2022) to the fused model, with the aligned models'
            statistics and the averaging weights; needs the fusion set (affine levels only).
        reset_batchnorm: recompute the fused model's BatchNorm running statistics on the fusion
            set (models with BatchNorm only, which need the fusion set anyway; default on).
        device: where activations and costs are computed (``"auto"``, ``"cpu"``, ``"cuda"``).
        batch_size_capture: samples per forward pass when capturing level outputs.

    The transport map is the paper's corrected one (``correction`` with proper marginals in
    the authors' code): the plan scaled by the inverse of the reference's marginal, so every
    reference neuron gets a convex combination of the model's neurons (see the module doc).

    Details: ``reference``, ``ground_metric``, ``weighting`` (``"uniform"`` or ``"samples"``),
    ``weights``; where an ``"auto"`` option chose, ``ground_metric_chosen``,
    ``reference_chosen``, ``weighting_chosen`` and ``fusion_set_losses`` (per candidate fusion,
    its ``ground_metric``, ``reference``, ``weighting``, ``loss`` and ``accuracy``); and
    ``levels``: per hidden level its ``level`` name,
    ``transport_cost`` (``<P*, C>`` per aligned model, in the ground metric's units),
    ``seconds`` (cost and transport, all models) and ``permutation`` (whether every plan was a
    permutation). On the feature-space path ``spaces`` instead, the same per feature space,
    and ``path`` (``"levels"`` or ``"spaces"``) in both.
    """

    name = "otfusion"

    def __init__(
        self,
        reference: int | str = 0,
        ground_metric: str = "auto",
        solver: str = "emd",
        reg: float = 0.01,
        max_iter: int = 1000,
        **inherited: Any,
    ) -> None:
        if ground_metric not in GROUND_METRICS:
            raise ValueError(
                f"ground_metric must be one of {GROUND_METRICS}, got {ground_metric!r}"
            )
        if solver not in SOLVERS:
            raise ValueError(f"solver must be one of {SOLVERS}, got {solver!r}")
        if solver == "sinkhorn" and reg <= 0:
            raise ValueError(f"Sinkhorn needs reg > 0, got {reg}")
        super().__init__(**inherited)
        if isinstance(reference, bool) or not (
            isinstance(reference, int) or reference in REFERENCE_RULES
        ):
            raise ValueError(
                f"reference must be a model index or one of {REFERENCE_RULES}, got {reference!r}"
            )
        self.reference = reference
        self.ground_metric = ground_metric
        self.solver = solver
        self.reg = reg
        self.max_iter = max_iter

    def _check_space_options(self) -> None:
        refused = {
            "ground_metric='weights'": self.ground_metric == "weights",
            "use_scores": self.use_scores,
            "repair": self.repair,
        }
        named = [name for name, on in refused.items() if on]
        if named:
            raise ValueError(
                f"{', '.join(named)} work(s) level by level and need(s) affine levels; "
                "feature-space OTFusion uses activation costs, uniform marginals and "
                "reset_batchnorm for BatchNorm statistics"
            )

    def requirements(self) -> frozenset[str]:
        needed = set(self.requires)
        if self.ground_metric == "activations" or self.repair:
            needed.add("data")
        if self.weighted_average is True or self.reference == "largest":
            needed.add("sample_counts")
        return frozenset(needed)

    def _needs(self) -> frozenset[str]:
        needed = set(self.requirements())
        if self.reset_batchnorm:
            needed.add("data")  # read for models with BatchNorm (which need it anyway)
        if self.use_scores:
            needed.add("scores")
            if self.fallback_scores != "uniform":
                needed |= {"data", "labels"}
        return frozenset(needed)

    def _check(self, models: Sequence[LeveledModel], inputs: FusionInputs, **options: Any) -> None:
        super()._check(models, inputs, **options)
        if isinstance(self.reference, int) and not 0 <= self.reference < len(models):
            raise ValueError(f"{self.name}: reference {self.reference} is not one of the models")

    def needs(self) -> frozenset[str]:
        needed = set(self._needs())
        if self.ground_metric == "auto":
            needed |= {"data", "labels"}  # optional: without them, weights
        if self.weighted_average == "auto" or self.reference == "auto":
            needed |= {"data", "labels", "sample_counts"}  # optional (the fallbacks)
        return frozenset(needed)

    def _fuse_levels(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec
    ) -> tuple[LeveledModel, dict[str, Any]]:
        return self._fuse_path(models, inputs, target, True)

    def _fuse_spaces(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec
    ) -> tuple[LeveledModel, dict[str, Any]]:
        return self._fuse_path(models, inputs, target, False)

    def _fuse_path(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec, affine: bool
    ) -> tuple[LeveledModel, dict[str, Any]]:
        """Align (per ground metric and reference), average (per weighting), keep the
        candidate :func:`best_on_fusion_set` keeps where there are several."""
        metrics = self._metrics(inputs) if affine else ["activations"]
        references = self._references(models, inputs)
        weightings = averaging_candidates(self.name, inputs, len(models), self.weighted_average)
        fusions = self._fusions(models, inputs, target, affine, metrics, references, weightings)
        if len(metrics) * len(references) * len(weightings) == 1:
            return next(fusions)[1]
        chosen = best_on_fusion_set(fusions, inputs, self.batch_size_capture)
        details = chosen.details
        for option, key in (("ground_metric", metrics), ("reference", references)):
            if len(key) > 1:
                details[f"{option}_chosen"] = details[option]
        if len(weightings) > 1:
            details["weighting_chosen"] = details["weighting"]
        losses = [
            {
                "ground_metric": metric,
                "reference": ref,
                "weighting": weighting,
                "loss": loss,
                "accuracy": chosen.accuracies[(metric, ref, weighting)],
            }
            for (metric, ref, weighting), loss in chosen.losses.items()
        ]
        details["fusion_set_losses"] = losses
        log.info(
            "%s: ground metric %s, reference %s, %s weights (fusion-set losses %s)",
            self.name,
            details["ground_metric"],
            details["reference"],
            details["weighting"],
            losses,
        )
        return chosen.model, details

    def _fusions(
        self,
        models: list[LeveledModel],
        inputs: FusionInputs,
        target: ModelSpec,
        affine: bool,
        metrics: list[str],
        references: list[int],
        weightings: dict[str, list[float]],
    ) -> Iterator[tuple[tuple[str, int, str], Fused]]:
        """Each candidate fusion, one at a time, keyed by its ground metric, reference and
        weighting: every alignment averaged with every weighting, then finished."""
        device = resolve_device(self.device)
        levels = check_levels(self.name, models) if affine else []
        captured = None
        if affine and "activations" in metrics:
            assert inputs.data is not None
            captured = self._capture_hidden(models, inputs.data, levels[:-1])  # once, any ref
        transport = Transport(
            self.solver, self.reg, self.max_iter, self.batch_size_capture, device, self.name
        )
        for metric in metrics:
            for ref in references:
                if affine:
                    scores = self._scores(models, inputs)
                    aligned, alignment = transport.levels(
                        models, levels, metric, ref, captured, scores
                    )
                else:
                    assert inputs.data is not None
                    aligned, alignment = transport.spaces(models, inputs.data, ref)
                for weighting, weights in weightings.items():
                    details = {**alignment, "weighting": weighting, "weights": weights}
                    fused = self._average(aligned, weights, target)
                    fused = self._finish(fused, aligned, weights, inputs, details, affine)
                    yield (metric, ref, weighting), (fused, details)

    def _metrics(self, inputs: FusionInputs) -> list[str]:
        """The ground metrics to fuse with (affine levels): ``auto``, both when the fusion set
        is labelled, else activations (unlabelled) or weights (no fusion set)."""
        if self.ground_metric != "auto":
            return [self.ground_metric]
        if inputs.data is None:
            return ["weights"]
        if inputs.labels is None:
            return ["activations"]
        return ["activations", "weights"]

    def _references(self, models: list[LeveledModel], inputs: FusionInputs) -> list[int]:
        """The reference models to align to: the index; ``"largest"``: the model with the most
        samples; ``"auto"``: every model when the fusion set is labelled (the largest, or model
        0 without sample counts, first: preferred), else that one."""
        if isinstance(self.reference, int):
            return [self.reference]
        if inputs.sample_counts is None:
            if self.reference == "largest":
                raise ValueError(
                    f"{self.name}: needs FusionInputs.sample_counts, which was not given"
                )
            fallback = 0
        else:
            counts = sample_counts(self.name, inputs, len(models))
            fallback = counts.index(max(counts))
        labelled = inputs.data is not None and inputs.labels is not None
        if self.reference == "auto" and labelled:  # the fallback preferred
            return [fallback] + [k for k in range(len(models)) if k != fallback]
        return [fallback]
