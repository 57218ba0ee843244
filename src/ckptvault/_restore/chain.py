"""Reading a predicted checkpoint's restore chain: the levels stored in chunk objects (DESIGN §6, "Predicted
deltas"), each read and verified like any chunk (C3), then parsed and checked like the manifest's own records."""

from __future__ import annotations

from .._format.manifest import manifest_key
from .._format.records import Manifest
from .._format.schema import check_chain_level
from .._vault import Vault
from .verified import read_verified


def with_chain(vault: Vault, manifest: Manifest) -> Manifest:
    """``manifest`` with the records of every level of its restore chain (read from its chunks where it is stored
    in chunks). Raises CorruptChunkError for a damaged chunk, CorruptManifestError for a level that is no valid
    level of this manifest."""
    for n, level in enumerate(manifest.chain):
        if level.tensors is not None or level.pieces is None:
            continue
        where = f"restore chain level {n} (step {level.step})"
        data = b"".join(read_verified(vault, manifest, p.chunk, where)[p.offset: p.offset + p.length]
                        for p in level.pieces)
        manifest = check_chain_level(manifest, n, data, f"manifest {manifest_key(manifest.step)} in {vault.url}")
    return manifest
