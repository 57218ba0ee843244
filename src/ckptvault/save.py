"""Steps 2-4 of a save: chunk + hash -> dedup -> encode -> write, then commit.

Call order: :func:`take_snapshot` (``snapshot.py``), then :func:`write_chunks`,
then :func:`commit`. Only :func:`commit` makes the checkpoint visible, by
creating its manifest (create-if-absent, or atomic replace with
``overwrite``). If anything fails before it, nothing is committed and the
chunks already written are unreferenced garbage for ``gc``.

Chunk writes may be retried freely: a chunk is named by the hash of its raw
bytes and written with create-if-absent, so writing it twice is harmless.
They go through the store's write batch (``Store.write_batch``), which
:func:`write_chunks` finishes before it returns: every new chunk is durable
and visible before :func:`commit` names it.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ._version import __version__
from .codecs import BytePlanes, PlaneDelta, chain_for
from .delta import BaseRef, DeltaContext, find_bases
from .delta_io import base_planes_for_save
from .errors import CorruptChunkError, InvalidArgumentError, ObjectNotFoundError, SaveError, StepExistsError
from .format import FORMAT_VERSION, records
from .format.chunk_object import CHUNKS_PREFIX, ChunkHeader, chunk_id, chunk_key, object_parts
from .format.manifest import encode_manifest, manifest_key
from .format.records import ChunkRef, LossyInfo, Manifest, TensorRecord
from .format.schema import MAX_DEPTH, MAX_STEP, too_deep
from .guard import ManifestGuard
from .layout import ChunkPlan, LeafSpec, Piece, plan_chunks
from .parallel import map_all
from .snapshot import ArrayRecord, Snapshot
from .stores.base import Store, WriteBatch
from .vault import Vault

log = logging.getLogger(__name__)

Progress = Callable[[int], None]


@dataclass
class ChunkResult:
    """One chunk of a checkpoint: its id, raw and stored sizes, whether this save wrote it,
    and the chunk its stored object is a delta against (None for a full object)."""

    id: str
    raw: int
    stored: int
    new: bool
    base: str | None = None


Payload = bytes | memoryview | list[Any]


def _size(parts: list[Any]) -> int:
    return sum(memoryview(p).nbytes for p in parts)


def _full(planes: BytePlanes, raw: memoryview, parts: list[Any]) -> tuple[ChunkHeader, Payload]:
    """A full chunk: its planes payload if that is smaller than the raw bytes, else the raw bytes."""
    if _size(parts) < len(raw):
        return ChunkHeader(codec=[planes.spec()], raw=len(raw)), parts
    return ChunkHeader(codec=[], raw=len(raw)), raw


#: on a store where asking whether a chunk exists is a request (S3), a save stops asking for chunks that no
#: manifest it read names once this many such probes in a row found nothing, and asks again after a write
#: finds a chunk there (``_ChunkWriter._should_probe``)
PROBE_MISSES = 8

#: where asking whether a chunk exists is a request (S3), the commit's existence check lists the chunk keys
#: instead if the vault seems to hold fewer than this many chunks per chunk it checks (``missing_chunks``)
LIST_PER_PROBE = 10


def pack_threshold(chunk_size: int) -> int:
    """Arrays smaller than this share chunks with other small arrays."""
    return chunk_size // 4


def write_chunks(vault: Vault, snapshot: Snapshot, progress: Progress | None = None,
                 delta: DeltaContext | None = None) -> tuple[list[ChunkResult], list[list[Piece]]]:
    """Write every chunk of ``snapshot`` the vault lacks. Returns chunk results and per-leaf pieces."""
    delta = delta or DeltaContext()
    chunk_size = vault.require().chunk_size
    specs = [LeafSpec(r.nbytes, r.itemsize, r.codec) for r in snapshot.records]
    plans, pieces = plan_chunks(specs, chunk_size, pack_threshold(chunk_size))
    bases = find_bases(plans, snapshot.records, delta.keyframe) if delta.keyframe else [None] * len(plans)
    batch = vault.store.write_batch()
    writer = _ChunkWriter(vault, snapshot, progress, delta, batch)
    try:
        results = map_all(vault.pool, writer.write, plans, bases)
        _finish(batch)  # every new chunk durable and visible before commit() names it
    except BaseException:
        batch.abandon()
        raise
    return results, pieces


class _ChunkWriter:
    """Hash, dedup, encode and store one planned chunk; safe to call from many threads."""

    def __init__(self, vault: Vault, snapshot: Snapshot, progress: Progress | None, delta: DeltaContext,
                 batch: WriteBatch) -> None:
        self.vault, self.snapshot, self.progress, self.batch = vault, snapshot, progress, batch
        self.known_bases, self.keyframe_step, self.guard = delta.known_bases, delta.keyframe_step, delta.guard
        self.cache = delta.cache  # a keyframe save fills it (it ignores adds otherwise); delta saves read it
        self._claimed: dict[str, threading.Event] = {}
        self._done: dict[str, tuple[int, str | None]] = {}
        self._misses = 0  # probes in a row that found nothing
        self._lock = threading.Lock()

    def _raw(self, plan: ChunkPlan) -> memoryview:
        views = self.snapshot.views
        if len(plan.sources) == 1:
            s = plan.sources[0]
            return views[s.leaf][s.start : s.start + s.length]
        return memoryview(b"".join(views[s.leaf][s.start : s.start + s.length] for s in plan.sources))

    def write(self, plan: ChunkPlan, base: BaseRef | None) -> ChunkResult:
        raw = self._raw(plan)
        cid = chunk_id(raw)
        if self._first_claim(cid):
            try:
                created, stored, stored_base = self._store(cid, raw, plan, base)
                self._done[cid] = (stored, stored_base)
            finally:
                self._release(cid)
        else:
            self._wait_for_claim(cid)
            created, (stored, stored_base) = False, self._done[cid]
        if self.cache is not None:  # a keyframe save notes every chunk for the cache (it ignores this otherwise)
            self.cache.add(cid, raw, plan.itemsize)
        if self.progress:
            self.progress(len(raw))
        return ChunkResult(cid, len(raw), stored, created, stored_base)

    def _store(self, cid: str, raw: memoryview, plan: ChunkPlan, base: BaseRef | None) -> tuple[bool, int, str | None]:
        """Encode and write the chunk unless the vault has it. Returns (created, stored size, delta base).

        Whether the vault has it is asked first (the probe) where :meth:`_should_probe` says so; otherwise the
        create-if-absent write answers it, after sending the chunk."""
        store, key = self.vault.store, chunk_key(cid)
        if self._should_probe(cid):
            try:
                size = store.stat(key).size
                self._probed(found=True)
                self.guard.protect(store, cid)  # the reused chunk must outlive this save
                return False, size, self._existing_base(cid)
            except ObjectNotFoundError:
                self._probed(found=False)  # absent, or collected between stat() and touch(): write it
        header, payload = self._encode(cid, raw, plan, base)
        parts = object_parts(header, payload)
        if self.batch.put_parts_if_absent(key, parts):  # the batch copies the parts (of scratch memory) out
            return True, _size(parts), header.base
        self._probed(found=True)  # the vault had a chunk this save did not expect: probe again
        try:
            self.guard.protect(store, cid)  # reused after all: it must outlive this save too
        except ObjectNotFoundError:  # collected since the write found it there: write it after all
            if self.batch.put_parts_if_absent(key, parts):
                return True, _size(parts), header.base
        return False, store.stat(key).size, self._existing_base(cid)

    def _should_probe(self, cid: str) -> bool:
        """Whether to ask the store for ``cid`` before encoding and writing it: always where a probe is cheap
        (a local ``stat``) or the chunk is named by a manifest this save read; on a store where a probe is a
        request, only until ``PROBE_MISSES`` probes in a row found nothing (a new state's chunks are almost all
        new, and a chunk that is there after all costs one upload that the store refuses)."""
        if self.vault.store.cheap_stat or cid in self.known_bases:
            return True
        with self._lock:
            return self._misses < PROBE_MISSES

    def _probed(self, found: bool) -> None:
        with self._lock:
            self._misses = 0 if found else self._misses + 1

    def _encode(self, cid: str, raw: memoryview, plan: ChunkPlan, base: BaseRef | None) -> tuple[ChunkHeader, Payload]:
        """Encode in full, or against ``base`` plane by plane where XOR with the base's plane compresses better.

        The payload may be a list of buffers (viewing this thread's scratch memory) that the write batch
        copies out: one copy of the encoded bytes instead of two.
        """
        stages = chain_for(plan.codec, plan.itemsize)
        if not stages:
            return ChunkHeader(codec=[], raw=len(raw)), raw
        planes = stages[0]
        assert isinstance(planes, BytePlanes) and len(stages) == 1
        if base is not None:
            stage = PlaneDelta(planes.typesize, planes.inner)
            try:
                self.guard.protect(self.vault.store, base.id)  # a base must outlive this save, like a reused chunk
                base_planes = self._base_planes(base.id, planes.typesize)
                parts, uses_base = stage.encode_against(
                    raw, base_planes, lambda: base_planes_for_save(self.vault.store, base.id, planes.typesize,
                                                                   max_raw=self.vault.chunk_size()))
            except (ObjectNotFoundError, CorruptChunkError) as exc:
                log.warning("cannot use delta base %s (%s); storing the chunk in full", base.id, exc)
            else:
                if uses_base and _size(parts) < len(raw):
                    return ChunkHeader(codec=[stage.spec()], raw=len(raw), base=base.id), parts
                return _full(planes, raw, parts)  # no plane XORed: a plain planes payload
        return _full(planes, raw, planes.encode_parts(raw))

    def _base_planes(self, base_id: str, typesize: int) -> list[np.ndarray | None]:
        """The byte planes of keyframe chunk ``base_id``: from the keyframe cache (its high planes, None for the
        others), else read and verified. ObjectNotFoundError if the store lacks the chunk (cached or not: a
        delta needs it there)."""
        cached = None if self.cache is None else self.cache.planes(self.keyframe_step, base_id, typesize)
        if cached is None:
            return base_planes_for_save(self.vault.store, base_id, typesize, max_raw=self.vault.chunk_size())
        self.vault.store.stat(chunk_key(base_id))  # no touch checked that it is there (guard.py)
        return cached

    def _existing_base(self, cid: str) -> str | None:
        if cid in self.known_bases:
            return self.known_bases[cid]
        return self.vault.chunk_base(cid)

    def _first_claim(self, cid: str) -> bool:
        with self._lock:
            if cid in self._claimed:
                return False
            self._claimed[cid] = threading.Event()
            return True

    def _wait_for_claim(self, cid: str) -> None:
        """A duplicate chunk within one save waits until the first copy is stored."""
        event = self._claimed.get(cid)
        if event is not None:
            event.wait()

    def _release(self, cid: str) -> None:
        event = self._claimed.get(cid)
        if event is not None:
            event.set()


def _finish(batch: WriteBatch) -> None:
    """``batch.finish()``; a written object that vanished before it became visible (a concurrent gc took it) fails
    the save as a retryable SaveError, as a chunk missing at commit does."""
    try:
        batch.finish()
    except ObjectNotFoundError as exc:
        raise SaveError(f"{exc}; nothing was committed: save again") from exc


def build_manifest(step: int, snapshot: Snapshot, chunks: list[ChunkResult], pieces: list[list[Piece]],
                   metrics: dict[str, Any] | None, metadata: dict[str, Any] | None,
                   keyframe_step: int | None = None, since_keyframe: int = 0) -> Manifest:
    """The manifest: every tensor, the unique chunks they use, and the statistics.

    ``keyframe_step`` is the keyframe whose chunks this checkpoint's deltas are
    against (None: this checkpoint is a keyframe); ``since_keyframe`` counts
    checkpoints since it.
    """
    table = _ChunkTable()
    remap = [table.add(ChunkRef(c.id, c.raw, c.stored, c.new, c.base)) for c in chunks]
    tensors = tuple(_tensor_record(record, leaf_pieces, remap, table)
                    for record, leaf_pieces in zip(snapshot.records, pieces, strict=True))
    requires = tuple(feature for feature, used in (("lossy", any(t.lossy is not None for t in tensors)),
                                                   ("xplanes", any(c.base for c in table.entries))) if used)
    return Manifest(  # a reader without the features in ``requires`` must refuse, not misread (DESIGN §4)
        step=step, time=time.time(), writer=f"ckptvault {__version__}",
        pickle=snapshot.allow_pickle and any(r.kind == "pickle" for r in snapshot.records),
        logical_bytes=snapshot.logical_bytes, stored_bytes=sum(c.stored for c in table.entries),
        added_bytes=sum(c.stored for c in table.entries if c.new),
        metrics=json_fields(metrics, "metrics"), metadata=json_fields(metadata, "metadata"),
        keyframe_step=step if keyframe_step is None else keyframe_step,
        since_keyframe=0 if keyframe_step is None else since_keyframe,
        tree=snapshot.tree, tensors=tensors, chunks=tuple(table.entries), requires=requires, version=FORMAT_VERSION)


class _ChunkTable:
    """The manifest's list of unique chunks, built by adding references."""

    def __init__(self) -> None:
        self.entries: list[ChunkRef] = []
        self._index: dict[str, int] = {}

    def add(self, chunk: ChunkRef) -> int:
        """Index of ``chunk`` in the table, adding it if new (a chunk this save wrote stays marked new)."""
        index = self._index.get(chunk.id)
        if index is None:
            index = self._index[chunk.id] = len(self.entries)
            self.entries.append(chunk)
        elif chunk.new and not self.entries[index].new:
            self.entries[index] = replace(self.entries[index], new=True)
        return index


def _tensor_record(record: ArrayRecord, pieces: list[Piece], remap: list[int], table: _ChunkTable) -> TensorRecord:
    return TensorRecord(
        path=record.path, kind=record.kind, dtype=record.dtype, shape=tuple(record.shape), nbytes=record.nbytes,
        codec=record.codec, pieces=tuple(records.Piece(remap[p.chunk], p.offset, p.length) for p in pieces),
        global_shape=tuple(record.shape), offsets=(0,) * len(record.shape), requires_grad=record.requires_grad,
        device=None if record.device == "cpu" else record.device,
        lossy=None if record.lossy is None else _lossy_info(record.lossy, table))


def _lossy_info(lossy: dict[str, Any], table: _ChunkTable) -> LossyInfo:
    """The manifest's form of the lossy description a save made (``lossy_stage``); a residual's keyframe copy
    is named in this manifest's own chunk table, so its chunks stay live (DESIGN §12, L4)."""
    base_pieces = None
    if "base_pieces" in lossy:
        base_pieces = tuple(records.Piece(table.add(replace(p["chunk"], new=False)), p["offset"], p["length"])
                            for p in lossy["base_pieces"])
    stored_shape = lossy.get("stored_shape")
    return LossyInfo(codec=lossy["codec"], block=lossy.get("block"), stored_dtype=lossy.get("stored_dtype"),
                     stored_shape=None if stored_shape is None else tuple(stored_shape),
                     original_nbytes=lossy.get("original_nbytes"), error=lossy.get("error"),
                     notes=tuple(lossy.get("notes", ())), parts=dict(lossy.get("parts", {})),
                     base_step=lossy.get("base_step"), base_pieces=base_pieces, requested=lossy.get("requested"))


def commit(vault: Vault, step: int, manifest: Manifest, overwrite: bool, guard: ManifestGuard | None = None
           ) -> None:
    """Make the checkpoint visible. Atomic: afterwards it is either fully committed or absent.

    Before writing the manifest, every chunk it names and every delta base is
    checked to still exist: gc deletes unreferenced chunks older than its grace
    period, which a reused chunk, a delta base whose keyframe was pruned, or a
    chunk written early in a save longer than the grace period could be. A
    missing one fails the save with nothing committed; the save may be retried.
    First, ``guard`` touches the chunks the save reused untouched if a manifest
    it relied on changed meanwhile (``guard.py``).
    """
    if guard is not None:
        guard.ensure(vault.store, vault.pool)
    needed = sorted({c.id for c in manifest.chunks} | {c.base for c in manifest.chunks if c.base})
    missing = missing_chunks(vault, needed)
    if missing:
        raise SaveError(
            f"{len(missing)} chunks of step {step} (such as {missing[0]}) were removed by a concurrent gc before it "
            "committed (is gc's grace period shorter than a save?); nothing was committed: save again"
        )
    data = encode_manifest(manifest)
    key = manifest_key(step)
    if overwrite:
        vault.store.put(key, data)
    elif not vault.store.put_if_absent(key, data):
        raise StepExistsError(step, vault.url)
    log.info("committed step %d to %s (%d bytes added)", step, vault.url, manifest.added_bytes)


def missing_chunks(vault: Vault, ids: list[str]) -> list[str]:
    """The chunks of ``ids`` the store does not hold now, in the order of ``ids``.

    Where asking for one is cheap (a local ``stat``) each is asked for. Where it is a request (S3: a HEAD,
    about 1.3 ms of client CPU), the vault's chunk keys are listed instead (about 0.1 ms each) if the vault
    seems to hold fewer than ``LIST_PER_PROBE`` chunks per chunk checked (:func:`_chunk_count_estimate`). If
    the listing ends, a chunk it did not show is missing; if it runs to twice that many keys (the estimate was
    low), it stops and the chunks it did not show are asked for. A listed key and an answered probe say the
    same: the object existed when the store answered.
    """
    store = vault.store
    budget = LIST_PER_PROBE * len(ids)
    if not store.cheap_stat and ids and _chunk_count_estimate(store) <= budget:
        wanted = {chunk_key(cid): cid for cid in ids}
        for listed, info in enumerate(store.list(CHUNKS_PREFIX)):
            if listed == 2 * budget:
                break
            wanted.pop(info.key, None)
        else:  # the listing ended: whatever it did not show is missing
            unseen = set(wanted.values())
            return [cid for cid in ids if cid in unseen]
        ids = [cid for cid in ids if chunk_key(cid) in wanted]  # not shown before the listing stopped: ask
    present = map_all(vault.pool, lambda cid: store.exists(chunk_key(cid)), ids)
    return [cid for cid, ok in zip(ids, present, strict=True) if not ok]


def _chunk_count_estimate(store: Store) -> int:
    """About how many chunks the vault holds: 256 times those under one of the 256 two-hex-digit key prefixes
    (chunk ids are uniform hashes), from one small listing."""
    return 256 * sum(1 for _ in store.list(f"{CHUNKS_PREFIX}00/"))


def check_step(step: Any) -> int:
    """``step`` if it is an int a manifest key can name (20 decimal digits), else InvalidArgumentError."""
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        raise InvalidArgumentError(f"step must be an int from 0 to {MAX_STEP} (20 digits), got {step!r}")
    return step


def json_fields(values: dict[str, Any] | None, what: str) -> dict[str, Any]:
    """``values`` checked to be a JSON object of finite values (numpy/torch scalars become floats)."""
    values = {} if values is None else values
    if not isinstance(values, dict) or not all(isinstance(k, str) for k in values):
        raise InvalidArgumentError(f"{what} must be a dict with str keys, got {type(values).__name__}")
    cleaned = {k: (float(v) if _is_number_like(v) else v) for k, v in values.items()}
    if too_deep(cleaned):  # readers refuse deeper manifests (format/schema.py)
        raise InvalidArgumentError(f"{what} is nested more than {MAX_DEPTH} levels deep; flatten it")
    try:
        json.dumps(cleaned, allow_nan=False)
    except (TypeError, ValueError) as exc:
        bad = [k for k, v in cleaned.items() if isinstance(v, float) and not math.isfinite(v)]
        detail = f"non-finite values at {bad}" if bad else str(exc)
        raise InvalidArgumentError(f"{what} must be JSON-serialisable (finite numbers, str, lists, dicts): {detail}") from None
    return cleaned


def _is_number_like(value: Any) -> bool:
    """numpy and 0-d torch scalars (a loss.item() forgotten) are accepted as floats."""
    return type(value).__module__ in ("numpy", "torch") and getattr(value, "ndim", 1) == 0 and hasattr(value, "item")
