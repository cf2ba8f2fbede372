"""Measure the example: the template's FedAvg against one-shot fusion, several runs each.

Run from the repository root: ``python examples/flower-app/measure.py --runs 3``. Each run is a
real ``flwr run`` of 2 simulated sites (``fedfuse run-app``) on a copy of this app: once with the
template's own ServerApp and ClientApp (FedAvg, ``num-server-rounds`` rounds), once with the
one-shot ServerApp and its methods replaced by ``--methods`` (with ``client_extras=True`` when one
of them requires the sites' Grams, Fisher or class counts). Prints a Markdown table of the
central test accuracy (the first ``--test-samples`` Fashion-MNIST test images), mean ± std.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from fedfuse.federation.simulation import run_flower_app

HERE = Path(__file__).resolve().parent
SUMMARY = re.compile(r"^\s+(\S+)\s+fused in\s+([\d.]+) s\s+accuracy ([\d.]+)", re.MULTILINE)
REFERENCES = ("best single site", "ensemble (not one model)")
KEPT = re.compile(r"the sites' uploads are kept in (\S+)")


def _copy(into: Path, *, template: bool, methods: str) -> Path:
    app = into / ("template" if template else "one-shot")
    shutil.copytree(HERE, app, ignore=shutil.ignore_patterns("measure.py", "__pycache__"))
    if template:
        pyproject = app / "pyproject.toml"
        text = pyproject.read_text().replace(
            "flower_app.server_app:app", "flower_app.template_server_app:app"
        )
        pyproject.write_text(
            text.replace("flower_app.client_app:app", "flower_app.template_client_app:app")
        )
    else:
        server = app / "flower_app" / "server_app.py"
        text = server.read_text().replace('"kf-sites,fedavg"', f'"{methods}"')
        if _needs_extras(methods):  # the ClientApp already calls add_fusion_extras
            text = text.replace(
                "client_statistics=True", "client_statistics=True, client_extras=True"
            )
        server.write_text(text)
    return app


def _needs_extras(methods: str) -> bool:
    """Whether a method of ``methods`` requires what ``add_fusion_extras`` sends (Grams, Fisher,
    class counts); methods that only read scores optionally run without them, as the app does."""
    from fedfuse.fusion import as_fusion_methods

    extras = {"grams", "fisher", "class_counts", "scores"}
    return any(method.requirements() & extras for method in as_fusion_methods(methods))


def _site_references(uploads: Path, test_set) -> dict[str, float]:
    """The best single site's and the ensemble's accuracy (mean of the sites' softmax), from
    the uploads the one-shot run kept (each site's trained ``Net``)."""
    from flower_app.task import Net

    from fedfuse.federation.uploads import UploadStore
    from fedfuse.models import ModelAdapter

    adapter = ModelAdapter(Net, (1, 28, 28)).register()
    nets = [adapter.export(model).eval() for model in UploadStore.open(uploads).models()]
    probabilities, labels = [], []
    with torch.no_grad():
        for images, batch_labels in test_set:
            probabilities.append(torch.stack([net(images).softmax(1) for net in nets]))
            labels.append(batch_labels)
    stacked, truth = torch.cat(probabilities, dim=1), torch.cat(labels)
    each = [(p.argmax(1) == truth).float().mean().item() for p in stacked]
    ensemble = (stacked.mean(0).argmax(1) == truth).float().mean().item()
    return {"best single site": max(each), "ensemble (not one model)": ensemble}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--methods",
        default="kf-sites,hf-sites,kf-linear,hf-linear,regmean,fedavg,otfusion,git-rebasin,kd",
    )
    parser.add_argument("--train-samples", type=int, default=0, help="cap per site (0: all)")
    parser.add_argument("--test-samples", type=int, default=10000)
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    from flower_app.task import Net, load_centralized_test, test

    test_set = load_centralized_test(args.test_samples)
    accuracy: dict[str, list[float]] = {}
    seconds: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        apps = {
            "template": _copy(root, template=True, methods=args.methods),
            "one-shot": _copy(root, template=False, methods=args.methods),
        }
        for run in range(args.runs):
            for kind, app in apps.items():
                saved = root / f"{kind}-{run}.pt"
                config = f"train-samples={args.train_samples} save-path='{saved}'"
                done = run_flower_app(app, run_config=config, echo=False, timeout=1800)
                if not done.ok:
                    print(done.output[-3000:], file=sys.stderr)
                    raise SystemExit(f"{kind} run {run} failed: {done.status}")
                if kind == "template":
                    net = Net()
                    net.load_state_dict(torch.load(saved, weights_only=True))
                    accuracy.setdefault("FedAvg, 3 rounds (template)", []).append(
                        test(net, test_set, "cpu")[1]
                    )
                    continue
                for name, fused_in, acc in SUMMARY.findall(done.output):
                    accuracy.setdefault(name, []).append(float(acc))
                    seconds.setdefault(name, []).append(float(fused_in))
                kept = KEPT.search(done.output)
                if kept:
                    for name, value in _site_references(Path(kept.group(1)), test_set).items():
                        accuracy.setdefault(name, []).append(value)
                    shutil.rmtree(kept.group(1), ignore_errors=True)
            print(f"run {run + 1} of {args.runs} done", file=sys.stderr)
    print("| method (2 sites, disjoint classes) | rounds | test accuracy % | fusion s |")
    print("|---|--:|--:|--:|")
    for name, values in sorted(accuracy.items(), key=lambda item: -statistics.mean(item[1])):
        mean = 100 * statistics.mean(values)
        spread = 100 * statistics.stdev(values) if len(values) > 1 else 0.0
        rounds = 3 if name.startswith("FedAvg, 3") else "" if name in REFERENCES else 1
        fused = f"{statistics.mean(seconds[name]):.2f}" if name in seconds else "-"
        print(f"| {name} | {rounds} | {mean:.2f} ± {spread:.2f} | {fused} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
