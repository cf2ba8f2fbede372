"""``fedfuse compare``: a Hydra app that compares fusion methods across partition configs.

One job = one composed config (``configs/compare.yaml`` plus overrides): the site set it names
is trained once (:mod:`fedfuse.federation.site_cache`), fused by the job's method, evaluated, and
written as one JSON row under ``<output_dir>/<sweep>/rows/``. Sweep with Hydra's ``-m``::

    fedfuse compare -m partition=sharded,dirichlet sites=2,4,8 method=kf-linear,regmean seed=0,1,2

Rerunning the same command resumes: a job whose row is already ``ok`` is skipped, a site set
already trained (even partly) is loaded. ``runner=library`` runs in this process;
``runner=flower`` runs each job as a real ``fedfuse simulate`` (``flwr run``) whose sites read
the same site-set cache. ``fedfuse report <sweep dir>`` turns the rows into tables and plots.

The paper's optional steps have rows of their own, never mixed into the zero-shot numbers:

* ``finetune=fusion-set`` or ``finetune=sites`` (``finetune.epochs`` > 0): the job writes its
  zero-shot row (``stage: "zero-shot"``, the same row a job without fine-tuning writes) and a
  second row (``stage: "finetuned"``) for the fused model fine-tuned on the server's fusion set
  or on the sites in one more round, labelled ``<method> +ft(<data>,<E>ep)``. When the zero-shot
  row is already there with its fused checkpoint, only the fine-tuning runs.
* ``fusion_set.augment_copies=N``: the method fuses with a fusion set expanded by ``N`` cropped
  and flipped copies; a different row (its id covers the augmentation), labelled
  ``<method> +aug(xN)``.
* ``fusion_set.invert_samples=N``: the fusion set is completed, after the uploads, with ``N``
  rows per site inverted from its model's BatchNorm statistics
  (:mod:`fedfuse.fusion.inversion`); a row of its own, labelled ``<method> +inv(xN)``.
* ``fusion_set.gaussian_samples=N``: every site also uploads its class Gaussians (a rank-
  ``fusion_set.gaussian_rank`` PPCA of its inputs per class), and the fusion set is completed
  with ``N`` rows per site drawn from them (:mod:`fedfuse.fusion.statistics.class_gaussians`); a row
  of its own, labelled ``<method> +gauss(xN)``, with the bytes each site uploads for them.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from fedfuse.experiments.row_ids import ROW_FORMAT, row_id, without_finetuning
from fedfuse.federation.evaluation import evaluate_fusion
from fedfuse.federation.scenario import Scenario
from fedfuse.federation.simulation import simulate_command
from fedfuse.federation.site import finetune_site, train_site
from fedfuse.federation.site_cache import SiteCache
from fedfuse.federation.uploads import (
    complete_fusion_set,
    fusion_inputs,
    needs_grams,
)
from fedfuse.fusion.inversion import check_invertible
from fedfuse.fusion.methods.averaging.fisher import fisher_kinds
from fedfuse.fusion.methods.trained.dense import SyntheticFusionSet
from fedfuse.fusion.statistics.rounds import LocalSites, statistics_round_bytes
from fedfuse.io.atomic import json_safe, write_json
from fedfuse.io.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from fedfuse.models import build_model
from fedfuse.runtime import PeakMemory
from fedfuse.settings.hydra import method_from_config, method_label, settings_from_config
from fedfuse.settings.run import RunSettings, finetune_seed, initial_seed
from fedfuse.training.averaging import average_models, state_bytes
from fedfuse.training.finetune import finetune

log = logging.getLogger("fedfuse.experiments.compare")


@dataclass
class Outcome:
    """What a runner produced: the zero-shot row's fields (None: the row already there stands)
    and, when the job fine-tunes, the fine-tuned row's fields or the error that stopped it."""

    zero_shot: dict[str, Any] | None
    finetuned: dict[str, Any] | None = None
    finetune_error: str | None = None


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
        settings = settings_from_config(cfg, self.method)
        self.settings = replace(settings, site_cache=str(self.cache.root))
        self.finetunes = self.settings.finetune_epochs > 0
        self.id = row_id(self.settings, self.sites, self.method, self.runner)
        self.row_path = self.sweep_dir / "rows" / f"{self.id}.json"
        self.ft_id = (
            row_id(self.settings, self.sites, self.method, self.runner, "finetuned")
            if self.finetunes
            else None
        )
        self.ft_row_path = self.sweep_dir / "rows" / f"{self.ft_id}.json" if self.ft_id else None
        self.site_set_dir = self.cache.directory(self.settings, self.sites)
        parts = (self.settings.fusion_set_label(), self.settings.widths_label())
        self.label = " ".join([method_label(self.method), *(part for part in parts if part)])
        self.ft_label = f"{self.label} {self.settings.finetune_label()}"

    @staticmethod
    def _read_ok(path: Path | None) -> dict[str, Any] | None:
        try:
            row = json.loads(path.read_text()) if path is not None else None
        except (OSError, json.JSONDecodeError):
            return None
        return row if isinstance(row, dict) and row.get("status") == "ok" else None

    def zero_shot_row(self) -> dict[str, Any] | None:
        """The job's zero-shot row when it exists and succeeded."""
        return self._read_ok(self.row_path)

    def done(self) -> bool:
        """Whether this job's rows (zero-shot, and fine-tuned when it fine-tunes) exist and
        succeeded (a rerun skips it)."""
        rows_ok = self._read_ok(self.row_path) is not None
        return rows_ok and (not self.finetunes or self._read_ok(self.ft_row_path) is not None)

    def base_row(self, stage: str = "zero-shot") -> dict[str, Any]:
        s = self.settings if stage == "finetuned" else without_finetuning(self.settings)
        row = {
            "format": ROW_FORMAT,
            "row_id": self.id if stage == "zero-shot" else self.ft_id,
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
            "label": self.label if stage == "zero-shot" else self.ft_label,
            "kind": self.method.kind,
            "stage": stage,
            "fusion_augment": s.fusion_augment_options(),
            "options": self.method.options(),
            "runner": self.runner,
            "site_set_dir": str(self.site_set_dir),
            "fused_checkpoint": None,
            "settings": {k: v for k, v in s.to_config().items() if k != "site-cache"},
        }
        if stage == "finetuned":
            row.update(zero_shot_row_id=self.id, finetune=s.finetune_options())
        return row


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
    ft_row = job.base_row("finetuned") if job.finetunes else None
    started = time.perf_counter()
    try:
        scenario = Scenario(job.settings, job.sites)
        spec = scenario.model_spec()
        job.method.check_run(job.sites, spec, target=job.settings.fused_spec(spec))
        if job.settings.fusion_invert_samples and job.method.needs() & {"data", "labels"}:
            check_invertible(build_model(spec), where="fusion_set.invert_samples")  # before sites
        runner = _run_library if job.runner == "library" else _run_flower
        outcome = runner(job, scenario)
        if outcome.zero_shot is None:  # kept from an earlier run; only the fine-tuning ran
            row = job.zero_shot_row() or row
        else:
            row.update(outcome.zero_shot, status="ok")
        if ft_row is not None:
            if outcome.finetuned is not None:
                ft_row.update(outcome.finetuned, status="ok")
            else:
                ft_row.update(status="failed", error=outcome.finetune_error or "not run")
    except Exception as error:  # a failed job is a row, the sweep goes on
        log.exception("%s failed", job.id)
        outcome = None
        for failed in (row, ft_row):
            if failed is not None:
                failed.update(status="failed", error=f"{type(error).__name__}: {error}")
    seconds = time.perf_counter() - started
    finished = datetime.now(UTC).isoformat(timespec="seconds")
    written = [] if outcome is not None and outcome.zero_shot is None else [(job.row_path, row)]
    if ft_row is not None:
        written.append((job.ft_row_path, ft_row))
    for path, document in written:
        document.update(seconds=seconds, finished_at=finished)
        write_json(path, document)
        log.info(
            "%s: %s %s",
            document["row_id"],
            document["status"],
            f"accuracy {document['accuracy']:.4f}"
            if document.get("accuracy") is not None
            else document["error"],
        )
    return row


