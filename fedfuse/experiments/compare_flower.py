"""The Flower runner of ``fedfuse compare``: a job run as a real ``fedfuse simulate``.

The job's settings become the run config of one ``flwr run``, whose sites read the same site-set
cache as the library runner (:mod:`.compare_library`); its ``results.json`` is read back into the
same row fields (:func:`~.compare_job.result_fields`). Kept apart because it is the one runner
that starts a subprocess and reads a report instead of computing the row itself.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess

from fedfuse.experiments.compare_job import Job, Outcome, result_fields
from fedfuse.federation.scenario import Scenario
from fedfuse.federation.simulation import simulate_command
from fedfuse.fusion.statistics.rounds import statistics_round_bytes

log = logging.getLogger(__name__)


def run_flower(job: Job, scenario: Scenario) -> Outcome:
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
    row = result_fields(
        accuracy,
        accuracy["fused"][job.method.name],
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
    outcome.finetuned = result_fields(
        accuracy,
        tuned["accuracy"],
        fusion_seconds=fusion["seconds"],
        finetune_seconds=tuned["seconds"],
        upload_bytes_per_site=row["upload_bytes_per_site"],
        round_upload_bytes=rounds,
        details={},
        finetune_details=tuned.get("details", {}),
        flower_results=row["flower_results"],
    )
    if tuned.get("checkpoint"):
        outcome.finetuned["fused_checkpoint"] = os.path.relpath(tuned["checkpoint"], job.sweep_dir)
    return outcome
