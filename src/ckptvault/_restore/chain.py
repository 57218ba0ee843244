"""Reading a predicted checkpoint's restore chain: the levels stored in chunk objects (DESIGN §6, "Predicted
deltas"), each read and verified like any chunk (C3), then parsed and checked like the manifest's own records."""

from __future__ import annotations

from dataclasses import replace

from .._format.manifest import manifest_key
from .._format.records import Manifest, TensorRecord
from .._format.remembered import Remembered
from .._format.schema import check_chain_inputs, check_chain_level
from .._vault import Vault
from .verified import read_verified

#: levels whose check a process remembers: a chain of ``max_chain`` 19 and some beside it
LEVELS_KEPT = 64


#: a checked level's records and the chunk extents they need: the table index of each chunk they name, and the end
#: of the furthest bytes they read of it
Checked = tuple[tuple[TensorRecord, ...], dict[int, int]]
#: levels stored in chunks that this process read and checked, by the chunk ids and byte ranges of their pieces (the
#: exact bytes, as every chunk read is verified against its id) and their step: every later manifest of a chain
#: names the same levels, and a restore of each, or ``verify`` of them all, takes their records from here
_CHECKED: Remembered[tuple[object, ...], Checked] = Remembered(LEVELS_KEPT)


def with_chain(vault: Vault, manifest: Manifest) -> Manifest:
    """``manifest`` with the records of every level of its restore chain (read from its chunks where it is stored
    in chunks, or as a read of the same bytes checked them earlier in this process, where their pieces fit this
    manifest's chunk table). Raises CorruptChunkError for a damaged chunk, CorruptManifestError for a level that is
    no valid level of this manifest."""
    what = f"manifest {manifest_key(manifest.step)} in {vault.url}"
    read = False
    for n, level in enumerate(manifest.chain):
        if level.tensors is not None or level.pieces is None:
            continue
        read = True
        key = (level.step, *((manifest.chunks[p.chunk].id, p.offset, p.length) for p in level.pieces))
        checked = _CHECKED.get(key)
        if checked is not None and _fits(checked[1], manifest):
            manifest = replace(manifest, chain=(*manifest.chain[:n], replace(level, tensors=checked[0]),
                                                *manifest.chain[n + 1:]))
            continue
        where = f"restore chain level {n} (step {level.step})"
        data = b"".join(read_verified(vault, manifest, p.chunk, where)[p.offset: p.offset + p.length]
                        for p in level.pieces)
        manifest = check_chain_level(manifest, n, data, what)
        records = manifest.chain[n].tensors
        assert records is not None
        _CHECKED.put(key, (records, _extents(records)))
    if read:
        check_chain_inputs(manifest, what)
    return manifest


def _extents(records: tuple[TensorRecord, ...]) -> dict[int, int]:
    """Each chunk (table index) the pieces of ``records`` read, with the end of the furthest bytes read of it."""
    ends: dict[int, int] = {}
    for record in records:
        for piece in (*record.pieces, *((record.lossy.base_pieces or ()) if record.lossy is not None else ())):
            ends[piece.chunk] = max(ends.get(piece.chunk, 0), piece.offset + piece.length)
    return ends


def _fits(extents: dict[int, int], manifest: Manifest) -> bool:
    """Whether records needing ``extents`` read only bytes inside ``manifest``'s chunks (what the check of a level's
    records asks of the manifest's chunk table; the rest of it depends on the level's bytes alone)."""
    chunks = manifest.chunks
    return all(index < len(chunks) and end <= chunks[index].raw for index, end in extents.items())
