"""``fedfuse compare``: a Hydra app that compares fusion methods across partition configs.

One job = one composed config (``configs/compare.yaml`` plus overrides): the site set it names
is trained once (:mod:`fedfuse.site_cache`), fused by the job's method, evaluated, and written
as one JSON row under ``<output_dir>/<sweep>/rows/``. Sweep with Hydra's ``-m``::

    fedfuse compare -m partition=sharded,dirichlet sites=2,4,8 method=kf-linear,regmean seed=0,1,2

Rerunning the same command resumes: a job whose row is already ``ok`` is skipped, a site set
already trained (even partly) is loaded. ``runner=library`` runs in this process;
``runner=flower`` runs each job as a real ``fedfuse simulate`` (``flwr run``) whose sites read
the same site-set cache. ``fedfuse report <sweep dir>`` turns the rows into tables and plots.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shlex
import subprocess
import sys
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from ..checkpoint import save_checkpoint
from ..config import NON_RESULT_OPTIONS, method_from_config, method_label, settings_from_config
from ..fusion import FusionInputs, FusionMethod
from ..fusion.site_statistics import LocalSites, statistics_round_bytes
from ..report import evaluate_fusion, write_json
from ..scenario import RunSettings, Scenario
from ..site_cache import SiteCache, site_set_key

log = logging.getLogger("fedfuse.experiments.compare")

ROW_FORMAT = "fedfuse-compare-row/1"
#: run-config keys that pick the data a fusion set or test set is drawn from
_ROW_FIELDS = ("score_method", "fusion_samples", "fusion_source", "fusion_data", "test_samples")


def row_id(settings: RunSettings, sites: int, method: FusionMethod, runner: str) -> str:
    """A stable digest of everything that determines a row (site set, scores, fusion and test
    sets, the method and its result-changing options, the runner)."""
    options = {k: v for k, v in method.options().items() if k not in NON_RESULT_OPTIONS}
    preimage = {
        "site_set": site_set_key(settings, sites),
        **{name: getattr(settings, name) for name in _ROW_FIELDS},
        "method": method.name,
        "options": options,
        "runner": runner,
    }
    digest = hashlib.sha256(json.dumps(preimage, sort_keys=True, default=str).encode())
    return f"{method.name}-{digest.hexdigest()[:12]}"


class Job:
    """One job of a sweep: its settings, method, and where its row and caches live."""

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.sites = int(cfg.sites)
        if self.sites < 2:
            raise ValueError(f"sites must be at least 2, got {self.sites}")
        self.method = method_from_config(cfg.method)
        self.runner = str(cfg.runner.name)
        self.sweep_dir = Path(str(cfg.output_dir)).expanduser().resolve() / str(cfg.sweep)
        cache_dir = str(cfg.cache_dir) or str(Path(str(cfg.output_dir)) / "site-sets")
        self.cache = SiteCache(cache_dir)
        settings = settings_from_config(cfg)
        self.settings = replace(settings, site_cache=str(self.cache.root))
        self.id = row_id(self.settings, self.sites, self.method, self.runner)
        self.row_path = self.sweep_dir / "rows" / f"{self.id}.json"
        self.site_set_dir = self.cache.directory(self.settings, self.sites)

    def done(self) -> bool:
        """Whether this job's row exists and succeeded (a rerun skips it)."""
        try:
            return json.loads(self.row_path.read_text()).get("status") == "ok"
        except (OSError, json.JSONDecodeError):
            return False

    def base_row(self) -> dict[str, Any]:
        s = self.settings
        return {
            "format": ROW_FORMAT,
            "row_id": self.id,
            "status": "running",
            "error": None,
            "experiment": str(self.cfg.name),
            "dataset": s.dataset,
            "model": s.model,
            "partition": s.partitioner,
            "sites": self.sites,
            "seed": s.seed,
            "scores": s.score_method,
            "method": self.method.name,
            "label": method_label(self.method),
            "kind": self.method.kind,
            "options": self.method.options(),
            "runner": self.runner,
            "site_set_dir": str(self.site_set_dir),
            "fused_checkpoint": None,
            "settings": {k: v for k, v in s.to_config().items() if k != "site-cache"},
        }


