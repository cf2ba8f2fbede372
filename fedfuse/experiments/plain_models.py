"""Users' own models, fused as they are: Flower's template ``Net``, torchvision's ResNet-18 and a
small torchvision ViT on Fashion-MNIST (:mod:`fedfuse.experiments.user_models`).

Each site trains its own model (independently initialised) on its share of a sharded or
Dirichlet split; the server holds 400 training images of site 0 (skewed, as fedfuse's
default). Every listed method fuses the sites' models through
:class:`fedfuse.models.ModelAdapter` and gets the user's class back; ``kf-sites`` and
``hf-sites`` fit on each site's own training data (statistics rounds, in-process). The table
compares them with the best single site and the ensemble, mean ± std over seeds. With ``--own``
fedfuse's own architecture of the same shape (:data:`~.user_models.OWN_SPECS`) is trained with
the same recipe on the same split and fused by the same methods (rows ``own ...``): from its
own random start (``--own-start independent``), or from the torchvision model's initial weights
copied into it (``--own-start shared``, :func:`~.user_models.as_fedfuse_model`), so that what
differs between the two is the fusion alone. With
``--gaussian-samples N`` each site also fits its class Gaussians on its training data
(:mod:`fedfuse.fusion.statistics.class_gaussians`, one upload) and the server completes its
fusion set with ``N`` rows per site drawn from them, for every method that reads a fusion set
(``fusion_set.gaussian_samples`` of ``fedfuse compare``).

Run: ``python -m fedfuse.experiments.plain_models --sites 2 --seeds 0 1 2`` (prints a Markdown
table and writes it as JSON beside ``--output``); ``--model resnet18 --own`` for torchvision's
ResNet-18 beside fedfuse's.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from fedfuse.data import ImageDataset, load_dataset
from fedfuse.experiments.user_models import (  # noqa: F401  (TemplateNet: re-exported for the example app)
    OWN_SPECS,
    USER_MODELS,
    TemplateNet,
    as_fedfuse_model,
)
from fedfuse.federation.evaluation import evaluate_fusion
from fedfuse.fusion import FusionInputs, FusionMethod, LocalSites, make_fusion_method
from fedfuse.fusion.base import reads_sites
from fedfuse.fusion.methods.regression.regmean import level_grams
from fedfuse.fusion.registry import FUSION_METHODS
from fedfuse.fusion.statistics.class_gaussians import (
    GaussianFusionSet,
    fit_class_gaussians,
    upload_rank,
)
from fedfuse.models import LeveledModel, ModelAdapter, build_model, importance_scores
from fedfuse.partitions import partition_labels, sample_fusion_set
from fedfuse.runtime import configure_logging
from fedfuse.settings.hydra import available_options, compose, method_from_config
from fedfuse.training.loop import TrainConfig, train

log = logging.getLogger(__name__)

#: the methods that take a plain chain model, each with the extras it reads
METHODS = ("fedavg", "otfusion", "git-rebasin", "hf-linear", "kf-linear", "regmean", "kd")

#: the methods measured on torchvision's models: those that take fedfuse's own ResNet and ViT
#: and fuse without training (kd, linear-probe and dense train on the server)
TORCHVISION_METHODS = (
    "fedavg",
    "otfusion",
    "git-rebasin",
    "regmean",
    "hf-linear",
    "kf-linear",
    "kf-trust",
    "hf-sites",
    "kf-sites",
)

#: how fedfuse's own architecture starts beside the user's model (``--own-start``)
OWN_STARTS = ("independent", "shared", "copied")

#: site extras a method reads (the rest read the weights, the fusion set and sample counts)
_SITE_DATA = ("kf-sites", "hf-sites")


def named_method(name: str) -> FusionMethod:
    """A registered method by its name, or a packaged method config by its name (e.g.
    ``kf-gradient-refine``), as ``fedfuse compare``'s ``method=`` takes them."""
    if name in FUSION_METHODS or name not in available_options("method"):
        return make_fusion_method(name)  # an unknown name fails here, listing the methods
    return method_from_config(compose([f"method={name}"]).method)


