"""Rebuilding predicted records slice by slice (DESIGN §6, "Predicted deltas"): the levels of the restore chain
stream through the prediction kernels one chunk at a time, and no level is ever held whole.

A *family* is a set of records linked by predictions (a parameter's weights and moments, at every level of the
chain it needs): all of one dtype and shape, as the schema checks. A family is streamed when every record of it
is stored in whole chunks cut at the same byte offsets (arrays of a quarter of a chunk and more start their own
run of chunks: ``_save/chunking.py``), so that slice ``j`` of every record is its piece ``j``, alone in its chunk.
Each (family, slice) is one task on the vault's threads: it reads and verifies (C3) the slice's chunks deepest
level first, and rebuilds each predicted record's slice from its inputs' slices into the caller's array (level 0)
or into scratch memory of the thread (deeper levels, and inputs the caller did not ask for), released once the
level above is rebuilt. Memory: the outputs, plus a slice of each record of two levels per thread, let go when
the restore returns.

Each output that is a predicted record is hashed slice by slice in order, as its slices finish, and checked against
its digest (P2) once all are in. Only the chunks of outputs stored as they are get hashed as they are read (C3):
every other chunk a family reads holds the residual of a predicted output, which its prediction maps one to one
onto the output (XOR and the wrapping difference are both bijections of the words), or an input of a prediction (a
record of a deeper level, or one the caller did not ask for), which every output it feeds into recomputes from it.
Every record a family reads feeds a predicted output that the caller asked for, so the outputs' digests check all
their bytes that matter: an output whose digest matches is exactly the saved record, whatever its inputs held where
they did not count. On a mismatch the family's chunks are read again, hashed, so that a damaged chunk is named
before the prediction is blamed.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import blake3
import numpy as np

from .._delta.kernels import flat_array, undo_residual
from .._format.records import ChunkRef, Manifest, TensorRecord
from .._parallel import map_all
from .._vault import Vault
from ..errors import CorruptManifestError, PredictionError
from .readahead import read_ahead
from .verified import read_verified

#: a record of the chain: (level, index into that level's records); level 0 is the checkpoint restored
Node = tuple[int, int]
Levels = list[tuple[TensorRecord, ...]]


@dataclass
class Family:
    """Records linked by predictions, in an order that rebuilds every input before the records that read it."""

    order: list[Node]
    slices: list[tuple[int, int]]  # byte ranges, the same pieces in every record


def families(levels: Levels, index: list[dict[str, int]], needed: list[set[int]]) -> list[list[Node]]:
    """The records ``needed`` (per level), grouped into families: connected by their predictions' inputs."""
    parent: dict[Node, Node] = {}

    def root(node: Node) -> Node:
        parent.setdefault(node, node)
        while parent[node] != node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    for n, indices in enumerate(needed):
        for k in indices:
            info = levels[n][k].predict
            for i in info.inputs if info is not None else ():
                parent[root((n, k))] = root((n + i.level, index[n + i.level][i.path]))
            root((n, k))
    groups: dict[Node, list[Node]] = {}
    for node in parent:
        groups.setdefault(root(node), []).append(node)
    return list(groups.values())


def streamable(levels: Levels, chunks: tuple[ChunkRef, ...], nodes: list[Node], index: list[dict[str, int]],
               step: int) -> Family | None:
    """``nodes`` as a :class:`Family` to stream, or None where a record is not cut into whole chunks alike (small
    arrays packed with others: those rebuild level by level) or a block stored raw straddles a slice."""
    first: list[int] | None = None
    for n, k in nodes:
        record = levels[n][k]
        lengths = [p.length for p in record.pieces]
        if not lengths or any(p.offset != 0 or p.length != chunks[p.chunk].raw for p in record.pieces):
            return None
        if first is None:
            first = lengths
        elif lengths != first:
            return None
    assert first is not None  # a family has a record
    starts = np.cumsum([0, *first])
    slices = [(int(lo), int(hi)) for lo, hi in zip(starts[:-1], starts[1:], strict=True)]
    for n, k in nodes:
        info = levels[n][k].predict
        if info is not None and info.raw_blocks and any(lo % info.block for lo, _ in slices):
            return None
    return Family(_rebuild_order(levels, index, nodes, step), slices)