def run_job(cfg: DictConfig) -> dict[str, Any]:
    """Run (or skip, when already done) the job ``cfg`` describes; returns its row.

    Config errors (unknown keys, bad options) raise. A method that cannot fuse this
    configuration, or that fails, gives a ``failed`` row naming the error, and the sweep goes on.
    """
    job = Job(cfg)
    if job.done():
        log.info("%s: already done (%s), skipped", job.id, job.row_path)
        return json.loads(job.row_path.read_text())
    row = job.base_row()
    started = time.perf_counter()
    try:
        scenario = Scenario(job.settings, job.sites)
        job.method.check_run(job.sites, scenario.model_spec())
        runner = _run_library if job.runner == "library" else _run_flower
        row.update(runner(job, scenario))
        row["status"] = "ok"
    except Exception as error:  # a failed job is a row, the sweep goes on
        log.exception("%s failed", job.id)
        row.update(status="failed", error=f"{type(error).__name__}: {error}")
    row["seconds"] = time.perf_counter() - started
    row["finished_at"] = datetime.now(UTC).isoformat(timespec="seconds")
    write_json(job.row_path, row)
    log.info(
        "%s: %s %s",
        job.id,
        row["status"],
        f"accuracy {row['accuracy']:.4f}" if row.get("accuracy") is not None else row["error"],
    )
    return row


# ----------------------------------------------------------------------------- library runner
def _run_library(job: Job, scenario: Scenario) -> dict[str, Any]:
    """Train (or load) the sites in-process, fuse with the job's method, evaluate."""
    from ..clients.site import train_site  # the sites' own code path, as the ClientApp runs it

    settings = replace(job.settings, strategy=job.method.name)
    threads = torch.get_num_threads()
    try:
        uploads = [
            train_site(settings, pid, job.sites)
            for pid in tqdm(range(job.sites), desc=f"sites ({job.id})", disable=None)
        ]
    finally:
        torch.set_num_threads(threads)  # train_site caps threads as a Flower client would
    models = [upload.model for upload in uploads]
    needs = job.method.needs() if hasattr(job.method, "needs") else None
    fusion_set = scenario.fusion_set() if needs is None or needs & {"data", "labels"} else None
    available = {
        "data": fusion_set.inputs() if fusion_set is not None else None,
        "labels": fusion_set.labels if fusion_set is not None else None,
        "scores": [u.scores for u in uploads],
        "sample_counts": [u.num_examples for u in uploads],
        "class_counts": [u.class_counts for u in uploads],
        "grams": [u.grams for u in uploads] if all(u.grams for u in uploads) else None,
    }
    if needs is None or "sites" in needs:  # statistics rounds answered in-process
        site_inputs = [scenario.client_data(pid).inputs() for pid in range(job.sites)]
        available["sites"] = LocalSites(models, site_inputs, device=settings.device)
    inputs = FusionInputs(**{k: v for k, v in available.items() if needs is None or k in needs})
    result = job.method.fuse(models, inputs)
    evaluation = _site_set_evaluation(job, scenario, models, uploads)
    fused = evaluate_fusion([result.model], None, scenario.test_set, device=settings.device)
    row = _evaluation_fields(evaluation)
    row.update(
        accuracy=fused["base"][0]["accuracy"],
        loss=fused["base"][0]["loss"],
        fusion_seconds=result.seconds,
        upload_bytes_per_site=[u.payload_bytes() for u in uploads],
        round_upload_bytes=statistics_round_bytes(result.details, job.sites),
        details=_json_safe(result.details),
    )
    if job.cfg.save_models:
        path = job.sweep_dir / "fused" / f"{job.id}.safetensors"
        save_checkpoint(
            path, result.model, metadata={"row_id": job.id, "label": method_label(job.method)}
        )
        row["fused_checkpoint"] = str(path.relative_to(job.sweep_dir))
    return row


def _site_set_evaluation(job: Job, scenario: Scenario, models, uploads) -> dict[str, Any]:
    """The base models' and ensemble's test results, computed once per site set and test set."""
    description = job.site_set_dir / "site_set.json"
    document = json.loads(description.read_text()) if description.is_file() else {}
    key = f"test_samples={job.settings.test_samples}"
    evaluations = document.setdefault("evaluations", {})
    if key not in evaluations:
        evaluations[key] = evaluate_fusion(
            models, None, scenario.test_set, device=job.settings.device
        )
    document.update(
        class_counts=[u.class_counts for u in uploads],
        num_examples=[u.num_examples for u in uploads],
        evaluation=evaluations[key],
        upload_bytes=[u.payload_bytes() for u in uploads],
    )
    write_json(description, document)
    return evaluations[key]