def run_seed(
    seed: int,
    *,
    sites: int,
    partitioner: str,
    epochs: int,
    fusion_samples: int,
    train_set: ImageDataset,
    test_set: ImageDataset,
    methods: tuple[str, ...] = METHODS,
    model: str = "template",
    own: bool = False,
    own_start: str = "independent",
    train_samples: int = 0,
    gaussian_samples: int = 0,
) -> dict[str, dict[str, float]]:
    """One seed: train the sites, fuse with every method, evaluate; accuracy and fusion time.

    ``model`` names a :data:`~.user_models.USER_MODELS` entry; ``own`` adds fedfuse's own
    architecture of its shape, trained and fused alike (rows prefixed ``own``), each site from
    its own random start, from the user's model's initial weights (``own_start="shared"``), or
    not trained at all but the user's trained sites copied in (``"copied"``: the same functions);
    ``train_samples`` caps each site's training share (0: all of it); ``gaussian_samples``
    rows per site drawn from the sites' class Gaussians complete the fusion set (0: none)."""
    labels = train_set.labels.numpy()
    options = {"alpha_min": 0.5} if partitioner == "dirichlet" else {}
    parts = partition_labels(partitioner, labels, sites, seed=seed, **options)
    fusion_index = sample_fusion_set(labels, parts, fusion_samples, source=0, seed=seed)
    if train_samples > 0:
        generator = torch.Generator().manual_seed(seed)
        parts = [
            p[torch.randperm(len(p), generator=generator)[:train_samples].numpy()] for p in parts
        ]
    shares = [train_set.subset(part) for part in parts]
    fusion = train_set.subset(fusion_index)
    builders: dict[str, Callable[[], nn.Module]] = {"": USER_MODELS[model]}
    if own_start not in OWN_STARTS:
        raise ValueError(f"own_start must be one of {OWN_STARTS}, got {own_start!r}")
    if own:
        spec = OWN_SPECS[model]
        if own_start == "shared":  # drawn under the same seed as the user's site model
            builders["own "] = lambda: as_fedfuse_model(USER_MODELS[model](), spec)
        else:
            builders["own "] = lambda: build_model(spec)
    row: dict[str, dict[str, float]] = {}
    needs = set().union(*(named_method(name).needs() for name in methods))
    completion = GaussianFusionSet(gaussian_samples, seed=seed + 3)  # as fedfuse compare's
    rank = upload_rank(completion, [named_method(name) for name in methods])
    # each site's upload, fitted on its training data (the server draws from them)
    gaussians = [
        fit_class_gaussians(s.inputs(), s.labels, s.num_classes, rank=rank) for s in shares if rank
    ]
    copied = None  # own_start="copied": the user's trained sites in fedfuse's architecture
    for prefix, build in builders.items():
        nets, extras = _trained_sites(
            build, shares, train_set.input_shape, seed, epochs, needs, trained=copied
        )
        if own and own_start == "copied" and not prefix:
            copied = [as_fedfuse_model(net, OWN_SPECS[model]) for net in nets]
        inputs = FusionInputs(
            data=fusion.inputs(),
            labels=fusion.labels,
            sample_counts=[len(share) for share in shares],
            **extras,
        )
        if rank:
            inputs = completion.complete_inputs(inputs, gaussians)
        fused, seconds = {}, {}
        for name in methods:
            method = named_method(name)
            if method.max_models is not None and sites > method.max_models:
                continue
            started = time.perf_counter()
            fused[name] = method.fuse(nets, inputs).model
            seconds[name] = time.perf_counter() - started
        evaluation = evaluate_fusion(nets, fused, test_set, device="cpu")
        row[f"{prefix}best site"] = {"accuracy": max(b["accuracy"] for b in evaluation["base"])}
        row[f"{prefix}ensemble"] = {"accuracy": evaluation["ensemble"]["accuracy"]}
        for name, result in evaluation["fused"].items():
            row[f"{prefix}{name}"] = {"accuracy": result["accuracy"], "seconds": seconds[name]}
    return row


