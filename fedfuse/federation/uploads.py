"""Sites' uploads: what one site sends once, and the run directory that keeps every upload.

A server never needs every upload in memory at once. :class:`UploadStore` writes each upload to
``<run>/clients/client_<partition id>.safetensors`` (weights, importance scores, optional Gram
matrices and the site's facts, see :mod:`fedfuse.io.checkpoint`) the moment it is accepted, and
hands fusion methods lazy sequences: a model is loaded memory-mapped only when a method asks for
it, and a site's Gram matrices only while RegMean sums them. The same directory is what
``fedfuse fuse <run dir>`` fuses again with another method, long after the sites went home.

:func:`needs_grams` says whether the sites must upload Gram matrices. What the server makes of
the uploads for the fusion methods (:class:`~fedfuse.fusion.FusionInputs`, the completed fusion
set) comes from :mod:`fedfuse.federation.upload_inputs`.
"""

from __future__ import annotations

import logging
import re
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar, overload

import torch

from fedfuse.fusion import FusionMethod
from fedfuse.fusion.statistics.class_gaussians import ClassGaussians
from fedfuse.io.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from fedfuse.io.validation import (
    ContributionError,
    as_count,
    validate_partition,
    validate_site_facts,
)
from fedfuse.models import LeveledModel, ModelSpec
from fedfuse.models.importance import Scores

log = logging.getLogger(__name__)

T = TypeVar("T")

_FILE = re.compile(r"client_(\d+)\.safetensors")


@dataclass
class ClientUpload:
    """What one site sends to the server after local training."""

    model: LeveledModel
    scores: Scores
    num_examples: int
    #: the site's training samples per class (None: not reported, e.g. by a plain ClientApp)
    class_counts: list[int] | None
    partition_id: int
    num_partitions: int
    score_method: str
    init: str
    train_loss: float
    grams: dict[int, torch.Tensor] | None = None
    #: the site's Fisher information (:func:`fedfuse.fusion.statistics.fisher.site_fisher`),
    #: when a method of the run reads it
    fisher: dict[str, torch.Tensor] | None = None
    #: the site's class Gaussians (:mod:`fedfuse.fusion.statistics.class_gaussians`), when the run
    #: completes its fusion set from them
    class_gaussians: ClassGaussians | None = None
    #: wall time of the site's phases (load, train, score, grams), as the site reported it
    seconds: dict[str, float] = field(default_factory=dict)
    #: the site's name (its SuperNode's ``site-name`` node config; "" when it gave none)
    site_name: str = ""
    #: the Ray node the site ran on in a simulation ("" when deployed)
    ray_node: str = ""

    def payload_bytes(self) -> int:
        """Bytes of the tensors the site uploads: weights, scores and Grams when sent."""
        return sum(self.payload_parts().values())

    def payload_parts(self) -> dict[str, int]:
        """Bytes of each part of the upload (``weights``, ``scores``, ``grams``, ``fisher``,
        ``class_gaussians``), so that a method's cost counts only the parts it reads."""

        def size(tensors: Iterable[torch.Tensor]) -> int:
            return sum(t.numel() * t.element_size() for t in tensors)

        return {
            "weights": size(self.model.state_dict().values()),
            "scores": size(self.scores.values()),
            "grams": size((self.grams or {}).values()),
            "fisher": size((self.fisher or {}).values()),
            "class_gaussians": 0 if self.class_gaussians is None else self.class_gaussians.nbytes,
        }

    def facts(self) -> dict[str, Any]:
        """The site's facts, JSON-ready (what results files and checkpoint metadata record)."""
        return {
            "site_name": self.site_name,
            "upload_bytes": self.payload_bytes(),
            "upload_parts": self.payload_parts(),
            "partition_id": self.partition_id,
            "num_partitions": self.num_partitions,
            "num_examples": self.num_examples,
            "class_counts": None if self.class_counts is None else list(self.class_counts),
            "train_loss": self.train_loss,
            "score_method": self.score_method,
            "init": self.init,
            "seconds": dict(self.seconds),
            **({"ray_node": self.ray_node} if self.ray_node else {}),
        }


class LazySequence(Sequence[T], Generic[T]):
    """A read-only sequence whose items are produced by a loader on every access (no caching).

    Fusion methods iterate over models and Gram matrices; with this sequence only the item in
    use has to be in memory, and whatever a method drops is freed.
    """

    def __init__(self, size: int, load: Callable[[int], T]) -> None:
        self._size = size
        self._load = load

    def __len__(self) -> int:
        return self._size

    @overload
    def __getitem__(self, index: int) -> T: ...

    @overload
    def __getitem__(self, index: slice) -> list[T]: ...

    def __getitem__(self, index: int | slice) -> T | list[T]:
        if isinstance(index, slice):
            return [self._load(i) for i in range(*index.indices(self._size))]
        if not -self._size <= index < self._size:
            raise IndexError(f"index {index} out of range for {self._size} items")
        return self._load(index % self._size)

    def __iter__(self) -> Iterator[T]:
        return (self._load(i) for i in range(self._size))