def _rebuild_order(levels: Levels, index: list[dict[str, int]], nodes: list[Node], step: int) -> list[Node]:
    """``nodes`` deepest level first, and within a level every record after the records of it that it reads."""
    order: list[Node] = []
    placed: set[Node] = set()

    def visit(node: Node, visiting: set[Node]) -> None:
        if node in placed:
            return
        n, k = node
        info = levels[n][k].predict
        if node in visiting:
            raise CorruptManifestError(f"step {step}: the predictions of {levels[n][k].path!r} form a cycle")
        visiting.add(node)
        for i in info.inputs if info is not None else ():
            if i.level == 0:
                visit((n, index[n][i.path]), visiting)
        placed.add(node)
        order.append(node)

    for node in sorted(nodes, key=lambda node: (-node[0], node[1])):
        visit(node, set())
    return order


def stream(vault: Vault, manifest: Manifest, levels: Levels, index: list[dict[str, int]], streamed: list[Family],
           outputs: dict[int, np.ndarray]) -> None:
    """Rebuild the level-0 records ``outputs`` names (flat arrays of their dtype, written in place) from the
    ``streamed`` families holding them, every slice of every family as one task on the vault's threads; raises
    PredictionError if a predicted output does not match its digest, CorruptChunkError for a damaged chunk."""
    digests = {k: _InOrder(outputs[k].view(np.uint8), family.slices) for family in streamed for n, k in family.order
               if n == 0 and k in outputs and levels[0][k].predict is not None}
    run = _Run(vault, manifest, levels, index, outputs, digests)
    units = [(family, j) for family in streamed for j in range(len(family.slices))]
    with read_ahead(vault.store, [_chunks_of(manifest, levels, family, j) for family, j in units]) as ahead:

        def unit(position: int) -> None:
            ahead.started(position)
            run.slice(*units[position])

        map_all(vault.pool, unit, range(len(units)))
    for k, hashed in digests.items():
        info = levels[0][k].predict
        assert info is not None  # only predicted records are hashed
        if hashed.hexdigest() != info.digest:
            family = next(f for f in streamed if (0, k) in f.order)
            for n, i in family.order:  # its chunks were read unverified: name a damaged one first
                for piece in levels[n][i].pieces:
                    read_verified(vault, manifest, piece.chunk, levels[n][i].path)
            raise mismatch(manifest, levels[0][k])


def _chunks_of(manifest: Manifest, levels: Levels, family: Family, j: int) -> list[tuple[str, int]]:
    """The chunk objects slice ``j`` of ``family`` reads, in the order it reads them, with their raw sizes."""
    refs = [manifest.chunks[levels[n][k].pieces[j].chunk] for n, k in family.order]
    return [(ref.id, ref.raw) for ref in refs]


def mismatch(manifest: Manifest, record: TensorRecord) -> PredictionError:
    """The error of predicted ``record`` restored to bytes other than those it was saved with."""
    info = record.predict
    assert info is not None  # only predicted records are checked against a digest
    return PredictionError(f"step {manifest.step}: {record.path!r}, stored as the residual against its prediction "
                           f"({info.op}) from step {info.from_step}, does not restore to the bytes it was saved "
                           "with (BLAKE3 digest differs) although its chunks are intact; its value is not "
                           "trustworthy: restore an earlier checkpoint, and report this with `ckptvault show`")


