"""One job of a ``fedfuse compare`` sweep, and the row fields both of its runners write alike.

A :class:`Job` is one composed config: its settings and method, its row ids and the paths of its
rows, caches and fused checkpoints. The library runner (:mod:`.compare_library`) and the Flower
runner (:mod:`.compare_flower`) each return an :class:`Outcome` built from the same fields
(:func:`result_fields`), and :mod:`.compare` writes it; keeping these here lets the runners and
the sweep share them without importing each other.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from torch import nn

from fedfuse.experiments.row_ids import ROW_FORMAT, row_id, without_finetuning
from fedfuse.federation.site_cache import SiteCache
from fedfuse.io.checkpoint import save_checkpoint
from fedfuse.settings.hydra import method_from_config, method_label, settings_from_config


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

    def save_model(self, model: nn.Module, row: str, label: str) -> str:
        """Save a fused model of row ``row``; its path, relative to the sweep's folder."""
        path = self.sweep_dir / "fused" / f"{row}.safetensors"
        save_checkpoint(path, model, metadata={"row_id": row, "label": label})
        return str(path.relative_to(self.sweep_dir))


def evaluation_fields(evaluation: dict[str, Any]) -> dict[str, Any]:
    """The row fields of the site set's evaluation: the base models' and ensembles' results."""
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


def result_fields(
    evaluation: dict[str, Any], test: dict[str, Any], **fields: Any
) -> dict[str, Any]:
    """A result row's fields: the site set's evaluation, the model's ``test`` accuracy and loss,
    then ``fields``."""
    return {
        **evaluation_fields(evaluation),
        "accuracy": test["accuracy"],
        "loss": test["loss"],
        **fields,
    }
