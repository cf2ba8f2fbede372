"""fedfuse's one-shot baselines on LeNets trained with ANOTHER recipe than fedfuse's presets.

The federation (issue 52, "selection criteria that transfer"): Fashion-MNIST, 5 sites, a
Dirichlet(0.1) label split in the style of the FedMA/FedFisher code (each class's proportions
``Dir(0.1 * 1)`` over the sites, sites already holding ``N / sites`` samples skipped, redrawn
until every site has 10 samples), one SHARED initialisation, and plain local training unlike
fedfuse's own loop: SGD with momentum 0.9 (no Nesterov), learning rate 0.01, batch 64, no
weight decay, no warm-up, no schedule, no label smoothing, 30 epochs. The server holds 500
labelled training rows drawn uniformly. fedfuse's own LeNet-5 (:mod:`fedfuse.models.lenet`)
and data loading (:func:`fedfuse.data.load_dataset`) are used; the sites' models, the split
and the fusion rows are cached under ``--cache`` (the Fisher uploads too, keyed by how they
were computed), so a rerun only fuses.

Each method runs with its defaults (what a user gets) and the table prints test accuracy (%),
with FedAvg and the ensemble of the sites' probabilities as references, and "exact Fisher
merging": ``fisher-merging`` with no damping, sample-count weights (FedFisher's), on each
site's diagonal Fisher computed with the expectation over classes on ALL its rows (the
quantity both Fisher papers define). ``fedfisher-diag`` and ``fedfisher-kfac`` read the
uploads :func:`fedfuse.fusion.statistics.fisher.site_fisher` computes with its defaults.

Run (one thread; about 10 minutes to train the sites once and 20 to compute the Fisher uploads
once, then a minute a rerun)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/other_recipe_lenet.py

Measured (seed 0, 30 epochs, CPU; sites 48.8, 39.8, 21.9, 29.6, 53.4; before = fedfuse at
a4ae2ae run with ``--methods fedavg vanilla otfusion git-rebasin fedfisher-diag fedfisher-kfac
fedma``, after = issue 52's change), test accuracy %:

=============== ====== ===== =============================================
method          before after chosen after
=============== ====== ===== =============================================
fedavg          46.14  46.14
vanilla         45.33  45.33
otfusion        45.33  46.14 weight cost, sample-count weights
git-rebasin     36.75  46.14 weight matching, sample-count weights
fedfisher-diag  24.61  26.98 damping 0.01 (before 1.0, sampled, 2048 rows)
exact Fisher           27.11 damping 0
fedfisher-kfac  64.99  59.02 damping 0.01 (before 1.0, sampled, 2048 rows)
fedma           57.36  57.36 sigma 0.4
ensemble        63.90  63.90
=============== ====== ===== =============================================

Discussion (K-FAC's spread over Monte Carlo draws, FedMA's width cap) in docs/results.md,
"Baselines on LeNets trained with another recipe (issue 52, ...)".

The methods are also given what they read from the sites, when listed: importance scores and
Gram matrices (:func:`fedfuse.federation.compute_site_extras` with its defaults, as
:func:`~fedfuse.federation.site_fusion_inputs` computes them; cached: a minute and a half for
both, once) and the sites themselves (:class:`~fedfuse.fusion.LocalSites`: statistics rounds,
and scores of a model on each site's training rows). A method may carry options,
``name:key=value``.

**auto on this federation** (issue 52; fedfuse at 5b65187 with the working tree of
2026-11-29, seed 0; 25 minutes on 2 shared cores, fusion s inflated by other jobs)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/other_recipe_lenet.py --methods auto \
        auto:score_on=fusion-set kf-sites hf-sites kf-linear hf-linear kf-trust hf-trust \
        regmean regmean-fs fedavg vanilla

======================== ====== ======== ======== ========= ==========
method                   test % fusion s chosen   sites'    held-out
                                                  score %   fusion %
======================== ====== ======== ======== ========= ==========
auto                     84.83  489      hf-sites
auto:score_on=fusion-set 84.83  465      hf-sites
kf-sites                 83.44  177               84.44     87.50
hf-sites                 84.83  158               85.80     87.50
kf-linear                74.86  4                 75.50     73.68
hf-linear                74.05  4                 74.80     73.68
kf-trust                 77.62  6                 78.24     74.34
hf-trust                 77.87  7                 78.53     76.32
regmean                  59.60  0.2               59.74     65.79
regmean-fs               77.62  59                78.78     78.29
fedavg                   46.14  0.1               46.98     48.03
vanilla                  45.33  0.1               46.35     46.71
ensemble                 63.90
======================== ====== ======== ======== ========= ==========

The sites' score (each candidate's accuracy on all 60000 training rows of the 5 sites, pooled)
ranks the candidates as the test set does, except that it puts regmean-fs above hf-trust and
kf-trust (on the test set 0.25 points below hf-trust, level with kf-trust): ``auto`` keeps the
best method, hf-sites, 21 points above the ensemble (kf-sites, next, 1.4 points below).
On the 152 held-out fusion rows kf-sites and hf-sites tie, and the lower loss picks hf-sites
too. ``auto`` costs the sum of its candidates (kf-sites and hf-sites are most of it).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import inspect
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from fedfuse.data import load_dataset
from fedfuse.federation import compute_site_extras, extras_for
from fedfuse.federation.evaluation import evaluate_fusion
from fedfuse.federation.plain_site import EXTRA_FIELDS
from fedfuse.fusion import (
    FusionInputs,
    FusionMethod,
    LocalSites,
    make_fusion_method,
    parse_options,
)
from fedfuse.fusion.base import reads_sites
from fedfuse.fusion.statistics.fisher import site_fisher
from fedfuse.models import build_model
from fedfuse.models.lenet import lenet5_spec

METHODS = (
    "fedavg",
    "vanilla",
    "otfusion",
    "git-rebasin",
    "fedfisher-diag",
    "fedfisher-kfac",
    "exact-fisher",
    "fedma",
)


def dirichlet_split(labels: np.ndarray, sites: int, alpha: float, seed: int) -> list[np.ndarray]:
    """The FedMA/FedFisher-style Dirichlet label split (module docstring)."""
    rng = np.random.default_rng(seed)
    n, classes = len(labels), int(labels.max()) + 1
    while True:
        parts: list[list[int]] = [[] for _ in range(sites)]
        for c in range(classes):
            index = np.flatnonzero(labels == c)
            rng.shuffle(index)
            p = rng.dirichlet(np.full(sites, alpha))
            p = np.array([q * (len(part) < n / sites) for q, part in zip(p, parts, strict=True)])
            p = p / p.sum()
            cuts = (np.cumsum(p) * len(index)).astype(int)[:-1]
            for part, chunk in zip(parts, np.split(index, cuts), strict=True):
                part.extend(chunk.tolist())
        if min(len(p) for p in parts) >= 10:
            return [np.sort(np.array(p, dtype=np.int64)) for p in parts]


def train_site(model, inputs, labels, epochs: int, seed: int) -> None:
    """Plain SGD (momentum 0.9, lr 0.01, batch 64), the recipe of the module docstring."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model.train()
    for _ in range(epochs):
        for index in torch.randperm(len(inputs), generator=generator).split(64):
            optimizer.zero_grad()
            F.cross_entropy(model(inputs[index]), labels[index]).backward()
            optimizer.step()
    model.eval()