@dataclass
class _Run:
    vault: Vault
    manifest: Manifest
    levels: Levels
    index: list[dict[str, int]]
    outputs: dict[int, np.ndarray]
    digests: dict[int, _InOrder]
    #: each thread's spare scratch arrays (bytes), reused from slice to slice (fresh memory is slow to fault in)
    #: and let go with the run
    spare: dict[int, list[np.ndarray]] = field(default_factory=dict)

    def slice(self, family: Family, j: int) -> None:
        """Rebuild slice ``j`` of every record of ``family``, then hash the outputs' slices that are due."""
        lo, hi = family.slices[j]
        values: dict[Node, np.ndarray] = {}
        scratch = self.spare.setdefault(threading.get_ident(), [])  # only this thread uses its list
        held: dict[int, list[np.ndarray]] = {}  # scratch taken per level
        level = None
        for node in family.order:
            n, k = node
            if n != level:
                for gone in [m for m in held if m > n + 1]:  # no record below level n + 1 is read any more
                    scratch.extend(held.pop(gone))
                    for dropped in [v for v in values if v[0] == gone]:
                        del values[dropped]
                level = n
            record = self.levels[n][k]
            output = self.outputs.get(k) if n == 0 else None
            out = None if output is None else output[lo // output.itemsize: hi // output.itemsize]
            if out is not None and record.predict is None:  # decoded straight into the caller's array, verified
                self._read(record, j, out.view(np.uint8).data, verify=True)
                values[node] = out
                continue
            kept = record.predict is None  # the stored bytes are the value, read by the levels above
            borrowed: list[np.ndarray] = []  # the read buffer of a residual, given back once it is undone
            buffer = _take(scratch, held.setdefault(n, []) if kept else borrowed, record.pieces[j].length)
            stored = flat_array(self._read(record, j, buffer.data, verify=False), record.dtype)  # the digests check it
            values[node] = stored if kept else self._rebuilt(record, n, lo, stored, out, values, scratch,
                                                             held.setdefault(n, []))
            scratch.extend(borrowed)
        scratch.extend(buffer for taken in held.values() for buffer in taken)
        for n, k in family.order:
            if n == 0 and k in self.digests:
                self.digests[k].finished(j)

    def _read(self, record: TensorRecord, j: int, into: memoryview, verify: bool) -> memoryview:
        """Piece ``j`` of ``record``, its whole chunk, read, decoded into ``into`` and, with ``verify``, hashed."""
        return read_verified(self.vault, self.manifest, record.pieces[j].chunk, record.path, into, verify)

    def _rebuilt(self, record: TensorRecord, n: int, lo: int, stored: np.ndarray, out: np.ndarray | None,
                 values: dict[Node, np.ndarray], scratch: list[np.ndarray], held: list[np.ndarray]) -> np.ndarray:
        """Predicted ``record``'s slice from byte ``lo``: its stored residual undone with its prediction, in ``out`` (the
        caller's) if given, else in scratch that ``held`` keeps for the levels above."""
        info = record.predict
        assert info is not None  # records stored as they are need no rebuilding
        target = out if out is not None else _take(scratch, held, stored.nbytes).view(stored.dtype)
        inputs = {i.role: values[(n + i.level, self.index[n + i.level][i.path])] for i in info.inputs}
        first, last = lo // info.block, (lo + stored.nbytes - 1) // info.block
        skip = tuple(b - first for b in info.raw_blocks if first <= b <= last)
        if skip:  # blocks stored as they are: copied, and undoing the residual leaves them alone
            np.copyto(target, stored)
        undo_residual(info.op, inputs, info.scalars, target, info.residual, skip, info.block,
                      source=None if skip else stored)
        return target


def _take(scratch: list[np.ndarray], held: list[np.ndarray], nbytes: int) -> np.ndarray:
    """``nbytes`` of scratch bytes, from this thread's spare arrays where one is large enough, noted in ``held``
    (which gives them back to ``scratch`` once what they hold is no longer read)."""
    for n, spare in enumerate(scratch):
        if spare.nbytes >= nbytes:
            buffer = scratch.pop(n)
            break
    else:
        buffer = np.empty(nbytes, dtype=np.uint8)
    held.append(buffer)
    return buffer[:nbytes]


@dataclass
class _InOrder:
    """A BLAKE3 digest of an array fed slice by slice in order, as slices finish in any order on any thread: the
    thread that finishes the next slice due hashes it and every finished slice after it."""

    data: np.ndarray  # bytes
    slices: list[tuple[int, int]]
    _next: int = 0
    _finished: set[int] = field(default_factory=set)
    _busy: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _hasher: Any = field(default_factory=blake3.blake3)

    def finished(self, j: int) -> None:
        with self._lock:
            self._finished.add(j)
            if self._busy:
                return
            self._busy = True
        while True:
            with self._lock:
                if self._next not in self._finished:
                    self._busy = False
                    return
                due = self._next
            lo, hi = self.slices[due]
            self._hasher.update(self.data[lo:hi])
            with self._lock:
                self._next += 1

    def hexdigest(self) -> str:
        assert self._next == len(self.slices), "every slice is hashed before the digest is read"
        return str(self._hasher.hexdigest())
