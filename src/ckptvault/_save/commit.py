"""The last step of a save: build the manifest and commit it, the only write that makes a checkpoint visible.

:func:`commit` creates the manifest create-if-absent (or replaces it atomically with ``overwrite``) after checking
that every chunk it names still exists; a failure leaves nothing committed, and the save may be retried.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import replace
from typing import Any

from .._feedback import warn_at_caller
from .._format import FORMAT_VERSION, records
from .._format.chunk_object import CHUNKS_PREFIX, chunk_key
from .._format.manifest import encode_manifest, manifest_key
from .._format.predicted import RESIDUALS, build_chain, chain_table_prefix
from .._format.records import ChunkRef, LossyInfo, Manifest, TensorRecord
from .._format.schema import MAX_DEPTH, too_deep
from .._maintenance.gc import remember_written
from .._parallel import map_all
from .._vault import Vault
from .._version import __version__
from ..errors import InvalidArgumentError, SaveError, StepExistsError
from ..stores.base import Store, WriteBatch
from .chain_level import StoreLevel
from .chunking import Piece
from .chunks import ChunkResult, finish_batch
from .guard import ManifestGuard
from .snapshot import ArrayRecord, Snapshot

log = logging.getLogger(__name__)

#: where asking whether a chunk exists is a request (S3), the commit's existence check lists the chunk keys
#: instead if the vault seems to hold fewer than this many chunks per chunk it checks (``missing_chunks``)
LIST_PER_PROBE = 10


def build_manifest(step: int, snapshot: Snapshot, chunks: list[ChunkResult], pieces: list[list[Piece]],
                   metrics: dict[str, Any], metadata: dict[str, Any],
                   keyframe_step: int | None = None, since_keyframe: int = 0, predicted_from: Manifest | None = None,
                   store_level: StoreLevel | None = None) -> Manifest:
    """The manifest: every tensor, the unique chunks they use, and the statistics.

    ``metrics`` and ``metadata`` as :func:`json_fields` returned them. ``keyframe_step`` is the keyframe whose
    chunks this checkpoint's deltas are against (None: this checkpoint is a keyframe); ``since_keyframe`` counts
    checkpoints since it. ``predicted_from``: the checkpoint predicted records are predicted from, whose records
    they read (and its chain's) the manifest's restore chain lists; ``store_level`` writes the chain's new level in
    chunks (``chain_level.py``), which the manifest then names instead of holding the level's records.
    """
    table = ChunkTable()
    if not any(r.predict is not None for r in snapshot.records):
        predicted_from = None
    if predicted_from is not None:  # the restore chain keeps that manifest's chunk indices
        for ref in chain_table_prefix(predicted_from):
            table.add(ref)
    remap = [table.add(ChunkRef(c.id, c.raw, c.stored, c.new, c.base)) for c in chunks]
    tensors = tuple(_tensor_record(record, leaf_pieces, remap, table)
                    for record, leaf_pieces in zip(snapshot.records, pieces, strict=True))
    chain = build_chain(tensors, predicted_from)
    if chain and store_level is not None:
        stored = tuple(records.Piece(table.add(ref), 0, ref.raw) for ref in store_level(chain[0]))
        chain = (replace(chain[0], pieces=stored), *chain[1:])
    requires = tuple(feature for feature, used in (("lossy", any(t.lossy is not None for t in tensors)),
                                                   ("xplanes", any(c.base for c in table.entries)),
                                                   ("predicted", bool(chain)),
                                                   ("chain-chunks", any(level.pieces for level in chain))) if used)
    requires += _residual_features(tensors, chain)
    manifest = new_manifest(
        step, table, tensors, tree=snapshot.tree, logical_bytes=snapshot.logical_bytes, metrics=metrics,
        metadata=metadata, pickle=snapshot.allow_pickle and any(r.kind == "pickle" for r in snapshot.records),
        keyframe_step=step if keyframe_step is None else keyframe_step,
        since_keyframe=0 if keyframe_step is None else since_keyframe, requires=requires)
    return replace(manifest, chain=chain) if chain else manifest


def new_manifest(step: int, table: ChunkTable, tensors: tuple[TensorRecord, ...], *, tree: Any, logical_bytes: int,
                 metrics: dict[str, Any], metadata: dict[str, Any], pickle: bool, keyframe_step: int,
                 since_keyframe: int, requires: tuple[str, ...]) -> Manifest:
    """A manifest of ``tensors`` over the chunks of ``table``, written now by this version: the stored and added
    bytes follow from the table. ``requires``: the features a reader must know, or refuse it (DESIGN §4)."""
    return Manifest(
        step=step, time=time.time(), writer=f"ckptvault {__version__}", pickle=pickle, logical_bytes=logical_bytes,
        stored_bytes=sum(c.stored for c in table.entries), added_bytes=sum(c.stored for c in table.entries if c.new),
        metrics=metrics, metadata=metadata, keyframe_step=keyframe_step, since_keyframe=since_keyframe,
        tree=tree, tensors=tensors, chunks=tuple(table.entries), requires=requires, version=FORMAT_VERSION)


class ChunkTable:
    """The manifest's list of unique chunks, built by adding references."""

    def __init__(self) -> None:
        self.entries: list[ChunkRef] = []
        self._index: dict[str, int] = {}

    def add(self, chunk: ChunkRef) -> int:
        """Index of ``chunk`` in the table, adding it if new (a chunk this save wrote, or one rank of it, stays
        marked new)."""
        index = self._index.get(chunk.id)
        if index is None:
            index = self._index[chunk.id] = len(self.entries)
            self.entries.append(chunk)
        elif chunk.new and not self.entries[index].new:
            self.entries[index] = replace(self.entries[index], new=True)
        return index


def _residual_features(tensors: tuple[TensorRecord, ...], chain: tuple[records.ChainLevel, ...]) -> tuple[str, ...]:
    """The ``requires`` features (``RESIDUALS``) of the residuals that records of this manifest, or of levels it holds
    inline, are stored as."""
    forms = {t.predict.residual for t in tensors if t.predict is not None}
    forms.update(*(level.residual_forms for level in chain if level.tensors is not None))
    return tuple(sorted(feature for form in forms if (feature := RESIDUALS[form]) is not None))


def _tensor_record(record: ArrayRecord, pieces: list[Piece], remap: list[int], table: ChunkTable) -> TensorRecord:
    return TensorRecord(
        path=record.path, kind=record.kind, dtype=record.dtype, shape=tuple(record.shape), nbytes=record.nbytes,
        codec=record.codec, pieces=tuple(records.Piece(remap[p.chunk], p.offset, p.length) for p in pieces),
        global_shape=tuple(record.shape), offsets=(0,) * len(record.shape), requires_grad=record.requires_grad,
        device=None if record.device == "cpu" else record.device, lossy=_lossy_info(record, table),
        predict=record.predict)


def _lossy_info(record: ArrayRecord, table: ChunkTable) -> LossyInfo | None:
    """The record's lossy entry as the manifest holds it: a residual's keyframe copy is named in this manifest's
    own chunk table, so its chunks stay live (DESIGN §12, L4)."""
    if record.lossy is None or not record.keyframe_pieces:
        return record.lossy
    base_pieces = tuple(records.Piece(table.add(replace(p.chunk, new=False)), p.offset, p.length)
                        for p in record.keyframe_pieces)
    return replace(record.lossy, base_pieces=base_pieces)


def commit(vault: Vault, step: int, manifest: Manifest, overwrite: bool, guard: ManifestGuard | None = None,
           batch: WriteBatch | None = None) -> None:
    """Make the checkpoint visible. Atomic: afterwards it is either fully committed or absent.

    ``batch``: the unfinished write batch of the save's chunks (``write_chunks(..., batch)``). The manifest is
    staged in it, the batch finished (its chunks durable and visible, the manifest's bytes written with theirs),
    and then the manifest published; with the local store that is three syncs where finishing the batch first
    and then putting the manifest takes four. None: the chunks are durable already. Abandoned if this raises.

    Before writing the manifest, every chunk it names and every delta base is
    checked to still exist: gc deletes unreferenced chunks older than its grace
    period, which a reused chunk, a delta base whose keyframe was pruned, or a
    chunk written early in a save longer than the grace period could be. A
    missing one fails the save with nothing committed; the save may be retried.
    Before that check (and after the batch is finished), ``guard`` touches the
    chunks the save reused untouched if a manifest it relied on changed
    meanwhile (``_save/guard.py``).
    """
    batch = batch or vault.store.write_batch()
    data = encode_manifest(manifest)
    try:
        batch.stage_final(manifest_key(step), data)
        finish_batch(batch)
        if guard is not None:
            guard.ensure(vault.store, vault.pool)
        needed = sorted({c.id for c in manifest.chunks} | {c.base for c in manifest.chunks if c.base})
        missing = missing_chunks(vault, needed)
        if missing:
            raise SaveError(
                f"{len(missing)} chunks of step {step} (such as {missing[0]}) were removed by a concurrent gc before "
                "it committed (is gc's grace period shorter than a save?); nothing was committed: save again"
            )
        if not batch.publish_final(overwrite):
            raise StepExistsError(step, vault.url)
    except BaseException:
        batch.abandon()
        raise
    remember_written(vault, step, data, manifest)  # retention after this commit reads it back
    log.info("committed step %d to %s (%d bytes added)", step, vault.url, manifest.added_bytes)


def missing_chunks(vault: Vault, ids: list[str]) -> list[str]:
    """The chunks of ``ids`` the store does not hold now, in the order of ``ids``.

    Where asking for one is cheap (a local ``stat``) each is asked for. Where it is a request (S3: a HEAD,
    which costs far more client CPU than a listed key), the vault's chunk keys are listed instead if the vault
    seems to hold fewer than ``LIST_PER_PROBE`` chunks per chunk checked (:func:`_chunk_count_estimate`). If
    the listing ends, a chunk it did not show is missing; if it runs to twice that many keys (the estimate was
    low), it stops and the chunks it did not show are asked for. A listed key and an answered probe say the
    same: the object existed when the store answered.
    """
    store = vault.store
    budget = LIST_PER_PROBE * len(ids)
    if not store.cheap_stat and ids and _chunk_count_estimate(store) <= budget:
        wanted = {chunk_key(cid): cid for cid in ids}
        for listed, info in enumerate(store.list(CHUNKS_PREFIX)):
            if listed == 2 * budget:
                break
            wanted.pop(info.key, None)
        else:  # the listing ended: whatever it did not show is missing
            unseen = set(wanted.values())
            return [cid for cid in ids if cid in unseen]
        ids = [cid for cid in ids if chunk_key(cid) in wanted]  # not shown before the listing stopped: ask
    present = map_all(vault.pool, lambda cid: store.exists(chunk_key(cid)), ids)
    return [cid for cid, ok in zip(ids, present, strict=True) if not ok]


def _chunk_count_estimate(store: Store) -> int:
    """About how many chunks the vault holds: 256 times those under one of the 256 two-hex-digit key prefixes
    (chunk ids are uniform hashes), from one small listing."""
    return 256 * sum(1 for _ in store.list(f"{CHUNKS_PREFIX}00/"))


def json_fields(values: dict[str, Any] | None, what: str) -> dict[str, Any]:
    """``values`` checked to be a JSON object of finite values (numpy/torch scalars become floats).

    For ``metrics``, non-finite floats (a diverged loss) are kept as the strings ``"nan"``, ``"inf"``, ``"-inf"``
    (manifests are strict JSON; :func:`metrics_from_manifest` gives the floats back), and a RuntimeWarning at the
    caller's ``save()`` line names them (values already stored as strings warn no more)."""
    values = {} if values is None else values
    if not isinstance(values, dict) or not all(isinstance(k, str) for k in values):
        raise InvalidArgumentError(f"{what} must be a dict with str keys, got {type(values).__name__}")
    cleaned = {k: (float(v) if _is_number_like(v) else v) for k, v in values.items()}
    if what == "metrics":
        found: list[str] = []
        cleaned = {k: non_finite_as_str(v, k, found) for k, v in cleaned.items()}
        if found:
            what_is = f"metric {found[0]} is not a finite number" if len(found) == 1 else \
                f"metrics {', '.join(found)} are not finite numbers"
            warn_at_caller(f"{what_is} (NaN or infinity: did training diverge?): stored as 'nan'/'inf'/'-inf' in the "
                          "manifest and read back as floats by info(); KeepBest and best_step() ignore it; check the "
                          "value you pass to save(metrics=...)", RuntimeWarning)
    if too_deep(cleaned):  # readers refuse deeper manifests (_format/schema.py)
        raise InvalidArgumentError(f"{what} is nested more than {MAX_DEPTH} levels deep; flatten it")
    try:
        json.dumps(cleaned, allow_nan=False)
    except (TypeError, ValueError) as exc:
        bad = [k for k, v in cleaned.items() if isinstance(v, float) and not math.isfinite(v)]
        detail = f"non-finite values at {bad}" if bad else str(exc)
        raise InvalidArgumentError(f"{what} must be JSON-serialisable (finite numbers, str, lists, dicts): {detail}") from None
    return cleaned


def non_finite_as_str(value: Any, path: str = "", found: list[str] | None = None) -> Any:
    """``value`` with every non-finite float (also inside lists and dicts) as ``"nan"``, ``"inf"`` or ``"-inf"``,
    as manifests keep metrics (strict JSON); the key path of each goes to ``found`` if given."""
    if isinstance(value, float) and not math.isfinite(value):
        if found is not None:
            found.append(f"{path}={value}")
        return str(value)
    if isinstance(value, dict):
        return {k: non_finite_as_str(v, f"{path}.{k}", found) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [non_finite_as_str(v, f"{path}[{i}]", found) for i, v in enumerate(value)]
    return value


NON_FINITE_STRINGS = frozenset({"nan", "inf", "-inf"})


def metrics_from_manifest(value: Any) -> Any:
    """Stored metrics with the strings ``"nan"``, ``"inf"`` and ``"-inf"`` (how :func:`json_fields` keeps
    non-finite numbers) as floats again, also inside lists and dicts."""
    if isinstance(value, str) and value in NON_FINITE_STRINGS:
        return float(value)
    if isinstance(value, dict):
        return {k: metrics_from_manifest(v) for k, v in value.items()}
    if isinstance(value, list):
        return [metrics_from_manifest(v) for v in value]
    return value


def _is_number_like(value: Any) -> bool:
    """numpy and 0-d torch scalars (a loss.item() forgotten) are accepted as floats."""
    return type(value).__module__ in ("numpy", "torch") and getattr(value, "ndim", 1) == 0 and hasattr(value, "item")
