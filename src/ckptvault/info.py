"""Read-only views of manifests for users: CheckpointInfo and TensorInfo."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ._format.records import LossyInfo, Manifest, TensorRecord
from ._save.commit import metrics_from_manifest


@dataclass(frozen=True)
class TensorInfo:
    """One stored array. ``nbytes`` is its size as saved (original dtype); ``stored_bytes`` counts its
    share of the chunks it lives in (for a lossy tensor, including its scales). ``codec`` names the
    lossy codec and the lossless one (``"bf16+zstd"``); ``error`` is the measured lossy error
    (``max_abs``, ``rel_l2``, ``flushed``, ``overflow``, ``nan``), None when stored exactly."""

    path: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    stored_bytes: int
    codec: str
    error: dict[str, float] | None = None
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint.

    ``logical_bytes``: bytes of its arrays uncompressed. ``stored_bytes``: stored
    size of every chunk it references. ``added_bytes``: what this checkpoint
    added to the vault (chunks no earlier checkpoint had).
    ``metrics``: as saved; a non-finite number (NaN, infinity) is stored as the string ``"nan"``, ``"inf"`` or
    ``"-inf"`` and given back here as a float (so a metric saved as one of those strings also reads back as a float).
    """

    step: int
    time: float
    logical_bytes: int
    stored_bytes: int
    added_bytes: int
    metrics: dict[str, Any]
    metadata: dict[str, Any]
    tensors: list[TensorInfo] = field(repr=False)
    num_chunks: int = 0

    @property
    def ratio(self) -> float:
        """Stored / logical bytes (lower is better)."""
        return self.stored_bytes / self.logical_bytes if self.logical_bytes else 1.0

    def to_dict(self, with_tensors: bool = False) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in ("step", "time", "logical_bytes", "stored_bytes", "added_bytes",
                                             "metrics", "metadata", "num_chunks")}
        out["ratio"] = self.ratio
        if with_tensors:
            out["tensors"] = [vars(t) | {"shape": list(t.shape)} for t in self.tensors]
        return out


def _lossy_name(lossy: LossyInfo) -> str:
    return f"{lossy.codec}:{lossy.block}" if lossy.block is not None else lossy.codec


def info_from_manifest(manifest: Manifest) -> CheckpointInfo:
    chunks = manifest.chunks
    records = manifest.tensors

    def share(record: TensorRecord) -> float:
        return sum(chunks[p.chunk].stored * p.length / max(chunks[p.chunk].raw, 1) for p in record.pieces)

    tensors = []
    for t in records:
        if t.kind == "part":
            continue
        lossy = t.lossy if t.is_lossy else None
        stored = share(t) + (sum(share(records[j]) for j in lossy.parts.values()) if lossy else 0)
        codec = f"{_lossy_name(lossy)}+{t.codec}" if lossy else t.codec
        tensors.append(TensorInfo(t.path, t.kind, t.dtype, t.shape,
                                  t.restored_nbytes, round(stored), codec,
                                  _error(lossy.error if lossy else None), t.lossy.notes if t.lossy else ()))
    return CheckpointInfo(
        step=manifest.step, time=manifest.time, logical_bytes=manifest.logical_bytes,
        stored_bytes=manifest.stored_bytes, added_bytes=manifest.added_bytes,
        metrics=metrics_from_manifest(manifest.metrics),
        metadata=manifest.metadata, tensors=tensors, num_chunks=len(chunks),
    )


def _error(stored: dict[str, Any] | None) -> dict[str, float] | None:
    """A manifest's measured error with its numbers as floats (non-finite ones are stored as strings)."""
    return None if stored is None else {k: float(v) if isinstance(v, str) else v for k, v in stored.items()}
