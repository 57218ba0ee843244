"""The lossy step of a save: runs in the background, between the snapshot and chunking.

For every array whose rule names a lossy codec, the staged bytes are encoded
(``_codecs.lossy.encode_safely``), the error is measured, and the record's bytes are
replaced by the stored representation: the primary part keeps the record
(``stored_dtype``/``stored_shape`` in its :class:`LossyInfo`) and secondary parts
(int8 block scales) become extra records of kind ``"part"`` after the tree's
leaves. Deltas and chunking then work on what is actually stored, so a
restore gives exactly what the manifest promises.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, replace
from typing import Any

import torch

from .._arrays import empty_like_record, tensor_bytes, torch_dtype, torch_dtype_name, writable_bytes
from .._codecs.lossy import (
    Alloc,
    Encoded,
    LossySafety,
    LossySpec,
    applies_to,
    describe,
    encode_safely,
    error_for_manifest,
    fresh,
    parse_codec,
)
from .._format.records import LossyInfo, Manifest
from .._format.shards import box_of
from .._parallel import map_all
from .._vault import Vault
from .snapshot import ArrayRecord, KeyframePiece, Snapshot

log = logging.getLogger(__name__)


class LossyBuffers:
    """Output memory of lossy encodings, kept per record from one save to the next, like the staging buffer.

    A cast into fresh memory is several times slower than into reused memory, because every fresh page
    faults (figures: docs/benchmarks/lossy.md). The memory kept is the size of the stored forms of the lossy
    records (at most half their original bytes). Only one save may use the buffers at a time: the saver
    runs one save at a time, and a save's snapshot views these buffers until its chunks are written.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}
        self._used: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def allocator(self, path: str) -> Alloc:
        """An :data:`~ckptvault._codecs.lossy.Alloc` for record ``path``: its buffer from the last save, grown if needed."""

        def alloc(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            nbytes = dtype.itemsize * math.prod(shape)
            with self._lock:
                key = (path, name)
                buffer = self._buffers.get(key)
                if buffer is None or buffer.numel() < nbytes:
                    buffer = self._buffers[key] = torch.empty(max(nbytes, 1), dtype=torch.uint8)
                self._used.add(key)
            return buffer[:nbytes].view(dtype).view(shape)

        return alloc

    def release_unused(self) -> None:
        """Free the buffers no encoding asked for since the last call (tensors that left the state or the rules)."""
        with self._lock:
            self._buffers = {k: v for k, v in self._buffers.items() if k in self._used}
            self._used = set()

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._buffers.values())


def apply_lossy(snapshot: Snapshot, policy: LossySafety, default_lossless: str, vault: Vault,
                keyframe: Manifest | None, buffers: LossyBuffers | None = None) -> Snapshot:
    """Return a snapshot whose lossy-ruled records hold their encoded bytes (others unchanged).

    ``buffers``: where encoded parts go, reused across saves (default: fresh memory each time).

    Order: decide each record's codec and read residual bases (on this thread; reading
    uses the vault's pool), then encode and measure all lossy records in parallel on
    the pool, then assemble records in their original order.
    """
    records, views = list(snapshot.records), list(snapshot.views)
    jobs: list[tuple[int, LossySpec, str, ResidualBase | None]] = []
    for index, record in enumerate(snapshot.records):
        spec, lossless = parse_codec(record.codec, default_lossless)
        if spec is None or record.kind != "torch" or not applies_to(spec, torch_dtype(record.dtype)):
            if record.codec != lossless:  # a replace() per record of a lossless state cost more than the rest
                records[index] = replace(record, codec=lossless)
            continue
        base_entry = _residual_base(vault, keyframe, record) if spec.kind == "residual-int8" else None
        if spec.kind == "residual-int8" and base_entry is None:
            records[index] = replace(record, codec=lossless)  # keyframe (or no usable base): stored exactly
            continue
        jobs.append((index, spec, lossless, base_entry))

    def encode_one(job: tuple[int, LossySpec, str, Any]) -> tuple[Encoded | None, list[str]]:
        index, spec, _lossless, base_entry = job
        original = _as_tensor(records[index], views[index])
        alloc = fresh if buffers is None else buffers.allocator(records[index].path)
        return encode_safely(records[index].path, original, spec, policy, base_entry.value if base_entry else None, alloc)

    results = map_all(vault.pool, encode_one, jobs)
    if buffers is not None:
        buffers.release_unused()
    extra_records: list[ArrayRecord] = []
    extra_views: list[memoryview] = []
    for (index, spec, lossless, base_entry), (encoded, notes) in zip(jobs, results, strict=True):
        record = records[index]
        if encoded is None:
            fallback = LossyInfo(codec="lossless", requested=spec.name, notes=tuple(notes))
            records[index] = replace(record, codec=lossless, lossy=fallback)
            continue
        record, view, parts = _stored_form(record, encoded, lossless, notes, base_entry)
        indices = {}
        for name, (part_record, part_view) in parts.items():
            indices[name] = len(records) + len(extra_records)
            extra_records.append(part_record)
            extra_views.append(part_view)
        assert record.lossy is not None  # _stored_form always describes the stored form
        records[index] = replace(record, lossy=replace(record.lossy, parts=indices))
        views[index] = view
    return replace(snapshot, records=records + extra_records, views=views + extra_views)