# ----------------------------------------------------------------------------- library runner
def _run_library(job: Job, scenario: Scenario) -> Outcome:
    """Train (or load) the sites in-process, fuse with the job's method, evaluate; then, when
    the job fine-tunes, fine-tune the fused model and evaluate that too."""
    settings = job.settings
    send_grams = needs_grams([job.method])  # what the server's train message would say
    send_fisher = fisher_kinds([job.method])
    initial = (  # the server's common start in shared mode, as strategies/server_app.py sends it
        build_model(scenario.model_spec(), seed=initial_seed(settings)).state_dict()
        if settings.init == "shared"
        else None
    )
    uploads = [  # the sites' own code path, as the ClientApp runs it
        train_site(
            settings,
            pid,
            job.sites,
            initial,
            send_grams=send_grams,
            send_fisher=send_fisher,
            send_gaussians=settings.gaussian_rank([job.method]),
            cache=job.cache.site(settings, pid, job.sites),
        )
        for pid in tqdm(range(job.sites), desc=f"sites ({job.id})", disable=None)
    ]
    models = [upload.model for upload in uploads]
    evaluation = _site_set_evaluation(job, scenario, models, uploads)
    reused = _zero_shot_model(job) if job.finetunes else None
    if reused is not None:
        fused, zero_shot = reused
        base = {k: zero_shot.get(k) for k in ("fusion_seconds", "round_upload_bytes")}
        outcome = Outcome(None)
    else:
        fused, base = _fuse_library(job, scenario, settings, models, uploads)
        row = _evaluation_fields(evaluation)
        test = evaluate_fusion([fused], None, scenario.test_set, device=settings.device)
        row.update(
            accuracy=test["base"][0]["accuracy"],
            loss=test["base"][0]["loss"],
            upload_bytes_per_site=[u.payload_bytes() for u in uploads],
            **base,
        )
        if job.cfg.save_models:
            row["fused_checkpoint"] = _save_model(job, fused, job.id, job.label)
        outcome = Outcome(row)
    if not job.finetunes:
        return outcome
    try:
        outcome.finetuned = _finetune_library(job, scenario, fused, uploads, evaluation, base)
    except Exception as error:  # the zero-shot row stands; the fine-tuned row names the error
        log.exception("%s: fine-tuning failed", job.ft_id)
        outcome.finetune_error = f"{type(error).__name__}: {error}"
    return outcome