def federation(args, train_set):
    """The sites' models, data indices and the fusion rows, trained once and cached."""
    path = Path(args.cache) / f"sites-s{args.seed}-e{args.epochs}.pt"
    spec = lenet5_spec(train_set.input_shape, train_set.num_classes)
    if path.exists():
        saved = torch.load(path, weights_only=False)
    else:
        labels = train_set.labels.numpy()
        parts = dirichlet_split(labels, args.sites, args.alpha, args.seed)
        rng = np.random.default_rng(args.seed + 1)
        fusion = np.sort(rng.choice(len(labels), args.fusion_rows, replace=False))
        start = build_model(spec, seed=args.seed)  # the SHARED start
        states = []
        for k, part in enumerate(parts):
            began = time.perf_counter()
            model = copy.deepcopy(start)
            data = train_set.subset(part)
            train_site(model, data.inputs(), data.labels, args.epochs, args.seed * 100 + k)
            states.append(model.state_dict())
            print(f"site {k}: {len(part)} rows, {time.perf_counter() - began:.0f} s", flush=True)
        saved = {"parts": parts, "fusion": fusion, "states": states}
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(saved, path)
    models = []
    for state in saved["states"]:
        model = build_model(spec)
        model.load_state_dict(state)
        models.append(model.eval())
    return models, saved["parts"], saved["fusion"]


