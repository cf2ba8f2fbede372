"""A local Flower simulation launched as a subprocess (``fedfuse simulate``), for experiments.

A simulation owns its process tree (Ray, the local SuperLink), so sweeps and benchmarks run
each one as its own process and read its result file.
"""

from __future__ import annotations

import sys
from pathlib import Path


def simulate_command(
    *,
    sites: int,
    output_dir: str | Path,
    run_config: str,
    cpus_per_client: int = 1,
    timeout: float = 3600.0,
) -> list[str]:
    """The ``fedfuse simulate`` command line, run in this interpreter, that experiments launch
    as a subprocess."""
    return [
        sys.executable,
        "-m",
        "fedfuse.cli.main",
        "simulate",
        "--num-clients",
        str(sites),
        "--cpus-per-client",
        str(cpus_per_client),
        "--timeout",
        str(timeout),
        "--output-dir",
        str(output_dir),
        "--run-config",
        run_config,
    ]
