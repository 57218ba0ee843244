"""Which keyframe chunk each new chunk of a delta save is encoded against: the one that held exactly the same
region of the same tensor in the keyframe, stored the same way (a pure function of the plans and the keyframe)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._format.records import LossyInfo, Manifest, TensorRecord
from .._format.shards import box_of
from .._save.chunking import ChunkPlan
from .._save.snapshot import ArrayRecord


@dataclass(frozen=True)
class BaseRef:
    """The keyframe chunk a planned chunk may be delta-encoded against."""

    id: str
    stored: int


def find_bases(plans: list[ChunkPlan], records: list[ArrayRecord], keyframe: Manifest) -> list[BaseRef | None]:
    """For each planned chunk, the keyframe chunk that held exactly the same region, if any.

    A region matches when every array in the chunk has the same key path
    (and, for a shard, the same offsets in its global array), dtype and shape in
    the keyframe and sits at the same offset of one full (non-delta) keyframe
    chunk of the same length.
    """
    by_path = {(t.path, box_of(t)[1]): t for t in keyframe.tensors}
    chunks = keyframe.chunks
    bases: list[BaseRef | None] = []
    for plan in plans:
        candidate: int | None = None
        offset = 0
        for source in plan.sources:
            record = records[source.leaf]
            box = record.offsets if record.offsets is not None else (0,) * len(record.shape)
            located = _locate(by_path.get((record.path, box)), record, source.start, source.length)
            if located is None or located[1] != offset or candidate not in (None, located[0]):
                candidate = None
                break
            candidate = located[0]
            offset += source.length
        entry = chunks[candidate] if candidate is not None else None
        usable = entry is not None and entry.base is None and entry.raw == plan.nbytes
        bases.append(BaseRef(entry.id, entry.stored) if entry is not None and usable else None)
    return bases


def _locate(base: TensorRecord | None, record: ArrayRecord, start: int, length: int) -> tuple[int, int] | None:
    """(chunk index, offset in chunk) of bytes [start, start+length) of ``base``, if in one piece."""
    if base is None or base.kind != record.kind or base.dtype != record.dtype or base.shape != tuple(record.shape):
        return None
    if base.predict is not None or record.predict is not None:  # residuals: XOR with another form would not pay
        return None
    if _stored_as(base.lossy) != _stored_as(record.lossy):
        return None
    position = 0
    for piece in base.pieces:
        if position == start:
            return (piece.chunk, piece.offset) if piece.length == length else None
        position += piece.length
    return None


def _stored_as(lossy: LossyInfo | None) -> tuple[Any, ...]:
    """What identifies a lossy stored form, of a manifest record or of one a save is writing (() for exact
    storage); deltas need equal forms."""
    return () if lossy is None else _form(lossy.codec, lossy.block, lossy.stored_dtype, lossy.base_step)


def _form(codec: str, block: int | None, stored_dtype: str | None, base_step: int | None) -> tuple[Any, ...]:
    return () if codec == "lossless" else (codec, block, stored_dtype, base_step)
