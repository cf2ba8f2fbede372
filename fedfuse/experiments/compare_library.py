"""The library runner of ``fedfuse compare``: a job's sites trained, fused and evaluated in-process.

The sites run their own code path (:func:`~fedfuse.federation.site.train_site`, as the ClientApp
runs it) against the site-set cache, the job's method fuses them as the server would, and the
fused model is evaluated; a fine-tuning job then fine-tunes it on the fusion set, or on every
site with the sites' models averaged as the Flower round does. Kept apart from the sweep
(:mod:`.compare`) and from the Flower runner (:mod:`.compare_flower`), which give the same rows.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import torch
from tqdm.auto import tqdm

from fedfuse.experiments.compare_job import Job, Outcome, result_fields
from fedfuse.federation.evaluation import evaluate_fusion
from fedfuse.federation.method_needs import upload_request_for
from fedfuse.federation.scenario import Scenario
from fedfuse.federation.site import SiteIdentity, SiteSetup, finetune_site, train_site
from fedfuse.federation.site_data import site_part
from fedfuse.federation.upload_inputs import complete_fusion_set, fusion_inputs
from fedfuse.fusion.base import reads_sites
from fedfuse.fusion.methods.trained.dense import SyntheticFusionSet
from fedfuse.fusion.statistics.channels import LocalSites
from fedfuse.fusion.statistics.rounds import statistics_round_bytes
from fedfuse.io.atomic import json_safe, write_json
from fedfuse.io.checkpoint import CheckpointError, load_checkpoint
from fedfuse.models import build_model
from fedfuse.runtime import PeakMemory
from fedfuse.settings.run import RunSettings, finetune_seed, initial_seed
from fedfuse.training.averaging import average_models, state_bytes
from fedfuse.training.finetune import finetune

log = logging.getLogger(__name__)


def run_library(job: Job, scenario: Scenario) -> Outcome:
    """Train (or load) the sites in-process, fuse with the job's method, evaluate; then, when
    the job fine-tunes, fine-tune the fused model and evaluate that too."""
    settings = job.settings
    request = upload_request_for(  # what the server's train message would ask
        [job.method], settings.fusion_gaussians(), secure=settings.secure_aggregation
    )
    initial = (  # the server's common start in shared mode, as strategies/one_shot_run.py sends it
        build_model(scenario.model_spec(), seed=initial_seed(settings)).state_dict()
        if settings.init == "shared"
        else None
    )
    uploads = [  # the sites' own code path, as the ClientApp runs it
        train_site(
            settings,
            SiteIdentity(pid, job.sites),
            request,
            initial,
            SiteSetup(cache=job.cache.site(settings, pid, job.sites)),
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
        test = evaluate_fusion([fused], None, scenario.test_set, device=settings.device)
        row = result_fields(
            evaluation,
            test["base"][0],
            upload_bytes_per_site=[u.payload_bytes() for u in uploads],
            **base,
        )
        if job.cfg.save_models:
            row["fused_checkpoint"] = job.save_model(fused, job.id, job.label)
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
    if reads_sites(needs):  # statistics rounds and scores (auto) answered in-process
        own = [scenario.client_data(pid) for pid in range(job.sites)]
        site_inputs = [site_part(d, settings, pid).inputs() for pid, d in enumerate(own)]
        held = [site_part(d, settings, pid, "validation") for pid, d in enumerate(own)]
        validation = [(d.inputs(), d.labels) for d in held]
        sites = LocalSites(models, site_inputs, device=settings.device, validation=validation)
    inputs = fusion_inputs(uploads, fusion_set, sites=sites, needs=needs)
    inverted = settings.fusion_inversion()
    gaussians = settings.fusion_gaussians()
    if not upload_request_for([job.method], gaussians).gaussian_rank:
        gaussians = None  # the sites sent none: the job's method reads no fusion set
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
    row = result_fields(
        evaluation,
        test,
        fusion_seconds=base.get("fusion_seconds"),
        finetune_seconds=seconds,
        upload_bytes_per_site=[u.payload_bytes() for u in uploads],
        round_upload_bytes=rounds,
        details={},
        finetune_details=json_safe(details),
    )
    if job.cfg.save_models:
        row["fused_checkpoint"] = job.save_model(model, job.ft_id, job.ft_label)
    return row


def _parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


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
