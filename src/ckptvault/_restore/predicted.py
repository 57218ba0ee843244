"""Restoring predicted records: the stored residual combined back with the prediction recomputed from the records
it was predicted from (DESIGN §6, "Predicted deltas").

A predicted record's inputs are records of its own checkpoint or of the checkpoints before it, which the
manifest's restore chain lists (with pieces in its own chunk table). A restore groups the records it needs into
families (records linked by predictions) and rebuilds each predicted one checking it against its saved digest: a
prediction that differs raises :class:`~ckptvault.errors.PredictionError` (a record rebuilt in a caller's buffer
leaves it undefined, as any failed restore does). Families of arrays cut into whole chunks stream through the
kernels slice by slice (``streamed.py``: memory, the outputs plus a few slices per thread); the rest, small arrays
packed with others, are read level by level, deepest first (memory: their records of two levels at a time).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .._delta.kernels import check_ieee, digest, flat_array, undo_residual
from .._format.records import Manifest, PredictInfo, TensorRecord
from .._vault import Vault
from ..errors import CorruptManifestError
from .chain import with_chain
from .streamed import Levels, families, mismatch, stream, streamable

ReadStored = Callable[[Vault, Manifest, dict[Any, Any]], None]


def is_predicted(tensors: tuple[TensorRecord, ...], key: Any) -> bool:
    """Whether read key ``key`` (a record index, or ``("range", index, start, length)``) is a predicted record."""
    index = key if isinstance(key, int) else key[1] if key[0] == "range" else None
    return index is not None and tensors[index].predict is not None


def fill_predicted(vault: Vault, manifest: Manifest, dests: dict[Any, Any], read: ReadStored,
                   on_filled: Callable[[Any], None] | None) -> None:
    """Write the restored bytes of each predicted record named by ``dests`` (keys as :func:`is_predicted` takes;
    values views or functions that make them) into its view; ``read`` reads stored bytes as ``read_into`` does.
    A whole-record view is rebuilt in place; a range is copied out of the rebuilt record."""
    direct = {key: (view if isinstance(view, memoryview) else view()) for key, view in dests.items()
              if isinstance(key, int)}
    indices = set(direct) | {key[1] for key in dests if not isinstance(key, int)}
    values = rebuild(vault, manifest, indices, read, direct)
    for key, view in dests.items():
        if not isinstance(key, int):
            target = view if isinstance(view, memoryview) else view()
            np.frombuffer(target, dtype=np.uint8)[:] = values[key[1]].view(np.uint8)[key[2]: key[2] + key[3]]
        if on_filled is not None:
            on_filled(key)


def rebuild(vault: Vault, manifest: Manifest, wanted: set[int], read: ReadStored,
            into: dict[int, memoryview] | None = None) -> dict[int, np.ndarray]:
    """Records ``wanted`` (indices into ``manifest.tensors``, predicted or not) as flat arrays of their dtype,
    rebuilt in the views ``into`` names (exactly a record's bytes) and in new arrays for the rest."""
    check_ieee()
    into = into or {}
    manifest = with_chain(vault, manifest)
    levels = [manifest.tensors] + [level.records for level in manifest.chain]
    index = [{t.path: k for k, t in enumerate(records)} for records in levels]
    needed = _closure(levels, index, wanted)
    streamed, by_level = [], [set[int]() for _ in levels]
    for nodes in families(levels, index, needed):
        family = streamable(levels, manifest.chunks, nodes, index, manifest.step)
        if family is not None:
            streamed.append(family)
        else:
            for n, k in nodes:
                by_level[n].add(k)
    values = {k: _buffer(levels[0][k], into.get(k)) for family in streamed for n, k in family.order
              if n == 0 and k in wanted}
    if streamed:
        stream(vault, manifest, levels, index, streamed, values)
    if any(by_level):
        values.update(_rebuild_by_level(vault, manifest, levels, index, by_level, read, into))
    return {k: values[k] for k in wanted}


def _rebuild_by_level(vault: Vault, manifest: Manifest, levels: Levels, index: list[dict[str, int]],
                      needed: list[set[int]], read: ReadStored, into: dict[int, memoryview]) -> dict[int, np.ndarray]:
    """The level-0 records of ``needed`` (a closed set of records per level), read and rebuilt level by level."""
    depth = max(n for n in range(len(levels)) if needed[n])
    below: dict[str, np.ndarray] = {}
    done: dict[int, np.ndarray] = {}
    read_ahead: dict[int, dict[int, np.ndarray]] = {}
    for n in range(depth, -1, -1):
        arrays = read_ahead.pop(n, None)
        if arrays is None:
            # the deepest two levels in one read (chunks both use are fetched once), then one level at a time
            batch = [n, n - 1] if n == depth and n > 0 else [n]
            read_ahead = _read_levels(vault, manifest, levels, needed, batch, read, into)
            arrays = read_ahead.pop(n)
        level = _Level(manifest, levels[n], index[n], arrays, below, vault.pool)
        for k in sorted(needed[n]):
            level.value(k, set())
        below, done = {levels[n][k].path: a for k, a in level.done.items()}, level.done
    return done


def _read_levels(vault: Vault, manifest: Manifest, levels: Levels, needed: list[set[int]],
                 batch: list[int], read: ReadStored, into: dict[int, memoryview]) -> dict[int, dict[int, np.ndarray]]:
    """The stored bytes of the records ``needed`` at the levels ``batch``, in one read: level 0's into the views
    ``into`` names where it names one, the rest into new arrays."""
    records: list[TensorRecord] = []
    arrays: dict[int, dict[int, np.ndarray]] = {}
    dests: dict[Any, Any] = {}
    for n in batch:
        arrays[n] = {}
        for k in sorted(needed[n]):
            arrays[n][k] = _buffer(levels[n][k], into.get(k) if n == 0 else None)
            dests[len(records)] = arrays[n][k].view(np.uint8).data
            records.append(levels[n][k])
    read(vault, replace(manifest, tensors=tuple(records)), dests)  # every level's pieces index the same chunk table
    return arrays


def _buffer(record: TensorRecord, view: memoryview | None) -> np.ndarray:
    """Where record's stored bytes are read: ``view`` (a caller's buffer), else a new array."""
    return flat_array(np.empty(record.nbytes, dtype=np.uint8).data if view is None else view, record.dtype)


def _closure(levels: Levels, index: list[dict[str, int]], wanted: set[int]) -> list[set[int]]:
    needed: list[set[int]] = [set() for _ in levels]
    todo = [(0, k) for k in wanted]
    while todo:
        n, k = todo.pop()
        if k in needed[n]:
            continue
        needed[n].add(k)
        record = levels[n][k]
        if record.predict is not None:
            todo.extend((n + i.level, index[n + i.level][i.path]) for i in record.predict.inputs)
    return needed


@dataclass
class _Level:
    """One level of a chain being rebuilt: its records' stored bytes (``arrays``), the level below rebuilt."""

    manifest: Manifest
    records: tuple[TensorRecord, ...]
    index: dict[str, int]
    arrays: dict[int, np.ndarray]
    below: dict[str, np.ndarray]
    pool: ThreadPoolExecutor
    done: dict[int, np.ndarray] = field(default_factory=dict)

    def value(self, k: int, visiting: set[int]) -> np.ndarray:
        """Record ``k``, rebuilt (its same-level inputs first)."""
        if k in self.done:
            return self.done[k]
        record, array = self.records[k], self.arrays[k]
        info = record.predict
        if info is not None:
            if k in visiting:
                raise CorruptManifestError(f"step {self.manifest.step}: the predictions of {record.path!r} form a cycle")
            visiting.add(k)
            inputs = {i.role: self.value(self.index[i.path], visiting) if i.level == 0 else self.below[i.path]
                      for i in info.inputs}
            self._unpredict(record, info, array, inputs)
        self.done[k] = array
        return array

    def _unpredict(self, record: TensorRecord, info: PredictInfo, array: np.ndarray,
                   inputs: dict[str, np.ndarray]) -> None:
        undo_residual(info.op, inputs, info.scalars, array, info.residual, info.raw_blocks, info.block, self.pool)
        if digest(array) != info.digest:
            raise mismatch(self.manifest, record)
