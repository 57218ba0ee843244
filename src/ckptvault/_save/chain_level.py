"""Storing the newest level of a predicted checkpoint's restore chain in chunk objects (DESIGN §6, "Predicted
deltas"): the records of the previous checkpoint that its predictions read, as JSON, cut into chunks of the
vault's chunk size, compressed (zstd, no byte planes) and written create-if-absent in the save's write batch,
like the state's chunks. The manifest lists those chunks in its chunk table and names them in ``"chain"``; deeper
levels pass on as they are, so a manifest holds its chain by reference whatever its length, and each level is
stored once.

Call order: inside ``build_manifest`` (``commit.py``), after the state's chunks were written to the batch and
before :func:`~ckptvault._save.commit.commit` finishes it: the level's chunks are durable and visible before the
manifest that names them, as every chunk is.
"""

from __future__ import annotations

from collections.abc import Callable

from .._codecs import encode_chain
from .._codecs.zstd import Zstd
from .._format.chunk_object import ChunkHeader, chunk_id, chunk_key, object_parts
from .._format.records import ChainLevel, ChunkRef
from .._vault import Vault
from ..stores.base import WriteBatch
from .guard import ManifestGuard

#: zstd's level for a level's JSON: a text's matches are long-range, unlike byte planes (level 1 here is tuned for
#: those, and stores such text three times larger)
LEVEL = 3
#: writes a new chain level's JSON in chunks; returns them, in order, for the manifest's chunk table
StoreLevel = Callable[[ChainLevel], list[ChunkRef]]


def level_writer(vault: Vault, batch: WriteBatch, guard: ManifestGuard) -> StoreLevel:
    """A :data:`StoreLevel` writing into ``batch``; a level chunk the vault has already is protected by ``guard``
    until the commit, as a reused chunk of the state is."""

    def store(level: ChainLevel) -> list[ChunkRef]:
        data = memoryview(level.body_text)
        size = vault.chunk_size()
        return [_write(vault, batch, guard, data[start: start + size]) for start in range(0, len(data), size)]

    return store


def _write(vault: Vault, batch: WriteBatch, guard: ManifestGuard, raw: memoryview) -> ChunkRef:
    cid = chunk_id(raw)
    specs, payload = encode_chain(raw, [Zstd(LEVEL)])
    parts = object_parts(ChunkHeader(codec=specs, raw=len(raw)), payload)
    if batch.put_parts_if_absent(chunk_key(cid), parts):
        return ChunkRef(cid, len(raw), sum(memoryview(p).nbytes for p in parts), new=True)
    guard.protect(vault.store, cid)  # the level's chunk was there (the same records, saved before): keep it
    return ChunkRef(cid, len(raw), vault.store.stat(chunk_key(cid)).size)
