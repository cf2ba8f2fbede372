"""``fedfuse simulate``: the Flower app run as a local simulation (``flwr run``).

Unlike ``flwr run``, it checks the run config and every listed method before Flower starts,
stops the local SuperLink it started, and exits non-zero when the run or a method failed.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fedfuse.federation.flower_state import (
    failure_reason,
    local_superlink_dir,
    read_from,
    stop_process_tree,
    superlink_pids,
    superlink_startup_error,
)
from fedfuse.federation.ray_cluster import ray_environment, requested_address
from fedfuse.federation.simulation import flower_environment
from fedfuse.settings.bounds import Range

log = logging.getLogger(__name__)

#: a duration on the command line (``--timeout``): positive seconds, at most about 4 months
SECONDS = Range(0, 10**7, integer=False, open_low=True)


def _tee(stream, sink, tail: collections.deque) -> threading.Thread:
    """Copy ``stream``'s lines to ``sink`` as they come, keeping the last ones in ``tail``."""

    def copy() -> None:
        for line in stream:
            tail.append(line)
            sink.write(line)
            sink.flush()

    thread = threading.Thread(target=copy, daemon=True)
    thread.start()
    return thread


def _find_app(app: str | None) -> Path:
    candidates = [Path(app)] if app else [Path.cwd(), Path(__file__).resolve().parents[2]]
    for candidate in candidates:
        pyproject = candidate / "pyproject.toml"
        if pyproject.is_file() and "[tool.flwr.app]" in pyproject.read_text():
            return candidate.resolve()
    raise SystemExit(
        f"fedfuse simulate: no Flower app (pyproject.toml with [tool.flwr.app]) in "
        f"{', '.join(str(c) for c in candidates)}; run it from a fedfuse checkout or pass --app"
    )


def _run_finished(results: Path, started: datetime) -> bool:
    """Whether this run's ServerApp wrote its final ``results.json`` (not an earlier run's)."""
    try:
        report = json.loads(results.read_text())
        begun = datetime.fromisoformat(report.get("started_at", "1970-01-01T00:00:00+00:00"))
    except (OSError, ValueError, AttributeError):
        return False
    return begun >= started and report.get("status") in ("ok", "partial", "failed", "stopped")


def parse_run_config(text: str) -> dict[str, Any]:
    """``--run-config``'s ``key=value`` pairs (TOML values), as Flower parses them; a
    ValueError quoting the text (escaped) when they do not parse (Flower's own error names
    neither the text nor the key)."""
    from click import ClickException
    from flwr.common.config import parse_config_args

    if not text.strip():
        return {}
    try:
        return parse_config_args([text])
    except ClickException as error:
        raise ValueError(f"--run-config {text!r:.300}: {error.message}") from None


