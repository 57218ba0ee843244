"""Incremental checkpoints: chunk deltas against a keyframe, plane by plane.

A *keyframe* is a checkpoint stored without deltas. Every later checkpoint,
until the next keyframe, may store a changed chunk against the chunk that held
the same region in the keyframe: plane by plane, each byte plane stored either
on its own or XORed with the base's plane, whichever compresses better
(``_codecs/xplanes.py``). XOR of two nearby float states leaves the sign,
exponent and high mantissa bits mostly zero, which compresses well; the low
mantissa planes are noise either way and are stored without the base, so a
restore reads only the base's high planes (``reads.py``). Vaults written
before plane deltas may hold whole-chunk XOR deltas, which stay readable.

Invariants (docs/DESIGN.md):

* A delta's base is always a full (non-delta) chunk object, so restoring any
  chunk reads at most two objects: restore chains have length <= 1.
* A delta is named, like every chunk, by the hash of its *reconstructed* raw
  bytes, and verified against it after the XOR.
* The manifest records each delta's base chunk id (``"base"``), so garbage
  collection keeps a base alive as long as any delta needs it, whatever
  happens to the keyframe's own manifest.

The keyframe cadence: a new keyframe every ``every`` checkpoints, or as soon as
the previous checkpoint's added bytes exceed ``growth`` x the keyframe's stored
bytes, or when there is no usable keyframe; with predicted deltas
(``predict.py``), also after a checkpoint whose restore chain reached ``max_chain``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .._argcheck import check_kind
from .._codecs.planes import scratch, split_planes
from .._format.manifest import manifest_key
from .._format.records import Manifest
from .._parallel import map_all
from .._save.guard import ManifestGuard
from ..errors import InvalidArgumentError, ObjectNotFoundError, StepNotFoundError, VaultError

if TYPE_CHECKING:
    from .._vault import Vault

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class DeltaPolicy:
    """When to write a keyframe. ``enabled=False`` stores every checkpoint in full."""

    enabled: bool = True
    every: int = 10
    growth: float = 0.9
    max_chain: int | None = None  # with predictions: a checkpoint whose chain is this long is followed by a keyframe

    def __post_init__(self) -> None:
        check_kind("incremental", self.enabled, bool)
        check_kind("keyframe_every", self.every, int)
        check_kind("keyframe_growth", self.growth, int, float)
        if self.every < 1:
            raise InvalidArgumentError(f"keyframe_every must be >= 1, got {self.every}")
        if not 0 < self.growth:
            raise InvalidArgumentError(f"keyframe_growth must be > 0, got {self.growth}")

    def needs_keyframe(self, latest: Manifest | None, keyframe: Manifest | None) -> bool:
        """True if the next checkpoint should be a keyframe, given the latest manifest and its keyframe's."""
        if not self.enabled or latest is None or keyframe is None:
            return True
        if latest.since_keyframe + 1 >= self.every:
            return True
        if self.max_chain is not None and len(latest.chain) >= self.max_chain:
            return True  # the next one could not be predicted: a keyframe stores less than a delta before one
        if latest is keyframe or latest.step == keyframe.step:
            return False
        return latest.added_bytes > self.growth * max(keyframe.stored_bytes, 1)


