"""``fedfuse compare``: a Hydra app that compares fusion methods across partition configs.

One job = one composed config (``configs/compare.yaml`` plus overrides): the site set it names
is trained once (:mod:`fedfuse.federation.site_cache`), fused by the job's method, evaluated, and
written as one JSON row under ``<output_dir>/<sweep>/rows/``. Sweep with Hydra's ``-m``::

    fedfuse compare -m partition=sharded,dirichlet sites=2,4,8 method=kf-linear,regmean seed=0,1,2

Rerunning the same command resumes: a job whose row is already ``ok`` is skipped, a site set
already trained (even partly) is loaded. ``runner=library`` runs in this process;
``runner=flower`` runs each job as a real ``fedfuse simulate`` (``flwr run``) whose sites read
the same site-set cache. ``fedfuse report <sweep dir>`` turns the rows into tables and plots.
This module runs the sweep and writes the rows; a job and its row fields are
:mod:`.compare_job`'s, the runners :mod:`.compare_library` and :mod:`.compare_flower`.

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
import shlex
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from fedfuse.experiments.compare_flower import run_flower
from fedfuse.experiments.compare_job import Job
from fedfuse.experiments.compare_library import run_library
from fedfuse.federation.scenario import Scenario
from fedfuse.fusion.inversion import check_invertible
from fedfuse.io.atomic import write_json
from fedfuse.models import build_model

log = logging.getLogger("fedfuse.experiments.compare")


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
        runner = run_library if job.runner == "library" else run_flower
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
