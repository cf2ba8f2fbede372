"""Trained sites kept on disk, so a sweep over fusion methods never retrains a site.

A *site set* is the trained models of the ``K`` sites of one simulated split; everything that
determines it (data, split, model, training recipe, score sampling, seed, ``K``) is hashed into
its directory name::

    <root>/<key>/site_<i>.safetensors   site i: its model (fedfuse checkpoint), its Gram
                                         matrices once computed, and in the metadata its facts
                                         and its importance scores by score method
    <root>/<key>/site_set.json          the settings behind the key, class counts, evaluations

Both runners of ``fedfuse compare`` go through :func:`fedfuse.federation.site.train_site`,
which reads and writes one site's entry (:meth:`SiteCache.site`) when its caller passes one:
the library runner does, and so does a Flower site when the run config's ``site-cache`` names a
root (:func:`run_site_cache`), so the library runner and a real Flower simulation share trained
sites. Files are written atomically; an entry whose key, architecture or tensors do not check
out is ignored with a warning and recomputed.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch

from fedfuse.federation.site import TrainedSite
from fedfuse.io.atomic import write_json
from fedfuse.io.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from fedfuse.io.validation import ContributionError, validate_scores
from fedfuse.models import ModelSpec
from fedfuse.models.importance import Scores
from fedfuse.settings.run import RunSettings

log = logging.getLogger(__name__)

FORMAT = "fedfuse-site-set/1"
#: bump when cached sites stop being valid (e.g. a change in how sites train)
CACHE_VERSION = 1
#: RunSettings fields that determine a site's trained model and its scores' sample
SITE_FIELDS = (
    "dataset",
    "data_root",
    "partitioner",
    "dirichlet_alpha_min",
    "dirichlet_min_max_ratio",
    "sharded_class_groups",
    "train_samples",
    "validation_share",
    "seed",
    "model",
    "mlp_widths",
    "vgg_width_multiplier",
    "init",
    "local_epochs",
    "batch_size",
    "optimizer",
    "lr",
    "weight_decay",
    "label_smoothing",
    "score_samples",
    "score_steps",
    "device",
)


def site_set_fields(settings: RunSettings, num_sites: int) -> dict[str, Any]:
    """Everything that determines the site set (the preimage of its key)."""
    fields = {name: getattr(settings, name) for name in SITE_FIELDS}
    if not settings.validation_share:  # no held-out rows: the key of the sites before the field
        fields.pop("validation_share")
    # fields of another partitioner do not change the split
    if settings.partitioner != "dirichlet":
        fields.pop("dirichlet_alpha_min")
        fields.pop("dirichlet_min_max_ratio")
    if settings.partitioner != "sharded":
        fields.pop("sharded_class_groups")
    if settings.model_options:  # absent when empty, so MLP and VGG keys stay as they were
        fields["model_options"] = settings.model_options
    fields.update(num_sites=num_sites, version=CACHE_VERSION)
    return fields


def site_set_key(settings: RunSettings, num_sites: int) -> str:
    """A short stable digest of :func:`site_set_fields`."""
    text = json.dumps(site_set_fields(settings, num_sites), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


#: one cached site: its model, facts, scores by score method and Grams (if computed)
CachedSite = TrainedSite


class SiteCache:
    """The site sets under ``root`` (see the module docstring)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser().resolve()

    def directory(self, settings: RunSettings, num_sites: int) -> Path:
        return self.root / site_set_key(settings, num_sites)

    def site_path(self, settings: RunSettings, site: int, num_sites: int) -> Path:
        return self.directory(settings, num_sites) / f"site_{site}.safetensors"

    def load(
        self, settings: RunSettings, site: int, num_sites: int, spec: ModelSpec | None = None
    ) -> CachedSite | None:
        """Site ``site``'s cached entry, or None when absent or unusable (logged)."""
        path = self.site_path(settings, site, num_sites)
        if not path.is_file():
            return None
        key = site_set_key(settings, num_sites)
        try:
            checkpoint = load_checkpoint(path, with_grams=True)
        except CheckpointError as error:
            log.warning("ignoring unusable cached site: %s", error)
            return None
        meta = checkpoint.metadata
        if meta.get("site_set") != key or (spec is not None and checkpoint.model.spec != spec):
            log.warning("ignoring cached site %s: trained with other settings", path)
            return None
        scores: dict[str, Scores] = {}
        for method, by_level in (meta.get("scores") or {}).items():
            try:
                vectors = {
                    int(lv): torch.tensor(v, dtype=torch.float32) for lv, v in by_level.items()
                }
                validate_scores(checkpoint.model, vectors, source=f"{path} ({method} scores)")
            except (ContributionError, TypeError, ValueError) as error:
                log.warning("recomputing %s scores: %s", method, error)
                continue
            scores[method] = vectors
        facts = meta.get("facts")
        if not isinstance(facts, dict):
            log.warning("ignoring cached site %s: no site facts", path)
            return None
        return CachedSite(checkpoint.model, facts, scores, checkpoint.grams)

    def save(self, settings: RunSettings, site: int, num_sites: int, entry: CachedSite) -> Path:
        """Write site ``site``'s entry (atomically) and the site set's description."""
        path = self.site_path(settings, site, num_sites)
        metadata = {
            "site_set": site_set_key(settings, num_sites),
            "facts": entry.facts,
            "scores": {
                method: {str(level): v.tolist() for level, v in scores.items()}
                for method, scores in entry.scores.items()
            },
        }
        save_checkpoint(path, entry.model, grams=entry.grams, metadata=metadata)
        description = path.parent / "site_set.json"
        if not description.exists():
            write_json(
                description,
                {
                    "format": FORMAT,
                    "key": site_set_key(settings, num_sites),
                    "fields": site_set_fields(settings, num_sites),
                    "settings": settings.to_config(),
                    "num_sites": num_sites,
                },
            )
        return path

    def site(self, settings: RunSettings, site: int, num_sites: int) -> CachedSiteEntry:
        """Site ``site``'s entry in the site set of ``settings`` and ``num_sites`` sites: the
        cache :func:`fedfuse.federation.site.train_site` takes."""
        return CachedSiteEntry(self, settings, site, num_sites)


class CachedSiteEntry:
    """One site's entry of a :class:`SiteCache`: ``load()`` and ``save(entry)`` (a
    :class:`~fedfuse.federation.site.TrainedSiteCache`)."""

    def __init__(self, cache: SiteCache, settings: RunSettings, site: int, num_sites: int) -> None:
        self.cache = cache
        self.settings = settings
        self.index = site
        self.num_sites = num_sites

    def load(self) -> CachedSite | None:
        return self.cache.load(self.settings, self.index, self.num_sites)

    def save(self, site: CachedSite) -> None:
        self.cache.save(self.settings, self.index, self.num_sites, site)

    def __str__(self) -> str:
        return str(self.cache.root)


def run_site_cache(
    settings: RunSettings, partition_id: int, num_partitions: int, data_path: str | None = None
) -> CachedSiteEntry | None:
    """A simulated site's entry of the run config's ``site-cache`` (None: the run keeps no
    site cache, or the site trains on its own data file)."""
    if not settings.site_cache or data_path:
        return None
    return SiteCache(settings.site_cache).site(settings, partition_id, num_partitions)