class KeyframeCache:
    """The byte planes of the latest keyframe's chunks, kept in host memory so that deltas need no reads of it.

    Without it, every delta save reads its keyframe's chunks back from the store (a GET per chunk on S3),
    checks them and splits them into planes. With it, a keyframe save keeps the planes of each chunk and later
    delta saves against that keyframe XOR against those: every plane of a keyframe of at most
    :data:`ALL_PLANES_UP_TO` bytes, else only the high planes (:func:`kept_planes`: for float32, the
    sign-and-exponent plane and the high mantissa plane; half the state's bytes). The low planes of a large
    keyframe are not kept: between nearby float states they are noise, which a delta stores on its own anyway
    (figures: docs/benchmarks/incremental.md); a delta against the cache stores them on their own, unless the
    chunk barely changed (``_codecs/xplanes.py``, ``BARELY_CHANGED``: rows a sparse optimizer did not touch),
    when it reads the whole base instead.

    It fills in one of two ways. From a keyframe save (asynchronous saves): call order, one save at a time:
    :meth:`begin` when a keyframe save starts (frees the previous keyframe's planes first), :meth:`add` per chunk
    (it only notes the chunk's bytes), then, once its manifest is committed, :meth:`commit`, which splits and copies
    the noted chunks' planes; or :meth:`abort`. From delta saves (synchronous saves of small states, whose caller
    would wait for that copy at each keyframe): :meth:`keep_read` keeps each keyframe chunk a delta save read back
    and verified, so each is read once per keyframe instead of once per delta save.
    :meth:`clear` frees it all. Only a committed keyframe's planes are ever used. The bytes :meth:`add` noted
    must stay unchanged until :meth:`commit` returns (the staging buffer, or a state the caller is not yet
    allowed to modify): the saver commits the cache after the save's handle reports the commit, before the
    next save may stage, so filling it costs a save's wait nothing. Thread-safe for the chunk writers of
    one save.
    """

    def __init__(self) -> None:
        self._chunks: dict[str, tuple[int, np.ndarray]] = {}  # chunk id -> (typesize, kept x n high planes)
        self._step: int | None = None  # the committed keyframe the planes belong to
        self._filling: int | None = None
        self._noted: dict[str, tuple[int, memoryview]] = {}  # chunk id -> (typesize, bytes), until commit
        self._spare: dict[tuple[int, int], list[np.ndarray]] = {}  # the previous keyframe's arrays, by shape
        self._lock = threading.Lock()

    def begin(self, step: int) -> None:
        """Start filling for keyframe ``step``. The previous keyframe's arrays are reused for this one's planes
        where their shapes match (new memory is slow to fault in; the staging buffer is reused likewise)."""
        with self._lock:
            for _typesize, kept in self._chunks.values():
                self._spare.setdefault(kept.shape, []).append(kept)
            self._chunks, self._noted, self._step, self._filling = {}, {}, None, step

    def add(self, cid: str, raw: memoryview, typesize: int) -> None:
        """Note chunk ``cid`` (``raw``, elements of ``typesize`` bytes) for :meth:`commit` to keep, if a keyframe
        save is filling the cache; nothing is copied yet."""
        if self._filling is None:
            return
        with self._lock:
            self._noted.setdefault(cid, (typesize, raw))

    def commit(self, step: int, pool: ThreadPoolExecutor) -> None:
        """Keep the high planes of every chunk noted for keyframe ``step`` (now committed) and make them usable;
        the chunks are split and copied on ``pool``. On any error (MemoryError) the cache is left empty and the
        error raised: deltas then read the store."""
        if self._filling != step:
            return
        noted = list(self._noted.items())
        every_plane = sum(len(raw) for _typesize, raw in self._noted.values()) <= ALL_PLANES_UP_TO
        try:
            kept = map_all(pool, lambda item: self._kept(item, every_plane), noted)
        except BaseException:
            self.abort()
            raise
        with self._lock:
            self._chunks = {cid: (typesize, planes) for (cid, (typesize, _raw)), planes in zip(noted, kept, strict=True)}
            self._step, self._filling, self._noted, self._spare = step, None, {}, {}

    def _kept(self, item: tuple[str, tuple[int, memoryview]], every_plane: bool) -> np.ndarray:
        """The planes of a noted chunk to keep (``every_plane``, or the high ones), in a spare array of the previous
        keyframe where one has their shape."""
        _cid, (typesize, raw) = item
        planes = split_planes(raw, typesize, scratch(len(raw), "planes"))[0]  # this thread's; copied below
        high = planes[typesize - (typesize if every_plane else kept_planes(typesize)):]
        with self._lock:
            into = self._pop_spare(high.shape)
        return _stacked(high, into)

    def keep_read(self, step: int, cid: str, typesize: int, planes: Sequence[np.ndarray]) -> None:
        """Keep a copy of every byte plane of chunk ``cid`` of committed keyframe ``step``, as a delta save read it
        back and checked it against its name, for later deltas against that keyframe. Planes of another keyframe
        are dropped first (their memory reused where shapes match). Ignored while a keyframe save fills the cache."""
        with self._lock:
            if self._filling is not None or (self._step == step and cid in self._chunks):
                return
            if self._step != step:
                for _typesize, kept in self._chunks.values():
                    self._spare.setdefault(kept.shape, []).append(kept)
                self._chunks, self._step = {}, step
            into = self._pop_spare((typesize, len(planes[0])))
        copy = _stacked(planes, into)
        with self._lock:
            if self._step == step and self._filling is None:
                self._chunks[cid] = (typesize, copy)

    def _pop_spare(self, shape: tuple[int, int]) -> np.ndarray | None:
        """A spare array of ``shape`` from the previous keyframe's planes, if one is left (call under the lock)."""
        spare = self._spare.get(shape)
        return spare.pop() if spare else None

    def abort(self) -> None:
        with self._lock:
            self._chunks, self._noted, self._filling, self._spare = {}, {}, None, {}

    def clear(self) -> None:
        with self._lock:
            self._chunks, self._noted, self._step, self._filling, self._spare = {}, {}, None, None, {}

    def planes(self, keyframe_step: int | None, cid: str, typesize: int) -> list[np.ndarray | None] | None:
        """The byte planes of chunk ``cid`` of committed keyframe ``keyframe_step``, if cached with ``typesize``:
        None in place of each low plane that is not kept."""
        entry = self._chunks.get(cid) if keyframe_step is not None and keyframe_step == self._step else None
        if entry is None or entry[0] != typesize:
            return None
        kept = entry[1]
        return [None] * (typesize - len(kept)) + list(kept)

    @property
    def nbytes(self) -> int:
        return sum(planes.nbytes for _typesize, planes in self._chunks.values())


