"""A user's own small CNN, fused as it is: the Flower PyTorch template's ``Net`` on Fashion-MNIST.

Each site trains its own ``TemplateNet`` (independently initialised) on its share of a sharded
or Dirichlet split; the server holds 400 training images of site 0 (skewed, as fedfuse's
default). Every method that accepts the plain model fuses the sites' ``Net``\\ s through
:class:`fedfuse.models.ModelAdapter` and gets a ``Net`` back; the table compares them with the
best single site and the ensemble, mean ± std over seeds.

Run: ``python -m fedfuse.experiments.plain_models --sites 2 --seeds 0 1 2`` (prints a Markdown
table and writes it as JSON beside ``--output``).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fedfuse.data import ImageDataset, load_dataset
from fedfuse.federation.evaluation import evaluate_fusion
from fedfuse.fusion import FusionInputs, make_fusion_method
from fedfuse.fusion.methods.regression.regmean import level_grams
from fedfuse.models import ModelAdapter, importance_scores
from fedfuse.partitions import partition_labels, sample_fusion_set
from fedfuse.runtime import configure_logging
from fedfuse.training.loop import TrainConfig, train

log = logging.getLogger(__name__)

#: the methods that take a plain chain model, each with the extras it reads
METHODS = ("fedavg", "otfusion", "git-rebasin", "hf-linear", "kf-linear", "regmean", "kd")


class TemplateNet(nn.Module):
    """The CNN of Flower's PyTorch template, sized for 28x28x1 inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 4 * 4, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 4 * 4)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


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
) -> dict[str, dict[str, float]]:
    """One seed: train the sites, fuse with every method, evaluate; accuracy and fusion time."""
    labels = train_set.labels.numpy()
    options = {"alpha_min": 0.5} if partitioner == "dirichlet" else {}
    parts = partition_labels(partitioner, labels, sites, seed=seed, **options)
    fusion_index = sample_fusion_set(labels, parts, fusion_samples, source=0, seed=seed)
    adapter = ModelAdapter(TemplateNet, train_set.input_shape).register()
    nets, scores, grams, counts = [], [], [], []
    for site, part in enumerate(parts):
        torch.manual_seed(seed * 1000 + site)
        net = TemplateNet()
        data = train_set.subset(part)
        train(net, data, TrainConfig(epochs=epochs), seed=seed * 1000 + site, progress=False)
        net.eval()
        leveled = adapter.adapt(net)
        sample = data.inputs(torch.randperm(len(data))[:512].numpy())
        scores.append(importance_scores(leveled, sample, method="deeplift"))
        grams.append(level_grams(leveled, data.inputs()))
        nets.append(net)
        counts.append(len(data))
    fusion = train_set.subset(fusion_index)
    inputs = FusionInputs(
        data=fusion.inputs(),
        labels=fusion.labels,
        scores=scores,
        sample_counts=counts,
        grams=grams,
    )
    fused, seconds = {}, {}
    for name in methods:
        method = make_fusion_method(name)
        if method.max_models is not None and sites > method.max_models:
            continue  # hf-linear and git-rebasin fuse two models
        started = time.perf_counter()
        fused[name] = method.fuse(nets, inputs).model
        seconds[name] = time.perf_counter() - started
    evaluation = evaluate_fusion(nets, fused, test_set, device="cpu")
    row = {"best site": {"accuracy": max(b["accuracy"] for b in evaluation["base"])}}
    row["ensemble"] = {"accuracy": evaluation["ensemble"]["accuracy"]}
    for name, result in evaluation["fused"].items():
        row[name] = {"accuracy": result["accuracy"], "seconds": seconds[name]}
    return row


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
    parser.add_argument("--output", default="bench-results/plain-models.json")
    args = parser.parse_args(argv)
    configure_logging()
    train_set, test_set = load_dataset(args.dataset, "train"), load_dataset(args.dataset, "test")
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
