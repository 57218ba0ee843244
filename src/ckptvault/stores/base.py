"""The narrow storage interface every vault backend implements.

Keys are ``/``-separated relative paths (``chunks/ab/ab12...``). Objects are
immutable once written, except through :meth:`Store.put` which replaces a
whole object atomically.

Contract for implementations:

* ``put`` and ``put_if_absent`` are atomic: a reader sees either no object or
  the complete new bytes, never a prefix. When they return, the object is
  durable (survives a crash of this process and, where the backend allows, of
  the machine).
* ``put_if_absent`` is the primitive that dedup and commit rest on: exactly one
  of several concurrent writers of one key gets ``True``.
* :meth:`Store.write_batch` groups the chunk writes of one save: objects put
  through a batch may become visible and durable only when the batch finishes
  (a store where one sync for many objects is cheaper than one each overrides
  it; the default writes each object durably at once).
* Errors are classified by the store itself: :class:`ObjectNotFoundError` for
  a missing key, :class:`StorageFullError` when space runs out,
  :class:`RetryableStorageError` for transient faults and
  :class:`PermanentStorageError` otherwise.
* Every method may be called from several threads at once.
"""

from __future__ import annotations

import abc
import builtins
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import OversizedObjectError


@dataclass(frozen=True)
class ObjectInfo:
    """Size in bytes and modification time (seconds since the epoch) of a stored object."""

    key: str
    size: int
    mtime: float


