"""One run of fedfuse's ServerApp, phase by phase: check, collect and fuse, evaluate, fine-tune.

:class:`OneShotRun` holds what a run knows (its settings, methods, output folder and report) and
drives :class:`~.one_shot.OneShotFusion` through the phases, saving ``results.json`` after each
and every fused model the moment it exists. The entry point that names the run folder and turns
an error or a stop into the report's status is :mod:`.server_app`; what happens inside a run
lives here.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord
from flwr.serverapp import Grid

from fedfuse.data import DatasetNotFoundError, ImageDataset
from fedfuse.federation.contract import DataContract
from fedfuse.federation.evaluation import (
    evaluate_fusion,
    format_level_summary,
    format_run_summary,
)
from fedfuse.federation.provenance import DATA_FILE_KEYS, data_files, fused_model_metadata
from fedfuse.federation.scenario import Scenario
from fedfuse.federation.uploads import StoredUpload, UploadStore
from fedfuse.fusion import FusionMethod, FusionResult
from fedfuse.fusion.inversion import check_invertible
from fedfuse.fusion.methods.trained.dense import SyntheticFusionSet
from fedfuse.io.atomic import write_json
from fedfuse.io.checkpoint import save_checkpoint
from fedfuse.models import ModelSpec, build_model
from fedfuse.partitions import plot_class_counts
from fedfuse.settings.run import RunSettings, finetune_seed, initial_seed
from fedfuse.training.finetune import finetune

from .one_shot import OneShotFusion
from .secure_sums import SecureSettings

log = logging.getLogger(__name__)


def _available_inputs(settings: RunSettings, scenario: Scenario) -> set[str]:
    """The FusionInputs fields this run can provide (for the check before training)."""
    available = {"scores", "sample_counts", "class_counts", "grams", "fisher", "sites"}
    if settings.fusion_data or settings.synthetic_fusion_set:
        available |= {"data", "labels"}
    else:
        try:
            scenario.train_set  # noqa: B018 - the server samples its fusion set from it
            available |= {"data", "labels"}
        except (DatasetNotFoundError, FileNotFoundError):
            log.warning(
                "no %s training data on the server and no fusion-data file: methods that "
                "need a fusion set cannot run",
                settings.dataset,
            )
    return available


class OneShotRun:
    """One run of the app: its settings, output directory and report, phase by phase."""

    def __init__(self, settings: RunSettings, methods: list[FusionMethod], out: Path) -> None:
        self.settings = settings
        self.methods = methods
        self.out = out
        self.report: dict[str, Any] = {}
        self.phases: dict[str, float] = {}
        self.scenarios: dict[int, Scenario] = {}
        self.fusion_sets: dict[int, ImageDataset] = {}
        #: the fusion set made from the uploads (``fusion-source=synthetic``), else None
        self.synthetic = (
            SyntheticFusionSet(
                settings.fusion_samples, seed=settings.seed + 2, device=settings.device
            )
            if settings.synthetic_fusion_set
            else None
        )
        #: completes the fusion set from the uploads' BatchNorm statistics, else None
        self.inversion = settings.fusion_inversion()
        #: completes it from the class Gaussians the sites upload, else None
        self.gaussians = settings.fusion_gaussians()
        #: what the run is doing (named by a failure or a stop)
        self.phase = "start"
        self.contract: DataContract | None = None
        self.files: dict[str, Any] = {}

    def scenario(self, num_partitions: int) -> Scenario:
        if num_partitions not in self.scenarios:
            known = next(iter(self.scenarios.values()), None)
            self.scenarios[num_partitions] = (
                known.with_clients(num_partitions)
                if known is not None
                else Scenario(self.settings, num_partitions)
            )
        return self.scenarios[num_partitions]

    def fusion_set(self, num_partitions: int) -> ImageDataset:
        """The server's fusion set (built once per split, so the check before training and the
        fusion itself use the very same samples)."""
        if num_partitions == 0 and not self.settings.fusion_data:
            raise ValueError(
                "the sites train on their own data files (num-partitions 0), so the server's "
                "fusion set must be given as a file: run config fusion-data='<file.npz>'"
            )
        if num_partitions not in self.fusion_sets:
            self.fusion_sets[num_partitions] = self.scenario(num_partitions).fusion_set()
        return self.fusion_sets[num_partitions]

    def save(self) -> None:
        self.report["phases"] = self.phases
        write_json(self.out / "results.json", self.report)

    def preflight(self, scenario: Scenario) -> tuple[ModelSpec, DataContract]:
        """Check the server's own files before any site is asked to train: the fusion and test
        sets (named by their run-config key), and the output folder (by writing the report).
        Returns the sites' model spec and the run's data contract."""
        self.phase = "preflight"
        self.save()  # the output folder is writable, or the run ends here
        config = self.settings.to_config()
        for key in DATA_FILE_KEYS:
            path = str(config.get(key) or "")
            if path and not Path(path).expanduser().is_file():
                raise ServerFileError(f"run config {key}='{path}': no such file on the server")
        spec = scenario.model_spec()  # a fusion-data file that cannot be read fails here
        if self.inversion is not None:
            check_invertible(build_model(spec), where="run config fusion-invert-samples")
        reference = self.fusion_set(0) if self.settings.fusion_data else scenario.train_set
        try:
            scenario.test_set  # noqa: B018 - loaded now, not after every site trained
        except (ValueError, OSError) as error:
            key = "test-data" if self.settings.test_data else "dataset"
            raise ServerFileError(f"the server's test set (run config {key}): {error}") from None
        self.files = data_files(self.settings)
        contract = self.contract = DataContract.of(reference)
        self.report["data_contract"] = contract.to_dict()
        self.report["data_files"] = self.files
        return spec, contract

    def on_fused(self, name: str, result: FusionResult, strategy: OneShotFusion) -> None:
        """Save a fused model the moment it exists, with everything needed to use it alone."""
        first = not any(f.get("checkpoint") for f in self.report["fusions"].values())
        path = self.out / ("fused.safetensors" if first else f"fused-{name}.safetensors")
        method = next(m for m in self.methods if m.name == name)
        metadata = fused_model_metadata(
            self.settings,
            method=name,
            options=method.options(),
            sites=[e.facts for e in strategy.store.entries],
            contract=self.contract,
            files=self.files,
            run_id=self.report.get("run_id"),
        )
        save_checkpoint(path, result.model, metadata={**metadata, "fusion_seconds": result.seconds})
        self.report["fusions"][name].update(
            **fused_outcome(result, len(strategy.store.entries)), checkpoint=str(path)
        )
        self.save()
        log.info("%s: fused model saved to %s", name, path)

    def run(self, grid: Grid) -> None:
        """Collect the uploads, fuse them and evaluate; ``report`` is saved after each phase."""
        settings = self.settings
        started = time.monotonic()
        scenario = self.scenario(settings.min_nodes)
        spec, contract = self.preflight(scenario)
        available = _available_inputs(settings, scenario)
        self.phases["prepare"] = time.monotonic() - started
        initial = (
            ArrayRecord(build_model(spec, seed=initial_seed(settings)).state_dict())
            if settings.init == "shared"
            else ArrayRecord()
        )
        store = UploadStore(self.out / "clients", expected_spec=spec)
        self.report["clients"] = []
        self.report["rejected"] = []
        self.report["fusions"] = {m.name: self._method_entry(m) for m in self.methods}

        def on_upload(entry: StoredUpload) -> None:
            self.report["clients"].append(entry.facts)

        def before_training(num_sites: int) -> None:
            if "data" in available and not settings.synthetic_fusion_set:  # fails now, not later
                self.fusion_set(0 if settings.fusion_data else num_sites)
            elif settings.finetune_epochs and settings.finetune_data == "fusion-set":
                raise ValueError(
                    "finetune-data='fusion-set' needs the server's fusion set, and this server "
                    "has neither the training data to sample it nor a fusion-data file; give "
                    "fusion-data, or fine-tune on the sites (finetune-data='sites')"
                )

        strategy = OneShotFusion(
            self.methods,
            store=store,
            fusion_set=self.synthetic or self.fusion_set,
            min_nodes=settings.min_nodes,
            node_wait_timeout=settings.node_wait_timeout,
            available_inputs=available,
            before_training=before_training,
            on_upload=on_upload,
            max_in_flight=settings.max_in_flight,
            target=settings.fused_spec,
            contract=contract,
            # every site checks its data first, in a simulation too: a site that dies later
            # (a lost Ray node) is then named by its partition, and a policy that refuses
            # what the run asks refuses before any site trains
            check_contract=True,
            on_fused=lambda name, result: self.on_fused(name, result, strategy),
            secure=SecureSettings(settings.secure_threshold, settings.reply_timeout)
            if settings.secure_aggregation
            else None,
            inversion=self.inversion,
            gaussians=self.gaussians,
        )
        self.phase = "collect and fuse"
        try:
            strategy.start(grid, initial, num_rounds=1, timeout=settings.reply_timeout)
        finally:
            self.report["clients"] = [e.facts for e in store.entries]
            self.report["rejected"] = strategy.problems
            self.report["sites"] = strategy.sites()
            self.report["fusions"] = self._fusions(strategy)
            self.phases.update(strategy.timings)
            made = {
                "synthetic_fusion_set": self.synthetic,
                "inverted_fusion_set": self.inversion,
                "gaussian_fusion_set": self.gaussians,
            }
            for phase, fusion_set in made.items():
                if fusion_set is not None and fusion_set.seconds is not None:
                    self.phases[phase] = fusion_set.seconds
            self.save()

        self.phase = "evaluate"
        started = time.monotonic()
        entries = store.entries
        test_set = self.scenario(strategy.num_partitions).test_set
        fused = {name: result.model for name, result in strategy.results.items()}
        self.report["accuracy"] = evaluate_fusion(
            store.models(), fused, test_set, device=settings.device, progress=True
        )
        self.phases["evaluate"] = time.monotonic() - started
        self.phase = "report"
        self.report["class_counts"] = [e.class_counts for e in entries]
        self.save()
        kept = [e.source for e in entries if e.class_counts is None]
        if kept:  # their policy keeps their case mix (send-class-counts=false)
            log.info("no class_counts.png: %s sent no class counts", ", ".join(kept))
        else:
            counts = np.asarray(self.report["class_counts"])
            plot_class_counts(counts, self.out / "class_counts.png")
        for name, result in strategy.results.items():
            log.info("%s per level:\n%s", name, format_level_summary(result))
        log.info(
            "results of one-shot fusion (init=%s):\n%s",
            settings.init,
            format_run_summary(self.report),
        )
        for name, failure in strategy.failures.items():
            log.error("fusion method %s failed: %s", name, failure.error)
        if settings.finetune_epochs > 0:
            self.phase = "finetune"
            self.finetune(strategy, test_set)

    def finetune(self, strategy: OneShotFusion, test_set: ImageDataset) -> None:
        """Fine-tune every fused model after fusion, evaluate it and save it: the ``finetuned``
        entry of the report, one per method (a failure is recorded there; the others go on)."""
        settings = self.settings
        started = time.monotonic()
        suffix = settings.finetune_label()
        self.report["finetuned"] = {}
        for name, result in strategy.results.items():
            label = f"{name} {suffix}"
            entry: dict[str, Any] = {
                "label": label,
                "stage": "finetuned",
                "options": settings.finetune_options(),
                "status": "running",
            }
            self.report["finetuned"][name] = entry
            method_started = time.monotonic()
            try:
                if settings.finetune_data == "sites":
                    round_ = strategy.finetune_round()
                    model, details = round_.run(result.model, label)
                    entry.update(problems=round_.problems, upload_bytes=details["upload_bytes"])
                else:
                    data = self.fusion_set(strategy.num_partitions)
                    model, details = finetune(
                        result.model,
                        data.inputs(),
                        data.labels,
                        seed=finetune_seed(settings),
                        description=f"{name} fine-tune",
                        **settings.finetune_kwargs(),
                    )
                scores = evaluate_fusion([model], None, test_set, device=settings.device)
                path = self.out / f"finetuned-{name}.safetensors"
                save_checkpoint(
                    path,
                    model,
                    metadata={
                        "init": settings.init,
                        "settings": settings.to_config(),
                        "strategy": name,
                        "stage": "finetuned",
                        "label": label,
                    },
                )
                entry.update(
                    status="ok",
                    seconds=time.monotonic() - method_started,
                    accuracy=scores["base"][0],
                    details=details,
                    checkpoint=str(path),
                )
            except Exception as error:  # the zero-shot results stand; the others go on
                entry.update(
                    status="failed",
                    seconds=time.monotonic() - method_started,
                    error=f"{type(error).__name__}: {error}",
                )
                log.exception("fine-tuning %s failed", label)
            self.save()
        self.phases["finetune"] = time.monotonic() - started
        lines = [
            f"{e['label']}: "
            + (
                f"{e['accuracy']['accuracy'] * 100:.2f}% (loss {e['accuracy']['loss']:.3f})"
                if e["status"] == "ok"
                else f"FAILED ({e['error']})"
            )
            for e in self.report["finetuned"].values()
        ]
        log.info("fine-tuned after fusion (not zero-shot):\n%s", "\n".join(lines))

    def _method_entry(self, method: FusionMethod) -> dict[str, Any]:
        return {"options": method.options(), "needs": sorted(method.needs()), "status": "not run"}

    def _fusions(self, strategy: OneShotFusion) -> dict[str, Any]:
        fusions: dict[str, Any] = {}
        for method in self.methods:
            entry = {**self._method_entry(method), **self.report["fusions"].get(method.name, {})}
            if method.name in strategy.results:
                entry.update(
                    fused_outcome(strategy.results[method.name], len(strategy.store.entries))
                )
            elif method.name in strategy.failures:
                failure = strategy.failures[method.name]
                entry.update(status="failed", seconds=failure.seconds, error=failure.error)
            fusions[method.name] = entry
        return fusions


def fused_outcome(result: FusionResult, uploads: int) -> dict[str, Any]:
    """A fused model's entry in the report: ``ok``, or ``partial`` naming the sites a method
    fitted on the sites' data went without (a model of fewer sites than the run fused)."""
    entry: dict[str, Any] = {"status": "ok", "seconds": result.seconds, "details": result.details}
    missing = result.missing_sites(uploads)
    if missing:
        used = uploads - len(missing)
        entry.update(
            status="partial",
            missing_sites=missing,
            error=f"fitted on {used} of {uploads} sites' statistics: sites {missing} gave none "
            "in some round (see the problems above)",
        )
    return entry


class ServerFileError(ValueError):
    """A file the server itself needs (fusion set, test set) is missing or unusable."""
