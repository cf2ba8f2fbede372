"""``fedfuse run-app``: any Flower app as a local simulation that exits non-zero when it failed.

``flwr run`` exits 0 even when the ServerApp raised (the run is only marked ``failed`` on the
SuperLink). This command runs ``flwr run <app> --stream``, reads the run's final status from the
SuperLink, stops the local SuperLink it started, and exits 1 unless the run completed.
"""

from __future__ import annotations

import argparse
import sys


def run_app(args: argparse.Namespace) -> int:
    """Run the app; 0 when its run completed, 1 when it failed, 124 past ``--timeout``."""
    from fedfuse.federation.simulation import run_flower_app

    if args.num_supernodes < 1 or args.cpus_per_client < 1:
        raise ValueError("--num-supernodes and --cpus-per-client must be at least 1")
    run = run_flower_app(
        args.app,
        num_supernodes=args.num_supernodes,
        run_config=args.run_config,
        cpus_per_client=args.cpus_per_client,
        timeout=args.timeout,
        ray_address=args.ray_address,
    )
    if run.ok:
        print(f"fedfuse run-app: run {run.run_id} completed", file=sys.stderr)
        return 0
    if run.returncode == 124:
        print(f"fedfuse run-app: FAILED: no end within {args.timeout:.0f} s", file=sys.stderr)
        return 124
    print(
        f"fedfuse run-app: FAILED: run {run.run_id or '(not started)'} ended with status "
        f"{run.status or 'unknown'} (flwr exit {run.returncode}); the ServerApp's error is in "
        "the log above",
        file=sys.stderr,
    )
    return 1


def register_cli(commands: argparse._SubParsersAction) -> None:
    """Add ``fedfuse run-app`` to the command line."""
    parser = commands.add_parser(
        "run-app",
        help="run any Flower app as a local simulation; exit non-zero when it failed",
    )
    parser.add_argument("app", nargs="?", default=".", help="the app's folder (pyproject.toml)")
    parser.add_argument("--num-supernodes", type=int, default=2, help="simulated sites")
    parser.add_argument("--cpus-per-client", type=int, default=1)
    parser.add_argument("--run-config", default="", help='flwr run\'s "key=value ..." overrides')
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds")
    parser.add_argument(
        "--ray-address",
        default=None,
        help="the Ray cluster's head host:port (default: $RAY_ADDRESS; neither: a local Ray)",
    )
    parser.set_defaults(handler=run_app)
