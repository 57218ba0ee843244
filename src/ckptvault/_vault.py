"""The vault: a store plus the layout of ckptvault objects in it.

Keys::

    vault.json                         descriptor, created once (create-if-absent)
    chunks/<2 hex>/<64 hex>            immutable chunk objects (_format/chunk_object.py)
    manifests/<step, 20 digits>.json   one per committed checkpoint (_format/manifest.py)

A checkpoint exists exactly when its manifest exists. Chunks are written
before the manifest that names them, so a crash leaves unreferenced chunks
(garbage that ``gc`` removes) but never a manifest naming a missing chunk.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from ._argcheck import check_kind
from ._arrays import address
from ._codecs import DEFAULT_CODEC, validate_codec_name
from ._codecs.base import copy_into_parts
from ._delta.reads import is_plane_delta, read_plane_delta
from ._format import FORMAT_VERSION
from ._format.chunk_object import (
    HASH_MISMATCH,
    ChunkHeader,
    chunk_id,
    chunk_key,
    decode_payload,
    decode_payload_into_parts,
    header_length,
    parse_object,
    read_object,
)
from ._format.manifest import decode_manifest, manifest_key, parse_json, step_of_key
from ._format.records import Descriptor, Manifest
from ._format.schema import MAX_CHUNK_SIZE, MIN_CHUNK_SIZE, check_descriptor
from ._parallel import WorkerPool, release_pool, take_pool
from .errors import (
    CorruptChunkError,
    CorruptManifestError,
    InvalidArgumentError,
    ObjectNotFoundError,
    OversizedObjectError,
    StepNotFoundError,
    VaultNotFoundError,
)
from .stores import StorageOptions, Store, open_store

log = logging.getLogger(__name__)

DESCRIPTOR_KEY = "vault.json"
DEFAULT_CHUNK_SIZE = 4 << 20
#: the most bytes a vault.json is read as (ckptvault writes about 150)
MAX_DESCRIPTOR_SIZE = 64 << 10


def default_workers() -> int:
    """Threads for encoding and I/O: twice the cores, at least 4. Codecs and hashes release the GIL;
    the extra threads keep the cores busy while others wait in fsync (figures: docs/benchmarks/core.md)."""
    return max(4, 2 * (os.cpu_count() or 2))


class Vault:
    """Low-level access to one vault. Thread-safe; owns a worker pool."""

    def __init__(self, url: str | os.PathLike[str] | Store, storage_options: StorageOptions | None = None,
                 workers: int | None = None) -> None:
        check_kind("workers", workers, int, type(None))
        if workers is not None and workers < 1:
            raise InvalidArgumentError(f"workers must be at least 1 (None: the default), got {workers}")
        self.store = open_store(url, storage_options)
        self.url = self.store.url
        self.workers = workers or max(default_workers(), self.store.preferred_workers)
        self._pool: WorkerPool | None = None
        self._pool_lock = threading.Lock()
        self._descriptor: Descriptor | None = None

    # -- descriptor --------------------------------------------------------
    def descriptor(self) -> Descriptor | None:
        """The vault descriptor, or None if no vault exists at the URL yet."""
        if self._descriptor is None:
            try:
                raw = self.store.get(DESCRIPTOR_KEY, MAX_DESCRIPTOR_SIZE)
            except ObjectNotFoundError:
                return None
            except OversizedObjectError as exc:
                raise CorruptManifestError(f"{DESCRIPTOR_KEY} in {self.url} is {exc.size} bytes, more than a vault "
                                           f"descriptor can be ({MAX_DESCRIPTOR_SIZE}): it was not written by "
                                           "ckptvault") from None
            self._descriptor = _parse_descriptor(raw, self.url)
        return self._descriptor

    def require(self) -> Descriptor:
        """The descriptor; raises VaultNotFoundError if there is no vault."""
        desc = self.descriptor()
        if desc is None:
            raise VaultNotFoundError(f"no ckptvault vault at {self.url} (nothing was saved there yet)")
        return desc

    def default_chunk_size(self) -> int:
        """Chunk size of a new vault when none is given: the store's preference (S3: 16 MiB), else 4 MiB."""
        return self.store.preferred_chunk_size or DEFAULT_CHUNK_SIZE

    def create(self, chunk_size: int | None = None, codec: str = DEFAULT_CODEC) -> Descriptor:
        """Create the descriptor unless it exists (safe when several processes race); return it.
        ``chunk_size`` None: :meth:`default_chunk_size`."""
        chunk_size = self.default_chunk_size() if chunk_size is None else chunk_size
        check_kind("chunk_size", chunk_size, int)
        chunk_size = int(chunk_size)  # a numpy integer would not go into the JSON descriptor
        if chunk_size % 64 or not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE:
            raise InvalidArgumentError(
                f"chunk_size must be a multiple of 64 between {MIN_CHUNK_SIZE} and {MAX_CHUNK_SIZE}, got {chunk_size}"
            )
        desc = Descriptor(chunk_size, validate_codec_name(codec), time.time(), FORMAT_VERSION)
        if not self.store.put_if_absent(DESCRIPTOR_KEY, json.dumps(desc.to_json(), indent=1).encode()):
            self._descriptor = None
            return self.require()
        self._descriptor = desc
        return desc

    # -- checkpoints -------------------------------------------------------
    def steps(self) -> list[int]:
        """Committed steps, ascending. An absent vault has none."""
        found = (step_of_key(info.key) for info in self.store.list("manifests/"))
        return sorted(s for s in found if s is not None)

    def read_manifest(self, step: int) -> Manifest:
        """The verified manifest of ``step``; StepNotFoundError if not committed."""
        return self.decode_manifest(step, self.manifest_bytes(step))

    def manifest_bytes(self, step: int) -> bytes:
        """The stored bytes of ``step``'s manifest, not verified yet (:meth:`decode_manifest` does); StepNotFoundError
        if not committed."""
        self.descriptor()  # raises FormatVersionError for a vault of a newer format before anything is read
        try:
            return self.store.get(manifest_key(step))
        except ObjectNotFoundError:
            self.require()
            raise StepNotFoundError(step, self.url, self.steps()) from None

    def decode_manifest(self, step: int, data: bytes) -> Manifest:
        """The manifest ``data`` (:meth:`manifest_bytes`) holds, verified as ``step``'s of this vault."""
        return decode_manifest(data, f"{manifest_key(step)} in {self.url}", step, self.require().chunk_size)

    def chunk_size(self) -> int:
        """The vault's chunk size: no chunk of it holds more raw bytes, so no reader decodes more per chunk."""
        return self.require().chunk_size

    def read_chunk(self, cid: str, *, expected_raw: int | None = None, into: memoryview | None = None,
                   verify: bool = True) -> bytes | memoryview:
        """Raw bytes of a chunk, verified against its hash; a delta is applied to its base.

        Reads one object, or two for a delta (whose base must be a full chunk:
        restore chains are never longer); of a plane delta's base, only the planes it XORs. A header whose
        ``raw`` is above :meth:`chunk_size` or differs from ``expected_raw`` (the raw length the manifest's chunk
        table gives) is refused before anything is decoded. Raises CorruptChunkError,
        ObjectNotFoundError if the chunk itself is missing.

        ``into``: a writable byte buffer of at least the chunk's raw size that the chunk is decoded or copied
        into, returning a view of it; the object is then read into this thread's reused read buffer
        (``Store.get_transient``). A restore that passes buffers it reuses is spared fresh memory per chunk.

        ``verify=False`` skips the hash check of a full chunk (a delta is always checked): only for a caller that
        checks the bytes otherwise, as a predicted record's digest covers its residual's (DESIGN C3).
        """
        if into is None:
            return self._read_chunk(cid, expected_raw, None, verify)
        raw = self._read_chunk(cid, expected_raw, into, verify)
        target = memoryview(into).cast("B")
        if not _starts_at(raw, target):  # decoded elsewhere (or a view of the transient read buffer): copy it in
            target[: len(raw)] = raw
        return target[: len(raw)]

    def read_chunk_into_parts(self, cid: str, parts: list[memoryview], *, expected_raw: int | None = None) -> None:
        """:meth:`read_chunk`, the raw bytes written across ``parts`` (consecutive writable byte views whose lengths
        add up to the chunk's raw size) and verified there: a chunk packed with several records is decoded into
        their memory directly, with no buffer of the whole chunk (fresh memory, slow to fault in) and no copy. A
        chunk stored as a delta is decoded as :meth:`read_chunk` does and copied in. Raises as :meth:`read_chunk`
        (the parts then hold unspecified bytes), ValueError if the parts do not add up to the chunk's size."""
        header, payload = self._parsed(cid, expected_raw, transient=True)
        if sum(len(p) for p in parts) != header.raw:
            raise ValueError(f"parts of {sum(len(p) for p in parts)} bytes cannot take chunk {cid} ({header.raw} bytes)")
        if header.base is None and not is_plane_delta(header):
            decode_payload_into_parts(cid, header, payload, parts)
        else:  # decoded with its base (checked to be header.raw bytes), then copied in
            copy_into_parts(self._decoded(cid, header, payload, None, True, transient=True), parts)

    def _parsed(self, cid: str, expected_raw: int | None, transient: bool) -> tuple[ChunkHeader, memoryview]:
        max_raw = self.chunk_size()
        return parse_object(cid, read_object(self.store, cid, max_raw, transient=transient),
                            max_raw=max_raw, expected_raw=expected_raw)

    def _read_chunk(self, cid: str, expected_raw: int | None, into: memoryview | None,
                    verify: bool) -> bytes | memoryview:
        header, payload = self._parsed(cid, expected_raw, transient=into is not None)
        if into is not None and len(into) < header.raw:
            raise ValueError(f"a buffer of {len(into)} bytes cannot take chunk {cid} ({header.raw} bytes)")
        return self._decoded(cid, header, payload, into, verify, transient=into is not None)

    def _decoded(self, cid: str, header: ChunkHeader, payload: memoryview, into: memoryview | None, verify: bool,
                 transient: bool) -> bytes | memoryview:
        """The raw bytes of a parsed chunk object (``transient``: ``payload`` is in this thread's read buffer)."""
        max_raw = self.chunk_size()
        if is_plane_delta(header):  # reads only the base planes it XORs
            if transient:  # its base is read into the thread's read buffer, which holds this object now
                payload = memoryview(bytes(payload))
            return read_plane_delta(self.store, cid, header, payload, max_raw)
        base_raw = None
        if header.base is not None:
            try:
                base_header, base_payload = parse_object(header.base, read_object(self.store, header.base, max_raw),
                                                         max_raw=max_raw)
            except ObjectNotFoundError:
                raise CorruptChunkError(cid, f"its delta base {header.base} is missing") from None
            if base_header.base is not None:
                raise CorruptChunkError(cid, f"its delta base {header.base} is itself a delta (chains are limited to 1)")
            try:  # the base's hash is checked only if the delta's fails (the delta's check covers it)
                base_raw = decode_payload(header.base, base_header, base_payload, verify=False)
            except CorruptChunkError as exc:  # name the damaged base, not only the delta that needs it
                raise CorruptChunkError(cid, f"its delta base {header.base} is corrupt: {exc.reason}") from None
            try:
                return decode_payload(cid, header, payload, base_raw)
            except CorruptChunkError:
                if chunk_id(base_raw) != header.base:
                    raise CorruptChunkError(cid, f"its delta base {header.base} is corrupt: {HASH_MISMATCH}") from None
                raise
        return decode_payload(cid, header, payload, verify=verify, out=into)

    def chunk_base(self, cid: str) -> str | None:
        """The delta base of a stored chunk object (None for a full chunk), from its header alone: one read of
        the first KiB (a header is about 150 bytes), a second only for a longer header, at most its prefix and
        header (64 KiB); parses only those, decodes nothing. Raises CorruptChunkError as :meth:`read_chunk` does
        for a header."""
        key = chunk_key(cid)
        prefix = self.store.get_range(key, 0, 1024)
        if len(prefix) < 8:
            raise CorruptChunkError(cid, f"object is {len(prefix)} bytes, shorter than its fixed header")
        needed = header_length(prefix)
        if needed > len(prefix):
            prefix = self.store.get_range(key, 0, needed)
        return parse_object(cid, prefix[:needed], max_raw=self.chunk_size())[0].base

    # -- workers -----------------------------------------------------------
    @property
    def pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = take_pool(self.workers, "ckptvault")
            return self._pool

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                release_pool(self._pool)  # kept for the next vault if idle: its threads' buffers are warm
                self._pool = None
        self.store.close()


def _parse_descriptor(raw: bytes, url: str) -> Descriptor:
    what = f"{DESCRIPTOR_KEY} in {url}"
    return check_descriptor(parse_json(raw, what, CorruptManifestError), what)


def _starts_at(data: bytes | memoryview, buffer: memoryview) -> bool:
    """Whether ``data`` is a view that starts at ``buffer``'s first byte."""
    if not isinstance(data, memoryview) or not len(data) or not len(buffer):
        return False
    return address(data) == address(buffer)