def _fuse_library(
    job: Job, scenario: Scenario, settings: RunSettings, models, uploads
) -> tuple[Any, dict[str, Any]]:
    """The job's method fused over the sites; the fused model and the row's fusion fields."""
    needs = job.method.needs()
    fusion_set, synthetic = None, None
    if needs & {"data", "labels"} and settings.synthetic_fusion_set:  # made from the models
        synthetic = SyntheticFusionSet(
            settings.fusion_samples, seed=settings.seed + 2, device=settings.device
        )
        fusion_set = synthetic.generate(models)
    elif needs & {"data", "labels"}:
        fusion_set = scenario.fusion_set()
    sites = None
    if "sites" in needs:  # statistics rounds answered in-process
        site_inputs = [scenario.client_data(pid).inputs() for pid in range(job.sites)]
        sites = LocalSites(models, site_inputs, device=settings.device)
    inputs = fusion_inputs(uploads, fusion_set, sites=sites, needs=needs)
    inverted = settings.fusion_inversion()
    gaussians = settings.fusion_gaussians() if settings.gaussian_rank([job.method]) else None
    inputs = complete_fusion_set(models, inputs, uploads, inversion=inverted, gaussians=gaussians)
    with PeakMemory() as peak:
        result = job.method.fuse(models, inputs, target=job.settings.fused_spec(models[0].spec))
    return result.model, {
        "fusion_seconds": result.seconds,
        "fused_parameters": _parameters(result.model),
        "site_parameters": _parameters(models[0]),
        "fusion_peak_rss_mib": round(peak.rss_mib, 1),
        "fusion_extra_rss_mib": round(peak.extra_mib, 1),
        "fusion_peak_cuda_mib": None if peak.cuda_mib is None else round(peak.cuda_mib, 1),
        "round_upload_bytes": statistics_round_bytes(result.details, job.sites),
        "synthetic_fusion_set_seconds": None if synthetic is None else synthetic.seconds,
        "inverted_fusion_set_seconds": None if inverted is None else inverted.seconds,
        "gaussian_fusion_set_seconds": None if gaussians is None else gaussians.seconds,
        "gaussian_upload_bytes": None
        if gaussians is None
        else max(u.payload_parts()["class_gaussians"] for u in uploads),
        "details": json_safe(result.details),
    }


