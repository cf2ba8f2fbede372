"""``fedfuse methods``: the fusion registry, with what each method needs and what it accepts.

For every registered method (default options): what the sites must send besides their weights,
what the server must hold, how many models it fuses, and which architectures it accepts. The
architecture column asks each method's own pre-training check (``check_run``) on a model of
each of fedfuse's architectures and on two adapted plain ``nn.Module`` s (a chain, and a CNN
with BatchNorm and a residual add), built on the meta device, so it says exactly what a run
would say before any site trains.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedfuse.fusion import FusionMethod
    from fedfuse.models import ModelSpec

#: what each FusionInputs field asks of whom
SITE_INPUTS = {
    "scores": "importance scores",
    "sample_counts": "sample counts",
    "class_counts": "class counts",
    "grams": "Gram matrices",
    "fisher": "Fisher information",
    "sites": "statistics rounds",
    "site_scores": "scores of models on their rows",
}
SERVER_INPUTS = {"data": "fusion set", "labels": "fusion-set labels"}


#: the plain models' columns: a chain of layers, and a model with residuals and normalisation
PLAIN_CHAIN, PLAIN_RESIDUAL = "plain nn.Module", "plain residual+norm"


def architectures() -> dict[str, ModelSpec]:
    """A spec of each of fedfuse's architectures, of an adapted plain chain and of an adapted
    plain model with a residual add and BatchNorm."""
    from fedfuse.cli._plain_models import _PlainChain, _PlainResidual
    from fedfuse.models import ModelAdapter, make_spec

    shape = (1, 28, 28)
    archs = ("mlp", "vgg11", "lenet5", "resnet", "vit")
    specs = {arch: make_spec(arch, shape, 10) for arch in archs}
    specs[PLAIN_CHAIN] = ModelAdapter(_PlainChain, shape, name="plain-chain").register().spec
    residual = ModelAdapter(_PlainResidual, shape, name="plain-residual").register()
    specs[PLAIN_RESIDUAL] = residual.spec
    return specs


def describe(method: FusionMethod, specs: dict[str, ModelSpec]) -> dict[str, object]:
    """What ``method`` needs, how many models it takes and which of ``specs`` it accepts."""
    needs = method.needs()
    required = method.requirements()

    def listed(names: dict[str, str]) -> list[str]:
        return [text + ("" if field in required else " (optional)")
                for field, text in names.items() if field in needs]  # fmt: skip

    accepts = {}
    for name, spec in specs.items():
        try:
            method.check_run(2, spec)
            plain = name not in (PLAIN_CHAIN, PLAIN_RESIDUAL) or not method.chooses_widths
            accepts[name] = "yes" if plain else "no: it changes the widths a class defines"
        except ValueError as error:
            accepts[name] = f"no: {str(error).split(': ', 1)[-1]}"
    most = method.max_models
    return {
        "name": method.name,
        "kind": method.kind,
        "sites send": listed(SITE_INPUTS),
        "server holds": listed(SERVER_INPUTS),
        "models": ("2 only" if most == 2 else f"2 to {most}") if most else "2 or more",
        "accepts": accepts,
    }


def methods_command(args: argparse.Namespace) -> int:
    """Print the registry as a table (or JSON with ``--json``)."""
    from fedfuse.fusion import FUSION_METHODS, make_fusion_method

    specs = architectures()
    rows = [describe(make_fusion_method(name), specs) for name in sorted(FUSION_METHODS)]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    archs = list(specs)
    header = ["method", "sites send (besides weights)", "server holds", "models", *archs]
    table = [
        [
            row["name"] + ("" if row["kind"] == "fusion" else f" ({row['kind']})"),
            ", ".join(row["sites send"]) or "-",
            ", ".join(row["server holds"]) or "-",
            row["models"],
            *("yes" if row["accepts"][a] == "yes" else "no" for a in archs),
        ]
        for row in rows
    ]
    widths = [max(len(r[i]) for r in [header, *table]) for i in range(len(header))]
    for line in [header, ["-" * w for w in widths], *table]:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip())
    print(
        f"({PLAIN_CHAIN}: your own model, a chain of Linear/Conv2d layers; {PLAIN_RESIDUAL}: "
        "your own model with residual adds and BatchNorm, e.g. torchvision's resnet18 (the "
        "closed-form fits, on the fusion set or on the sites' statistics, take its convs with "
        "their BatchNorms and its residual blocks, and torchvision's VisionTransformer as "
        "fedfuse's vit, as fs-merge and zipit do); why a method refuses an architecture: "
        "fedfuse methods --json)"
    )
    return 0


def register_cli(commands: argparse._SubParsersAction) -> None:
    """Add ``fedfuse methods`` to the command line."""
    parser = commands.add_parser(
        "methods", help="list the fusion methods: what they need, how many models, which models"
    )
    parser.add_argument("--json", action="store_true", help="print JSON, with refusal reasons")
    parser.set_defaults(handler=methods_command)
