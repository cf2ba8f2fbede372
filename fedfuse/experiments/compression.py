"""Compression benchmark (paper Sec. 5.5.2): fuse a deep ResNet into a shallower one.

A ResNet-34-style *teacher* is trained on the whole training set; a ResNet-18-style *student*
spec is filled from the teacher's activations alone, on a fusion set drawn from a third of the
classes, by K-means Fusion (Gradient) level by level (the student's levels correspond to the
teacher's stage by stage, :func:`~fedfuse.models.corresponding_levels`), and, for comparison, by
knowledge distillation on the same fusion set. The paper's third reference, a ResNet-18 trained
on the fusion classes only, is trained on the same classes' training samples.

Run: ``python -m fedfuse.experiments.compression --seeds 0 1 2`` (prints a Markdown table and
writes JSON rows; times are wall seconds of the fusion alone, peak RSS of the process).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfuse.experiments.speed import peak_rss_gib
from fedfuse.federation.scenario import Scenario
from fedfuse.fusion import FusionInputs, make_fusion_method
from fedfuse.io.checkpoint import load_checkpoint, save_checkpoint
from fedfuse.models import build_model, make_spec
from fedfuse.models.importance import importance_scores
from fedfuse.runtime import configure_logging
from fedfuse.settings.run import RunSettings
from fedfuse.training.loop import TrainConfig, evaluate, train

log = logging.getLogger("fedfuse.experiments.compression")


def run_seed(
    seed: int,
    *,
    dataset: str = "fashion-mnist",
    width_multiplier: float = 0.125,
    teacher_depth: int = 34,
    student_depth: int = 18,
    train_samples: int = 12000,
    epochs: int = 3,
    fusion_classes: int = 3,
    fusion_samples: int = 2000,
    fusion_epochs: int | None = None,
    device: str = "auto",
    out: Path = Path("outputs/compression"),
) -> list[dict[str, Any]]:
    """Train the teacher, compress it with KF Gradient (uniform and conductance scores) and KD;
    one row per model with its test accuracy.

    ``fusion_epochs`` overrides KF Gradient's epochs per level and KD's epochs (None: their
    defaults, Table 9's setting 1 and 100); a short run or a test sets it."""
    scenario = Scenario(RunSettings(dataset=dataset, seed=seed, device=device), 1)
    train_set, test_set = scenario.train_set, scenario.test_set
    rng = np.random.default_rng(seed)
    subset = rng.choice(len(train_set), min(train_samples, len(train_set)), replace=False)
    teacher_data = train_set.subset(np.sort(subset))
    classes = np.sort(rng.choice(train_set.num_classes, fusion_classes, replace=False))
    in_classes = np.flatnonzero(np.isin(train_set.labels.numpy(), classes))
    fusion_index = np.sort(rng.choice(in_classes, min(fusion_samples, len(in_classes)), False))
    fusion = train_set.subset(fusion_index)
    own = train_set.subset(
        np.sort(rng.choice(in_classes, min(train_samples, len(in_classes)), False))
    )
    shape, n = train_set.input_shape, train_set.num_classes
    big = make_spec("resnet", shape, n, depth=teacher_depth, width_multiplier=width_multiplier)
    small = make_spec("resnet", shape, n, depth=student_depth, width_multiplier=width_multiplier)
    recipe = TrainConfig(epochs=epochs)

    teacher = _trained_once(out, f"teacher-{seed}", big, teacher_data, recipe, seed, device)
    baseline = _trained_once(out, f"own-classes-{seed}", small, own, recipe, seed, device)
    common = {"seed": seed, "fusion_classes": classes.tolist(), "fusion_samples": len(fusion)}
    rows = [
        {**common, "model": f"ResNet-{teacher_depth} (teacher)", **_score(teacher, test_set)},
        {**common, "model": f"ResNet-{student_depth} trained on the fusion classes",
         **_score(baseline, test_set)},
    ]  # fmt: skip
    for row in rows:
        log.info("seed %d: %s", seed, row)
    x, y = fusion.inputs(), fusion.labels
    conductance = importance_scores(teacher, x, y, method="conductance", device=device)
    methods = {
        "KF Gradient, uniform scores": ("kf-gradient", {"use_scores": False}, None),
        "Knowledge distillation": ("kd", {"student_init": "fresh"}, None),
        "KF Gradient, conductance": ("kf-gradient", {}, [conductance]),
    }
    for label, (name, options, scores) in methods.items():
        if fusion_epochs is not None:
            options = {**options, "epochs": fusion_epochs}
            options |= {"last_epochs": fusion_epochs} if name == "kf-gradient" else {}
        method = make_fusion_method(name, device=device, seed=seed, **options)
        started = time.perf_counter()
        result = method.fuse([teacher], FusionInputs(data=x, labels=y, scores=scores), target=small)
        rows.append(
            {
                **common,
                "model": f"ResNet-{student_depth}: {label}",
                **_score(result.model, test_set),
                "fusion_seconds": round(time.perf_counter() - started, 3),
                "peak_rss_gib": round(peak_rss_gib(), 2),
            }
        )
        log.info("seed %d: %s", seed, rows[-1])
    return rows


def _trained_once(
    out: Path, name: str, spec: Any, data: Any, recipe: TrainConfig, seed: int, device: str
) -> torch.nn.Module:
    """A model of ``spec`` trained on ``data``, kept as ``<out>/<name>.safetensors`` and loaded
    from there when a rerun finds it (teachers take the longest)."""
    path = out / f"{name}.safetensors"
    if path.exists():
        return load_checkpoint(path).model.eval()
    model = build_model(spec, seed=seed)
    train(model, data, recipe, seed=seed, device=device, progress=False, description=name)
    save_checkpoint(path, model)
    return model.eval()


def _score(model: torch.nn.Module, test_set: Any) -> dict[str, float]:
    return {"accuracy": round(evaluate(model, test_set).accuracy, 4)}


def table(rows: list[dict[str, Any]]) -> str:
    """Mean ± sample std over seeds per model, with fusion seconds and peak RSS."""
    by_model: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_model.setdefault(row["model"], []).append(row)
    lines = [
        "| model | test accuracy % (mean ± std) | seeds | fusion s | peak RSS GiB |",
        "|---|--:|--:|--:|--:|",
    ]
    for model, group in by_model.items():
        acc = np.array([r["accuracy"] for r in group]) * 100
        std = acc.std(ddof=1) if len(acc) > 1 else 0.0
        seconds = [r["fusion_seconds"] for r in group if "fusion_seconds" in r]
        peak = [r["peak_rss_gib"] for r in group if "peak_rss_gib" in r]
        lines.append(
            f"| {model} | {acc.mean():.2f} ± {std:.2f} | {len(group)} | "
            f"{np.mean(seconds):.1f} | {max(peak):.2f} |"
            if seconds
            else f"| {model} | {acc.mean():.2f} ± {std:.2f} | {len(group)} | | |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--width-multiplier", type=float, default=0.125)
    parser.add_argument("--train-samples", type=int, default=12000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--fusion-samples", type=int, default=2000)
    parser.add_argument("--fusion-epochs", type=int, default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default="outputs/compression")
    args = parser.parse_args(argv)
    configure_logging()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in args.seeds:
        path = out / f"seed-{seed}.json"
        if path.exists():  # resume
            rows += json.loads(path.read_text())
            continue
        seed_rows = run_seed(
            seed,
            dataset=args.dataset,
            width_multiplier=args.width_multiplier,
            train_samples=args.train_samples,
            epochs=args.epochs,
            fusion_samples=args.fusion_samples,
            fusion_epochs=args.fusion_epochs,
            device=args.device,
            out=out,
        )
        path.write_text(json.dumps(seed_rows, indent=1))
        rows += seed_rows
    print(table(rows))  # noqa: T201 - the benchmark's report


if __name__ == "__main__":
    main()