def simulation_run_config(
    overrides: str,
    output_dir: Path | None,
    num_clients: int,
    cpus_per_client: int = 1,
    app_keys: Iterable[str] | None = None,
    workers: int | None = None,
) -> dict[str, Any]:
    """The run config overrides of a simulation: the user's, plus the output directory
    (``output_dir``, else the run config's ``output-dir``, else ``outputs``; both given and
    different is a ValueError) and, unless given, ``min-nodes`` (wait for every simulated
    site) and ``max-in-flight`` (four train messages per Ray worker at a time; ``workers``
    sites run at once, by default as many as this machine's cores hold), each only where the
    app declares that key."""
    config = parse_run_config(overrides)
    keys = None if app_keys is None else set(app_keys)
    # a few messages per Ray worker at a time: Flower's simulation engine rescans every waiting
    # message for every node ten times a second, which at 1000 sites starves the workers
    if workers is None:
        workers = max(1, (os.cpu_count() or 1) // max(cpus_per_client, 1))
    for key, value in (("min-nodes", num_clients), ("max-in-flight", 4 * workers)):
        if keys is None or key in keys:
            config.setdefault(key, value)
    given = config.get("output-dir")
    if output_dir is None:
        output_dir = Path(str(given or "outputs"))
    elif given is not None and Path(str(given)).expanduser().resolve() != output_dir.resolve():
        raise ValueError(
            f"--output-dir {output_dir} and run config output-dir={given!r} differ; give one"
        )
    config["output-dir"] = str(output_dir.expanduser().resolve())
    return config


def _app_config_keys(app: Path) -> list[str]:
    """The run config keys the Flower app at ``app`` declares."""
    import tomllib

    with open(app / "pyproject.toml", "rb") as handle:
        project = tomllib.load(handle)
    return list(project.get("tool", {}).get("flwr", {}).get("app", {}).get("config", {}))


def _toml_assignments(config: dict[str, Any]) -> str:
    """``key=value ...`` as ``flwr run --run-config`` parses it (TOML values)."""

    def value(v: Any) -> str:
        return ("true" if v else "false") if isinstance(v, bool) else json.dumps(v)

    return " ".join(f"{key}={value(v)}" for key, v in config.items())


def _wait_for_run(
    process: subprocess.Popen, results: Path, started: datetime, timeout: float, grace: float
) -> int:
    """``flwr run``'s exit code; 124 past ``timeout``. Once the ServerApp wrote its final result
    file, Flower may still wait on a site that never returns (a hung ClientApp): after ``grace``
    seconds the run counts as done and that wait is cut short."""
    deadline = time.monotonic() + timeout
    finished_at: float | None = None
    while (code := process.poll()) is None:
        now = time.monotonic()
        if now > deadline:
            log.error("the run did not finish within %s s", timeout)
            return 124
        if finished_at is None and _run_finished(results, started):
            finished_at = now
        if finished_at is not None and now - finished_at > grace:
            log.warning(
                "the run finished %.0f s ago but Flower still waits on a site that has not "
                "returned; stopping the simulation",
                now - finished_at,
            )
            return 0
        time.sleep(0.5)
    return code


def settle_unfinished(
    results: Path, report: dict[str, Any], returncode: int, reasons: list[str]
) -> dict[str, Any]:
    """The report of a run whose ServerApp ended without finishing it (killed, out of memory,
    a crash below Python), which still reads ``running``: marked ``failed`` with what Flower
    logged, and written back, so that ``fedfuse status`` does not wait on a dead run."""
    from fedfuse.io.atomic import write_json

    said = reasons[-1] if reasons else "Flower logged no reason"
    report = {
        **report,
        "status": "failed",
        "error": f"the ServerApp ended without finishing the run (flwr exit {returncode}): {said}",
    }
    write_json(results.resolve(), report)
    return report


def check_simulation(config: dict[str, Any], num_clients: int) -> None:
    """Fail fast, before Flower starts: the run config must parse (no unknown keys, every value
    in range), the server's data files must exist, the data must split into ``num_clients``
    sites and give the fusion set, every listed fusion method must be able to fuse
    ``num_clients`` sites of the run's architecture, and requested fused widths must fit the
    sites' model and the size limit."""
    from fedfuse.data import DatasetNotFoundError
    from fedfuse.data.arrays import check_npz_headers
    from fedfuse.federation.provenance import DATA_FILE_KEYS
    from fedfuse.federation.scenario import Scenario
    from fedfuse.settings.run import RunSettings

    # RunSettings' defaults are the app's (a test keeps them identical): parse the overrides
    settings = RunSettings.from_config(config)
    methods = settings.fusion_methods()
    # the server's own files, here rather than in the ServerApp, 30-40 s of Flower later
    for key in DATA_FILE_KEYS:
        path = str(settings.to_config().get(key) or "")
        if path and not Path(path).expanduser().is_file():
            raise FileNotFoundError(f"run config {key}='{path}': no such file")
        if path:  # its headers, labels and classes (a forged test set failed inside Flower)
            check_npz_headers(Path(path).expanduser())
    try:  # the sites' spec needs the data's shape (and the server's data, which it checks)
        scenario = Scenario(settings, num_clients)
        spec = scenario.model_spec()
        # the split and the fusion set the ServerApp builds once Flower is up (a sharded split
        # holds at most one site per class)
        if settings.fusion_data or settings.synthetic_fusion_set:
            scenario.partitions  # noqa: B018 - computed for its check
        else:
            scenario.fusion_set()
    except (DatasetNotFoundError, FileNotFoundError):
        if settings.fused_widths.strip():
            raise
        spec = None  # the ServerApp names the missing data itself
    target = settings.fused_spec(spec) if spec is not None else None
    problems = []
    for method in methods:
        try:
            method.check_run(num_clients, spec, target=target)
        except ValueError as error:
            problems.append(str(error))
    if problems:
        raise ValueError("; ".join(problems))


def _run_config_from_overrides(overrides: list[str], extra: str) -> tuple[str, int]:
    """The run config that Hydra ``overrides`` describe, plus the Flower-only ``extra`` keys
    (a key set on both sides is an error), and the number of sites (``sites=``)."""
    from fedfuse.settings.hydra import (
        FLOWER_ONLY_KEYS,
        compose,
        settings_from_config,
        validate_overrides,
    )

    # an unknown key or option in one line naming the closest, as `fedfuse compare` says it
    cfg = compose(validate_overrides(overrides))
    settings = settings_from_config(cfg)
    from_hydra = {k: v for k, v in settings.to_config().items() if k not in FLOWER_ONLY_KEYS}
    given = parse_run_config(extra)
    both = sorted(set(given) & set(from_hydra))
    if both:
        raise ValueError(
            f"run config key(s) {both} are set by the Hydra overrides too; set them one way "
            "(--run-config is for Flower-only keys: " + ", ".join(FLOWER_ONLY_KEYS) + ")"
        )
    return _toml_assignments({**from_hydra, **given}), int(cfg.sites)


def simulate(args: argparse.Namespace) -> int:
    """Run the app as a local simulation and report its result file's status."""
    if not args.overrides:
        args.num_clients = args.num_clients or 2
    app = _find_app(args.app)
    ray_env, workers = ray_environment(
        requested_address(args.ray_address), args.cpus_per_client, args.gpus_per_client
    )
    run_config = args.run_config
    if args.overrides:
        run_config, sites = _run_config_from_overrides(args.overrides, args.run_config)
        args.num_clients = args.num_clients or sites
    config = simulation_run_config(
        run_config,
        None if args.output_dir is None else Path(args.output_dir),
        args.num_clients,
        args.cpus_per_client,
        _app_config_keys(app),
        workers,
    )
    output_dir = Path(config["output-dir"])
    check_simulation(config, args.num_clients)
    run_config = _toml_assignments(config)
    # only once the run config is known to be good; its FLWR_HOME holds the local SuperLink
    env, flwr = flower_environment()
    env.update(ray_env)
    superlink_dir = local_superlink_dir(Path(env["FLWR_HOME"]))
    superlink_log = superlink_dir / "superlink.log"
    log_offset = superlink_log.stat().st_size if superlink_log.is_file() else 0
    control_port = env.get("FLWR_LOCAL_CONTROL_API_PORT", "39093")
    running_before = set(superlink_pids(control_port))
    if running_before and workers is not None:
        log.warning(
            "a local SuperLink is already running (pid %s); its simulation keeps the Ray it "
            "started with, not the cluster at %s: stop it first",
            sorted(running_before),
            env["RAY_ADDRESS"],
        )
    started = datetime.now(UTC)
    federation = (
        f"num-supernodes={args.num_clients} client-resources-num-cpus={args.cpus_per_client} "
        f"client-resources-num-gpus={args.gpus_per_client}"
    )
    command = [
        flwr,
        "run",
        str(app),
        "--stream",
        "--federation-config",
        federation,
        "--run-config",
        run_config,
    ]
    log.info("running: %s", shlex.join(command))
    results = output_dir / "latest" / "results.json"
    # a SIGTERM (a scheduler, a benchmark's timeout) still stops the SuperLink below
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    output: collections.deque[str] = collections.deque(maxlen=500)
    copying = _tee(process.stdout, sys.stdout, output)
    try:
        returncode = _wait_for_run(process, results, started, args.timeout, args.grace)
    finally:
        if process.poll() is None:
            stop_process_tree([process.pid])
        if not args.keep_superlink:
            stop_process_tree(sorted(set(superlink_pids(control_port)) - running_before))
        copying.join(timeout=5)

    if not results.is_file():
        print(
            f"fedfuse simulate: FAILED: no result file at {results} (flwr exit {returncode})",
            file=sys.stderr,
        )
        reasons = failure_reason("".join(output) + "\n" + read_from(superlink_log, log_offset))
        if any("Failed to start local SuperLink" in reason for reason in reasons[-1:]):
            reasons = reasons[-1:] + superlink_startup_error(env, superlink_dir / "state.db")
        for reason in reasons[-4:]:
            print(f"  Flower: {reason}", file=sys.stderr)
        if not reasons:
            print(f"  Flower logged no reason; see {superlink_log}", file=sys.stderr)
        return 1
    report = json.loads(results.read_text())
    if datetime.fromisoformat(report.get("started_at", "1970-01-01T00:00:00+00:00")) < started:
        print(
            f"fedfuse simulate: FAILED: {results} is from an earlier run; this run wrote nothing",
            file=sys.stderr,
        )
        return 1
    if report.get("status") == "running":  # the ServerApp died before it could say so
        reasons = failure_reason("".join(output) + "\n" + read_from(superlink_log, log_offset))
        report = settle_unfinished(results, report, returncode, reasons)
    status = report.get("status")
    if status not in ("ok", "partial"):
        print(f"fedfuse simulate: FAILED: {report.get('error', 'unknown error')}", file=sys.stderr)
        print(f"details: {results}", file=sys.stderr)
        return 1
    fusions = report["fusions"]
    print()
    print(
        f"one-shot fusion with {report['strategy']!r}, init={report['init']!r}, "
        f"{len(report['clients'])} clients, fusion "
        + ", ".join(
            f"{name} {f['seconds']:.2f} s"
            for name, f in fusions.items()
            if f["status"] in ("ok", "partial")
        )
        + f", run {report['wall_seconds']:.0f} s"
    )
    from fedfuse.federation.evaluation import format_run_summary

    print(format_run_summary(report))
    on_nodes = collections.Counter(site.get("ray_node") for site in report.get("sites", []))
    on_nodes.pop(None, None)
    if workers is not None and on_nodes:
        print(
            f"sites ran on {len(on_nodes)} Ray node(s): "
            + ", ".join(f"{node[:12]}… {count}" for node, count in on_nodes.most_common())
        )
    finetuned = report.get("finetuned", {})
    if finetuned:
        print("fine-tuned after fusion (not zero-shot):")
        for entry in finetuned.values():
            if entry["status"] == "ok":
                scores = entry["accuracy"]
                print(
                    f"  {entry['label']}: {scores['accuracy'] * 100:.2f}% "
                    f"(loss {scores['loss']:.3f}, {entry['seconds']:.1f} s)"
                )
            for problem in entry.get("problems", []):
                print(f"  problem: {problem}")
    for problem in report.get("rejected", []):
        print(f"rejected: {problem}")
    print(f"results: {results.parent.resolve()}")
    if status == "partial":
        for name, fusion in fusions.items():
            if fusion["status"] != "ok":
                outcome = fusion["status"].upper()
                print(f"fedfuse simulate: {name} {outcome}: {fusion.get('error')}", file=sys.stderr)
        for entry in finetuned.values():
            if entry["status"] != "ok":
                print(
                    f"fedfuse simulate: {entry['label']} FAILED: {entry.get('error')}",
                    file=sys.stderr,
                )
        return 1
    return 0


def register_cli(commands: argparse._SubParsersAction) -> None:
    """Add ``fedfuse simulate`` to the command line."""
    sim = commands.add_parser("simulate", help="run the Flower app as a local simulation")
    sim.add_argument("--app", help="Flower app directory (default: this checkout)")
    sim.add_argument(
        "overrides",
        nargs="*",
        help="Hydra overrides of configs/compare.yaml (e.g. partition=dirichlet sites=4 "
        "method=regmean); they set the run config, --run-config adds Flower-only keys",
    )
    sim.add_argument(
        "--num-clients",
        type=Range(2, 100_000).argument("--num-clients"),
        help="sites (default: sites= or 2)",
    )
    sim.add_argument(
        "--cpus-per-client",
        type=Range(1, 1_024).argument("--cpus-per-client"),
        default=1,
        help="CPU cores per site",
    )
    sim.add_argument(
        "--gpus-per-client",
        type=Range(0, 64, integer=False).argument("--gpus-per-client"),
        default=0.0,
        help="GPU share per site (e.g. 0.25: four sites per GPU); needs CUDA and device=auto/cuda",
    )
    sim.add_argument(
        "--ray-address",
        default=None,
        help="run the sites on the Ray cluster whose head is at host:port (default: "
        "$RAY_ADDRESS; neither: a Ray of its own on this machine); see docs/cluster.md",
    )
    sim.add_argument("--output-dir", default=None, help="where run folders go (default: outputs)")
    sim.add_argument("--run-config", default="", help='extra run config, "key=value ..."')
    sim.add_argument(
        "--timeout",
        type=SECONDS.argument("--timeout"),
        default=3600.0,
        help="seconds for the whole run",
    )
    sim.add_argument(
        "--grace",
        type=Range(0, 10**7, integer=False).argument("--grace"),
        default=20.0,
        help="seconds Flower may go on after the run wrote its results (e.g. waiting on a hung "
        "site) before the simulation is stopped",
    )
    sim.add_argument(
        "--keep-superlink",
        action="store_true",
        help="leave the local SuperLink that this command started running",
    )
    sim.set_defaults(handler=simulate)
