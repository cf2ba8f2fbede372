"""Pin the numbers of every fusion method: writes ``tests/data/method_regression.json``.

Three small MLPs (seeds 10, 11, 12, each trained for a few full-batch steps on its own synthetic
site data), a fixed fusion set, fixed scores, sample and class counts and level Grams. Every case
below fuses the first 2 or 3 models with one registered method and its options (the trainers
with few epochs) and records the fused model's logits on a fixed probe batch; two more cases
record :func:`fedfuse.training.loop.train`. ``tests/unit/test_method_regression.py``
recomputes every case and compares, so a refactoring that changes any method's numbers fails
there.

Regenerate only on purpose (the file pins the code it was made from), from the repository root::

    .venv/bin/python tests/data/make_method_regression.py

A new method needs a case in :data:`CASES` and a regeneration; ``git diff`` of the JSON should
then show only the new case.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fedfuse.data import ImageDataset
from fedfuse.fusion import FusionInputs, LocalSites, make_fusion_method
from fedfuse.fusion.methods.regression.regmean import level_grams
from fedfuse.fusion.statistics.fisher import FISHER_KINDS, site_fisher
from fedfuse.models import LeveledModel, build_model, make_spec
from fedfuse.training.loop import TrainConfig, train

FIXTURE = Path(__file__).with_name("method_regression.json")
SPEC = make_spec("mlp", (1, 8, 8), 4, widths=(16, 12))
#: the FusionInputs fields a case may leave out (``drop``); ``sites`` answers statistics rounds
#: in-process, each model on its own site data
FIELDS = ("data", "labels", "scores", "sample_counts", "class_counts", "grams", "fisher", "sites")
GRADIENT = {"epochs": 3, "last_epochs": 3}


@dataclass(frozen=True)
class Case:
    """One fusion to pin: the method, its options, how many models, inputs left out, target."""

    method: str
    options: dict[str, Any] = field(default_factory=dict)
    models: int = 2
    drop: tuple[str, ...] = ()
    widths: tuple[int, ...] | None = None

    @property
    def key(self) -> str:
        parts = [self.method, f"{self.models}m"]
        parts += [f"{k}={v}" for k, v in sorted(self.options.items())]
        parts += [f"no-{d}" for d in self.drop]
        if self.widths:
            parts.append("widths=" + ",".join(map(str, self.widths)))
        return " ".join(parts)


def _cases() -> list[Case]:
    cases: list[Case] = []
    for count in (2, 3):
        cases += [
            Case("vanilla", models=count),
            Case("fedavg", models=count),
            Case("regmean", models=count),
            Case("otfusion", models=count),
            Case("fedma", models=count),
            Case("kf-linear", models=count),
            Case("kf-gradient", dict(GRADIENT), models=count),
            Case("kd", {"epochs": 3}, models=count),
            Case("linear-probe", {"epochs": 3}, models=count),
            Case("fs-merge", {"epochs": 5}, models=count),
        ]
    cases += [
        Case("regmean", {"alpha": 0.5}, models=3),
        Case("otfusion", {"use_scores": True, "weighted_average": True}, models=3),
        Case("otfusion", {"ground_metric": "weights", "solver": "sinkhorn", "reg": 0.05}, 3),
        Case("otfusion", {"repair": True}),
        Case("otfusion", {"use_scores": True}, drop=("scores",)),
        Case("git-rebasin"),
        Case("git-rebasin", {"cost": "l2", "use_scores": True, "weighted_average": True}),
        Case("git-rebasin", {"repair": True}),
        Case("git-rebasin", {"use_scores": True}, drop=("scores",)),
        Case("fedma", {"normalize": False, "sigma": 1.0}, models=3),
        Case("fedma", {}, models=3, drop=("class_counts",)),
        Case("fedma", {"select": False, "popularity": "code"}, models=3),
        Case("hf-linear"),
        Case("hf-linear", {"head_weights": True, "score_normalization": "max"}),
        Case("hf-linear", {"use_scores": False, "ridge": 0.0}),
        Case("hf-linear", {}, drop=("scores",)),
        Case("kf-linear", {"head_weights": True, "n_init": 2, "local_search_swaps": 2}, 3),
        Case("kf-linear", {}, models=3, widths=(10, 8)),
        Case("kf-linear", {"head_weights": False}, models=3),
        Case("kf-linear", {"score_normalization": "none"}, models=3, drop=("scores",)),
        Case("hf-gradient", dict(GRADIENT)),
        Case("hf-gradient", {**GRADIENT, "head_weights": True, "use_scores": False}),
        Case("kf-gradient", {**GRADIENT, "preset": "setting2", "weighted_loss": True}, 3),
        Case(
            "kf-gradient",
            {
                "epochs": 10,
                "last_epochs": 10,
                "lr": 0.02,
                "last_lr": 0.02,
                "epsilon": 0.5,
                "batch_size": 8,
                "patience": 1,
            },
            widths=(10, 8),
        ),
        Case(
            "kd",
            {
                "epochs": 8,
                "optimizer": "sgd",
                "lr": 0.2,
                "student_init": "average",
                "ce_weight": 0.5,
                "patience": 1,
            },
            models=3,
        ),
        Case("kd", {"epochs": 2, "student_init": "fresh", "optimizer": "adam"}, widths=(10, 8)),
        Case(
            "linear-probe",
            {
                "target": "labels",
                "optimizer": "sgd",
                "lr": 0.05,
                "epochs": 3,
                "body": 1,
                "val_split": 0.0,
            },
            models=3,
        ),
        Case("fs-merge", {"recipe": "paper", "objective": "local", "epochs": 6}),
        Case(
            "fs-merge",
            {
                "recipe": "paper",
                "init": "first",
                "epochs": 4,
                "optimizer": "adam",
                "scheduler": "step",
                "batch_size": 16,
                "val_split": 0.25,
                "patience": 2,
            },
            models=3,
        ),
        Case(
            "fs-merge",
            {
                "init": "average",
                "rank": -1,
                "epochs": 4,
                "scheduler": "constant",
                "momentum": 0.5,
                "optimizer": "adamw",
                "lr": 0.01,
            },
        ),
        Case("fs-merge", {"recipe": "paper", "rank": 0, "epochs": 25, "head": "first"}),
        Case("kf-sites"),
        Case("kf-sites", {"gram_rank": 5, "statistics_dtype": "float64"}, models=3),
        Case("kf-sites", {"ridge": 0.01, "use_scores": False}, models=3, widths=(10, 8)),
        Case("hf-sites", {"max_samples": 40}),
        Case("kf-grams"),
        Case("kf-grams", {"ridge": 0.01, "use_scores": False}, models=3, widths=(10, 8)),
        Case("hf-grams", {}, models=3),
        Case("zipit"),
        Case("zipit", {"head": "first"}, models=3),
        Case("cca-merge"),
        Case("cca-merge", {"epsilon": 0.1}, models=3),
        Case("fisher-merging"),
        Case("fisher-merging", {"weighting": "samples", "damping": 0.01}, models=3),
        Case("fedfisher-diag", {}, models=3),
        Case("fedfisher-kfac"),
        Case("fedfisher-kfac", {"weighting": "uniform", "damping": 0.001}, models=3),
        Case("dense", {"epochs": 3, "batch_size": 16}),
        Case("dense", {"epochs": 2, "student_init": "average", "memory": 1}, models=3),
        Case("kf-trust"),
        Case("kf-trust", {"trust_exponent": 0.0, "use_scores": False}, models=3),
        Case("hf-trust", {"trust_exponent": float("inf")}),
        Case("regmean-fs", {"folds": 3}),
        Case("regmean-fs", {"weight": 0.5, "align": "none"}, models=3),
        Case("auto", {"candidates": "hf-linear,regmean,fedavg"}),
        Case("auto", {"candidates": "kf-linear,fedavg", "holdout": 0.5}, models=3),
    ]
    return cases


CASES = _cases()
#: local training (fedfuse.training.loop.train) on model 0's site data, pinned the same way
TRAIN_CASES = {
    "train adamw": TrainConfig(epochs=2, batch_size=32, lr=3e-3, warmup_epochs=0.5),
    "train sgd": TrainConfig(
        epochs=2, batch_size=32, optimizer="sgd", lr=0.05, momentum=0.8, augment=True
    ),
}


@dataclass
class Setup:
    """The models and everything the server knows about them, built from fixed seeds."""

    models: list[LeveledModel]
    site_data: list[torch.Tensor]
    site_labels: list[torch.Tensor]
    inputs: FusionInputs
    probe: torch.Tensor


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _teacher_labels(x: torch.Tensor) -> torch.Tensor:
    """Labels with structure to learn: the argmax of a fixed random linear map."""
    return (x.flatten(1) @ _randn(7, 64, 4)).argmax(1)


def _fit(model: LeveledModel, x: torch.Tensor, y: torch.Tensor, steps: int = 20) -> None:
    """A few full-batch plain gradient steps (plain torch: the setup must not move with fedfuse)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    model.train()
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    model.eval()


