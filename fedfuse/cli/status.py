"""``fedfuse status``: a run's outcome in a few lines, and an exit code a script can test.

``flwr run`` exits 0 even when the run failed, and ``flwr supernode ls`` shows sites by node id
only. This command reads the run's ``results.json`` and prints its status, every site by name
with its node id and what became of it, and the fused checkpoints; it exits 0 only for ``ok``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from fedfuse.io.jsontext import MAX_JSON_BYTES, read_json_file
from fedfuse.io.text import terminal_safe

#: exit code of each run status (a script tests ``fedfuse status`` like any command)
EXIT_CODES = {"ok": 0, "partial": 3, "running": 4, "stopped": 5, "failed": 1}


def results_file(path: str | Path) -> Path:
    """The ``results.json`` of a run folder, of an output folder's newest run, or as given."""
    path = Path(path).expanduser()
    for candidate in (path, path / "results.json", path / "latest" / "results.json"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{path}: no results.json here (give a run folder or an output folder)")


#: the largest results.json read (a 100-site run writes well under 1 MiB; the JSON parse of
#: a file this size stays under half a GB whatever it holds, :mod:`fedfuse.io.jsontext`)
MAX_RESULTS_BYTES = MAX_JSON_BYTES


def describe(report: dict[str, Any]) -> list[str]:
    """The lines ``fedfuse status`` prints for a run's report, its sites in partition order
    (every field from the file shown with its control characters escaped,
    :func:`~fedfuse.io.text.terminal_safe`).

    Raises:
        ValueError: a field is not of the shape a fedfuse run writes (names the field).
    """
    status = str(report.get("status", "unknown"))
    lines = [status]
    if report.get("error"):
        phase = f" (phase {report['failed_phase']})" if report.get("failed_phase") else ""
        lines.append(f"  why{phase}: {report['error']}")
    sites = _list_of_objects(report, "sites")
    for index, site in enumerate(sites):
        if "status" not in site:
            raise ValueError(f"sites[{index}] has no 'status'")
    for site in sorted(sites, key=_partition_order):
        name = site.get("site") or (
            f"client {site['partition_id']}" if site.get("partition_id") is not None else "?"
        )
        line = f"  site {name!s:<16} node {site.get('node_id')}  {site['status']}"
        if site["status"] == "uploaded":
            line += f" ({site.get('num_examples')} samples)"
        else:
            line += f": {site.get('reason', '')}"
        lines.append(line)
    fusions = report.get("fusions", {})
    if not isinstance(fusions, dict) or not all(isinstance(f, dict) for f in fusions.values()):
        raise ValueError("'fusions' is not an object of method objects")
    for name, fusion in fusions.items():
        if fusion.get("checkpoint"):
            lines.append(f"  fused {name}: {fusion['checkpoint']}")
        elif fusion.get("status") == "failed":
            lines.append(f"  fused {name}: FAILED: {fusion.get('error')}")
    return [terminal_safe(line) for line in lines]


def _partition_order(site: dict[str, Any]) -> float:
    """Where a site is listed: by partition id (a run lists them as they answered), a site
    without one last."""
    partition = site.get("partition_id")
    valid = isinstance(partition, int) and not isinstance(partition, bool)
    return float(partition) if valid else float("inf")


def _list_of_objects(report: dict[str, Any], key: str) -> list[dict[str, Any]]:
    entries = report.get(key, [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"{key!r} is not a list of objects")
    return entries


def status_command(args: argparse.Namespace) -> int:
    path = results_file(args.run)
    report = read_json_file(path, what="run's results", max_bytes=MAX_RESULTS_BYTES)
    if not isinstance(report, dict):
        raise ValueError(f"{path}: not a results file (no JSON object)")
    try:
        lines = describe(report)
    except ValueError as error:
        raise ValueError(f"{path}: not a results file of a fedfuse run: {error}") from None
    if args.json:
        print(json.dumps({k: report.get(k) for k in ("status", "error", "sites")}, indent=2))
    else:
        print("\n".join(lines))
    return EXIT_CODES.get(str(report.get("status")), 1)


def register_cli(commands: Any) -> None:
    parser = commands.add_parser(
        "status",
        help="a run's status, its sites by name and its fused models (exit 0 only when ok)",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument(
        "run",
        nargs="?",
        default="outputs",
        help="a run folder, an output folder (its newest run) or a results.json (default: outputs)",
    )
    parser.add_argument("--json", action="store_true", help="status, error and sites as JSON")
    parser.set_defaults(handler=status_command)
