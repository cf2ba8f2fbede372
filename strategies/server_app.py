"""The one-shot fusion ``ServerApp``: collect uploads once, fuse, evaluate, report.

A run writes, under ``<output-dir>/<run>/``:

* ``clients/client_<id>.safetensors``: each site's upload (weights, scores, counts, Grams),
  written the moment it arrives, so ``fedfuse fuse <run dir>`` can fuse it again later;
* ``results.json``: ``status`` (``running``; ``ok``; ``partial`` when a site was left out or a
  method failed, with the reasons in ``error``; ``failed`` with the error and the phase it
  failed in; ``stopped`` when the run was stopped: ``flwr stop``, Ctrl-C, SIGTERM), ``sites``
  (every site by name and node id, with its status: ``uploaded``, ``refused``, ``failed``,
  ``rejected`` or ``silent``, and why), the accepted uploads' facts (``clients``), the rejected
  uploads, per method its options, time, details or error, the accuracy table and the time of
  each phase; rewritten after each phase;
* ``fused.safetensors`` (the first method that succeeded) and ``fused-<method>.safetensors``,
  each written the moment its method has fused, before evaluation, and standing alone: its
  metadata names the sites, the server's data files (sha256), the method, the versions, the
  class names and the normalisation (:mod:`fedfuse.federation.provenance`);
* with ``finetune-epochs`` > 0, ``finetuned-<method>.safetensors``: each fused model fine-tuned
  after fusion, on the server's fusion set (``finetune-data="fusion-set"``) or on the sites in
  one more round (``"sites"``, :mod:`.finetune_round`). Its results are the ``finetuned`` entry
  of ``results.json``, never mixed into ``accuracy`` (the zero-shot fused models).

Before any site trains, the server checks its own files (fusion set, test set, output folder)
and sends the sites the run's data contract (input shape, classes, normalisation), which each
site checks its data against before training (:mod:`fedfuse.federation.contract`).

``<output-dir>/latest`` points at the newest run. ``flwr run`` exits 0 even when a run fails,
so check ``status`` (``fedfuse status <run dir>`` does, and so does ``fedfuse simulate``).

This module is the app's entry point: it names the run folder and turns the run's end (done,
failed, stopped) into ``status``; the run's phases are :mod:`.one_shot_run`'s.
"""

from __future__ import annotations

import logging
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedfuse import __version__
from fedfuse.io.atomic import write_json
from fedfuse.runtime import configure_logging, seed_everything
from fedfuse.settings.run import RunSettings

from .one_shot_run import OneShotRun

log = logging.getLogger(__name__)

app = ServerApp()


def _run_directory(root: Path, label: str, run_id: int) -> Path:
    """A new directory for this run under ``root``; ``root/latest`` points at it."""
    root = root.expanduser().resolve()
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    directory = root / f"{stamp}-{label}-run{run_id}"
    directory.mkdir(parents=True, exist_ok=False)
    latest = root / "latest"
    tmp_link = root / f".latest-{run_id}"
    tmp_link.unlink(missing_ok=True)
    tmp_link.symlink_to(directory.name)
    tmp_link.replace(latest)
    return directory


#: the longest method list written whole into a run directory's name (a name's limit is 255)
LABEL_CHARACTERS = 80


def _label(names: list[str]) -> str:
    """The methods' part of the run directory's name: all of them, or the first and a count."""
    label = "+".join(names)
    return label if len(label) <= LABEL_CHARACTERS else f"{names[0]}+{len(names) - 1}-more"


def _shortfalls(report: dict[str, Any]) -> list[str]:
    """What keeps a finished run from being ``ok``: each site left out (by name, with its
    status and reason), each failed fusion method and fine-tuning."""
    problems = [
        f"site {site.get('site') or site.get('node_id')} {site['status']}: {site['reason']}"
        for site in report.get("sites", [])
        if site["status"] != "uploaded"
    ]
    problems += [
        f"{name}: {f.get('error')}"
        for name, f in report.get("fusions", {}).items()
        if f["status"] != "ok"
    ]
    problems += [
        f"{f['label']}: {f.get('error')}"
        for f in report.get("finetuned", {}).values()
        if f["status"] != "ok"
    ]
    return problems


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Entry point of ``flwr run``: one-shot fusion with the run's methods (key ``strategy``)."""
    started = time.monotonic()
    configure_logging()
    report: dict[str, Any] = {
        "status": "running",
        "fedfuse_version": __version__,
        "started_at": datetime.now(UTC).isoformat(),
        "run_id": grid.run.run_id,
    }
    # Settings and methods are checked before the run directory is named after them.
    try:
        settings = RunSettings.from_config(context.run_config)
        methods = settings.fusion_methods()
        root, label = Path(settings.output_dir), _label([m.name for m in methods])
    except Exception as error:
        root, label = Path(str(context.run_config.get("output-dir", "outputs"))), "invalid-config"
        out = _run_directory(root, label, grid.run.run_id)
        _fail(report, error, out, started)
        raise
    # no limit_threads here: `threads` caps each site's process; the server fuses and evaluates
    # with every core once the sites are done
    seed_everything(settings.seed)
    out = _run_directory(root, label, grid.run.run_id)
    report.update(
        strategy=settings.methods,
        fusion_options=settings.fusion_options,
        init=settings.init,
        settings=settings.to_config(),
    )
    log.info("fedfuse one-shot run %s: writing to %s", grid.run.run_id, out)
    run = OneShotRun(settings, methods, out)
    run.report = report
    try:
        run.run(grid)
    except Exception as error:
        _fail(report, error, out, started, run)
        raise
    except (KeyboardInterrupt, SystemExit):
        # `flwr stop`, Ctrl-C and SIGTERM reach a ServerApp as one of these (Flower's signal
        # handler exits); what was saved stays, and the report says the run was stopped
        report.update(
            status="stopped",
            error=f"the run was stopped during phase {run.phase!r}",
            wall_seconds=time.monotonic() - started,
        )
        log.error("the run was stopped (phase %s); results so far in %s", run.phase, out)
        run.save()
        raise
    shortfalls = _shortfalls(report)
    report["status"] = "partial" if shortfalls else "ok"
    if shortfalls:
        report["error"] = "; ".join(shortfalls)
        for problem in shortfalls:
            log.warning("not ok: %s", problem)
    report["wall_seconds"] = time.monotonic() - started
    run.save()
    log.info("results written to %s", out / "results.json")


def _fail(
    report: dict[str, Any],
    error: Exception,
    out: Path,
    started: float,
    run: OneShotRun | None = None,
) -> None:
    report.update(
        status="failed",
        error=f"{type(error).__name__}: {error}",
        traceback=traceback.format_exc(),
        wall_seconds=time.monotonic() - started,
    )
    if run is not None:
        report["failed_phase"] = run.phase
        saved = [f["checkpoint"] for f in report.get("fusions", {}).values() if "checkpoint" in f]
        if saved:
            report["saved_checkpoints"] = saved
    log.error("one-shot fusion failed: %s", error)
    if run is not None:
        run.save()
    else:
        write_json(out / "results.json", report)