def build_setup() -> Setup:
    """Three trained models, their site data, all FusionInputs fields and the probe batch."""
    models, site_data, site_labels = [], [], []
    for k in range(3):
        model = build_model(SPEC, seed=10 + k)
        x = _randn(100 + k, 64 + 16 * k, 1, 8, 8)
        y = _teacher_labels(x)
        _fit(model, x, y)
        models.append(model)
        site_data.append(x)
        site_labels.append(y)
    data = _randn(1, 48, 1, 8, 8)
    generator = torch.Generator().manual_seed(200)
    scores = [
        {
            level: torch.rand(m.level_width(level), generator=generator) + 0.05
            for level in m.neuron_levels
        }
        for m in models
    ]
    inputs = FusionInputs(
        data=data,
        labels=_teacher_labels(data),
        scores=scores,
        sample_counts=[len(x) for x in site_data],
        class_counts=[torch.bincount(y, minlength=4).tolist() for y in site_labels],
        grams=[level_grams(m, x) for m, x in zip(models, site_data, strict=True)],
        fisher=[
            site_fisher(m, x, FISHER_KINDS, seed=k)
            for k, (m, x) in enumerate(zip(models, site_data, strict=True))
        ],
    )
    return Setup(models, site_data, site_labels, inputs, _randn(2, 16, 1, 8, 8))


