r"""Git Re-Basin by activation matching (Ainsworth et al., 2022): permute, then average.

Two models ``A`` and ``B``. At every hidden neuron level, with ``z^A_i`` and ``z^B_j`` the
*pre-activations* of the neurons (the level outputs of the **original** models on the fusion set,
as rows over samples and spatial positions; permuting the levels below does not change them),
the permutation of ``B``'s neurons onto ``A``'s solves the linear assignment problem

.. math::
    \pi^\ast = \operatorname*{arg\,max}_{\pi \in S_n} \sum_i
        \operatorname{corr}\bigl(z^A_i, z^B_{\pi(i)}\bigr)
    \quad\text{(``cost="correlation"``, default)}
    \qquad\text{or}\qquad
    \pi^\ast = \operatorname*{arg\,min}_{\pi \in S_n} \sum_i
        \bigl\lVert z^A_i - z^B_{\pi(i)} \bigr\rVert^2 \quad\text{(``"l2"``)},

with :math:`\operatorname{corr}` the Pearson correlation over the rows (each neuron
standardised), solved exactly by :func:`~fedfuse.fusion.blocks.matching.linear_assignment`
(Hungarian). ``B``'s neurons are reordered with
:func:`~fedfuse.fusion.blocks.alignment.permute_level` (the next level's inputs follow, so ``B``'s
function is unchanged) and the two are averaged. The classifier's outputs (the classes) are never
permuted.

Matching (``matching``): by activations as above, or by weights (Git Re-Basin's weight
matching: the neurons' incoming weights and bias, lower levels' permutations applied first), or
(``"auto"``, the default) whichever fuses to the better fusion-set accuracy.

Averaging: uniform, or by sample counts, or (``weighted_average="auto"``, the default) whichever
of the two :func:`~fedfuse.fusion.blocks.selection.best_on_fusion_set` keeps (fusion-set
accuracy, the sample counts preferred), or per neuron by importance
(``use_scores``, the paper's App. C, as in Hungarian Fusion): with ``s^A_i`` and ``s^B_{\pi(i)}``
the two matched neurons' scores (normalised to sum to 1 per model and level), and ``c_A, c_B``
the model weights (uniform or sample counts),

.. math::
    \lambda_i = \frac{c_A s^A_i}{c_A s^A_i + c_B s^B_{\pi(i)}}, \qquad
    (w_i, b_i) = \lambda_i (w^A_i, b^A_i) + (1 - \lambda_i)(w^B_{\pi(i)}, b^B_{\pi(i)}),

where :math:`w_i` is neuron ``i``'s *whole* incoming weight row: the neuron's own weight applies
to all its incoming weights (the next level's inputs are not reweighted by the previous level's
scores). ``lambda_i = c_A / (c_A + c_B)`` when both scores are 0. The classifier rows are averaged
with ``c_A, c_B`` only (class logits have no neuron scores to pair). Optionally followed by
:func:`~fedfuse.fusion.blocks.repair.repair` with ``A`` and the permuted ``B`` and ``alpha = (c_A,
c_B)``.

More than two models: MergeMany (the paper's Alg. 3). Every model ``k`` carries a permutation
``pi_k`` (start: the identity); a round visits the models in a random order (``seed``) and
re-matches each one's neurons to the others as already aligned, the assignment minimising the
``c``-weighted sum of its costs to them, :math:`\sum_{j \ne k} c_j\,C(z^j_{\pi_j(s)}, z^k_s)`
(for ``"l2"``: matching to the others' weighted mean of aligned pre-activations, up to a
constant; for ``"correlation"``: the summed correlations with each aligned model); rounds repeat
until one moves nothing, or ``match_rounds`` of them
(:func:`~fedfuse.fusion.blocks.matching.merge_many`). The paper runs MergeMany with weight
matching, which couples the levels; activation matching does not (the pre-activations of the
original models do not depend on the permutations below), so MergeMany runs level by level (or
feature space by feature space). The permutations are then expressed with model 0's the identity
(the fused neurons numbered like model 0's; no function changes), and all aligned models are
averaged: uniformly, by sample counts, or per neuron by importance, :math:`\lambda_{k,i} \propto
c_k s^k_{\pi_k(i)}`. For two models the rounds are not run: model 1 is matched once onto model 0,
which is where MergeMany stops whichever model it visits first (the optimal assignment of one
onto the other is each one's best reply; only when several assignments tie for the optimum
could MergeMany's solver settle on another of them), so two models fuse exactly as before.

Architectures. Models whose neuron levels are all affine (MLP, VGG) take the level path above,
with every option. Any other model whose neuron symmetries
:func:`~fedfuse.models.symmetry.feature_spaces` describes (ResNet, ViT) takes the feature-space
path (:mod:`fedfuse.fusion.blocks.space_alignment`): per feature space (a ResNet residual stream or
block interior; the ViT residual stream, each block's query/key dims, value dims and MLP hidden
units), the same cost summed over the space's probes (every module output holding its
features), the Hungarian permutation (per attention head for grouped spaces), applied to every
axis of the space (BatchNorm buffers and LayerNorm parameters included), then the average. On
that path the generic cost gives the same permutations as the level path on MLP/VGG (same
features, same cost), but ``use_scores`` and ``repair`` (which fold into affine levels) are
refused by :meth:`GitReBasin.check_architecture`.

BatchNorm: with ``reset_batchnorm`` (default), the fused model's BatchNorm running statistics
are recomputed on the fusion set
(:func:`~fedfuse.fusion.blocks.batchnorm.reset_batchnorm_statistics`, the paper's "reset BN" and
REPAIR's BatchNorm form); without it they are the averaged aligned statistics. Models without
BatchNorm are unaffected.

The matching step (costs, MergeMany per level or space) is in
:mod:`fedfuse.fusion.methods.matching.git_rebasin_matching`; what Git Re-Basin shares with
OTFusion (options, capture, averaging, REPAIR and BatchNorm reset) in
:mod:`fedfuse.fusion.methods.matching.aligned_average`.

Reference: S. K. Ainsworth, J. Hayase, S. Srinivasa. "Git Re-Basin: Merging Models modulo
Permutation Symmetries". ICLR 2023 (arXiv:2209.04836, 2022).
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Any

import torch

from fedfuse.fusion.base import FusionInputs
from fedfuse.fusion.blocks.alignment import affine_levels, permute_level
from fedfuse.fusion.blocks.selection import Fused, best_on_fusion_set
from fedfuse.fusion.blocks.space_alignment import (
    align_model,
    block_assignment,
    check_feature_spaces,
    pairwise_space_costs,
)
from fedfuse.fusion.inputs import averaging_candidates, check_levels
from fedfuse.fusion.methods.matching.aligned_average import AlignedAverage
from fedfuse.fusion.methods.matching.git_rebasin_matching import (
    MergeMany,
    check_cost,
    cost_matrix,
)
from fedfuse.fusion.registry import register_fusion_method
from fedfuse.models import LeveledModel, ModelSpec, build_model
from fedfuse.models.symmetry import permutation_matrix
from fedfuse.runtime import resolve_device

log = logging.getLogger(__name__)

#: how neurons are matched: by their activations on the fusion set (the correlation or l2
#: ``cost``), by their weights (incoming weights and bias, l2; Ainsworth et al.'s weight
#: matching, one pass bottom-up), or ``"auto"``
MATCHINGS = ("activations", "weights", "auto")


@register_fusion_method
class GitReBasin(AlignedAverage):
    """Git Re-Basin, activation matching: permute model 1 onto model 0, then average; more
    models: MergeMany (each model re-matched to the others until none moves), then average.

    Args:
        cost: ``"correlation"`` (default) or ``"l2"`` between pre-activations.
        matching: ``"activations"`` (the pre-activations on the fusion set, by ``cost``),
            ``"weights"`` (Ainsworth et al.'s weight matching, one pass bottom-up: each neuron's
            incoming weights and bias, the inputs already permuted, by squared distance; no
            data read; level path only), or ``"auto"`` (default): both when the fusion set is
            labelled, the activations preferred (:mod:`~fedfuse.fusion.blocks.selection`),
            else the activations. On sites of one initialisation the activations can move
            neurons the shared start had aligned, and weight matching keeps them (issue 52:
            37.6 against FedAvg's 46.1 on LeNets trained with SGD and momentum, 46.1 with
            weight matching).
        match_rounds: more than two models: most rounds of MergeMany (it stops earlier when a
            round moves nothing).
        seed: more than two models: seeds MergeMany's order of visits.
        use_scores: average each matched pair of neurons with weights proportional to their
            importance scores (the paper's App. C).
        fallback_scores: score method on the fusion set when scores are used but none given.
        weighted_average: the model weights ``c``, in MergeMany's costs and in the average:
            ``False`` uniform (the paper's), ``True`` the sample counts (FedAvg's), or
            ``"auto"`` (default): both, keeping the fused model of better accuracy on the
            labelled fusion set, the counts preferred (sites of unequal sizes favour them). The
            activations and costs are computed once; MergeMany and the average run per
            weighting, so a choice equals fusing with that weighting. Without labels, the
            sample counts; without sample counts, uniform.
        repair: apply REPAIR (Jordan et al., 2022) to the fused model (affine levels only).
        reset_batchnorm: recompute the fused model's BatchNorm running statistics on the fusion
            set (models with BatchNorm only; default on).
        device: where activations and costs are computed (``"auto"``, ``"cpu"``, ``"cuda"``).
        batch_size_capture: samples per forward pass when capturing level outputs.

    Details: ``weights`` (the model weights ``c``) and ``weighting`` (``"uniform"`` or
    ``"samples"``); where ``"auto"`` chose, ``weighting_chosen``, ``fusion_set_losses`` and
    ``fusion_set_accuracies`` (per weighting); and ``levels``: per hidden level its
    ``level`` name, ``matched`` (the mean matched correlation, or squared distance per row,
    averaged over the pairs of models), ``moved`` (neurons not matched to their own index,
    summed over models 1..N-1), ``permutation`` (model 1's; two models) or ``permutations``
    (each model's, model 0's the identity; more), ``rounds`` (MergeMany's) and ``seconds``; on
    the feature-space path ``spaces`` instead, the same per space (``matched`` averaged over
    its probes), and ``path`` (``"levels"`` or ``"spaces"``) in both.
    """

    name = "git-rebasin"
    requires = frozenset({"data"})
    option_bounds = {"match_rounds": (1, 1_000)}

    def __init__(
        self,
        cost: str = "correlation",
        match_rounds: int = 100,
        seed: int = 0,
        matching: str = "auto",
        **inherited: Any,
    ) -> None:
        check_cost(cost)
        if matching not in MATCHINGS:
            raise ValueError(f"{self.name}: matching must be one of {MATCHINGS}, got {matching!r}")
        super().__init__(**inherited)
        self.cost = cost
        self.matching = matching
        self.match_rounds = match_rounds
        self.seed = seed

    def _check_space_options(self) -> None:
        if self.matching == "weights":
            raise ValueError(
                "weight matching reads affine levels; fuse with matching='activations' "
                "(feature-space matching)"
            )
        if self.use_scores:
            raise ValueError(
                "use_scores weighs neurons level by level, which needs affine levels; fuse "
                "with use_scores=false (feature-space matching)"
            )
        if self.repair:
            raise ValueError(
                "repair folds its correction into affine levels; use repair=false (BatchNorm "
                "statistics are recomputed on the fusion set with reset_batchnorm=true)"
            )

    def requirements(self) -> frozenset[str]:
        return self.requires | ({"sample_counts"} if self.weighted_average is True else set())

    def needs(self) -> frozenset[str]:
        needed = set(self.requirements())
        if self.use_scores:
            needed.add("scores")
            if self.fallback_scores != "uniform":
                needed.add("labels")
        if self.weighted_average == "auto":
            needed |= {"labels", "sample_counts"}  # optional (the fallbacks)
        if self.matching == "auto":
            needed.add("labels")  # optional: without them, activations
        return frozenset(needed)

    def _fuse_levels(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec
    ) -> tuple[LeveledModel, dict[str, Any]]:
        labelled = inputs.labels is not None
        matchings = list(MATCHINGS[:2]) if self.matching == "auto" and labelled else [self.matching]
        matchings = ["activations" if m == "auto" else m for m in matchings]
        fusions = {
            (matching, weighting): fused
            for matching in matchings
            for weighting, fused in self._level_fusions(models, inputs, target, matching).items()
        }
        return self._choose(fusions, inputs)

    def _fuse_spaces(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec
    ) -> tuple[LeveledModel, dict[str, Any]]:
        fusions = self._space_fusions(models, inputs, target)
        return self._choose({("activations", w): f for w, f in fusions.items()}, inputs)

    def _choose(self, fusions: dict[str, Fused], inputs: FusionInputs) -> Fused:
        """Of several fused models (by matching and weighting, in order of preference), the one
        :func:`best_on_fusion_set` keeps."""
        if len(fusions) == 1:
            return next(iter(fusions.values()))
        chosen = best_on_fusion_set(fusions.items(), inputs, self.batch_size_capture)
        details = chosen.details
        if len({m for m, _ in fusions}) > 1:
            details["matching_chosen"] = chosen.key[0]
        if len({w for _, w in fusions}) > 1:
            details["weighting_chosen"] = chosen.key[1]
        details["fusion_set_losses"] = [
            {"matching": m, "weighting": w, "loss": loss, "accuracy": chosen.accuracies[(m, w)]}
            for (m, w), loss in chosen.losses.items()
        ]
        log.info(
            "%s: %s (fusion-set scores %s)", self.name, chosen.key, details["fusion_set_losses"]
        )
        return chosen.model, details

    def _details(self, weightings: dict[str, list[float]], path: str) -> dict[str, dict[str, Any]]:
        """Per weighting, the details to fill on ``path`` (``"levels"`` or ``"spaces"``)."""
        return {
            weighting: {
                "path": path,
                "weighting": weighting,
                "weights": weights,
                "cost": self.cost,
                path: [],
            }
            for weighting, weights in weightings.items()
        }

    def _space_fusions(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec
    ) -> dict[str, Fused]:
        """Match every feature space of the models (MergeMany), permute, average, finish: per
        candidate weighting, on the same costs."""
        weightings = averaging_candidates(self.name, inputs, len(models), self.weighted_average)
        device = resolve_device(self.device)
        assert inputs.data is not None
        spaces = check_feature_spaces(models[0])
        details = self._details(weightings, "spaces")
        maps: dict[str, list[dict[str, torch.Tensor]]] = {
            weighting: [{} for _ in models] for weighting in weightings
        }
        merging = MergeMany(self.cost, self.match_rounds, self.seed)
        for position, space in enumerate(spaces):
            started = time.perf_counter()
            costs = pairwise_space_costs(
                models,
                inputs.data,
                space,
                self.cost,
                batch_size=self.batch_size_capture,
                device=device,
            )
            merged = merging.permutations(
                costs,
                weightings,
                offset=position,
                label={"space": space.name},
                started=started,
                assign=lambda cost, groups=space.groups: block_assignment(cost, groups),
                probes=len(space.probes),
            )
            for weighting, (permutations, entry) in merged.items():
                for model_maps, permutation in zip(
                    maps[weighting][1:], permutations[1:], strict=True
                ):
                    model_maps[space.name] = permutation_matrix(permutation)
                details[weighting]["spaces"].append(entry)
        fusions = {}
        for weighting, weights in weightings.items():
            aligned = [models[0]] + [
                align_model(m, model_maps, spaces)
                for m, model_maps in zip(models[1:], maps[weighting][1:], strict=True)
            ]
            fused = self._average(aligned, weights, target)
            fused = self._finish(fused, aligned, weights, inputs, details[weighting], False)
            fusions[weighting] = (fused, details[weighting])
        return fusions

    def _level_fusions(
        self,
        models: list[LeveledModel],
        inputs: FusionInputs,
        target: ModelSpec,
        matching: str = "activations",
    ) -> dict[str, Fused]:
        """Match every hidden level of the models (MergeMany), permute, average, finish: per
        candidate weighting, on the same activation costs (weight costs: per weighting, on the
        models as the lower levels' permutations left them)."""
        weightings = averaging_candidates(self.name, inputs, len(models), self.weighted_average)
        hidden = check_levels(self.name, models)[:-1]
        assert inputs.data is not None
        scores = self._scores(models, inputs)
        activations = matching == "activations"
        captured = self._capture_hidden(models, inputs.data, hidden) if activations else []
        permuted = {
            weighting: [models[0]] + [copy.deepcopy(m).cpu() for m in models[1:]]
            for weighting in weightings
        }
        details = self._details(weightings, "levels")
        lambdas: dict[str, dict[int, torch.Tensor]] = {weighting: {} for weighting in weightings}
        merging = MergeMany(self.cost, self.match_rounds, self.seed)
        for index in hidden:
            started = time.perf_counter()
            label = {"level": models[0].level_name(index)}
            if activations:
                costs = _pairwise_costs(
                    [c[index].outputs for c in captured], self.cost, self.batch_size_capture
                )
                merged = merging.permutations(
                    costs, weightings, offset=index, label=label, started=started
                )
            else:  # weight matching: each neuron's incoming weights and bias
                merged = {}
                for weighting, weights in weightings.items():
                    rows = [affine_levels(m)[index].weights() for m in permuted[weighting]]
                    merged |= MergeMany("l2", self.match_rounds, self.seed).permutations(
                        _pairwise_costs(rows, "l2", 256),
                        {weighting: weights},
                        offset=index,
                        label=label,
                        started=started,
                    )
            for weighting, (permutations, entry) in merged.items():
                weights = weightings[weighting]
                for model, permutation in zip(
                    permuted[weighting][1:], permutations[1:], strict=True
                ):
                    permute_level(model, index, permutation)
                if scores is not None:
                    lambdas[weighting][index] = _score_lambdas(
                        [w * s[index].double().cpu() for w, s in zip(weights, scores, strict=True)],
                        permutations,
                        weights,
                    )
                details[weighting]["levels"].append(entry)
        del captured
        fusions = {}
        for weighting, weights in weightings.items():
            fused = _average_by_neuron(permuted[weighting], target, weights, lambdas[weighting])
            fused = self._finish(
                fused, permuted[weighting], weights, inputs, details[weighting], True
            )
            fusions[weighting] = (fused, details[weighting])
        return fusions


def _pairwise_costs(
    outputs: list[torch.Tensor], cost: str, batch_size: int
) -> dict[tuple[int, int], torch.Tensor]:
    """:func:`cost_matrix` between every pair ``i < j`` of the models' ``outputs``."""
    return {
        (i, j): cost_matrix(outputs[i], outputs[j], cost, batch_size).cpu()
        for i in range(len(outputs))
        for j in range(i + 1, len(outputs))
    }


def _score_lambdas(
    scores: list[torch.Tensor], permutations: list[torch.Tensor], weights: list[float]
) -> torch.Tensor:
    """``(models, n)`` per-neuron averaging weights ``c_k s^k_{pi_k(i)}`` over their sum (the
    model weights where all are 0); the last row is 1 minus the others."""
    aligned = [s[p] for s, p in zip(scores, permutations, strict=True)]
    total = sum(aligned)
    assert isinstance(total, torch.Tensor)
    rows = [
        torch.where(total > 0, a / total.clamp_min(1e-300), torch.tensor(w))
        for a, w in zip(aligned[:-1], weights[:-1], strict=True)
    ]
    return torch.stack([*rows, 1 - sum(rows)])


@torch.no_grad()
def _average_by_neuron(
    models: list[LeveledModel],
    target: ModelSpec,
    weights: list[float],
    lambdas: dict[int, torch.Tensor],
) -> LeveledModel:
    """``sum_k lambda_k M_k`` per level: per neuron (weight row and bias) on the levels in
    ``lambdas`` (``(models, n)``), the model weights elsewhere; the last model's weight is 1
    minus the others' (two models: ``lambda A + (1 - lambda) B``)."""
    fused = build_model(target, seed=0)  # overwritten; the seed spares the global RNG
    views = [affine_levels(m) for m in models]
    for index, view in affine_levels(fused).items():
        rows = [v[index].weights().double().cpu() for v in views]
        lam = lambdas.get(index)
        if lam is None:
            head = torch.tensor(weights[:-1], dtype=torch.float64)[:, None].expand(
                -1, rows[0].shape[1]
            )
            lam = torch.cat([head, (1 - head.sum(0))[None]])
        lam = lam.double().cpu()
        total = lam[0][None] * rows[0]
        for k in range(1, len(rows)):
            total = total + lam[k][None] * rows[k]
        view.set_weights(total)
    return fused
