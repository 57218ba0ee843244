"""Steps 2-4 of a save: chunk + hash -> dedup -> encode -> write.

Call order: :func:`take_snapshot` (``snapshot.py``), then :func:`write_chunks`,
then :func:`~ckptvault._save.commit.commit`. Only the commit makes the checkpoint
visible; if anything fails before it, nothing is committed and the chunks already
written are unreferenced garbage for ``gc``.

Chunk writes may be retried freely: a chunk is named by the hash of its raw
bytes and written with create-if-absent, so writing it twice is harmless.
They go through the store's write batch (``Store.write_batch``). Given a
batch, :func:`write_chunks` leaves finishing it to :func:`commit`, which
stages the manifest in it first (one sync fewer); without, it finishes a batch
of its own before it returns. Either way every new chunk is durable and
visible before the manifest that names it is.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._codecs import BytePlanes, PlaneDelta, chain_for
from .._delta.bases import BaseRef, find_bases
from .._delta.kernels import NEARLY_EXACT
from .._delta.policy import DeltaContext
from .._delta.reads import base_planes_for_save
from .._feedback import metered
from .._format.chunk_object import ChunkHeader, chunk_id, chunk_key, object_parts
from .._parallel import map_all
from .._vault import Vault
from ..errors import CorruptChunkError, ObjectNotFoundError, SaveError
from ..stores.base import WriteBatch
from .chunking import ChunkPlan, LeafSpec, Piece, plan_chunks
from .snapshot import Snapshot

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


def pack_group(record: Any) -> str:
    """The pack of a small array (``chunking.py``): residuals of nearly exact predictions apart from the rest."""
    return "exact" if record.predict is not None and record.predict.op in NEARLY_EXACT else ""


def pack_threshold(chunk_size: int) -> int:
    """Arrays smaller than this share chunks with other small arrays."""
    return chunk_size // 4


def write_chunks(vault: Vault, snapshot: Snapshot, progress: Progress | None = None,
                 delta: DeltaContext | None = None, batch: WriteBatch | None = None
                 ) -> tuple[list[ChunkResult], list[list[Piece]]]:
    """Write every chunk of ``snapshot`` the vault lacks. Returns chunk results and per-leaf pieces.

    ``batch``: the caller's, which the caller finishes (``commit(..., batch)``) or abandons, also if this raises.
    None: a batch of this call's own, finished before it returns and abandoned if it raises.
    """
    delta = delta or DeltaContext()
    chunk_size = vault.require().chunk_size
    specs = [LeafSpec(r.nbytes, r.itemsize, r.codec, pack_group(r)) for r in snapshot.records]
    plans, pieces = plan_chunks(specs, chunk_size, pack_threshold(chunk_size))
    bases = find_bases(plans, snapshot.records, delta.keyframe) if delta.keyframe else [None] * len(plans)
    own = batch is None
    batch = batch or vault.store.write_batch()
    progress = metered(progress, sum(plan.nbytes for plan in plans))  # every chunk is reported, new or not
    writer = _ChunkWriter(vault, snapshot, progress, delta, batch)
    if not own:
        return map_all(vault.pool, writer.write, plans, bases), pieces
    try:
        results = map_all(vault.pool, writer.write, plans, bases)
        finish_batch(batch)  # every new chunk durable and visible before commit() names it
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
        self.known_stored = delta.known_stored
        self.cache = delta.cache  # a keyframe save fills it (it ignores adds otherwise); delta saves read it
        self.keep_reads = delta.keep_reads  # and with this, keep in it the keyframe chunks they read back
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
        if cid in self.guard.chunk_ids and cid in self.known_stored:
            # named by a manifest the guard watches: no request; commit() checks that it exists (guard.py)
            self.guard.protect(store, cid)
            return False, self.known_stored[cid], self.known_bases.get(cid)
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

    def _base_planes(self, base_id: str, typesize: int) -> Sequence[np.ndarray | None]:
        """The byte planes of keyframe chunk ``base_id``: from the keyframe cache (its high planes, None for the
        others), else read and verified. ObjectNotFoundError if the store lacks the chunk (cached or not: a
        delta needs it there)."""
        cached = None if self.cache is None else self.cache.planes(self.keyframe_step, base_id, typesize)
        if cached is None:
            planes = base_planes_for_save(self.vault.store, base_id, typesize, max_raw=self.vault.chunk_size())
            if self.cache is not None and self.keep_reads and self.keyframe_step is not None:
                self.cache.keep_read(self.keyframe_step, base_id, typesize, planes)
            return planes
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


def finish_batch(batch: WriteBatch) -> None:
    """``batch.finish()``; a written object that vanished before it became visible (a concurrent gc took it) fails
    the save as a retryable SaveError, as a chunk missing at commit does."""
    try:
        batch.finish()
    except ObjectNotFoundError as exc:
        raise SaveError(f"{exc}; nothing was committed: save again") from exc