def settings_of(function, **options) -> dict:
    """``function``'s keyword defaults (but ``device``) updated by ``options``: what a cached
    result was computed with."""
    defaults = {
        k: v.default
        for k, v in inspect.signature(function).parameters.items()
        if v.default is not inspect.Parameter.empty and k != "device"
    }
    return {**defaults, **options}


def cache_path(args, stem: str, settings: dict) -> Path:
    """Where a result computed on the cached sites with ``settings`` is kept."""
    key = hashlib.sha1(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()
    return Path(args.cache) / f"{stem}-s{args.seed}-e{args.epochs}-{key[:12]}.pt"


def cached(path: Path, compute):
    """``compute()``, saved at ``path`` the first time and read from it afterwards."""
    if path.exists():
        return torch.load(path, weights_only=False)
    result = compute()
    torch.save(result, path)
    return result


def fishers(args, models, site_inputs, kinds, **options):
    """Each site's Fisher upload of ``kinds`` (:func:`site_fisher`, its defaults updated by
    ``options``), cached by the site models and those settings."""
    settings = {**settings_of(site_fisher, **options), "kinds": sorted(kinds)}
    if settings.get("labels") == "auto":  # 10 classes: the exact expectation
        settings["labels"] = "expected"
    return cached(
        cache_path(args, "fisher", settings),
        lambda: [
            site_fisher(copy.deepcopy(m), x, kinds, device="cpu", **options)
            for m, x in zip(models, site_inputs, strict=True)
        ],
    )


def site_extras(args, models, site_rows, wanted) -> dict[str, list]:
    """Each site's extras of ``wanted`` (names of :data:`EXTRAS`) as :class:`FusionInputs`
    fields, computed on its training rows by :func:`compute_site_extras` with its defaults (as
    :func:`~fedfuse.federation.site_fusion_inputs` does: conductance scores on 512 rows, Gram
    matrices of every row; a minute and a half for both) and cached per extra."""
    fields = {}
    for extra in wanted:
        field = EXTRA_FIELDS[extra]
        fields[field] = cached(
            cache_path(args, extra, settings_of(compute_site_extras, wanted=extra)),
            lambda extra=extra, field=field: [
                getattr(compute_site_extras(m, rows, [extra]), field)
                for m, rows in zip(models, site_rows, strict=True)
            ],
        )
    return fields


def method_of(spec: str) -> FusionMethod:
    """The fusion method of a ``--methods`` entry: a registered name with its defaults, one
    with options (``auto:score_on=fusion-set``, options as :func:`parse_options` reads them),
    or ``exact-fisher`` (module docstring)."""
    if spec == "exact-fisher":
        return make_fusion_method("fisher-merging", weighting="samples", damping=0.0)
    name, _, options = spec.partition(":")
    return make_fusion_method(name, **parse_options(options))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--sites", type=int, default=5)
    parser.add_argument("--alpha", type=float, default=0.1)
    parser.add_argument("--fusion-rows", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", default="outputs/other_recipe_lenet")
    parser.add_argument(
        "--methods",
        nargs="*",
        default=list(METHODS),
        help="fusion methods, each a name or name:key=value (e.g. auto:score_on=fusion-set)",
    )
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    train_set = load_dataset("fashion_mnist", "train")
    test_set = load_dataset("fashion_mnist", "test")
    models, parts, fusion = federation(args, train_set)
    site_rows = [(train_set.subset(p).inputs(), train_set.labels[p]) for p in parts]
    site_inputs = [x for x, _ in site_rows]
    classes = train_set.num_classes
    inputs = FusionInputs(
        data=train_set.subset(fusion).inputs(),
        labels=train_set.labels[fusion],
        sample_counts=[len(p) for p in parts],
        class_counts=[
            np.bincount(train_set.labels[p].numpy(), minlength=classes).tolist() for p in parts
        ],
    )
    methods = {spec: method_of(spec) for spec in args.methods}
    # what the sites send besides counts and Fisher uploads, only when a method reads it; the
    # sites score a model on their training rows (auto), as site_fusion_inputs' sites do
    wanted = [e for e in extras_for(methods.values()) if e in ("scores", "grams")]
    extras = site_extras(args, models, site_rows, wanted)
    sites = LocalSites(models, site_inputs, validation=site_rows)
    fused, seconds, details, candidates = {}, {}, {}, {}
    for spec, method in methods.items():
        # each method is given the sites' extras it reads, so that the others run as before
        given = {k: v for k, v in extras.items() if k in method.needs()}
        if reads_sites(method.needs()):
            given["sites"] = sites
        method_inputs = dataclasses.replace(inputs, **given)
        if spec == "exact-fisher":
            method_inputs.fisher = fishers(
                args, models, site_inputs, ["diagonal"], samples=0, labels="expected"
            )
        elif spec.startswith("fedfisher"):
            kind = "kfac" if spec.partition(":")[0].endswith("kfac") else "diagonal"
            method_inputs.fisher = fishers(args, models, site_inputs, [kind])
        began = time.perf_counter()
        result = method.fuse([copy.deepcopy(m) for m in models], method_inputs)
        seconds[spec] = time.perf_counter() - began
        fused[spec] = result.model
        details[spec] = {
            k: v
            for k, v in result.details.items()
            if k.endswith("_chosen") or k in ("damping", "sigma")
        }
        if "auto" in result.details:
            details[spec]["auto chose"] = result.details["auto"]["chosen"]
            candidates[spec] = result.details["auto"]
    evaluation = evaluate_fusion(models, fused, test_set, device="cpu")
    bases = ", ".join(f"{100 * b['accuracy']:.1f}" for b in evaluation["base"])
    print(f"\nsites: {bases}; ensemble {100 * evaluation['ensemble']['accuracy']:.2f}")
    print("\n| method | test accuracy % | fusion s | chosen |\n| --- | --: | --: | --- |")
    for name, result in evaluation["fused"].items():
        chosen = ", ".join(f"{k} {v}" for k, v in details[name].items())
        print(f"| {name} | {100 * result['accuracy']:.2f} | {seconds[name]:.1f} | {chosen} |")
    print(f"| ensemble | {100 * evaluation['ensemble']['accuracy']:.2f} | | |")
    for spec, report in candidates.items():
        print(f"\n{spec}: {report['why']}\n| candidate | score | per site |\n| --- | --: | --- |")
        for name, trial in report["candidates"].items():
            if "accuracy" not in trial:
                print(f"| {name} | {trial.get('skipped') or trial.get('failed')} | |")
                continue
            per_site = ", ".join(
                "-" if s is None else f"{100 * s['accuracy']:.1f}"
                for s in trial.get("site_scores", [])
            )
            print(f"| {name} | {100 * trial['accuracy']:.2f} | {per_site} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