@dataclass(frozen=True)
class StoredUpload:
    """One site's upload as kept on disk: the file and the small facts kept in memory."""

    path: Path
    partition_id: int
    num_partitions: int
    num_examples: int
    class_counts: list[int] | None
    scores: Scores | None
    has_grams: bool
    source: str
    facts: dict[str, Any]
    has_fisher: bool = False
    has_class_gaussians: bool = False


class UploadStore:
    """The uploads of one run, one checkpoint file per site, in ``directory``.

    Args:
        directory: where the site files live (created when missing).
        expected_spec: the architecture every upload must have (None: the first one's).
    """

    def __init__(self, directory: str | Path, *, expected_spec: ModelSpec | None = None) -> None:
        self.directory = Path(directory)
        self.expected_spec = expected_spec
        self._entries: dict[int, StoredUpload] = {}

    @classmethod
    def for_run(
        cls, store: UploadStore | str | Path | None, expected_spec: ModelSpec | None = None
    ) -> UploadStore:
        """A run's store: ``store`` itself (given ``expected_spec`` if it has none), or a new
        subfolder of the folder ``store`` (None: of a temporary folder), so none is reused."""
        if isinstance(store, UploadStore):
            if expected_spec is not None and store.expected_spec is None:
                store.expected_spec = expected_spec
            return store
        if store is None:
            folder = tempfile.mkdtemp(prefix="fedfuse-uploads-")
        else:
            Path(store).mkdir(parents=True, exist_ok=True)
            folder = tempfile.mkdtemp(prefix=time.strftime("run-%Y%m%d-%H%M%S-"), dir=store)
        return cls(folder, expected_spec=expected_spec)

    # ------------------------------------------------------------------ writing
    def add(
        self, upload: ClientUpload, *, source: str, metadata: dict[str, Any] | None = None
    ) -> StoredUpload:
        """Write ``upload`` to the store; a second upload for a partition id is refused.

        Raises:
            ContributionError: naming ``source``, when the partition id was already uploaded or
                the architecture differs from the store's.
        """
        pid = upload.partition_id
        if pid in self._entries:
            raise ContributionError(
                f"{source}: partition-id {pid} was already uploaded by "
                f"{self._entries[pid].source}; its upload is ignored"
            )
        spec = upload.model.spec
        if self.expected_spec is not None and spec != self.expected_spec:
            raise ContributionError(
                f"{source}: sent architecture {spec.to_dict()}, the run expects "
                f"{self.expected_spec.to_dict()}"
            )
        path = self.directory / f"client_{pid}.safetensors"
        if path.exists():
            raise ContributionError(
                f"{source}: {path} already exists; a store never overwrites a site's file"
            )
        facts = {**upload.facts(), "source": source}
        save_checkpoint(
            path,
            upload.model,
            scores=upload.scores or None,
            grams=upload.grams,
            fisher=upload.fisher,
            class_gaussians=None
            if upload.class_gaussians is None
            else upload.class_gaussians.to_tensors(),
            metadata={**(metadata or {}), **facts},
        )
        self.expected_spec = self.expected_spec or spec
        entry = StoredUpload(
            path=path,
            partition_id=pid,
            num_partitions=upload.num_partitions,
            num_examples=upload.num_examples,
            class_counts=None if upload.class_counts is None else list(upload.class_counts),
            scores=upload.scores or None,
            has_grams=upload.grams is not None,
            source=source,
            facts=facts,
            has_fisher=upload.fisher is not None,
            has_class_gaussians=upload.class_gaussians is not None,
        )
        self._entries[pid] = entry
        return entry

    def discard(self, partition_id: int, reason: str) -> None:
        """Drop an accepted upload from fusion (its file stays, renamed ``*.rejected``)."""
        entry = self._entries.pop(partition_id)
        entry.path.replace(entry.path.with_suffix(".rejected"))
        log.warning("dropped %s: %s", entry.source, reason)

    # ------------------------------------------------------------------ reading
    @classmethod
    def open(cls, directory: str | Path) -> UploadStore:
        """The store of an earlier run: every ``client_<id>.safetensors`` in ``directory``.

        Each file is validated (weights, scores, site facts) as it is indexed; its weights are
        not kept in memory.

        Raises:
            CheckpointError: naming the first unusable file.
            FileNotFoundError: when ``directory`` holds no site file.
        """
        directory = Path(directory)
        files = sorted(
            (int(m.group(1)), p)
            for p in directory.glob("client_*.safetensors")
            if (m := _FILE.fullmatch(p.name))
        )
        if not files:
            raise FileNotFoundError(f"{directory}: no client_<id>.safetensors site files")
        store = cls(directory)
        for pid, path in files:
            checkpoint = load_checkpoint(path)
            meta = checkpoint.metadata
            source = str(path)
            try:
                if meta.get("class_counts") is None:  # a plain ClientApp need not send them
                    count, counts = as_count(meta.get("num_examples"), "num-examples", source), None
                else:
                    count, counts = validate_site_facts(
                        meta.get("num_examples"),
                        meta.get("class_counts"),
                        checkpoint.model.spec.num_classes,
                        source=source,
                    )
                file_pid, total = validate_partition(
                    meta.get("partition_id", pid), meta.get("num_partitions", 0), source=source
                )
            except ContributionError as error:
                raise CheckpointError(str(error)) from None
            if file_pid != pid:
                raise CheckpointError(f"{path}: metadata says partition_id {file_pid}")
            if store.expected_spec is not None and checkpoint.model.spec != store.expected_spec:
                raise CheckpointError(
                    f"{path}: architecture {checkpoint.model.spec.to_dict()} differs from "
                    f"{files[0][1]}'s {store.expected_spec.to_dict()}"
                )
            store.expected_spec = checkpoint.model.spec
            with_grams, with_fisher = _has_prefix(path, "grams."), _has_prefix(path, "fisher.")
            store._entries[pid] = StoredUpload(
                path=path,
                partition_id=pid,
                num_partitions=total,
                num_examples=count,
                class_counts=counts,
                scores=checkpoint.scores,
                has_grams=with_grams,
                source=str(meta.get("source", path)),
                facts={k: v for k, v in meta.items() if k not in ("settings",)},
                has_fisher=with_fisher,
                has_class_gaussians=_has_prefix(path, "gaussians."),
            )
        return store

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def entries(self) -> list[StoredUpload]:
        """The accepted uploads, by partition id."""
        return [self._entries[pid] for pid in sorted(self._entries)]

    def models(self) -> LazySequence[LeveledModel]:
        """The sites' models by partition id, each loaded (memory-mapped) when accessed."""
        paths = [e.path for e in self.entries]
        return LazySequence(len(paths), lambda i: load_checkpoint(paths[i]).model)

    def grams(self) -> LazySequence[dict[int, torch.Tensor]] | None:
        """Every site's Gram matrices, loaded one site at a time; None unless all sent them."""
        return self._lazy_part("grams", lambda entry: entry.has_grams)

    def fisher(self) -> LazySequence[dict[str, torch.Tensor]] | None:
        """Every site's Fisher information, loaded one site at a time; None unless all sent it."""
        return self._lazy_part("fisher", lambda entry: entry.has_fisher)

    def class_gaussians(self) -> list[ClassGaussians] | None:
        """Every site's class Gaussians (small), checked as read; None unless all sent them.

        Raises:
            CheckpointError: naming the site file whose Gaussians are unusable.
        """
        paths = self._sent_by_all(lambda entry: entry.has_class_gaussians)
        return None if paths is None else [_class_gaussians(path) for path in paths]

    def _sent_by_all(self, sent: Callable[[StoredUpload], bool]) -> list[Path] | None:
        """The site files by partition id when every site sent a part (``sent``); else None."""
        entries = self.entries
        if not entries or not all(sent(entry) for entry in entries):
            return None
        return [entry.path for entry in entries]

    def _lazy_part(
        self, part: Literal["grams", "fisher"], sent: Callable[[StoredUpload], bool]
    ) -> LazySequence[Any] | None:
        """Every site's ``part`` of its file, loaded one site at a time; None unless all sent it."""
        paths = self._sent_by_all(sent)
        if paths is None:
            return None

        def load(index: int) -> Any:
            tensors = getattr(load_checkpoint(paths[index], **{f"with_{part}": True}), part)
            assert tensors is not None
            return tensors

        return LazySequence(len(paths), load)

    def scores(self) -> list[Scores] | None:
        """Every site's importance scores; None unless all sent them."""
        scores = [e.scores for e in self.entries]
        return None if any(s is None for s in scores) else scores  # type: ignore[return-value]


def _class_gaussians(path: Path) -> ClassGaussians:
    checkpoint = load_checkpoint(path, with_class_gaussians=True)
    spec = checkpoint.model.spec
    try:
        return ClassGaussians.from_tensors(
            checkpoint.class_gaussians or {},
            spec.input_shape,
            num_classes=spec.num_classes,
            source=str(path),
        )
    except ValueError as error:
        raise CheckpointError(str(error)) from None


def _has_prefix(path: Path, prefix: str) -> bool:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return any(name.startswith(prefix) for name in handle.keys())  # noqa: SIM118


def needs_grams(methods: Iterable[FusionMethod]) -> bool:
    """Whether one of the configured ``methods`` reads the sites' level Gram matrices (RegMean),
    as their declared :meth:`~fedfuse.fusion.FusionMethod.needs` say; sites upload them only
    then (they are large)."""
    return any("grams" in method.needs() for method in methods)