def _zero_shot_model(job: Job) -> tuple[Any, dict[str, Any]] | None:
    """The fused model and row of an earlier run of this job's zero-shot row, when both are
    there (a job that adds fine-tuning to a finished sweep then only fine-tunes)."""
    row = job.zero_shot_row()
    if row is None or not row.get("fused_checkpoint"):
        return None
    path = job.sweep_dir / row["fused_checkpoint"]
    try:
        model = load_checkpoint(path).model
    except (CheckpointError, OSError, ValueError) as error:
        log.warning("%s: cannot reuse the fused model %s (%s); fusing again", job.id, path, error)
        return None
    log.info("%s: zero-shot row done, fine-tuning its fused model %s", job.id, path)
    return model, row


def _finetune_library(
    job: Job,
    scenario: Scenario,
    fused,
    uploads,
    evaluation: dict[str, Any],
    base: dict[str, Any],
) -> dict[str, Any]:
    """The fine-tuned row's fields: ``fused`` fine-tuned on the fusion set, or on every site
    in-process and averaged (what the Flower round does), then evaluated."""
    s = job.settings
    started = time.perf_counter()
    rounds = list(base.get("round_upload_bytes") or [])
    if s.finetune_data == "fusion-set":
        fusion_set = scenario.fusion_set()
        model, details = finetune(
            fused,
            fusion_set.inputs(),
            fusion_set.labels,
            seed=finetune_seed(s),
            description=f"{job.ft_id} fine-tune",
            **s.finetune_kwargs(),
        )
    else:
        tuned = [finetune_site(s, fused, pid, job.sites) for pid in range(job.sites)]
        weights = [t.num_examples for t in tuned]
        model = average_models([t.model for t in tuned], weights, like=fused)
        details = {
            "weights": [w / sum(weights) for w in weights],
            "sites": [t.details for t in tuned],
        }
        rounds.append([state_bytes(t.model) for t in tuned])
    seconds = time.perf_counter() - started
    test = evaluate_fusion([model], None, scenario.test_set, device=s.device)["base"][0]
    row = _evaluation_fields(evaluation)
    row.update(
        accuracy=test["accuracy"],
        loss=test["loss"],
        fusion_seconds=base.get("fusion_seconds"),
        finetune_seconds=seconds,
        upload_bytes_per_site=[u.payload_bytes() for u in uploads],
        round_upload_bytes=rounds,
        details={},
        finetune_details=json_safe(details),
    )
    if job.cfg.save_models:
        row["fused_checkpoint"] = _save_model(job, model, job.ft_id, job.ft_label)
    return row


def _parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _save_model(job: Job, model, row: str, label: str) -> str:
    path = job.sweep_dir / "fused" / f"{row}.safetensors"
    save_checkpoint(path, model, metadata={"row_id": row, "label": label})
    return str(path.relative_to(job.sweep_dir))


def _site_set_evaluation(job: Job, scenario: Scenario, models, uploads) -> dict[str, Any]:
    """The base models' and ensemble's test results, computed once per site set and test set."""
    description = job.site_set_dir / "site_set.json"
    document = json.loads(description.read_text()) if description.is_file() else {}
    key = f"test_samples={job.settings.test_samples}"
    evaluations = document.setdefault("evaluations", {})
    if "logit_ensemble" not in evaluations.get(key, {}):  # (cached before it was added)
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
        # a reference beside the probability ensemble (absent from older results: None)
        "logit_ensemble_accuracy": evaluation.get("logit_ensemble", {}).get("accuracy"),
        "logit_ensemble_loss": evaluation.get("logit_ensemble", {}).get("loss"),
        "test_examples": evaluation["test_examples"],
    }


