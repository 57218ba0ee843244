"""Space accounting for a vault: what the checkpoints hold versus what the store holds.

Used by ``ckptvault du`` and ``ckptvault rm``. Everything here only reads: it
lists the store and reads manifests, never chunk payloads, so it is cheap even
for large vaults. A save in flight may have written chunks that no manifest
names yet; they are counted as unreferenced until that save commits.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .._format.chunk_object import chunk_key
from .._format.keys import chunk_id_of_key
from .._format.manifest import step_of_key
from .._format.records import Manifest
from .._vault import Vault
from ..errors import VaultError


@dataclass
class Tally:
    """A number of objects and their total size in bytes."""

    count: int = 0
    bytes: int = 0

    def add(self, size: int) -> None:
        self.count += 1
        self.bytes += size


@dataclass(frozen=True)
class StepUsage:
    """Sizes recorded in one checkpoint's manifest (see :class:`ckptvault.CheckpointInfo`)."""

    step: int
    logical_bytes: int
    stored_bytes: int
    added_bytes: int


@dataclass
class VaultUsage:
    """Logical size of every checkpoint against the physical size of the store.

    ``unique_raw_bytes``: raw size of the distinct chunks the checkpoints
    reference; ``referenced``: those chunk objects and the delta bases they
    need, as stored (sizes from the store listing). ``chunks``, ``manifests`` and ``other`` tally every object
    in the store; ``unreferenced`` are chunk objects no readable manifest names
    (garbage that gc reclaims, or chunks of a save in flight); ``missing``
    counts referenced chunks absent from the store. ``damaged`` maps steps whose
    manifest cannot be read to the reason; they are left out of every figure.
    """

    steps: list[StepUsage] = field(default_factory=list)
    damaged: dict[int, str] = field(default_factory=dict)
    unique_raw_bytes: int = 0
    referenced: Tally = field(default_factory=Tally)
    chunks: Tally = field(default_factory=Tally)
    manifests: Tally = field(default_factory=Tally)
    other: Tally = field(default_factory=Tally)
    unreferenced: Tally = field(default_factory=Tally)
    missing: int = 0

    @property
    def logical_bytes(self) -> int:
        """Sum of the logical bytes of every checkpoint (what separate full copies would take)."""
        return sum(s.logical_bytes for s in self.steps)

    @property
    def physical_bytes(self) -> int:
        """Every object in the store (temporary files of writes in flight excluded)."""
        return self.chunks.bytes + self.manifests.bytes + self.other.bytes

    @property
    def dedup_saved_bytes(self) -> int:
        """Bytes not stored because identical chunks are stored once."""
        return self.logical_bytes - self.unique_raw_bytes

    @property
    def compression_saved_bytes(self) -> int:
        """Bytes saved by the codecs on the distinct referenced chunks."""
        return self.unique_raw_bytes - self.referenced.bytes

    @property
    def ratio(self) -> float:
        """Physical bytes / logical bytes (lower is better); 1.0 for an empty vault."""
        return self.physical_bytes / self.logical_bytes if self.logical_bytes else 1.0


@dataclass
class References:
    """What a set of manifests needs from the store.

    ``raw``: chunk id -> raw size of every chunk the manifests list;
    ``bases``: the delta bases those chunks are stored against (a base stays
    needed even when no manifest lists it any more); ``unreadable``: steps whose
    manifest cannot be read (missing, damaged, newer format) -> the reason;
    their chunks are in neither set.
    """

    raw: dict[str, int] = field(default_factory=dict)
    bases: set[str] = field(default_factory=set)
    unreadable: dict[int, str] = field(default_factory=dict)

    def add(self, manifest: Manifest) -> None:
        """Record the chunks (and delta bases) one manifest needs."""
        for chunk in manifest.chunks:
            self.raw[chunk.id] = chunk.raw
            if chunk.base:
                self.bases.add(chunk.base)

    @property
    def ids(self) -> set[str]:
        """Every chunk object the manifests need: listed chunks and their delta bases."""
        return set(self.raw) | self.bases


def referenced_chunks(vault: Vault, steps: Iterable[int]) -> References:
    """The chunks the manifests of ``steps`` need (see :class:`References`). Reads manifests only."""
    refs = References()
    for step in steps:
        try:
            manifest = vault.read_manifest(step)
        except VaultError as exc:
            refs.unreadable[step] = str(exc)
            continue
        refs.add(manifest)
    return refs


def vault_usage(vault: Vault) -> VaultUsage:
    """Account for every checkpoint and every object of the vault. Reads manifests, not chunks."""
    usage = VaultUsage()
    refs = References()
    for step in vault.steps():
        try:
            manifest = vault.read_manifest(step)
        except VaultError as exc:
            usage.damaged[step] = str(exc)
            continue
        usage.steps.append(StepUsage(step, manifest.logical_bytes, manifest.stored_bytes, manifest.added_bytes))
        refs.add(manifest)
    usage.unique_raw_bytes = sum(refs.raw.values())
    needed = {chunk_key(cid) for cid in refs.ids}
    for info in vault.store.list():
        if chunk_id_of_key(info.key) is not None:
            usage.chunks.add(info.size)
            (usage.referenced if info.key in needed else usage.unreferenced).add(info.size)
        elif step_of_key(info.key) is not None:
            usage.manifests.add(info.size)
        else:
            usage.other.add(info.size)
    usage.missing = len(needed) - usage.referenced.count
    return usage
