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
from fedfuse.federation.evaluation import evaluate_fusion
from fedfuse.fusion import FusionInputs, make_fusion_method
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


def fishers(args, models, site_inputs, kinds, **options):
    """Each site's Fisher upload of ``kinds`` (:func:`site_fisher`, its defaults updated by
    ``options``), cached by the site models and those settings."""
    defaults = {
        k: v.default
        for k, v in inspect.signature(site_fisher).parameters.items()
        if v.default is not inspect.Parameter.empty and k != "device"
    }
    settings = {**defaults, **options, "kinds": sorted(kinds)}
    if settings.get("labels") == "auto":  # 10 classes: the exact expectation
        settings["labels"] = "expected"
    key = hashlib.sha1(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()
    path = Path(args.cache) / f"fisher-s{args.seed}-e{args.epochs}-{key[:12]}.pt"
    if path.exists():
        return torch.load(path, weights_only=False)
    uploads = [
        site_fisher(copy.deepcopy(m), x, kinds, device="cpu", **options)
        for m, x in zip(models, site_inputs, strict=True)
    ]
    torch.save(uploads, path)
    return uploads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--sites", type=int, default=5)
    parser.add_argument("--alpha", type=float, default=0.1)
    parser.add_argument("--fusion-rows", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", default="outputs/other_recipe_lenet")
    parser.add_argument("--methods", nargs="*", default=list(METHODS))
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    train_set = load_dataset("fashion_mnist", "train")
    test_set = load_dataset("fashion_mnist", "test")
    models, parts, fusion = federation(args, train_set)
    site_inputs = [train_set.subset(p).inputs() for p in parts]
    classes = train_set.num_classes
    inputs = FusionInputs(
        data=train_set.subset(fusion).inputs(),
        labels=train_set.labels[fusion],
        sample_counts=[len(p) for p in parts],
        class_counts=[
            np.bincount(train_set.labels[p].numpy(), minlength=classes).tolist() for p in parts
        ],
    )
    fused, seconds, details = {}, {}, {}
    for name in args.methods:
        method_inputs, options = inputs, {}
        if name == "exact-fisher":
            method_inputs = dataclasses.replace(inputs)
            method_inputs.fisher = fishers(
                args, models, site_inputs, ["diagonal"], samples=0, labels="expected"
            )
            options = {"weighting": "samples", "damping": 0.0}
        elif name.startswith("fedfisher"):
            method_inputs = dataclasses.replace(inputs)
            kind = "kfac" if name.endswith("kfac") else "diagonal"
            method_inputs.fisher = fishers(args, models, site_inputs, [kind])
        method = make_fusion_method("fisher-merging" if name == "exact-fisher" else name, **options)
        began = time.perf_counter()
        result = method.fuse([copy.deepcopy(m) for m in models], method_inputs)
        seconds[name] = time.perf_counter() - began
        fused[name] = result.model
        details[name] = {
            k: v
            for k, v in result.details.items()
            if k.endswith("_chosen") or k in ("damping", "sigma")
        }
    evaluation = evaluate_fusion(models, fused, test_set, device="cpu")
    sites = ", ".join(f"{100 * b['accuracy']:.1f}" for b in evaluation["base"])
    print(f"\nsites: {sites}; ensemble {100 * evaluation['ensemble']['accuracy']:.2f}")
    print("\n| method | test accuracy % | fusion s | chosen |\n| --- | --: | --: | --- |")
    for name, result in evaluation["fused"].items():
        chosen = ", ".join(f"{k} {v}" for k, v in details[name].items())
        print(f"| {name} | {100 * result['accuracy']:.2f} | {seconds[name]:.1f} | {chosen} |")
    print(f"| ensemble | {100 * evaluation['ensemble']['accuracy']:.2f} | | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