# ------------------------------------------------------------------------------ flower runner
def _run_flower(job: Job, scenario: Scenario) -> Outcome:
    """Run the job as a real ``fedfuse simulate`` (``flwr run``) and read its results file
    (the fine-tuned model, when the job fine-tunes, is its ``finetuned`` entry)."""
    del scenario
    out = job.sweep_dir / "flower" / (job.ft_id or job.id)
    config = {
        k: v for k, v in job.settings.to_config().items() if k not in ("output-dir", "min-nodes")
    }
    assignments = " ".join(f"{k}={json.dumps(v)}" for k, v in config.items())
    command = simulate_command(
        sites=job.sites,
        output_dir=out,
        run_config=assignments,
        cpus_per_client=job.cfg.runner.cpus_per_client,
        timeout=job.cfg.runner.timeout,
        ray_address=job.cfg.runner.ray_address,
    )
    log.info("%s: %s", job.id, shlex.join(command))
    process = subprocess.run(command, env=os.environ.copy(), check=False)
    results = out / "latest" / "results.json"
    if not results.is_file():
        raise RuntimeError(f"fedfuse simulate wrote no results (exit {process.returncode})")
    report = json.loads(results.read_text())
    fusion = report.get("fusions", {}).get(job.method.name, {})
    tuned = report.get("finetuned", {}).get(job.method.name) if job.finetunes else None
    finetune_failed = tuned is not None and tuned.get("status") != "ok"
    # a failed fine-tuning makes the run "partial" (exit 1) but leaves the zero-shot row good
    if (process.returncode != 0 and not finetune_failed) or fusion.get("status") != "ok":
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
    outcome = Outcome(row)
    if not job.finetunes:
        return outcome
    if tuned is None or tuned.get("status") != "ok":
        outcome.finetune_error = (tuned or {}).get("error") or f"no fine-tuned model in {results}"
        return outcome
    rounds = list(row["round_upload_bytes"])
    if tuned.get("upload_bytes"):
        rounds.append([int(tuned["upload_bytes"].get(str(p), 0)) for p in range(job.sites)])
    outcome.finetuned = {
        **_evaluation_fields(accuracy),
        "accuracy": tuned["accuracy"]["accuracy"],
        "loss": tuned["accuracy"]["loss"],
        "fusion_seconds": fusion["seconds"],
        "finetune_seconds": tuned["seconds"],
        "upload_bytes_per_site": row["upload_bytes_per_site"],
        "round_upload_bytes": rounds,
        "details": {},
        "finetune_details": tuned.get("details", {}),
        "flower_results": row["flower_results"],
    }
    if tuned.get("checkpoint"):
        outcome.finetuned["fused_checkpoint"] = os.path.relpath(tuned["checkpoint"], job.sweep_dir)
    return outcome


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


class ConfigError(SystemExit):
    """A job's config is invalid: the sweep stops, reported in one line (a SystemExit, so that
    Hydra, which turns a job's exceptions into tracebacks, lets it through)."""


def main(argv: list[str] | None = None, prog: str = "fedfuse compare") -> int:
    """``fedfuse compare [hydra args and overrides]`` (Hydra parses ``argv``). Config errors
    (an unknown key or option, a value out of range) end in one line on stderr, exit 2."""
    import hydra

    from fedfuse.runtime import configure_logging
    from fedfuse.settings.hydra import validate_overrides

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        hydra_argv = validate_overrides(argv)
    except ValueError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    configure_logging()
    started, clock = datetime.now(UTC), time.perf_counter()
    sweep_dirs: set[Path] = set()

    @hydra.main(config_path="pkg://fedfuse.configs", config_name="compare", version_base=None)
    def app(cfg: DictConfig) -> float | None:
        configure_logging()  # Hydra reconfigures logging per job
        try:
            row = run_job(cfg)  # a job's own failure is a row: what escapes is a config error
        except ValueError as error:
            text = "; ".join(line.strip() for line in str(error).splitlines() if line.strip())
            raise ConfigError(text) from None
        sweep_dirs.add(Path(str(cfg.output_dir)).expanduser().resolve() / str(cfg.sweep))
        return row.get("accuracy")

    saved = sys.argv
    sys.argv = [prog, *hydra_argv]
    try:
        app()
    except ConfigError as error:
        print(f"{prog}: error: {error.code}", file=sys.stderr)
        return 2
    finally:
        sys.argv = saved
    for sweep_dir in sweep_dirs:
        _record_invocation(sweep_dir, argv, started, time.perf_counter() - clock)
        log.info("rows in %s; tables and plots: fedfuse report %s", sweep_dir / "rows", sweep_dir)
    return 0
