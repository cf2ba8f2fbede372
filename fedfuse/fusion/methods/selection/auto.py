r"""``auto``: fuse with each of a stated list of methods, keep the best on the sites' own rows.

Which method leads depends on the federation (``docs/settings.md``: ``kf-sites`` on most
settings, ``kf-trust`` on class-sharded sites with a fusion set of every class, ``kf-linear`` on
Dirichlet ones, ``regmean`` with a shared start, ...). ``auto`` decides per run, from what the
server holds (its :class:`~fedfuse.fusion.base.FusionInputs`) and what the sites answer, never
from a test set:

1. **Candidates.** The methods of ``candidates``, a comma list in order of preference. One whose
   needs the inputs do not meet (its :meth:`~FusionMethod.requirements`), or that refuses the
   models (its :meth:`~FusionMethod.check_run`: architecture, number of sites), is skipped and
   the reason recorded; one that raises while fusing is recorded as failed.
2. **Scored by the sites** (``score_on="auto"`` when the inputs' sites can score a model,
   :class:`~fedfuse.fusion.statistics.channels.SiteScoring`: in-process
   :class:`~fedfuse.fusion.statistics.channels.LocalSites` given each site's labelled rows, or
   the sites of a Flower run answering Flower's ``evaluate`` message). Each candidate fuses with
   every input and each site scores it on its own labelled rows (a Flower app's
   ``@app.evaluate()`` on its validation split; ``fedfuse compare`` and
   :func:`~fedfuse.federation.site_fusion_inputs` on the site's training rows). The scores are
   pooled by rows over the sites that scored every candidate (a site silent once is left out
   of every comparison and named); the highest accuracy wins, ties go to the lower loss, then
   to the earlier candidate. What a site sends per candidate is two numbers and a row count.
3. **Scored on the fusion set** (``score_on="fusion-set"``, or no site can score). The
   labelled fusion set is split with ``seed`` into a fit part and a held-out part of share
   ``holdout``, stratified by class (each class's rows shuffled, ``round(holdout * rows)`` held
   out, at least one kept to fit on). Each candidate fuses with the fit part in place of the
   fusion set and is scored on the held-out rows, ranked as above. A method that loses the
   classes the fusion set does not show (``needs_every_class``: ``kf-trust``, ``hf-trust``) is
   left out when the sites' class counts name such a class, whoever scores: held-out fusion
   rows cannot see that loss, and the sites' scores would show it at the cost of a fusion
   (on the default 2 class-sharded sites, half the classes unshown, they scored 43-44 %
   against ``kf-sites``' 89 %, for a third of ``auto``'s time). With ``refit`` (the default)
   the winner fuses again with the whole fusion set when it reads it at all.
4. **Budget.** Once ``time_budget`` seconds have passed, the candidates not yet tried are
   skipped and named (the one under way finishes, the first always runs, the refit is extra).

Without sites that score or a labelled fusion set (no data, no labels, or no class with two rows
to hold one out) nothing can be scored: the fallback is the first candidate of the list that can
run, fused with every input, and ``details["auto"]["why"]`` says so.

``details["auto"]`` holds every candidate's ``accuracy``, ``loss`` and ``seconds`` (with the
sites: each site's ``site_scores``) or ``skipped``/``failed`` with the reason, the ``chosen``
method and ``why`` in one sentence, the ``criterion``, and the sites or rows that scored; the
other entries of ``details`` are the chosen method's own.

**The default list** is the methods that lead in fedfuse's measurements and fuse in seconds to
a minute: kf-sites, hf-sites, kf-linear, hf-linear, kf-trust, hf-trust, regmean, regmean-fs,
fedavg, vanilla, linear-probe. The statistics-round methods run only where the inputs reach the
sites (each trial costs the sites rounds of their own; elsewhere they are skipped, named), and
past 5 sites (``max_costly_sites``) the ``hf-*`` and ``*-trust`` candidates are skipped, named:
their cost grows steeply with the sites (at 10 sites the three ``hf-*`` took 230 of ``auto``'s
300 s, and ``kf-sites``, chosen, 25). ``linear-probe`` (one site's model, its head fitted to the
ensemble on the fusion set, about a second) is last: where no fusion holds up, as on ViTs with
Dirichlet sites, it is the best single model (ViT, 4 Dirichlet sites, 3 seeds: 79.46 % with it,
78.49 % without; on the 18 MLP site sets of ``docs/settings.md`` the sites scored it below the
chosen method every time). Left out, though any registered method may be listed: the Fisher
methods (another upload), the matching methods (below FedAvg on most of fedfuse's settings) and
the other trainers (``kd``, ``fs-merge``, ``dense``: minutes each). What the sites send is what
the listed methods read: :meth:`Auto.needs` is their union (plus what scores them), so the
default list asks the sites for Gram matrices (for ``regmean``); leave out ``regmean`` and
``regmean-fs`` not to send them.

**Measured**: ``docs/results.md``, section "``auto``: the sites score the candidates" (issue
52), and ``auto``'s column in ``docs/settings.md``: scored on held-out fusion rows drawn from one
site, ``auto`` lost up to 12 points to the best candidate; scored by the sites, it is within
0.23 points of the leader in every MLP setting (3 seeds) and within a point of the leader, or
above it, in the ViT and ResNet settings measured (numbers and commands there).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from fedfuse.fusion.base import INPUT_NEEDS, FusionInputs, FusionMethod, FusionResult
from fedfuse.fusion.methods.selection.criteria import (
    SCORE_ON,
    held_out_scores,
    pooled_on,
    scoring_sites,
    sites_answering_all,
    stratified_split,
    unshown_classes,
    why_chosen,
)
from fedfuse.fusion.registry import (
    FUSION_METHODS,
    make_fusion_method,
    parse_method_names,
    register_fusion_method,
)
from fedfuse.fusion.statistics.channels import SiteScoring
from fedfuse.models import LeveledModel, ModelSpec

log = logging.getLogger(__name__)

#: the candidates of ``auto`` unless the user lists others, in order of preference
DEFAULT_CANDIDATES = (
    "kf-sites,hf-sites,kf-linear,hf-linear,kf-trust,hf-trust,regmean,regmean-fs,fedavg,vanilla,"
    "linear-probe"
)
#: the inputs that make a labelled fusion set
LABELLED = frozenset({"data", "labels"})


@dataclass
class _Selection:
    """One fusion by ``auto``: what every candidate fuses and the report of them."""

    models: list[LeveledModel]
    inputs: FusionInputs
    target: ModelSpec
    started: float
    report: dict[str, dict[str, Any]] = field(default_factory=dict)


@register_fusion_method
class Auto(FusionMethod):
    """Fuse with each candidate method and keep the one of the highest accuracy on the sites'
    own rows, or on held-out fusion rows (the module's docstring states the procedure).

    Args:
        candidates: comma list of registered fusion methods to try, in order of preference (a
            tie, and the fallback without a labelled fusion set, goes to the earlier one).
        score_on: ``"sites"`` (the sites score each candidate on their labelled rows, pooled by
            rows), ``"fusion-set"`` (held-out fusion rows) or ``"auto"``: the sites when they
            can score (:class:`~fedfuse.fusion.statistics.channels.SiteScoring`), else the
            fusion set.
        holdout: the share of the labelled fusion set held out to score the candidates on.
        max_costly_sites: above this many sites the candidates whose cost grows steeply with
            the sites (:meth:`~fedfuse.fusion.base.FusionMethod.cost_with_many_sites`: the
            Hungarian ``hf-*``, one neuron of each model per group, matched iteratively; the
            ``*-trust`` methods, every model's reading fitted on every fusion row) are skipped,
            named. At 100 sites on a loaded 2-core machine ``hf-sites`` ran past 12 minutes and
            ``kf-trust`` took 20, where ``kf-sites`` took 5 and ``kf-linear`` 2; at 10 sites the
            ``hf-*`` took 230 of 300 s. Default 5 (the most sites where an ``hf-*`` candidate
            led in fedfuse's measurements: ``hf-sites`` on 5 LeNets). 0: no limit.
        refit: fuse the winner again with the whole fusion set (else it keeps its trial model).
        time_budget: seconds after which the candidates not yet tried are skipped (None: no
            limit).
        seed: the seed of the split (the candidates keep their own seeds).
        device: where the candidates that take a device fuse, and where the held-out rows are
            scored.
        batch_size: held-out rows per forward pass.
    """

    name = "auto"
    option_bounds = {
        "holdout": (0.01, 0.9),
        "time_budget": (0.0, 1e7),
        "max_costly_sites": (0, 1e9),
    }

    def __init__(
        self,
        candidates: str = DEFAULT_CANDIDATES,
        score_on: str = "auto",
        holdout: float = 0.3,
        max_costly_sites: int = 5,
        refit: bool = True,
        time_budget: float | None = None,
        seed: int = 0,
        device: str = "auto",
        batch_size: int = 256,
    ) -> None:
        names = parse_method_names(candidates)
        if not names:
            raise ValueError("auto: option candidates names no fusion method")
        unknown = [n for n in names if n not in FUSION_METHODS or n == self.name]
        if unknown:
            known = sorted(set(FUSION_METHODS) - {self.name})
            raise ValueError(f"auto: candidates {unknown} are not fusion methods; known: {known}")
        if score_on not in SCORE_ON:
            raise ValueError(f"auto: score_on must be one of {SCORE_ON}, got {score_on!r}")
        self.candidates = candidates
        self.score_on = score_on
        self.holdout = holdout
        self.max_costly_sites = max_costly_sites
        self.refit = refit
        self.time_budget = time_budget
        self.seed = seed
        self.device = device
        self.batch_size = batch_size

    def candidate_methods(self) -> list[FusionMethod]:
        """The candidates, built with their default options (and ``device`` where they take one)."""
        methods = []
        for name in parse_method_names(self.candidates):
            takes_device = "device" in FUSION_METHODS[name].accepted_options()
            methods.append(
                make_fusion_method(name, **({"device": self.device} if takes_device else {}))
            )
        return methods

    # ------------------------------------------------------------------ declared needs
    def requirements(self) -> frozenset[str]:
        """The fields every candidate requires: without one of them none could run."""
        return frozenset.intersection(*(m.requirements() for m in self.candidate_methods()))

    def needs(self) -> frozenset[str]:
        """What any candidate reads, and what scores them: the sites, the labelled fusion set."""
        scoring = {
            "auto": LABELLED | {"site_scores"},
            "sites": {"site_scores"},
            "fusion-set": LABELLED,
        }
        return frozenset().union(
            scoring[self.score_on], *(m.needs() for m in self.candidate_methods())
        )

    @property
    def fisher_kinds(self) -> tuple[str, ...]:
        """The Fisher kinds the candidates read (what the sites must upload for them)."""
        kinds = (
            kind
            for method in self.candidate_methods()
            if "fisher" in method.needs()
            for kind in getattr(method, "fisher_kinds", ())
        )
        return tuple(dict.fromkeys(kinds))

    def check_architecture(self, model: LeveledModel) -> None:
        """Accept the architecture when one candidate does."""
        reasons = []
        for method in self.candidate_methods():
            try:
                method.check_architecture(model)
                return
            except ValueError as error:
                reasons.append(f"{method.name}: {error}")
        raise ValueError(f"none of its candidates fuses it ({'; '.join(reasons)})")

    def check_run(
        self,
        num_models: int,
        spec: ModelSpec | None = None,
        available: Iterable[str] | None = None,
        target: ModelSpec | None = None,
        *,
        wording: Mapping[str, str] | None = None,
    ) -> None:
        """As :meth:`FusionMethod.check_run`, passing when one candidate can fuse the run."""
        super().check_run(num_models, spec, None, target, wording=wording)
        if available is None:
            return
        available = set(available)  # read once per candidate
        reasons = []
        for method in self.candidate_methods():
            try:
                method.check_run(num_models, spec, available, target, wording=wording)
                return
            except ValueError as error:
                reasons.append(str(error))
        raise ValueError(
            f"{self.name}: none of its candidates can fuse this run: {'; '.join(reasons)}"
        )

    # ------------------------------------------------------------------ fusion
    def _fuse(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec
    ) -> tuple[LeveledModel, dict[str, Any]]:
        sites = scoring_sites(inputs) if self.score_on != "fusion-set" else None
        if self.score_on == "sites" and sites is None:
            raise ValueError(
                f"{self.name}: score_on='sites', but the inputs' sites cannot score a model "
                "(give LocalSites validation rows, or run in a Flower app)"
            )
        run = _Selection(models, inputs, target, started=time.perf_counter())
        if sites is not None:
            chosen = self._by_sites(run, self._runnable(run, by_sites=True), sites)
            if chosen is not None:
                return chosen
        runnable = self._runnable(run, by_sites=False)
        split = self._split(inputs)
        if isinstance(split, str):
            return self._fallback(run, runnable, split)
        return self._by_fusion_set(run, runnable, split)

    def _runnable(self, run: _Selection, *, by_sites: bool) -> list[FusionMethod]:
        """The candidates that can be tried; the others' reasons go into the report."""
        runnable = []
        for method in self.candidate_methods():
            reason = _skip_reason(method, run.models, run.inputs, by_sites=by_sites)
            costly = method.cost_with_many_sites(len(run.models))
            if not reason and costly and len(run.models) > self.max_costly_sites > 0:
                reason = (
                    f"{costly}, past max_costly_sites={self.max_costly_sites} (its cost grows "
                    "with the sites)"
                )
            run.report[method.name] = {"skipped": reason} if reason else {}
            if not reason:
                runnable.append(method)
        if not runnable:
            reasons = "; ".join(f"{n}: {r['skipped']}" for n, r in run.report.items())
            raise ValueError(
                f"{self.name}: none of its candidates can fuse these inputs: {reasons}"
            )
        return runnable

    def _over_budget(self, order: int, started: float) -> str | None:
        """Why the candidate at ``order`` is not tried (the first always is), or None."""
        elapsed = time.perf_counter() - started
        if self.time_budget is not None and order and elapsed >= self.time_budget:
            return f"time budget of {self.time_budget:g} s spent ({elapsed:.1f} s)"
        return None

    def _trials(
        self,
        run: _Selection,
        runnable: Sequence[FusionMethod],
        inputs: FusionInputs,
        *,
        budget: bool = True,
    ) -> Iterator[tuple[FusionMethod, FusionResult, float]]:
        """``(method, result, when its trial began)`` for each candidate that fuses with
        ``inputs`` (within the time budget, unless not ``budget``); the others' reasons
        (skipped, failed) go into the report."""
        for order, method in enumerate(runnable):
            if budget and (skipped := self._over_budget(order, run.started)):
                run.report[method.name] = {"skipped": skipped}
                continue
            began = time.perf_counter()
            try:
                yield method, method.fuse(run.models, inputs, target=run.target), began
            except (ValueError, RuntimeError) as error:
                run.report[method.name] = {"failed": f"{type(error).__name__}: {error}"}
                log.warning("auto: %s failed: %s", method.name, error)

    def _none_fused(self, report: dict[str, dict[str, Any]]) -> ValueError:
        """The error when every candidate failed or was skipped, with each reason."""
        reasons = "; ".join(
            f"{n}: {r.get('failed') or r.get('skipped')}" for n, r in report.items()
        )
        return ValueError(f"{self.name}: every candidate failed: {reasons}")

    def _by_sites(
        self, run: _Selection, runnable: Sequence[FusionMethod], sites: SiteScoring
    ) -> tuple[LeveledModel, dict[str, Any]] | None:
        """Each candidate fused with every input and scored by the sites; the best by pooled
        accuracy (then loss, then order) over the sites that scored them all. None when no
        site scored every candidate (the fusion set decides then)."""
        report, trials = run.report, []
        for method, result, began in self._trials(run, runnable, run.inputs):
            try:
                scores = sites.score(result.model)
            except ValueError as error:  # e.g. a width the sites' own class cannot load
                report[method.name] = {"failed": f"the sites cannot score it: {error}"}
                log.warning("auto: the sites cannot score %s: %s", method.name, error)
                continue
            report[method.name] = {
                "site_scores": [None if s is None else vars(s).copy() for s in scores],
                "seconds": time.perf_counter() - began,
            }
            trials.append((method, result, scores))
        if not trials:
            raise self._none_fused(report)
        answered = sites_answering_all([scores for _, _, scores in trials])
        problems = list(getattr(sites, "problems", []))
        if not answered:
            log.warning("auto: no site scored every candidate (%s)", "; ".join(problems))
            return None
        best = None
        for method, result, scores in trials:
            pooled = pooled_on(scores, answered)
            report[method.name].update(accuracy=pooled.accuracy, loss=pooled.loss)
            log.info(
                "auto: %s accuracy %.4f loss %.4f on the sites' %d rows",
                method.name, pooled.accuracy, pooled.loss, pooled.examples,
            )  # fmt: skip
            if best is None or (pooled.accuracy, -pooled.loss) > (best[0], -best[1]):
                best = (pooled.accuracy, pooled.loss, method, result, pooled.examples)
        _, _, method, result, rows = best
        summary = {
            "chosen": method.name,
            "why": why_chosen(method.name, report, _rows_of(rows, answered, len(run.models))),
            "criterion": "the sites' accuracy pooled by rows, then loss",
            "candidates": report,
            "scored_by_sites": answered,
            "site_problems": problems,
            "refit": False,
        }
        return result.model, {**result.details, "auto": summary}

    def _by_fusion_set(
        self,
        run: _Selection,
        runnable: Sequence[FusionMethod],
        split: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[LeveledModel, dict[str, Any]]:
        """Each candidate fused on the fit rows and scored on the held-out rows; the winner
        refitted on every row (``refit``)."""
        fit, held = split
        inputs, report = run.inputs, run.report
        assert inputs.data is not None and inputs.labels is not None
        fit_inputs = replace(inputs, data=inputs.data[fit], labels=inputs.labels[fit])
        held_data, held_labels = inputs.data[held], inputs.labels[held]
        best: tuple[float, float, FusionMethod, LeveledModel, dict[str, Any]] | None = None
        for method, result, began in self._trials(run, runnable, fit_inputs):
            accuracy, loss = held_out_scores(
                result.model, held_data, held_labels, batch_size=self.batch_size, device=self.device
            )
            seconds = time.perf_counter() - began
            report[method.name] = {"accuracy": accuracy, "loss": loss, "seconds": seconds}
            log.info("auto: %s held-out accuracy %.4f loss %.4f", method.name, accuracy, loss)
            if best is None or (accuracy, -loss) > (best[0], -best[1]):
                best = (accuracy, loss, method, result.model, result.details)
        if best is None:
            raise self._none_fused(report)
        _, _, method, model, details = best
        refit = self.refit and bool(method.needs() & LABELLED)
        if refit:
            result = method.fuse(run.models, inputs, target=run.target)
            model, details = result.model, result.details
        summary = {
            "chosen": method.name,
            "why": why_chosen(method.name, report, f"{len(held)} held-out fusion rows"),
            "criterion": "held-out accuracy, then loss",
            "candidates": report,
            "unshown_classes": unshown_classes(inputs),
            "fit_rows": len(fit),
            "held_out_rows": len(held),
            "seed": self.seed,
            "refit": refit,
        }
        return model, {**details, "auto": summary}

    def _split(self, inputs: FusionInputs) -> tuple[torch.Tensor, torch.Tensor] | str:
        """The fit and held-out rows, or why there are none."""
        if inputs.data is None or inputs.labels is None:
            return "no labelled fusion set" if inputs.data is None else "no fusion-set labels"
        fit, held = stratified_split(inputs.labels, self.holdout, self.seed)
        if not len(held):
            return f"no class of the {len(fit)} fusion rows has two rows to hold one out"
        return fit, held

    def _fallback(
        self, run: _Selection, runnable: Sequence[FusionMethod], missing: str
    ) -> tuple[LeveledModel, dict[str, Any]]:
        """The first runnable candidate that fuses, unscored."""
        report = run.report
        for method, result, _ in self._trials(run, runnable, run.inputs, budget=False):
            report[method.name] = {"seconds": result.seconds}
            for other in runnable:
                report[other.name] = report[other.name] or {"skipped": f"not tried: {missing}"}
            why = (
                f"{missing} to score the candidates on, so the first candidate of the list "
                f"that could fuse: {method.name}"
            )
            log.info("auto: %s", why)
            summary = {"chosen": method.name, "why": why, "criterion": "fallback: list order",
                       "candidates": report, "refit": False}  # fmt: skip
            return result.model, {**result.details, "auto": summary}
        raise self._none_fused(report)


def _rows_of(rows: int, answered: list[int], sites: int) -> str:
    """``"the 600 rows of sites [0, 1]"``, or of all ``sites`` (a list of 100 says nothing)."""
    if len(answered) == sites:
        return f"the {rows} rows of all {sites} sites"
    listed = str(answered) if len(answered) <= 10 else f"{len(answered)} of the {sites}"
    return f"the {rows} rows of sites {listed}"


def _skip_reason(
    method: FusionMethod,
    models: Sequence[LeveledModel],
    inputs: FusionInputs,
    *,
    by_sites: bool = False,
) -> str | None:
    """Why ``method`` cannot fuse ``models`` with ``inputs`` (None: it can be tried). A method
    that loses the classes the fusion set does not show is left out unless the sites, which
    show them, score it (``by_sites``)."""
    lacking = sorted(f for f in method.requirements() if getattr(inputs, f) is None)
    if lacking:
        return f"needs {', '.join(INPUT_NEEDS.get(f, f) for f in lacking)}, not given"
    try:
        method.check_run(len(models), models[0].spec)
    except ValueError as error:
        return str(error)
    unshown = unshown_classes(inputs)
    if unshown and getattr(method, "needs_every_class", False):
        return (
            f"the fusion set shows no row of class(es) {unshown}, which sites hold: it loses "
            "them" + ("" if by_sites else ", and held-out fusion rows cannot see that")
        )
    return None