def _trained_sites(
    build: Callable[[], nn.Module],
    shares: list[ImageDataset],
    input_shape: tuple[int, ...],
    seed: int,
    epochs: int,
    needs: set[str],
    trained: list[nn.Module] | None = None,
) -> tuple[list[nn.Module], dict]:
    """Each site's model trained on its share, and what the sites send besides the weights
    that the methods read (``needs``): DeepLIFT scores on 512 of its samples, Gram matrices,
    and their labelled rows for statistics rounds and scores. ``trained``: the sites' models,
    already trained (only their extras are computed)."""
    adapter = None
    if not isinstance(build(), LeveledModel):  # a user's class, traced once
        adapter = ModelAdapter(build, input_shape).register()
    nets, scores, grams = [], [], []
    for site, data in enumerate(shares):
        if trained is None:
            torch.manual_seed(seed * 1000 + site)
            net = build()
            train(net, data, TrainConfig(epochs=epochs), seed=seed * 1000 + site, progress=False)
        else:
            net = trained[site]
        net.eval()
        leveled = net if adapter is None else adapter.adapt(net)
        generator = torch.Generator().manual_seed(seed * 1000 + site)
        sample_rows = data.inputs(torch.randperm(len(data), generator=generator)[:512].numpy())
        if "scores" in needs:
            scores.append(importance_scores(leveled, sample_rows, method="deeplift"))
        if "grams" in needs:
            grams.append(level_grams(leveled, data.inputs()))
        nets.append(net)
    extras: dict = {"scores": scores or None, "grams": grams or None}
    if reads_sites(needs):  # statistics rounds, or scores on each site's labelled rows
        rows = [(data.inputs(), data.labels) for data in shares]
        extras["sites"] = LocalSites(nets, [x for x, _ in rows], validation=rows)
    return nets, extras


def summarise(rows: list[dict[str, dict[str, float]]]) -> str:
    """Markdown: mean ± std of each row's accuracy (%) over seeds, and the mean fusion time."""
    lines = ["| model | accuracy % | fusion s |", "| --- | --: | --: |"]
    for name in rows[0]:
        accuracies = [100 * r[name]["accuracy"] for r in rows if name in r]
        spread = statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0
        times = [r[name]["seconds"] for r in rows if "seconds" in r.get(name, {})]
        time_cell = f"{statistics.mean(times):.1f}" if times else ""
        lines.append(f"| {name} | {statistics.mean(accuracies):.2f} ± {spread:.2f} | {time_cell} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", type=int, default=2)
    parser.add_argument("--partitioner", default="sharded", choices=["sharded", "dirichlet"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--fusion-samples", type=int, default=400)
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--model", default="template", choices=sorted(USER_MODELS))
    parser.add_argument(
        "--own", action="store_true", help="also fedfuse's own architecture of the model's shape"
    )
    parser.add_argument(
        "--own-start",
        default="independent",
        choices=OWN_STARTS,
        help="fedfuse's architecture from its own random start, from the user's model's "
        "initial weights (shared), or the user's trained sites copied in (copied: the fusion "
        "alone differs)",
    )
    parser.add_argument("--train-samples", type=int, default=0, help="cap per site (0: all)")
    parser.add_argument(
        "--methods",
        default=None,
        help="comma list of methods or packaged method configs, e.g. kf-gradient-refine "
        "(default: by model)",
    )
    parser.add_argument(
        "--gaussian-samples",
        type=int,
        default=0,
        help="rows per site drawn from its class Gaussians to complete the fusion set (0: off)",
    )
    parser.add_argument("--output", default="bench-results/plain-models.json")
    args = parser.parse_args(argv)
    configure_logging()
    train_set, test_set = load_dataset(args.dataset, "train"), load_dataset(args.dataset, "test")
    default = METHODS if args.model == "template" else TORCHVISION_METHODS
    rows = []
    for seed in args.seeds:
        rows.append(
            run_seed(
                seed,
                sites=args.sites,
                partitioner=args.partitioner,
                epochs=args.epochs,
                fusion_samples=args.fusion_samples,
                train_set=train_set,
                test_set=test_set,
                methods=tuple(args.methods.split(",")) if args.methods else default,
                model=args.model,
                own=args.own,
                own_start=args.own_start,
                train_samples=args.train_samples,
                gaussian_samples=args.gaussian_samples,
            )
        )
        log.info("seed %d: %s", seed, json.dumps(rows[-1]))
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")
    print(summarise(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