def _stacked(planes: Sequence[np.ndarray] | np.ndarray, into: np.ndarray | None) -> np.ndarray:
    """``planes`` (equal-length rows) copied into the rows of ``into`` (new memory if None)."""
    if into is None:
        return np.array(planes)  # a copy, stacked
    for row, plane in zip(into, planes, strict=True):
        row[:] = plane
    return into


#: the keyframe cache keeps every byte plane of a keyframe of at most this many bytes (raw): deltas against a
#: small state then never read their keyframe back, for the memory of one more copy of it
ALL_PLANES_UP_TO = 64 << 20


def kept_planes(typesize: int) -> int:
    """How many of a chunk's byte planes (the highest) the keyframe cache keeps of a keyframe larger than
    :data:`ALL_PLANES_UP_TO`: all of 1- and 2-byte elements, the upper half of wider ones."""
    return typesize if typesize <= 2 else (typesize + 1) // 2


@dataclass
class DeltaContext:
    """What one save may delta-encode against.

    ``keyframe``: the keyframe's manifest, or None when this save writes a
    keyframe. ``known_bases``: chunk id -> delta base (or None) for chunks of
    recent manifests, so reusing them needs no header read; ``known_stored``:
    their stored sizes, so reusing one the guard watches needs no request at all. ``guard``: those
    manifests as stat'ed before they were read, so the chunks they name need
    no touch (``_save/guard.py``). ``cache``: the saver's keyframe cache, if it keeps one. ``latest``: the
    latest committed checkpoint before this one, which a delta save may predict from (``predict.py``).
    """

    keyframe: Manifest | None = None
    known_bases: dict[str, str | None] = field(default_factory=dict)
    known_stored: dict[str, int] = field(default_factory=dict)
    since_keyframe: int = 0
    cache: KeyframeCache | None = None
    guard: ManifestGuard = field(default_factory=ManifestGuard)
    latest: Manifest | None = None
    keep_reads: bool = False  # keep the keyframe chunks this delta save reads back in ``cache`` (keep_read)

    @property
    def keyframe_step(self) -> int | None:
        return None if self.keyframe is None else self.keyframe.step