class Store(abc.ABC):
    """A flat key -> bytes object store."""

    #: human-readable location, used in error messages
    url: str
    #: whether :meth:`stat` is cheap next to sending an object (a local ``stat``, not a request): saves then
    #: ask for every chunk before writing it (``_save.chunks.PROBE_MISSES``)
    cheap_stat: bool = True
    #: threads a vault should use for chunk I/O here; 0 leaves it to the vault (from the CPU count). A store whose
    #: requests wait on the network (S3) asks for more threads than there are cores.
    preferred_workers: int = 0
    #: chunk size of new vaults here; 0 leaves it to the vault (4 MiB). ``CheckpointManager(chunk_size=)`` wins.
    preferred_chunk_size: int = 0

    @abc.abstractmethod
    def get(self, key: str, max_size: int | None = None) -> bytes:
        """Return the whole object. Raises ObjectNotFoundError if absent, and OversizedObjectError (without reading
        it whole) if it is larger than ``max_size`` bytes: what a reader that knows the largest object of its
        kind passes, so a hostile object cannot make it allocate more."""

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """Return ``length`` bytes from ``start`` (fewer at the end of the object)."""
        return self.get(key)[start : start + length]

    def get_transient(self, key: str, max_size: int | None = None) -> bytes | memoryview:
        """:meth:`get`, possibly into a buffer that this thread's next call reuses: for a reader done with the
        bytes (and views of them) before it reads again. The local store reads into one buffer per thread."""
        return self.get(key, max_size)

    def prefetch(self, keys: builtins.list[str]) -> None:  # noqa: B027 - optional hook: a hint a store may ignore
        """A hint that the objects ``keys`` will be read soon, in this order: a store may start reading them into
        a cache, returning without waiting for them. It never raises for a key that is missing or unreadable (the
        read that follows reports it). The default does nothing; the local store asks the kernel to read the
        files ahead (``posix_fadvise(WILLNEED)``)."""

    @abc.abstractmethod
    def put(self, key: str, data: bytes | memoryview) -> None:
        """Create or atomically replace an object; durable on return."""

    @abc.abstractmethod
    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        """Create the object unless it exists. True if this call created it."""

    def put_parts_if_absent(self, key: str, parts: list[Any]) -> bool:
        """:meth:`put_if_absent` of the concatenation of ``parts`` (buffers, which may be reused once this
        returns). This default joins them; a store that can send them as they are (S3's) saves a copy."""
        return self.put_if_absent(key, b"".join(parts))

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """True if the object exists."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix``, in no particular order."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; a missing object is not an error."""

    @abc.abstractmethod
    def stat(self, key: str) -> ObjectInfo:
        """Size and mtime of an object. Raises ObjectNotFoundError if absent."""

    @abc.abstractmethod
    def touch(self, key: str) -> None:
        """Set the object's mtime to now (the store's clock). Raises ObjectNotFoundError if absent.

        A save calls this on every chunk it reuses, so that garbage collection,
        which only deletes unreferenced objects older than a grace period, does
        not delete a chunk an uncommitted save is about to reference.
        """

    def temp_files(self) -> builtins.list[ObjectInfo]:
        """Leftover temporary objects of interrupted writes that :meth:`list` does not show, for garbage
        collection to delete once they are older than its grace period. A store whose writes leave none (every
        write is one atomic request) keeps this default: none."""
        return []

    def write_batch(self) -> WriteBatch:
        """A :class:`WriteBatch` for many new objects (the default: each one durable when put)."""
        return WriteBatch(self)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections or handles. The store is unusable afterwards."""


def check_size(store: Store, key: str, size: int, max_size: int | None) -> None:
    """Raise OversizedObjectError if ``size`` exceeds ``max_size`` (None: no limit); for :meth:`Store.get`."""
    if max_size is not None and size > max_size:
        raise OversizedObjectError(key, size, max_size, store.url)


class WriteBatch:
    """New objects written together, durable and visible together (the chunks of one save).

    Call order: :meth:`put_if_absent` from any number of threads; optionally :meth:`stage_final` once, the
    object that names the others (a save's manifest); then :meth:`finish` once (every object put is then
    durable and visible; if it raises, none is promised and the save must fail); then, if staged,
    :meth:`publish_final` once. Or, at any point, :meth:`abandon` (objects not yet visible are discarded).
    Until :meth:`finish`, an object put may be invisible, so only code that does not read it back (a save's
    chunk writer) may use a batch. This base class writes through to :meth:`Store.put_if_absent`, so each
    object is durable at once, :meth:`finish` and :meth:`abandon` are no-ops, and the staged object is
    written by :meth:`publish_final`. The local store's batch writes the staged object's bytes with the
    others, so that the sync making theirs durable makes its bytes durable too (one sync fewer per save).
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self._final: tuple[str, bytes] | None = None

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        """Create the object unless it exists. True if it did not exist when this call looked (two batches
        racing for one key may both say True; the object is created once, with the same bytes)."""
        return self.store.put_if_absent(key, data)

    def put_parts_if_absent(self, key: str, parts: list[Any]) -> bool:
        """:meth:`put_if_absent` of the concatenation of ``parts`` (buffers); a batch that can write them
        without joining them first (the local store's) saves a copy of the object. This one hands them to
        :meth:`Store.put_parts_if_absent`."""
        return self.store.put_parts_if_absent(key, parts)

    def stage_final(self, key: str, data: bytes) -> None:
        """Hold ``key``, to be made visible by :meth:`publish_final` after :meth:`finish`, never before every
        other object of the batch is durable and visible. Call at most once, before :meth:`finish`."""
        self._final = (key, data)

    def finish(self) -> None:  # noqa: B027 - the write-through batch has nothing left to do
        """Make every object put durable and visible."""

    def publish_final(self, overwrite: bool = False) -> bool:
        """After :meth:`finish`: make the staged object durable and visible, create-if-absent (False: an object
        of that key existed, and is left as it was) or, with ``overwrite``, replacing it atomically (True)."""
        if self._final is None:
            raise RuntimeError("publish_final() without stage_final(): nothing is staged")
        (key, data), self._final = self._final, None
        if overwrite:
            self.store.put(key, data)
            return True
        return self.store.put_if_absent(key, data)

    def abandon(self) -> None:  # noqa: B027 - the write-through batch has nothing left to do
        """Discard the objects not yet visible (best effort; after a failed save)."""