def _evaluation_fields(evaluation: dict[str, Any]) -> dict[str, Any]:
    return {
        "base_accuracies": [r["accuracy"] for r in evaluation["base"]],
        "base_mean_accuracy": evaluation["base_mean_accuracy"],
        "ensemble_accuracy": evaluation["ensemble"]["accuracy"],
        "ensemble_loss": evaluation["ensemble"]["loss"],
        "test_examples": evaluation["test_examples"],
    }


def _json_safe(value: Any) -> Any:
    return json.loads(
        json.dumps(value, default=lambda v: v.tolist() if hasattr(v, "tolist") else str(v))
    )


# ------------------------------------------------------------------------------ flower runner
def _run_flower(job: Job, scenario: Scenario) -> dict[str, Any]:
    """Run the job as a real ``fedfuse simulate`` (``flwr run``) and read its results file."""
    del scenario
    out = job.sweep_dir / "flower" / job.id
    config = {
        k: v for k, v in job.settings.to_config().items() if k not in ("output-dir", "min-nodes")
    }
    assignments = " ".join(f"{k}={json.dumps(v)}" for k, v in config.items())
    command = [
        sys.executable,
        "-m",
        "fedfuse.cli",
        "simulate",
        "--num-clients",
        str(job.sites),
        "--cpus-per-client",
        str(job.cfg.runner.cpus_per_client),
        "--timeout",
        str(job.cfg.runner.timeout),
        "--output-dir",
        str(out),
        "--run-config",
        assignments,
    ]
    log.info("%s: %s", job.id, shlex.join(command))
    process = subprocess.run(command, env=os.environ.copy(), check=False)
    results = out / "latest" / "results.json"
    if not results.is_file():
        raise RuntimeError(f"fedfuse simulate wrote no results (exit {process.returncode})")
    report = json.loads(results.read_text())
    fusion = report.get("fusions", {}).get(job.method.name, {})
    if process.returncode != 0 or fusion.get("status") != "ok":
        raise RuntimeError(
            f"fedfuse simulate exit {process.returncode}: "
            f"{fusion.get('error') or report.get('error') or 'see ' + str(results)}"
        )
    accuracy = report["accuracy"]
    row = _evaluation_fields(accuracy)
    row.update(
        accuracy=accuracy["fused"][job.method.name]["accuracy"],
        loss=accuracy["fused"][job.method.name]["loss"],
        fusion_seconds=fusion["seconds"],
        upload_bytes_per_site=[
            c.get("upload_bytes")
            for c in sorted(report["clients"], key=lambda c: c["partition_id"])
        ],
        round_upload_bytes=statistics_round_bytes(fusion.get("details", {}), job.sites),
        details=fusion.get("details", {}),
        flower_results=str(results.resolve()),
    )
    if fusion.get("checkpoint"):
        row["fused_checkpoint"] = os.path.relpath(fusion["checkpoint"], job.sweep_dir)
    return row


# --------------------------------------------------------------------------------- entry point
def _record_invocation(sweep_dir: Path, argv: list[str], started: datetime, seconds: float) -> None:
    """Append this invocation (command, times) to ``<sweep dir>/sweep.json``."""
    path = sweep_dir / "sweep.json"
    document = (
        json.loads(path.read_text())
        if path.is_file()
        else {"format": "fedfuse-sweep/1", "runs": []}
    )
    document["runs"].append(
        {
            "command": shlex.join(["fedfuse", "compare", *argv]),
            "started_at": started.isoformat(timespec="seconds"),
            "wall_seconds": round(seconds, 1),
        }
    )
    write_json(path, document)


def main(argv: list[str] | None = None) -> int:
    """``fedfuse compare [hydra args and overrides]`` (Hydra parses ``argv``)."""
    import hydra

    from ..runtime import configure_logging

    argv = list(sys.argv[1:] if argv is None else argv)
    configure_logging()
    started, clock = datetime.now(UTC), time.perf_counter()
    sweep_dirs: set[Path] = set()

    @hydra.main(config_path="pkg://fedfuse.configs", config_name="compare", version_base=None)
    def app(cfg: DictConfig) -> float | None:
        configure_logging()  # Hydra reconfigures logging per job
        row = run_job(cfg)
        sweep_dirs.add(Path(str(cfg.output_dir)).expanduser().resolve() / str(cfg.sweep))
        return row.get("accuracy")

    saved = sys.argv
    sys.argv = ["fedfuse compare", *argv]
    try:
        app()
    finally:
        sys.argv = saved
    for sweep_dir in sweep_dirs:
        _record_invocation(sweep_dir, argv, started, time.perf_counter() - clock)
        log.info("rows in %s; tables and plots: fedfuse report %s", sweep_dir / "rows", sweep_dir)
    return 0