class ManifestCache:
    """The manifests a saver committed lately, parsed, each with the size and modification time its object had
    just after the commit: :func:`delta_context` takes one instead of reading it again while a ``stat`` still
    shows the same object (a predicted checkpoint's manifest carries its restore chain and grows with it). It keeps the
    last :attr:`KEEP` and the last keyframe it committed."""

    KEEP = 4

    def __init__(self) -> None:
        self._entries: dict[str, tuple[int, float, Manifest]] = {}
        self._keyframe: dict[str, tuple[int, float, Manifest]] = {}  # the last keyframe: every delta after it reads it
        self.last_step: int | None = None  # the step of the manifest noted last

    def note(self, vault: Vault, manifest: Manifest) -> None:
        """Remember committed ``manifest`` as its object is now."""
        key = manifest_key(manifest.step)
        info = vault.store.stat(key)
        entry = (info.size, info.mtime, manifest)
        if manifest.keyframe == manifest.step:
            self._keyframe = {key: entry}
        self._entries[key] = entry
        self.last_step = manifest.step
        while len(self._entries) > self.KEEP:
            del self._entries[next(iter(self._entries))]

    def get(self, key: str, size: int, mtime: float) -> Manifest | None:
        entry = self._entries.get(key) or self._keyframe.get(key)
        return entry[2] if entry is not None and entry[:2] == (size, mtime) else None


def delta_context(vault: Vault, policy: DeltaPolicy, step: int, cache: ManifestCache | None = None) -> DeltaContext:
    """Decide whether checkpoint ``step`` is a keyframe and, if not, against which keyframe.

    Reads at most two manifests (the latest committed before ``step`` and its
    keyframe), each stat'ed first for the save's :class:`ManifestGuard` (and
    taken from ``cache`` while the stat matches). A keyframe that was deleted,
    or any unreadable manifest, simply makes this save a keyframe.
    """
    if not policy.enabled:
        return DeltaContext()
    previous = _previous_step(vault, step, cache)
    if previous is None:
        return DeltaContext()
    watched: dict[str, tuple[int, float]] = {}
    try:
        latest = _read_watched(vault, previous, watched, cache)
        keyframe = latest if latest.keyframe == latest.step else _read_watched(vault, latest.keyframe, watched, cache)
    except VaultError as exc:
        log.info("writing a keyframe: no usable previous keyframe (%s)", exc)
        return DeltaContext()
    known = {**keyframe.chunk_bases(), **latest.chunk_bases()}
    stored = {c.id: c.stored for m in (keyframe, latest) for c in m.chunks}
    guard = ManifestGuard(watched, known)
    if policy.needs_keyframe(latest, keyframe):
        return DeltaContext(known_bases=known, known_stored=stored, guard=guard)
    return DeltaContext(keyframe, known, stored, latest.since_keyframe + 1, guard=guard, latest=latest)


#: a save at most this many steps after the last one its saver committed looks for the steps in between by name;
#: any other lists the vault's manifests, which takes longer the more checkpoints the vault holds
NEARBY = 8


def _previous_step(vault: Vault, step: int, cache: ManifestCache | None) -> int | None:
    """The latest step committed before ``step``, or None. Where ``cache`` noted a step shortly before ``step`` (a save
    every step or every few), that step if it is still committed and none between it and ``step`` is (one ``exists``
    per step between: none for consecutive steps), else the latest before ``step`` in a listing of the manifests."""
    last = None if cache is None else cache.last_step
    if last is not None and last < step <= last + NEARBY:
        store = vault.store
        if store.exists(manifest_key(last)) and not any(store.exists(manifest_key(s)) for s in range(last + 1, step)):
            return last
    earlier = [s for s in vault.steps() if s < step]
    return earlier[-1] if earlier else None


def _read_watched(vault: Vault, step: int, watched: dict[str, tuple[int, float]], cache: ManifestCache | None
                  ) -> Manifest:
    """Manifest of ``step``, after noting its size and mtime in ``watched`` (stat first: what is read is at least
    as new as what was noted, so a change in between shows as a change)."""
    key = manifest_key(step)
    try:
        info = vault.store.stat(key)
    except ObjectNotFoundError:
        raise StepNotFoundError(step, vault.url) from None
    watched[key] = (info.size, info.mtime)
    cached = None if cache is None else cache.get(key, info.size, info.mtime)
    return cached if cached is not None else vault.read_manifest(step)