def case_inputs(setup: Setup, case: Case) -> FusionInputs:
    """The setup's inputs for the case's first ``case.models`` models, without ``case.drop``."""
    values: dict[str, Any] = {}
    for name in FIELDS:
        value = getattr(setup.inputs, name)
        if name in case.drop:
            value = None
        elif name in ("scores", "sample_counts", "class_counts", "grams", "fisher"):
            value = list(value[: case.models])
        elif name == "sites":
            count = case.models
            value = LocalSites(setup.models[:count], setup.site_data[:count], device="cpu")
        values[name] = value
    return FusionInputs(**values)


def run_case(setup: Setup, case: Case) -> dict[str, Any]:
    """Fuse as the case says; the fused widths and logits on the probe batch."""
    method = make_fusion_method(case.method, **case.options)
    if "device" in method.accepted_options():
        method = make_fusion_method(case.method, **case.options, device="cpu")
    models = [copy.deepcopy(m) for m in setup.models[: case.models]]
    target = None if case.widths is None else SPEC.with_widths(case.widths)
    fused = method.fuse(models, case_inputs(setup, case), target=target).model
    with torch.no_grad():
        logits = fused.eval()(setup.probe)
    return {"widths": list(fused.spec.widths), "logits": logits.tolist()}


def run_training(setup: Setup, name: str) -> dict[str, Any]:
    """Train a fresh model on model 0's site data (as uint8 images); losses and probe logits."""
    x = setup.site_data[0]
    images = ((x.clamp(-2, 2) + 2) * 63.75).round().to(torch.uint8)
    dataset = ImageDataset(images, setup.site_labels[0], 4, (0.5,), (0.25,), name="site 0")
    model = build_model(SPEC, seed=3)
    losses = train(model, dataset, TRAIN_CASES[name], seed=4, device="cpu", progress=False)
    with torch.no_grad():
        logits = model.eval()(setup.probe)
    return {"losses": losses, "logits": logits.tolist()}


def compute() -> dict[str, dict[str, Any]]:
    """Every case's record, by case key."""
    setup = build_setup()
    records = {case.key: run_case(setup, case) for case in CASES}
    records.update({name: run_training(setup, name) for name in TRAIN_CASES})
    return records


def main() -> int:
    torch.set_num_threads(1)  # the test runs single-threaded too: reductions in one order
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    document = {
        "about": "logits of every fusion method on a fixed probe; see make_method_regression.py",
        "commit": commit,
        "torch": torch.__version__,
        "cases": compute(),
    }
    FIXTURE.write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {len(document['cases'])} cases to {FIXTURE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
