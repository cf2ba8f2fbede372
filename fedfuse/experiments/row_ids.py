"""The ids of ``fedfuse compare``'s result rows: one digest of everything that determines a row,
so that a sweep run again skips what it has and a changed setting writes a row of its own."""

from __future__ import annotations

import hashlib
import json
from dataclasses import fields, replace

from fedfuse.federation.site_cache import site_set_key
from fedfuse.fusion import FusionMethod
from fedfuse.settings.hydra import NON_RESULT_OPTIONS
from fedfuse.settings.run import RunSettings

ROW_FORMAT = "fedfuse-compare-row/1"
#: a row's stage: the fused model as fused, or fine-tuned after fusion
STAGES = ("zero-shot", "finetuned")
#: run-config keys that pick the data a fusion set or test set is drawn from
_ROW_FIELDS = ("score_method", "fusion_samples", "fusion_source", "fusion_data", "test_samples")


def row_id(
    settings: RunSettings, sites: int, method: FusionMethod, runner: str, stage: str = "zero-shot"
) -> str:
    """A stable digest of everything that determines a row (site set, scores, fusion and test
    sets with any augmentation, the method and its result-changing options, the runner, and for
    a fine-tuned row the fine-tuning keys). Rows without augmentation keep the ids they had
    before augmentation existed; a fine-tuned row's id reads ``<method>-ft-<digest>``."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    options = {k: v for k, v in method.options().items() if k not in NON_RESULT_OPTIONS}
    preimage = {
        "site_set": site_set_key(settings, sites),
        **{name: getattr(settings, name) for name in _ROW_FIELDS},
        "method": method.name,
        "options": options,
        "runner": runner,
    }
    augment = settings.fusion_augment_options()
    if augment is not None:
        preimage["fusion_augment"] = augment
    if settings.fusion_invert_samples:  # absent by default: earlier rows keep their ids
        preimage["fusion_invert"] = [settings.fusion_invert_samples, settings.fusion_invert_steps]
    if settings.fusion_gaussian_samples:  # absent by default: earlier rows keep their ids
        preimage["fusion_gaussians"] = [
            settings.fusion_gaussian_samples,
            settings.fusion_gaussian_rank,
        ]
    if settings.fused_widths.strip():  # absent by default: earlier rows keep their ids
        preimage["fused_widths"] = settings.fused_widths.strip()
    prefix = method.name
    if stage == "finetuned":
        preimage["finetune"] = settings.finetune_options()
        prefix += "-ft"
    digest = hashlib.sha256(json.dumps(preimage, sort_keys=True, default=str).encode())
    return f"{prefix}-{digest.hexdigest()[:12]}"


def without_finetuning(settings: RunSettings) -> RunSettings:
    """``settings`` with the fine-tuning keys at their defaults (what a zero-shot row records:
    the same whichever job wrote it)."""
    default = RunSettings()
    names = [f.name for f in fields(RunSettings) if f.name.startswith("finetune_")]
    return replace(settings, **{name: getattr(default, name) for name in names})


__all__ = ["ROW_FORMAT", "STAGES", "row_id", "without_finetuning"]
