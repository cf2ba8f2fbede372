r"""FedMA-style one-shot matching: PFNM's BBP-MAP, layer-wise, without FedMA's retraining rounds.

Probabilistic Federated Neural Matching (PFNM, Yurochkin et al., 2019) models the hidden neurons
of every client as noisy copies of *global* neurons drawn from a Beta-Bernoulli process (BBP,
the Indian buffet process, IBP). For one level, with each neuron written as its incoming weight
vector ``v`` (the weights and the bias, ``D`` coordinates):

.. math::

    \theta_i \sim \mathcal N(\mu_0, \sigma_0^2 I), \qquad
    v_{jl} \mid B^j_{il} = 1 \sim \mathcal N(\theta_i, \sigma^2 I), \qquad
    B^j \sim \text{BBP}(\gamma),

where ``B^j`` is client ``j``'s (injective) assignment of its ``L_j`` neurons to global neurons
and ``\mu_0 = 0``. BBP-MAP maximises the posterior over the assignments and the global neurons:
with the ``theta_i`` at their posterior means the objective is, up to constants,

.. math::

    \sum_i \frac{\lVert \mu_0/\sigma_0^2 + \sum_{j,l} B^j_{il} v_{jl}/\sigma^2 \rVert^2}
                {1/\sigma_0^2 + m_i/\sigma^2} + 2 \log P(B),

(``m_i`` clients use global neuron ``i``), which is maximised by coordinate ascent over the
clients: remove client ``j``, then solve one linear assignment (Hungarian) of its neurons
``l`` to the columns ``[existing global neurons i | new neurons k = 1..L_j]`` with the gains
(the negated PFNM costs)

.. math::

    \text{existing } i:\; \frac{\lVert s_i + v_{jl}/\sigma^2\rVert^2}{p_i + 1/\sigma^2}
        - \frac{\lVert s_i\rVert^2}{p_i} + 2\log\frac{m^{-j}_i}{J - m^{-j}_i}, \qquad
    \text{new } k:\; \frac{\lVert \mu_0/\sigma_0^2 + v_{jl}/\sigma^2\rVert^2}{1/\sigma_0^2
        + 1/\sigma^2} - \frac{\lVert\mu_0\rVert^2}{\sigma_0^2} + 2\log\frac{\gamma}{J}
        - 2\log k,

with ``s_i = \mu_0/\sigma_0^2 + \sum v/\sigma^2`` and ``p_i = 1/\sigma_0^2 + m^{-j}_i/\sigma^2``
the natural parameters of global neuron ``i`` without client ``j``. The global neurons are then
the posterior means ``\theta_i = s_i / p_i``. (FedMA's reference code uses ``\log`` instead of
``2\log`` for the popularity term and clips ``m`` at 10: option ``popularity``.) For a flat prior
the matching rule reads: client neuron ``v`` joins global neuron ``theta`` (used by one other
client) rather than opening the ``k``-th new neuron when
``||v - theta||^2 < 2 sigma^2 (2 log(J/gamma) + log(m/(J-m)) + 2 log k)``.

Levels are matched bottom-up (FedMA's layer-wise matching). Before matching a level, each
client's incoming weights are re-expressed in the already-matched global previous level: the
input channel of its previous-level neuron ``l`` moves to the global index it was assigned to,
and the inputs from global neurons the client does not have get zero weight (FedMA's
"patching"). The classifier level is not matched (the classes are fixed): its mapped rows are
combined per class with each client's share of that class's training samples
(``FusionInputs.class_counts``; uniform when not given), as FedMA does for the last layer.

FedMA (Wang et al., 2020) retrains the clients after each matched layer; this implementation
stops after the matching, so it stays one-shot. It needs no data, except that by default it
chooses ``sigma`` from a small grid by the accuracy of the fused model on the labelled
fusion set (``select``), as PFNM's reference code chooses its
settings by training accuracy. The global model may be wider than the clients: it decides its
widths itself, capped per level: by default the fusion set chooses between ``width_factor``
(1.5) times the widest client and FedMA's cap of 700 neurons (PFNM has none), the first kept
unless FedMA's is significantly more accurate.
The default target of :meth:`fuse` (model 0's spec) is ignored; an explicit target with other
widths caps each level at those widths.

References:
    M. Yurochkin, M. Agarwal, S. Ghosh, K. Greenewald, T. N. Hoang, Y. Khazaeni. *Bayesian
    Nonparametric Federated Learning of Neural Networks*, ICML 2019 (PFNM).
    H. Wang, M. Yurochkin, Y. Sun, D. Papailiopoulos, Y. Khazaeni. *Federated Learning with
    Matched Averaging*, ICLR 2020 (FedMA).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from fedfuse.fusion.base import FusionInputs, FusionMethod
from fedfuse.fusion.blocks.alignment import affine_levels, incoming_by_channel
from fedfuse.fusion.blocks.selection import best_on_fusion_set
from fedfuse.fusion.inputs import check_levels, head_weights
from fedfuse.fusion.methods.matching.fedma_bbp import POPULARITY, bbp_map_match
from fedfuse.fusion.registry import register_fusion_method
from fedfuse.models import LeveledModel, ModelSpec, build_model
from fedfuse.models.affine import AffineLevel, affine_view

#: architectures built of residual blocks, which FedMA's layer-wise matching does not cover
_RESIDUAL_ARCHS = frozenset({"resnet", "vit"})
#: FedMA's reference code opens no global neuron past this many in a layer (PFNM has no cap)
FEDMA_WIDTH_LIMIT = 700

log = logging.getLogger(__name__)


def _mapped_incoming(
    view: AffineLevel, previous_assignment: list[int] | None, previous_width: int | None
) -> torch.Tensor:
    """A client level's neurons as rows ``[weights..., bias]`` with its input channels moved to
    the global previous level (zero for global neurons the client does not have)."""
    weight = view.layer.weight.detach().double().cpu()
    bias = (
        view.layer.bias.detach().double().cpu()
        if view.layer.bias is not None
        else weight.new_zeros(weight.shape[0])
    )
    if previous_assignment is None:
        rows = weight.flatten(1)
    else:
        assert previous_width is not None
        grouped = incoming_by_channel(view, len(previous_assignment)).double().cpu()
        mapped = grouped.new_zeros(grouped.shape[0], previous_width, grouped.shape[2])
        mapped[:, torch.as_tensor(previous_assignment)] = grouped
        rows = mapped.flatten(1)
    return torch.cat([rows, bias[:, None]], 1)


@register_fusion_method
class FedMAMatching(FusionMethod):
    """One-shot FedMA/PFNM matching (BBP-MAP, layer-wise) into a possibly wider global model.

    See the module docstring for the model and the algorithm. With ``normalize=True`` (the
    default) every level's neuron vectors are divided by their RMS norm ``rho`` over all clients
    before matching (and the global neurons multiplied back), so ``sigma`` and ``sigma0`` are
    per-coordinate stds *in units of a typical neuron's norm* and mean the same at every level
    and architecture; ``normalize=False`` uses raw weight units as FedMA's reference code (whose
    defaults are ``sigma = sigma0 = gamma = 1``, there with ``sigma`` a variance).

    Args:
        sigma: client noise std per coordinate (units: see above). It sets how far a client's
            neuron may be from a global one and still be matched: with a flat prior and two
            clients, it joins rather than opening the ``k``-th new neuron when
            ``||v - theta||^2 / rho^2 < 2 sigma^2 (1.39 + 2 log k)``. Default 0.1: only
            near-duplicates merge freely (relative distance below ~0.17 for the first new
            neuron, ~0.46 for the 100th); distinct neurons open new global ones until the width
            cap, after which each Hungarian step merges the closest pairs (independently trained
            clients rarely have near-duplicate neurons, and without FedMA's retraining merging
            merely similar ones costs accuracy). With ``select`` (default) it is only the centre
            of the grid tried on the labelled fusion set, which picks the value used.
        sigma0: prior std per coordinate around ``mu0 = 0``. The global neurons are posterior
            means, shrunk toward 0 by ``m / (m + sigma^2 / sigma0^2)``; with no retraining to
            undo that shrinkage the default prior is weak (10: shrinkage factor >= 0.9999).
        gamma: IBP mass (PFNM's ``gamma_0``); larger values make new global neurons cheaper by
            ``2 log gamma``. Default 1 (FedMA's).
        iterations: passes over the clients in random order after the initial sequential one
            (clients widest first), stopped early when a pass changes no assignment. Default 5
            (two clients settle after one pass; four 256-wide clients within about five).
        max_width: cap on each hidden level's global width: a count, 0 (``width_factor``'s
            cap) or ``"auto"`` (default): with a labelled fusion set, each ``sigma`` is tried
            under ``width_factor``'s cap and under FedMA's reference cap of 700 neurons per
            layer, and :func:`~fedfuse.fusion.blocks.selection.best_on_fusion_set` keeps
            ``width_factor``'s unless FedMA's is significantly more accurate (``details``:
            ``width_cap_chosen``, ``selection["caps"]``). On 5 LeNets trained with SGD and
            momentum on Dirichlet(0.1) sites the 1.5x cap merges neurons that only some sites
            learned (57.4 % against an ensemble's 63.9); FedMA's cap keeps them (76.6 %, a 5x
            wider model). Without labels or ``select``: ``width_factor``'s cap.
        width_factor: cap as a multiple of the widest client's width at that level when
            ``max_width`` is 0 or ``"auto"``. Default 1.5: some growth keeps distinct neurons
            apart, while the model stays comparable in size to the clients (FedMA's cap of 700
            is ~1.4x its 512-wide layers). ``width_factor = J``
            (number of clients) with a small ``sigma`` keeps every neuron: the fused model then
            computes the class-count-weighted sum of the clients' logits exactly.
        normalize: express ``sigma``/``sigma0`` relative to each level's RMS neuron norm.
        popularity: how an existing global neuron's popularity ``m`` enters the matching gain:
            ``"paper"`` (default, PFNM's and FedMA's equations: ``2 log(m / (J - m))``) or
            ``"code"`` (their reference code: ``log(m / (J - m))`` with ``m`` clipped at 10).
        select: choose ``sigma`` on the labelled fusion set (default): fuse with each value of
            the grid ``sigma * 2**k``, ``k = -(grid-1)/2 .. (grid-1)/2``, and keep the model
            :func:`~fedfuse.fusion.blocks.selection.best_on_fusion_set` keeps (fusion-set
            accuracy; ``sigma`` preferred, then the values nearest it); ``details`` reports
            ``sigma`` and ``selection`` (the grid, its accuracies and losses). PFNM's reference
            code likewise fuses over a grid of ``(sigma, sigma0, gamma)`` and keeps
            the best training accuracy; the papers fix no value, and ``sigma`` is the setting
            that decides which neurons merge (``sigma0`` and ``gamma`` barely moved the result
            on our runs). Without ``data`` and ``labels`` it fuses with ``sigma`` alone (then
            zero-shot and data-free).
        grid: number of ``sigma`` values tried when ``select`` (odd: centred on ``sigma``;
            1: no selection). Default 5, ``sigma/4 .. 4 sigma``: from "merge only
            near-duplicates" to "merge most neurons" at the default ``sigma``.
        seed: seeds the client order of the passes.
    """

    name = "fedma"
    needs_affine_levels = True
    same_spec = False  # clients may differ in width; everything else must agree
    retargetable = True
    chooses_widths = True  # the global widths come out of the matching
    option_bounds = {"grid": (1, 15)}

    def __init__(
        self,
        sigma: float = 0.1,
        sigma0: float = 10.0,
        gamma: float = 1.0,
        iterations: int = 5,
        max_width: int | str = "auto",
        width_factor: float = 1.5,
        normalize: bool = True,
        popularity: str = "paper",
        select: bool = True,
        grid: int = 5,
        seed: int = 0,
    ) -> None:
        if not sigma > 0 or not sigma0 > 0 or not gamma > 0:
            raise ValueError(
                f"fedma: sigma, sigma0 and gamma must be positive, got {sigma}, {sigma0}, {gamma}"
            )
        if popularity not in POPULARITY:
            raise ValueError(f"fedma: popularity must be one of {POPULARITY}, got {popularity!r}")
        self.sigma = float(sigma)
        self.sigma0 = float(sigma0)
        self.gamma = float(gamma)
        self.iterations = int(iterations)
        if max_width != "auto" and isinstance(max_width, str | bool):
            raise ValueError(f"fedma: max_width must be 'auto' or a count, got {max_width!r}")
        self.max_width: int | str = max_width if max_width == "auto" else int(max_width)
        self.width_factor = float(width_factor)
        self.normalize = bool(normalize)
        self.popularity = str(popularity)
        self.select = bool(select)
        self.grid = int(grid)
        self.seed = int(seed)

    def _cap_options(self, models: list[LeveledModel], target: ModelSpec) -> list[list[int]]:
        """The per-level caps on the global width to try, preferred first: an explicit target's
        widths, ``max_width``, or ``width_factor`` times the widest client, followed, for
        ``max_width="auto"``, by FedMA's cap of :data:`FEDMA_WIDTH_LIMIT` neurons where it
        differs (both caps are compared at the most neurons the clients have together)."""
        reference = models[0].spec
        levels = range(len(reference.widths))
        widest = [max(m.spec.widths[p] for m in models) for p in levels]
        together = [sum(m.spec.widths[p] for m in models) for p in levels]
        compact = [max(w, math.floor(self.width_factor * w)) for w in widest]
        if target.widths != reference.widths:  # an explicit target: its widths are the caps
            options = [list(target.widths)]
        elif self.max_width == "auto":
            if not self.select:
                return [compact]
            fedmas = [max(w, FEDMA_WIDTH_LIMIT) for w in widest]
            same = [min(c, t) for c, t in zip(compact, together, strict=True)] == [
                min(c, t) for c, t in zip(fedmas, together, strict=True)
            ]
            options = [compact] if same else [compact, fedmas]
        elif self.max_width > 0:
            options = [[int(self.max_width)] * len(widest)]
        else:
            options = [compact]
        for caps in options:
            for position, (cap, width) in enumerate(zip(caps, widest, strict=True)):
                if cap < width:
                    raise ValueError(
                        f"{self.name}: the global width cap {cap} of hidden level {position} is "
                        f"below the widest client's {width} neurons"
                    )
        return options

    def _check_models(self, models: Sequence[LeveledModel]) -> None:
        reference = models[0].spec
        for index, model in enumerate(models):
            try:
                same = model.spec.with_widths(reference.widths) == reference
            except ValueError:
                same = False
            if not same:
                raise ValueError(
                    f"{self.name}: model {index} has spec {model.spec.to_dict()}, which differs "
                    f"from model 0's {reference.to_dict()} in more than the widths"
                )

    def _check_target(self, models: list[LeveledModel], target: ModelSpec) -> None:
        reference = models[0].spec
        try:
            same = target.with_widths(reference.widths) == reference
        except ValueError:
            same = False
        if not same:
            raise ValueError(
                f"{self.name}: the target {target.to_dict()} differs from the base models' "
                f"architecture {reference.to_dict()} in more than the widths"
            )

    def check_architecture(self, model: LeveledModel) -> None:
        """FedMA matches each level's neurons into a wider global layer, level by level; across
        a residual connection (a ResNet's blocks, a ViT's residual stream) one block's output
        neurons are also summed into every later block's, and FedMA defines no such matching."""
        residual = [model.level_name(i) for i in model.neuron_levels if model.is_residual(i)]
        if model.spec.arch in _RESIDUAL_ARCHS or residual:
            where = f" (levels {', '.join(residual[:3])}{', ...' if len(residual) > 3 else ''})"
            raise ValueError(
                f"fedma matches neurons into a wider global layer level by level, which FedMA "
                f"does not define across residual blocks, and {model.spec.arch} models have "
                f"them{where if residual else ''}; use kf-gradient, git-rebasin or otfusion"
            )
        super().check_architecture(model)

    def needs(self) -> frozenset[str]:
        needed = {"class_counts"}  # the classifier's mix; uniform without them
        if self.select and (self.grid > 1 or self.max_width == "auto"):
            # the choice of sigma and cap; the configured sigma and width_factor without them
            needed |= {"data", "labels"}
        return frozenset(needed)

    def _sigmas(self) -> list[float]:
        """The noise stds tried: ``sigma * 2**k`` for ``k`` in ``-(grid//2) .. grid//2``
        (``grid`` values, centred on ``sigma``), or only ``sigma`` without selection."""
        if not self.select:
            return [self.sigma]
        half = (self.grid - 1) / 2
        return [self.sigma * 2.0 ** (k - half) for k in range(self.grid)]

    def _fuse(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec
    ) -> tuple[LeveledModel, dict[str, Any]]:
        self._check_target(models, target)
        check_levels(self.name, models)
        cap_options = self._cap_options(models, target)
        views = [affine_levels(m) for m in models]
        mix = head_weights(self.name, inputs.class_counts, len(models), models[0].spec.num_classes)
        sigmas = self._sigmas()
        labelled = inputs.data is not None and inputs.labels is not None
        if len(sigmas) * len(cap_options) == 1 or not labelled:
            fused, details = self._match(models, views, cap_options[0], mix, self.sigma)
            details["sigma"] = self.sigma
            return fused, details
        centre = (len(sigmas) - 1) / 2
        # preferred first: width_factor's cap before FedMA's, the configured sigma, then the
        # values nearest it
        order = [
            (cap, index)
            for cap in range(len(cap_options))
            for index in sorted(range(len(sigmas)), key=lambda index: abs(index - centre))
        ]
        chosen = best_on_fusion_set(
            (
                ((cap, index), self._match(models, views, cap_options[cap], mix, sigmas[index]))
                for cap, index in order
            ),
            inputs,
        )
        fused, details, (cap, index) = chosen.model, chosen.details, chosen.key
        tried = [
            {
                "caps": caps,
                "fusion_loss": [chosen.losses[(c, i)] for i in range(len(sigmas))],
                "fusion_accuracy": [chosen.accuracies[(c, i)] for i in range(len(sigmas))],
            }
            for c, caps in enumerate(cap_options)
        ]
        details["sigma"] = sigmas[index]
        details["selection"] = {
            "sigmas": sigmas,
            "fusion_loss": tried[cap]["fusion_loss"],
            "fusion_accuracy": tried[cap]["fusion_accuracy"],
            "chosen": index,
            "caps": tried,
            "chosen_caps": cap,
        }
        if len(cap_options) > 1:
            details["width_cap_chosen"] = "width_factor" if cap == 0 else f"{FEDMA_WIDTH_LIMIT}"
        log.info(
            "fedma: sigma %.4g, caps %s chosen on the fusion set (accuracies %s)",
            sigmas[index],
            cap_options[cap],
            [t["fusion_accuracy"] for t in tried],
        )
        return fused, details

    def _match(
        self,
        models: list[LeveledModel],
        views: list[dict[int, AffineLevel]],
        caps: list[int],
        mix: torch.Tensor,
        sigma: float,
    ) -> tuple[LeveledModel, dict[str, Any]]:
        """Match every hidden level bottom-up with noise std ``sigma``; the head mixed by
        ``mix`` ``(models, classes)``."""
        levels = models[0].neuron_levels
        previous: list[list[int]] | None = None
        previous_width: int | None = None
        global_rows: dict[int, torch.Tensor] = {}
        widths: list[int] = []
        level_details: list[dict[str, Any]] = []
        for position, level in enumerate(levels[:-1]):
            vectors = [
                _mapped_incoming(
                    v[level], None if previous is None else previous[j], previous_width
                )
                for j, v in enumerate(views)
            ]
            scale = 1.0
            if self.normalize:
                scale = float(torch.cat([(x * x).sum(1) for x in vectors]).mean().sqrt())
                scale = scale if scale > 0 else 1.0
            result = bbp_map_match(
                [x / scale for x in vectors],
                sigma=sigma,
                sigma0=self.sigma0,
                gamma=self.gamma,
                max_width=caps[position],
                iterations=self.iterations,
                seed=self.seed + position,
                popularity=self.popularity,
            )
            global_rows[level] = result.neurons * scale
            width = len(result.neurons)
            widest = max(len(x) for x in vectors)
            widths.append(width)
            level_details.append(
                {
                    "level": models[0].level_name(level),
                    "width": width,
                    "new_neurons": width - widest,
                    "cap": caps[position],
                    "popularity": np.bincount(result.counts, minlength=len(models) + 1)[
                        1:
                    ].tolist(),
                    "passes": result.passes,
                    "scale": scale,
                }
            )
            log.debug(
                "fedma level %s (sigma %.4g): %d global neurons (%d new, cap %d), %d passes",
                models[0].level_name(level),
                sigma,
                width,
                width - widest,
                caps[position],
                result.passes,
            )
            previous, previous_width = result.assignments, width

        head = levels[-1]
        head_rows = torch.zeros(())
        for j, v in enumerate(views):
            rows = _mapped_incoming(
                v[head], None if previous is None else previous[j], previous_width
            )
            head_rows = head_rows + mix[j][:, None] * rows
        global_rows[head] = head_rows

        spec = models[0].spec.with_widths(widths)
        fused = build_model(spec, seed=0)  # overwritten; the seed spares the global RNG
        for level, rows in global_rows.items():
            view = affine_view(fused.levels[level])
            assert view is not None
            view.set_weights(rows.T.contiguous())
        details = {
            "widths": widths,
            "new_neurons": [d["new_neurons"] for d in level_details],
            "levels": level_details,
            "head_weights": mix.tolist(),
        }
        return fused, details
