"""Read-only views of manifests for users: CheckpointInfo and TensorInfo."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ._format.records import LossyInfo, Manifest, TensorRecord
from ._reports.arrays import stored_arrays
from ._save.commit import metrics_from_manifest


@dataclass(frozen=True)
class TensorInfo:
    """One stored array. ``nbytes`` is its size as saved (original dtype); ``stored_bytes`` counts its
    share of the chunks it lives in (for a lossy tensor, including its scales). ``codec`` names the
    lossy codec and the lossless one (``"bf16+zstd"``); ``error`` is the measured lossy error
    (``max_abs``, ``rel_l2``, ``flushed``, ``overflow``, ``nan``), None when stored exactly.

    An array of a DCP checkpoint (``ckptvault.distributed.VaultWriter``) stored as the shards the ranks held is one
    TensorInfo: ``shape`` is the whole array's (its global shape), ``nbytes`` and ``stored_bytes`` sum over its
    shards, ``shards`` counts them and ``boxes`` gives each one's ``(offsets, shape)`` in the array (empty, and
    ``shards`` 1, for an array not stored as shards).

    ``predicted``: for an array stored as its residual against a prediction from the checkpoint one step earlier
    (``DeltaOptions(predict=True)``), the prediction's kernel (such as ``"adam-param-1"``); None otherwise."""

    path: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    stored_bytes: int
    codec: str
    error: dict[str, float] | None = None
    notes: tuple[str, ...] = ()
    shards: int = 1
    boxes: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = ()
    predicted: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (``boxes`` as ``[{"offsets", "shape"}]``)."""
        return vars(self) | {"shape": list(self.shape), "notes": list(self.notes),
                             "boxes": [{"offsets": list(o), "shape": list(s)} for o, s in self.boxes]}


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint.

    ``logical_bytes``: bytes of its arrays uncompressed. ``stored_bytes``: stored
    size of every chunk it references. ``added_bytes``: what this checkpoint
    added to the vault (chunks no earlier checkpoint had).
    ``tensors``: one per array (a DCP checkpoint's shards of one array are one, see :class:`TensorInfo`).
    ``sharded``: a DCP checkpoint whose arrays are stored as shards; ``num_shards``: the records holding its
    arrays (``len(tensors)`` unless sharded); ``max_shards``: the most shards one array is cut into (for an FSDP
    save whose arrays all have at least as many rows as ranks, the world size of the save).
    ``metrics``: as saved; a non-finite number (NaN, infinity) is stored as the string ``"nan"``, ``"inf"`` or
    ``"-inf"`` and given back here as a float (so a metric saved as one of those strings also reads back as a float).
    ``keyframe_step``: the keyframe this checkpoint's deltas are against (its own step for a keyframe);
    ``chain``: how many earlier checkpoints a restore of it rebuilds first (predicted deltas: the restore chain's
    length; 0 otherwise).
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
    sharded: bool = False
    num_shards: int = 0
    max_shards: int = 1
    keyframe_step: int | None = None
    chain: int = 0

    @property
    def ratio(self) -> float:
        """Stored / logical bytes (lower is better)."""
        return self.stored_bytes / self.logical_bytes if self.logical_bytes else 1.0

    def to_dict(self, with_tensors: bool = False) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in ("step", "time", "logical_bytes", "stored_bytes", "added_bytes",
                                             "metrics", "metadata", "num_chunks", "sharded", "num_shards",
                                             "max_shards", "keyframe_step", "chain")}
        out["ratio"] = self.ratio
        if with_tensors:
            out["tensors"] = [t.to_dict() for t in self.tensors]
        return out


def _lossy_name(lossy: LossyInfo) -> str:
    return f"{lossy.codec}:{lossy.block}" if lossy.block is not None else lossy.codec


def info_from_manifest(manifest: Manifest) -> CheckpointInfo:
    chunks = manifest.chunks
    records = manifest.tensors

    def share(record: TensorRecord) -> float:
        return sum(chunks[p.chunk].stored * p.length / max(chunks[p.chunk].raw, 1) for p in record.pieces)

    tensors = []
    arrays = stored_arrays(manifest)
    for array in arrays:
        t = array.first
        lossy = t.lossy if t.is_lossy else None  # shards are lossless (the schema checks it)
        stored = sum(share(records[i]) for i in array.indices)
        stored += sum(share(records[j]) for j in lossy.parts.values()) if lossy else 0
        codec = f"{_lossy_name(lossy)}+{t.codec}" if lossy else t.codec
        tensors.append(TensorInfo(t.path, t.kind, t.dtype, array.shape, array.nbytes, round(stored), codec,
                                  _error(lossy.error if lossy else None), t.lossy.notes if t.lossy else (),
                                  array.shards, array.boxes, t.predict.op if t.predict is not None else None))
    return CheckpointInfo(
        step=manifest.step, time=manifest.time, logical_bytes=manifest.logical_bytes,
        stored_bytes=manifest.stored_bytes, added_bytes=manifest.added_bytes,
        metrics=metrics_from_manifest(manifest.metrics),
        metadata=manifest.metadata, tensors=tensors, num_chunks=len(chunks),
        sharded=any(a.sharded for a in arrays), num_shards=sum(a.shards for a in arrays),
        max_shards=max((a.shards for a in arrays), default=1), keyframe_step=manifest.keyframe,
        chain=len(manifest.chain),
    )


def _error(stored: dict[str, Any] | None) -> dict[str, float] | None:
    """A manifest's measured error with its numbers as floats (non-finite ones are stored as strings)."""
    return None if stored is None else {k: float(v) if isinstance(v, str) else v for k, v in stored.items()}
