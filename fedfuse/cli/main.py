"""The ``fedfuse`` command line.

``fedfuse simulate`` runs the Flower app (``flwr run``) as a local simulation and, unlike
``flwr run``, exits non-zero when the run failed; ``fedfuse partition`` shows how a split
distributes classes over clients; ``fedfuse inspect`` prints a checkpoint's metadata.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import NoReturn

# light modules: each imports PyTorch (and the fusion, data and model stack) only in the
# handler of a command that needs it, so parsing and the light commands stay fast
from fedfuse.cli import deploy, doctor, fuse, methods, predict, run_app, simulate, speed, status
from fedfuse.io.text import one_line

log = logging.getLogger(__name__)


def partition(args: argparse.Namespace) -> int:
    """Print (and optionally plot) the clients x classes table of a split."""
    from fedfuse.data import load_dataset
    from fedfuse.partitions import (
        class_counts,
        format_class_counts,
        partition_labels,
        plot_class_counts,
    )

    labels = load_dataset(args.dataset, "train").labels.numpy()
    options = {}
    if args.partitioner == "dirichlet":
        options = {"alpha_min": args.alpha_min, "min_max_ratio": args.min_max_ratio}
    parts = partition_labels(args.partitioner, labels, args.num_clients, seed=args.seed, **options)
    table = class_counts(labels, parts)
    print(format_class_counts(table))
    if args.plot:
        print(f"plot: {plot_class_counts(table, args.plot)}")
    return 0


def inspect_checkpoint(args: argparse.Namespace) -> int:
    """Load (and so validate) a checkpoint and print its metadata."""
    from fedfuse.io.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(args.path)
    summary = {
        "model": checkpoint.model.spec.to_dict(),
        "parameters": sum(p.numel() for p in checkpoint.model.parameters()),
        "scores": sorted(checkpoint.scores) if checkpoint.scores else None,
        **checkpoint.metadata,
    }
    print(json.dumps(summary, indent=2, default=str))
    return 0


class _OneLineErrors(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (``fedfuse fuse: error: ...``)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineErrors(prog="fedfuse", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", required=True)

    simulate.register_cli(commands)
    run_app.register_cli(commands)

    part = commands.add_parser("partition", help="show a split's clients x classes table")
    part.add_argument("--dataset", default="fashion-mnist")
    part.add_argument("--partitioner", default="sharded", choices=["iid", "dirichlet", "sharded"])
    part.add_argument("--num-clients", type=int, default=2)
    part.add_argument("--seed", type=int, default=0)
    part.add_argument("--alpha-min", type=float, default=1.0)
    part.add_argument("--min-max-ratio", type=float, default=0.2)
    part.add_argument("--plot", help="write a PNG of the table here")
    part.set_defaults(handler=partition)

    insp = commands.add_parser("inspect", help="validate a checkpoint and print its metadata")
    insp.add_argument("path")
    insp.set_defaults(handler=inspect_checkpoint)

    from fedfuse.experiments import scale

    fuse.register_cli(commands)
    methods.register_cli(commands)
    deploy.register_cli(commands)
    status.register_cli(commands)
    predict.register_cli(commands)
    doctor.register_cli(commands)
    for name, text in HYDRA_COMMANDS.items():  # parsed by Hydra, see main()
        commands.add_parser(name, help=text, add_help=False)
    commands.add_parser(
        "report",
        help="tables and plots of a compare sweep: fedfuse report <sweep dir>",
        add_help=False,
    )
    speed.register_cli(commands)
    scale.register_cli(commands)
    return parser


#: subcommands whose arguments Hydra parses (overrides, -m, --cfg job, --help)
HYDRA_COMMANDS = {
    "compare": "compare fusion methods across partition configs (a Hydra app: "
    "fedfuse compare -m partition=sharded,dirichlet sites=2,4,8 method=kf-linear,regmean)",
    "bench": "a packaged experiment preset: fedfuse bench fmnist-sharded-2 [overrides] "
    "(= fedfuse compare -m experiment=fmnist-sharded-2)",
}


def _delegate(command: str, rest: list[str]) -> int:
    """Run a subcommand that parses its own arguments (Hydra apps, the report)."""
    if command == "report":
        from fedfuse.experiments.report import document as report

        return int(report.main(rest) or 0)
    from fedfuse.experiments import compare

    if command == "bench":
        if not rest or rest[0].startswith("-") or "=" in rest[0]:
            from fedfuse.settings.hydra import available_options

            names = ", ".join(available_options("experiment"))
            print(f"usage: fedfuse bench <preset> [overrides]; presets: {names}", file=sys.stderr)
            return 2
        rest = ["-m", f"experiment={rest[0]}", *rest[1:]]
    return compare.main(rest, prog=f"fedfuse {command}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and (argv[0] in HYDRA_COMMANDS or argv[0] == "report"):
        return _delegate(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    from fedfuse.runtime import configure_logging

    configure_logging(logging.DEBUG if args.verbose else logging.INFO)
    try:
        return int(args.handler(args))
    except KeyboardInterrupt:
        print(f"fedfuse {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # every failure ends in one line; -v shows the traceback
        if args.verbose:
            log.exception("fedfuse %s failed", args.command)
        print(f"fedfuse {args.command}: error: {one_line(error)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