def _as_tensor(record: ArrayRecord, view: memoryview) -> torch.Tensor:
    if not view.nbytes:
        return torch.empty(record.shape, dtype=torch_dtype(record.dtype))
    return torch.frombuffer(view, dtype=torch.uint8).view(torch_dtype(record.dtype)).reshape(record.shape)


def _stored_form(record: ArrayRecord, encoded: Encoded, lossless: str, notes: list[str],
                 base_entry: ResidualBase | None
                 ) -> tuple[ArrayRecord, memoryview, dict[str, tuple[ArrayRecord, memoryview]]]:
    primary = encoded.parts["q"]
    lossy = LossyInfo(**describe(encoded.spec), stored_dtype=torch_dtype_name(primary.dtype),
                      stored_shape=tuple(primary.shape), original_nbytes=record.nbytes,
                      error=error_for_manifest(encoded.error), notes=tuple(notes),
                      base_step=None if base_entry is None else base_entry.step)
    stored = replace(record, nbytes=primary.numel() * primary.dtype.itemsize, itemsize=primary.dtype.itemsize,
                     codec=lossless, lossy=lossy, keyframe_pieces=() if base_entry is None else base_entry.pieces)
    parts = {}
    for name, part in encoded.parts.items():
        if name == "q":
            continue
        part_record = ArrayRecord(f"{record.path}#{name}", "part", torch_dtype_name(part.dtype), list(part.shape),
                                  part.numel() * part.dtype.itemsize, part.dtype.itemsize, lossless)
        parts[name] = (part_record, tensor_bytes(part))
    return stored, tensor_bytes(primary.contiguous()), parts


@dataclass(frozen=True)
class ResidualBase:
    """The keyframe's exact copy of a tensor a residual is encoded against, its step, and where it lives."""

    value: torch.Tensor
    step: int
    pieces: tuple[KeyframePiece, ...]


def _residual_base(vault: Vault, keyframe: Manifest | None, record: ArrayRecord) -> ResidualBase | None:
    """The keyframe's exact copy of this tensor (of this shard: the same key path and offsets), if the keyframe
    stored it exactly."""
    if keyframe is None:
        return None
    box = record.offsets if record.offsets is not None else (0,) * len(record.shape)  # a shard: the same box
    index = next((i for i, t in enumerate(keyframe.tensors) if t.path == record.path and box_of(t)[1] == box), None)
    entry = None if index is None else keyframe.tensors[index]
    if (index is None or entry is None or entry.kind != "torch" or entry.dtype != record.dtype
            or entry.shape != tuple(record.shape) or entry.is_lossy):
        return None
    from .._restore.tensors import read_into

    value = empty_like_record("torch", entry.dtype, list(entry.shape))
    read_into(vault, keyframe, {index: writable_bytes(value)})
    pieces = tuple(KeyframePiece(keyframe.chunks[p.chunk], p.offset, p.length) for p in entry.pieces)
    return ResidualBase(value, keyframe.step, pieces)
