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
plain average. Modules that read the same tensor the same way (a ViT's ``q``, ``k`` and ``v``)
share one Gram. So that such a level still travels as one ``{level: Gram}`` entry (the upload,
checkpoint and validation formats are unchanged), its modules' Grams are packed into one
block-diagonal matrix, in the order :func:`module_grams_layout` gives; a block-diagonal of Grams
is itself the Gram of a (block-structured) design matrix, symmetric and positive semi-definite,
so the sites' uploads are validated as before. The zero blocks cost memory (about twice the
blocks' own size for a ResNet block, four times for a ViT block).

Reference:
    X. Jin, X. Ren, D. Preotiuc-Pietro, P. Cheng. *Dataless Knowledge Fusion by Merging Weights
    of Language Models*, ICLR 2023.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from fedfuse.fusion.base import FusionInputs, FusionMethod
from fedfuse.fusion.blocks.space_alignment import check_feature_spaces
from fedfuse.fusion.registry import register_fusion_method
from fedfuse.fusion.statistics.fixed_point import FixedPoint, coarse_norm_scale, norm_bound
from fedfuse.fusion.statistics.grams import (
    GramBlock,
    _mergeable_modules,
    align_sites,
    level_grams,
    mergeable,
    module_grams_layout,
)
from fedfuse.fusion.statistics.privacy import (
    GaussianStatistics,
    calibrate_noise,
    check_dp_options,
    spent_epsilon,
)
from fedfuse.fusion.statistics.summed_terms import (
    NORMS_CLIP,
    SiteSums,
    SummedRequest,
    sum_over_sites,
)
from fedfuse.io.grams import full_gram
from fedfuse.models import LeveledModel, ModelSpec, build_model
from fedfuse.models.affine import (
    affine_view,
    check_fit_bias,
    fit_intercept,
)
from fedfuse.runtime import resolve_device

log = logging.getLogger(__name__)


def _module_matrix(module: nn.Module, bias: bool) -> torch.Tensor:
    """A mergeable module's parameters as ``(fan_in[+1], out)``, the bias as the last row."""
    weight = module.weight.detach().flatten(1)
    if bias:
        weight = torch.cat([weight, module.bias.detach()[:, None]], 1)
    return weight.T


@torch.no_grad()
def _set_module_matrix(module: nn.Module, w: torch.Tensor, bias: bool) -> None:
    weight = module.weight
    rows = w[:-1] if bias else w
    weight.copy_(rows.T.reshape(weight.shape).to(weight.dtype))
    if bias:
        module.bias.copy_(w[-1].to(weight.dtype))


def _average_state(models: list[LeveledModel]) -> dict[str, torch.Tensor]:
    """The plain average of the floating-point state; other entries (BatchNorm's batch
    counters) from model 0."""
    state = {}
    for key, value in models[0].state_dict().items():
        if value.is_floating_point():
            total = sum(m.state_dict()[key].double().cpu() for m in models)
            state[key] = (total / len(models)).to(value.dtype)
        else:
            state[key] = value.clone()
    return state


@dataclass(frozen=True)
class _System:
    """One least-squares system of RegMean: its name, its modules (none: an affine level's
    layer), whether it has an intercept, its side, and where it sits in its level's Gram (of
    side ``level_size``)."""

    name: str
    modules: tuple[str, ...]
    bias: bool
    size: int
    offset: int
    level_size: int


def _system_key(key: tuple[int, int]) -> str:
    return f"{key[0]}" if key[1] == -1 else f"{key[0]}.{key[1]}"


@dataclass(frozen=True)
class GramTermsRequest:
    """RegMean's request to each site when it fits from sums (``grams="sums"``): the site's
    terms (:meth:`RegMean.site_terms`) or their norms (:meth:`RegMean.site_norms`) under the
    server's ``fit_bias``, from Grams noised by ``privacy`` (per level; None: exact)."""

    fit_bias: bool | str = "auto"
    privacy: Mapping[int, GaussianStatistics] | None = None

    def sources(
        self, model: LeveledModel, data: torch.Tensor, *, device: str | torch.device = "auto"
    ) -> dict[str, torch.Tensor]:
        """A site's level Grams on its own ``data`` with its own ``model`` (noised by
        ``privacy``), by level index as a string."""
        on = resolve_device(device)
        own = copy.deepcopy(model).to(on).eval()
        grams = level_grams(own, data.to(on), privacy=self.privacy)
        return {str(level): gram for level, gram in grams.items()}

    def terms(
        self, model: LeveledModel, sources: Mapping[str, torch.Tensor], *, norms: bool = False
    ) -> dict[str, torch.Tensor]:
        """The site's terms (or their norms) from its :meth:`sources`."""
        grams = {int(level): gram for level, gram in sources.items()}
        method = RegMean(fit_bias=self.fit_bias)
        return method.site_norms(model, grams) if norms else method.site_terms(model, grams)


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
        if grams not in ("per-site", "sums"):
            raise ValueError(f"regmean: grams must be 'per-site' or 'sums', got {grams!r}")
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
        # a secure channel's fixed units come from the fusion set and the sample counts
        extra = {"data", "sample_counts"} if self.grams == "sums" else set()
        return self.requirements() | extra

    def check_architecture(self, model: LeveledModel) -> None:
        """Every neuron level must be affine or hold at least one Linear/Conv2d to merge; with
        ``align``, the architecture's symmetries must be described."""
        if self.align != "none":
            check_feature_spaces(model)
        for index in model.neuron_levels:
            level = model.levels[index]
            view = affine_view(level)
            if view is None and not _mergeable_modules(level):
                raise ValueError(
                    f"level {model.level_name(index)} is neither affine nor holds a Linear or "
                    "Conv2d (groups=1, zero padding) to merge by its input Gram"
                )
            if view is None and self.dp_epsilon is not None:
                raise ValueError(
                    f"{self.name} with dp_epsilon noises affine levels' Grams only; "
                    f"{model.spec.arch} level {model.level_name(index)} is not affine"
                )
            if view is not None:
                where = f"{self.name}: level {model.level_name(index)}"
                fit_intercept(view.layer, self.fit_bias, where=where)

    @torch.no_grad()
    def _mechanisms(
        self, models: list[LeveledModel], data: torch.Tensor | None, details: dict[str, Any]
    ) -> dict[int, GaussianStatistics] | None:
        """Each level's Gaussian mechanism for ``dp_epsilon`` over all levels (one release each,
        composed by Opacus's RDP accountant): per design column, the scale that gives it a root
        mean square of 1 on the fusion set (averaged over the models), and the clip, the largest
        over the models of the median norm of a sample's scaled rows (or ``dp_clip``)."""
        if self.dp_epsilon is None:
            return None
        levels = models[0].neuron_levels
        noise = calibrate_noise(self.dp_epsilon, self.dp_delta, len(levels))
        mechanisms, clips = {}, []
        for index in levels:
            clip, columns = self.dp_clip, None
            if data is not None:
                rows = []
                for model in models:
                    inputs = model.forward_levels(data, 0, index)
                    rows.append(affine_view(model.levels[index]).design(inputs).double())
                rms = torch.stack([r.pow(2).mean(0) for r in rows]).mean(0).sqrt()
                columns = torch.where(rms > 1e-12, 1 / rms.clamp_min(1e-12), torch.ones_like(rms))
                norms = [
                    float((r * columns).pow(2).reshape(len(data), -1).sum(1).median().sqrt())
                    for r in rows
                ]
                clip = clip or max(norms)
            assert clip is not None
            clips.append(clip)
            mechanisms[index] = GaussianStatistics(
                noise, clip, self.dp_noise_seed, design_scale=columns
            )
        details["privacy"] = {
            "epsilon": spent_epsilon(noise, self.dp_delta, len(levels)),
            "delta": self.dp_delta,
            "noise_multiplier": noise,
            "rounds": len(levels),
            "clips": clips,
            "accountant": "Opacus RDP",
        }
        return mechanisms

    def _gram(
        self, grams: dict[int, torch.Tensor], client: int, level: int, name: str, size: int
    ) -> torch.Tensor:
        if level not in grams:
            raise ValueError(
                f"{self.name}: FusionInputs.grams[{client}] has no Gram for level {name} "
                f"(has levels {sorted(grams)}); compute them with "
                "fedfuse.fusion.methods.regression.regmean.level_grams"
            )
        gram = full_gram(torch.as_tensor(grams[level]))
        if gram.shape != (size, size) or not torch.isfinite(gram).all():
            raise ValueError(
                f"{self.name}: FusionInputs.grams[{client}][{level}] must be a finite "
                f"({size}, {size}) matrix for level {name}, got shape {tuple(gram.shape)}"
            )
        return gram

    def _shrink(self, gram: torch.Tensor) -> torch.Tensor:
        shrunk = self.alpha * gram
        shrunk.diagonal().add_((1.0 - self.alpha) * gram.diagonal())
        return shrunk

    def _systems(self, model: LeveledModel) -> dict[tuple[int, int], _System]:
        """The systems RegMean solves for ``model``'s architecture: one per affine level
        (key ``(level, -1)``; the Grams have the 1, a fit without intercept drops it) and one
        per Gram block of a level that is not affine (its modules' weight matrices side by side
        as the right-hand side)."""
        systems: dict[tuple[int, int], _System] = {}
        for level in model.neuron_levels:
            view = affine_view(model.levels[level])
            if view is not None:
                name = model.level_name(level)
                bias = fit_intercept(view.layer, self.fit_bias, where=f"{self.name}: level {name}")
                size = view.fan_in - int(not bias)
                systems[level, -1] = _System(name, (), bias, size, 0, view.fan_in)
        for level, blocks in module_grams_layout(model).items():
            offset, total = 0, sum(block.size for block in blocks)
            for number, block in enumerate(blocks):
                name = f"{model.level_name(level)}/{'+'.join(block.modules)}"
                systems[level, number] = _System(
                    name, block.modules, block.bias, block.size, offset, total
                )
                offset += block.size
        return systems

    def _client_weights(
        self, model: LeveledModel, systems: dict[tuple[int, int], _System]
    ) -> dict[tuple[int, int], torch.Tensor]:
        """Each system's weight matrix of one client (float64, CPU; the bias row only with an
        intercept)."""
        weights = {}
        for (level, number), system in systems.items():
            if number == -1:
                matrix = affine_view(model.levels[level]).weights().double().cpu()
                weights[level, number] = matrix if system.bias else matrix[:-1]
                continue
            modules = dict(model.levels[level].named_modules())
            matrix = torch.cat([_module_matrix(modules[m], system.bias) for m in system.modules], 1)
            weights[level, number] = matrix.double().cpu()
        return weights

    def _client_parts(
        self,
        model: LeveledModel,
        grams: dict[int, torch.Tensor],
        client: int,
        systems: dict[tuple[int, int], _System],
    ) -> Iterator[tuple[tuple[int, int], torch.Tensor, torch.Tensor]]:
        """``(key, Gram, weights)`` of every system for one client (float64, CPU), one level's
        Gram read at a time."""
        weights = self._client_weights(model, systems)
        for level in sorted({key[0] for key in systems}):
            keys = [key for key in systems if key[0] == level]
            size = systems[keys[0]].level_size
            gram = self._gram(grams, client, level, model.level_name(level), size)
            for key in keys:
                system = systems[key]
                if key[1] == -1:
                    part = gram if system.bias else gram[:-1, :-1]
                else:
                    rows = slice(system.offset, system.offset + system.size)
                    part = gram[rows, rows]
                yield key, part, weights[key]

    def site_terms(
        self, model: LeveledModel, grams: dict[int, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """What one site adds to the sums RegMean solves from (``grams="sums"``), per system:
        ``G`` (``<system>/gram``), ``G W`` (``/rhs``) and ``diag(G) W`` (``/diag_rhs``), from
        which ``sum G~`` and ``sum G~ W`` follow for any ``alpha``."""
        terms = {}
        for key, gram, weights in self._client_parts(model, grams, 0, self._systems(model)):
            name = _system_key(key)
            terms[f"{name}/gram"] = gram
            terms[f"{name}/rhs"] = gram @ weights
            terms[f"{name}/diag_rhs"] = gram.diagonal()[:, None] * weights
        return terms

    def site_norms(
        self, model: LeveledModel, grams: dict[int, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Step 1 of a secure sum of :meth:`site_terms`
        (:mod:`fedfuse.fusion.statistics.summed_terms`): per system, the norms of the design columns
        (roots of ``G``'s diagonal) and of the outputs ``X W`` (roots of ``diag(W^T G W)``)."""
        norms = {}
        for key, gram, weights in self._client_parts(model, grams, 0, self._systems(model)):
            name = _system_key(key)
            norms[f"{name}/gram"] = gram.diagonal().clamp_min(0).sqrt()
            norms[f"{name}/rhs"] = ((gram @ weights) * weights).sum(0).clamp_min(0).sqrt()
        return norms

    @torch.no_grad()
    def _norm_units(
        self, models: list[LeveledModel], data: torch.Tensor, samples: int
    ) -> FixedPoint:
        """The coarse units of step 1: the norms of a site of ``samples`` samples whose design
        columns and outputs had the fusion set's (``data``) mean squares per sample, averaged
        over the models."""
        energies: dict[str, torch.Tensor] = {}
        for model in models:
            for name, norm in self.site_norms(model, level_grams(model, data)).items():
                share = norm**2 / (len(data) * len(models))
                energies[name] = energies[name] + share if name in energies else share
        scales = {name: (coarse_norm_scale(e, samples), None) for name, e in energies.items()}
        return FixedPoint(scales, clip=NORMS_CLIP)

    def _units(self, norms: SiteSums, models: list[LeveledModel]) -> FixedPoint:
        """The units of step 2: the summed norms, and for ``diag(G) W`` the design's squared
        summed norms times the largest ``|W|`` of each output over the sites (the server holds
        the W)."""
        systems = self._systems(models[0])
        largest: dict[tuple[int, int], torch.Tensor] = {}
        for model in models:
            for key, weights in self._client_weights(model, systems).items():
                top = weights.abs().amax(0)
                largest[key] = torch.maximum(largest[key], top) if key in largest else top
        scales = {}
        for key in systems:
            name = _system_key(key)
            inputs = norm_bound(norms.terms[f"{name}/gram"], norms.error.get(f"{name}/gram"))
            outputs = norm_bound(norms.terms[f"{name}/rhs"], norms.error.get(f"{name}/rhs"))
            scales[f"{name}/gram"] = (inputs, inputs)
            scales[f"{name}/rhs"] = (inputs, outputs)
            floor = max(float(largest[key].max()) * 1e-12, 1e-300)
            scales[f"{name}/diag_rhs"] = (inputs**2, largest[key].clamp_min(floor))
        return FixedPoint(scales)

    def _summed_terms(
        self, models: list[LeveledModel], inputs: FusionInputs, details: dict[str, Any]
    ) -> tuple[SiteSums, dict[int, int]]:
        """The sums of :meth:`site_terms` over the sites: two secure rounds on a secure
        channel (norms, then terms), else one."""
        request = GramTermsRequest(self.fit_bias, self._mechanisms(models, inputs.data, details))
        if not getattr(inputs.sites, "secure", False):
            sums = sum_over_sites(inputs.sites, SummedRequest(request))
            return sums, dict(sums.upload_bytes)
        if inputs.data is None:
            raise ValueError(f"{self.name}: a secure sum needs the fusion set for its first units")
        samples = max(inputs.sample_counts or [len(inputs.data)])
        coarse = self._norm_units(models, inputs.data, samples)
        norms = sum_over_sites(inputs.sites, SummedRequest(request, coarse, norms=True))
        sums = sum_over_sites(inputs.sites, SummedRequest(request, self._units(norms, models)))
        sent = {m: norms.upload_bytes.get(m, 0) + sums.upload_bytes.get(m, 0) for m in sums.sites}
        return sums, sent

    def _fuse(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec
    ) -> tuple[LeveledModel, dict[str, Any]]:
        fused = build_model(target)
        systems = self._systems(fused)
        totals, rhs = {}, {}
        details: dict[str, Any] = {"alpha": self.alpha}
        if self.grams == "sums":
            sums, sent = self._summed_terms(models, inputs, details)
            models = [models[m] for m in sums.sites]
            for key in systems:
                name = _system_key(key)
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
                for key, gram, weights in self._client_parts(model, grams, client, systems):
                    shrunk = self._shrink(gram)
                    totals[key] = totals[key] + shrunk if key in totals else shrunk
                    product = shrunk @ weights
                    rhs[key] = rhs[key] + product if key in rhs else product
                del grams
        fused.load_state_dict(_average_state(models))  # what no Gram merges is averaged
        means = {key: torch.zeros_like(rhs[key]) for key in systems}
        for model in models:
            for key, weights in self._client_weights(model, systems).items():
                means[key] += weights / len(models)
        ridges: dict[str, float] = {}
        for key, system in systems.items():
            merged, relative = _solve_regularised(
                totals[key], rhs[key], means[key], self.jitter, system.name
            )
            level_modules = dict(fused.levels[key[0]].named_modules())
            if key[1] == -1:
                view = affine_view(fused.levels[key[0]])
                replace(view, bias=system.bias).set_weights(merged)
            else:
                column = 0
                for module_name in system.modules:
                    module = level_modules[module_name]
                    out = module.weight.shape[0]
                    _set_module_matrix(module, merged[:, column : column + out], system.bias)
                    column += out
            ridges[system.name] = relative
            log.debug("regmean %s: ridge %.1e (relative)", system.name, relative)
        details["ridge"] = ridges
        return fused.eval(), details


def _solve_regularised(
    total: torch.Tensor, rhs: torch.Tensor, mean: torch.Tensor, jitter: float, name: str
) -> tuple[torch.Tensor, float]:
    """``(total + lambda I)^{-1} (rhs + lambda mean)``, lambda relative to the mean diagonal,
    raised tenfold (from at least 1e-12) while the solve fails or returns non-finite values."""
    scale = float(total.diagonal().mean())
    if not scale > 0:
        raise ValueError(
            f"regmean: the clients' Grams of level {name} are all zero (no data reached it?)"
        )
    eye = torch.eye(len(total), dtype=total.dtype)
    relative = jitter
    for _ in range(14):
        penalty = relative * scale
        solution, info = torch.linalg.solve_ex(total + penalty * eye, rhs + penalty * mean)
        if int(info) == 0 and bool(torch.isfinite(solution).all()):
            return solution, relative
        relative = max(relative * 10, 1e-12)
    raise ValueError(f"regmean: the Gram system of level {name} stays singular (NaN inputs?)")


__all__ = [
    "GramBlock",
    "GramTermsRequest",
    "RegMean",
    "level_grams",
    "mergeable",
    "module_grams_layout",
]
