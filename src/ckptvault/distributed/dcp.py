"""torch.distributed.checkpoint (DCP) storage in a vault: :class:`VaultWriter` and :class:`VaultReader`.

One line changes in a DCP script::

    dcp.save(state, storage_writer=VaultWriter(url, step))
    dcp.load(state, storage_reader=VaultReader(url, step))

Every rank writes the chunks of its own items through the vault's chunk writer (content-addressed, compressed with
the vault's codec, deduplicated against every chunk already stored, by any step or rank, and durable before
``write_data`` returns); the coordinator then commits ONE manifest for all ranks, written last with
create-if-absent (DESIGN M1, M2): until ``finish`` has written it the checkpoint does not exist, and a save that
fails anywhere leaves only unreferenced chunks for ``gc``. Such a save may simply be run again. Tensors are stored
as shard records (DESIGN section 4, "DCP checkpoints"); non-tensor values as ckptvault's JSON skeleton, never
pickled unless ``allow_pickle``. DCP's metadata is rebuilt from the manifest on load, so nothing is pickled there
either.

Errors: DCP catches what a rank raises, and raises ``torch.distributed.checkpoint.api.CheckpointException`` on
every rank, with the rank's exception in ``failures`` (rank -> (exception, traceback)). CheckpointException derives
from BaseException, not Exception: catch it by name. The exceptions inside are ckptvault's typed errors (a
:class:`~ckptvault.errors.SaveError` naming the rank and the cause for anything unexpected,
:class:`~ckptvault.errors.StepExistsError`, :class:`~ckptvault.errors.UnsupportedObjectError` naming the key, storage
errors, ...), picklable across ranks (``VaultError.__reduce__``). A failure to read the manifest reaches DCP's loader as an
``AssertionError("metadata is None; global metadata read failed: <the error>")``.
"""

from __future__ import annotations

import io
import math
import os
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from .._argcheck import check_kind
from .._arrays import (
    empty_like_record,
    finish_ndarray,
    host_contiguous,
    ndarray_bytes,
    plain_cpu,
    tensor_bytes,
    torch_dtype_name,
    writable_bytes,
)
from .._codecs import DEFAULT_CODEC, validate_codec_name
from .._codecs.lossy import LossySafety, parse_codec
from .._delta.policy import DeltaContext, DeltaPolicy, KeyframeCache, delta_context
from .._format import records
from .._format.keys import step_of_manifest_key
from .._format.manifest import check_step, manifest_key
from .._format.records import ChunkRef, LossyInfo, Manifest, Node, TensorRecord
from .._format.schema import check_manifest
from .._restore.tensors import Dest, LossyReads, read_into, sharing_memory
from .._save.chunks import write_chunks
from .._save.commit import commit, json_fields
from .._save.guard import ManifestGuard
from .._save.lossy import LossyBuffers, apply_lossy
from .._save.snapshot import ArrayRecord, Snapshot
from .._tree import Flattener, Leaf, leaf_paths, unflatten
from .._vault import Vault
from ..errors import (
    CorruptDataError,
    InvalidArgumentError,
    PickleNotAllowedError,
    SaveError,
    StepExistsError,
    UnsupportedObjectError,
    VaultError,
    VaultNotFoundError,
)
from ..options import DeltaOptions
from ..rules import CodecRules
from ..stores import StorageOptions, Store
from ._layout import Layout, Placement, build_manifest, dcp_layout, leaf_indices, renumber
from ._staging import HostStaging

Url = str | os.PathLike[str] | Store
#: bytes of shards a reader holds at once (more only when one shard is larger)
READ_BATCH_BYTES = 256 << 20


@dataclass(frozen=True)
class _VaultPlan:
    """What the coordinator tells every rank (``SavePlan.storage_data``): the step, the vault it created, and the
    delta decision made once for all ranks: the keyframe to encode against (None: this save is a keyframe), and
    the manifests read for it as stat'ed (key -> (size, mtime)), whose chunks the ranks reuse without a touch."""

    step: int
    chunk_size: int
    codec: str
    keyframe_step: int | None = None
    since_keyframe: int = 0
    watched: tuple[tuple[str, tuple[int, float]], ...] = ()


def _step_of(checkpoint_id: Any) -> int:
    if type(checkpoint_id) is not int:
        raise InvalidArgumentError(f"a vault's checkpoint_id is the step (an int), got {checkpoint_id!r}; the vault's "
                                   "URL is given when the writer or reader is made")
    return check_step(checkpoint_id)


@contextmanager
def _typed_errors(what: str) -> Iterator[None]:
    """Let ckptvault's errors (and BaseExceptions that are not Exceptions) through; raise anything else as a
    SaveError "``what``: Type: message" caused by it, so every rank's failure is typed (and picklable)."""
    try:
        yield
    except VaultError:
        raise
    except Exception as exc:
        raise SaveError(f"{what}: {type(exc).__name__}: {exc}") from exc


class _OnVault:
    """What VaultWriter and VaultReader share: the vault they open lazily (its thread pool released by
    :meth:`close`, reopened by the next call) and the step DCP's ``checkpoint_id`` may name."""

    url: Url
    step: int | None
    storage_options: StorageOptions | None
    workers: int | None
    _vault: Vault | None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """False: DCP cannot pick a vault by itself (pass ``storage_writer=VaultWriter(url, step)`` or
        ``storage_reader=VaultReader(url, step)``)."""
        return False

    def reset(self, checkpoint_id: Any = None) -> None:
        """A new save or load: of step ``checkpoint_id`` if given (an int), else of the step given when made."""
        self.close()
        if checkpoint_id is not None:
            self.step = _step_of(checkpoint_id)

    #: a vault lent by its owner (a CheckpointManager): used as it is, never closed here
    _lent: Vault | None = None

    def _open(self) -> Vault:
        if self._lent is not None:
            return self._lent
        if self._vault is None:
            self._vault = Vault(self.url, self.storage_options, self.workers)
        return self._vault

    def close(self) -> None:
        """Release the vault's threads (the next call reopens it)."""
        if self._vault is not None:
            vault, self._vault = self._vault, None
            vault.close()


class VaultWriter(_OnVault, StorageWriter, AsyncStager):
    """Save a DCP checkpoint as step ``step`` of the vault at ``url`` (a path, ``memory://``, ``s3://``... or a Store).

    ``dcp.save(state, storage_writer=VaultWriter(url, step))`` on every rank (each with its own writer). DCP's call
    order: ``reset`` (when ``dcp.save`` gets a ``checkpoint_id``: the step, an int), ``set_up_storage_writer``,
    ``prepare_local_plan``, ``prepare_global_plan`` (coordinator: creates the vault with ``chunk_size`` and
    ``codec`` if there is none, refuses a committed step unless ``overwrite``), ``write_data`` (every rank: its
    chunks, durable on return), ``finish`` (coordinator, after every rank's write_data returned: the commit, atomic).
    ``metrics`` and ``metadata`` are JSON objects for the manifest, as in ``CheckpointManager.save``. Non-tensor
    values holding objects that need pickle are an UnsupportedObjectError naming the key unless ``allow_pickle``
    (loading them then needs it too). A writer may be used for one save after another (``checkpoint_id=step``).

    ``incremental`` and ``delta`` as for CheckpointManager: the coordinator decides once whether the save is a
    keyframe and, if not, every rank stores each changed chunk of its shards as a delta against the chunk of the
    keyframe that held the same region of the same shard (key path and offsets). ``codec_rules`` choose a lossless
    codec per key path (lossy codecs are not available for shards: InvalidArgumentError). As DCP's ``AsyncStager``,
    ``dcp.async_save(state, storage_writer=writer)`` waits only for :meth:`stage`, a host copy of this rank's
    tensors in buffers the writer keeps for its next save.
    """

    step: int

    def __init__(self, url: Url, step: int, *, overwrite: bool = False, allow_pickle: bool = False,
                 codec: str | None = None, codec_rules: Mapping[str, str] | Iterable[tuple[str, str]] | None = None,
                 chunk_size: int | None = None, storage_options: StorageOptions | None = None,
                 workers: int | None = None, metrics: dict[str, Any] | None = None,
                 metadata: dict[str, Any] | None = None, incremental: bool = True,
                 delta: DeltaOptions | None = None, lossy_safety: LossySafety | None = None) -> None:
        super().__init__()
        check_kind("overwrite", overwrite, bool)
        check_kind("allow_pickle", allow_pickle, bool)
        check_kind("codec", codec, str, type(None))
        check_kind("delta", delta, DeltaOptions, type(None))
        if codec is not None:
            validate_codec_name(codec)
        check_kind("lossy_safety", lossy_safety, LossySafety, type(None))
        self.codec_rules = checked_rules(codec_rules, codec)
        self.lossy_safety = lossy_safety or LossySafety()
        self.url, self.step, self.overwrite, self.allow_pickle = url, check_step(step), overwrite, allow_pickle
        self.codec, self.chunk_size, self.storage_options, self.workers = codec, chunk_size, storage_options, workers
        self.metrics, self.metadata = json_fields(metrics, "metrics"), json_fields(metadata, "metadata")
        delta = delta or DeltaOptions()
        self.delta_policy = DeltaPolicy(incremental, delta.keyframe_every, delta.keyframe_growth)
        self.is_coordinator, self.rank = False, 0
        self._vault: Vault | None = None
        self._delta: DeltaContext | None = None  # the coordinator's, from prepare_global_plan to finish
        self._manifests: dict[tuple[str, tuple[int, float]], Manifest] = {}  # read for deltas, by key and stat
        self._staging = HostStaging()
        self.manifest: Manifest | None = None  # the coordinator's last committed manifest
        #: called with the size of each chunk this rank writes or finds stored (``CheckpointManager.save``'s)
        self.progress: Callable[[int], None] | None = None
        #: a CheckpointManager's keyframe cache (``_delta/policy.py``): a keyframe save notes its chunks, which the
        #: manager keeps once ``dcp.save`` returned (committed); delta saves encode against it without reading
        self.keyframe_cache: KeyframeCache | None = None
        #: where lossy encodings go; a manager's, reused across its saves (None: fresh memory each save)
        self.lossy_buffers: LossyBuffers | None = None
        #: the save's process group, for the ranks to agree on each lossy array's stored form (a manager's; None:
        #: each shard's safety is decided on its own)
        self.agree_group: Any = None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """DCP's AsyncStager: a copy of ``state_dict`` whose tensors (a DTensor's local shard) are in host buffers
        this writer keeps for its next save, so training may change the state once this returns."""
        staged: dict[str, Any] = self._staging.stage(state_dict)
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` copies before it returns."""

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator, self.rank = is_coordinator, int(kwargs.get("rank", 0) or 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator, before any rank writes: create the vault (once: create-if-absent, so a race is harmless)
        and refuse a committed step unless ``overwrite`` (StepExistsError; the commit checks again)."""
        with _typed_errors(f"step {self.step} could not be set up in {self.url}"):
            vault = self._open()
            desc = vault.descriptor() or vault.create(self.chunk_size, self.codec or DEFAULT_CODEC)
            if not self.overwrite and vault.store.exists(manifest_key(self.step)):
                raise StepExistsError(self.step, vault.url)
            self._delta = delta = delta_context(vault, self.delta_policy, self.step)
        shared = _VaultPlan(self.step, desc.chunk_size, self.codec or desc.codec, delta.keyframe_step,
                            delta.since_keyframe, tuple(sorted(delta.guard.watched.items())))
        return [replace(plan, storage_data=shared) for plan in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items: tensors (``planner.resolve_data``) as shard records, values (through
        ``planner.lookup_object``, never DCP's pickled stream) as tree nodes; every chunk durable on return. The
        future is already done. Raises SaveError naming the rank for anything not ckptvault's."""
        shared = plan.storage_data
        try:
            with _typed_errors(f"rank {self.rank} failed writing step {self.step}, nothing was committed"):
                if not isinstance(shared, _VaultPlan):
                    raise SaveError("the save plan was not made by VaultWriter.prepare_global_plan (use one "
                                    "VaultWriter per rank, of the same vault)")
                results = self._write(plan, planner, shared)
        finally:
            if not self.is_coordinator:
                self.close()
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _write(self, plan: SavePlan, planner: SavePlanner, shared: _VaultPlan) -> list[WriteResult]:
        encoded: _Encoded | None = None
        error: BaseException | None = None
        try:
            encoded = self._encode(plan, planner, shared)
        except Exception as exc:  # noqa: BLE001 - raised below, after the ranks agreed (if they do)
            error = exc
        if self.agree_group is not None:
            encoded = self._agreed(encoded, error, shared)
        elif error is not None:
            raise error
        assert encoded is not None
        return self._store(plan, encoded)

    def _encode(self, plan: SavePlan, planner: SavePlanner, shared: _VaultPlan) -> _Encoded:
        """This rank's items as records (lossy ones encoded and measured), and the delta context of the save."""
        vault = self._open()
        if vault.require().chunk_size != shared.chunk_size:
            raise SaveError(f"the vault at {vault.url} has chunk size {vault.require().chunk_size}, the coordinator's "
                            f"{shared.chunk_size}: are the ranks writing to different vaults?")
        flattener = Flattener(self.allow_pickle)
        nodes: list[Node] = []
        offsets: dict[int, tuple[int, ...]] = {}
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                nodes.append(flattener.flatten(self._value(item, planner), item.index.fqn))
            else:
                flattener.leaves.append(Leaf(item.index.fqn, "torch", _shard(item, planner.resolve_data(item))))
                nodes.append({"shards": [len(flattener.leaves) - 1]})
                assert item.tensor_data is not None  # _shard checked it
                offsets[len(flattener.leaves) - 1] = tuple(item.tensor_data.chunk.offsets)
        leaves = flattener.leaves
        rules = CodecRules(self.codec_rules, shared.codec)
        arrays = [_array_record(leaf, rules, offsets.get(i)) for i, leaf in enumerate(leaves)]
        views = [tensor_bytes(leaf.value) if leaf.kind == "torch" else ndarray_bytes(leaf.value) for leaf in leaves]
        exact = Snapshot({"none": None}, arrays, views, self.allow_pickle)
        delta = self._rank_delta(vault, shared)
        snapshot = apply_lossy(exact, self.lossy_safety, shared.codec, vault, delta.keyframe, self.lossy_buffers)
        return nodes, exact, snapshot, delta

    def _agreed(self, encoded: _Encoded | None, error: BaseException | None, shared: _VaultPlan) -> _Encoded:
        """With ``agree_group``: every rank's stored form of each lossy-ruled array gathered, and an array whose
        shards came out differently (a fallback on some rank) re-encoded exactly on every rank, its records saying
        why; an encoding error on any rank raised on every rank (no rank is left in the gather)."""
        forms = None if encoded is None else _lossy_forms(encoded[2])
        text = None if error is None else f"{type(error).__name__}: {error}"
        gathered: list[Any] = [None] * dist.get_world_size(self.agree_group)
        dist.all_gather_object(gathered, (text, forms), group=self.agree_group)
        if error is not None:
            raise error
        failed = {rank: why for rank, (why, _forms) in enumerate(gathered) if why}
        if failed:
            raise SaveError(f"ranks {sorted(failed)} failed encoding their shards ({next(iter(failed.values()))})")
        assert encoded is not None
        seen: dict[str, set[str]] = defaultdict(set)
        for _why, rank_forms in gathered:
            for path, form in rank_forms.items():
                seen[path].add(form)
        split = {path: forms for path, forms in seen.items() if len(forms) > 1}
        if not split:
            return encoded
        nodes, exact, _snapshot, delta = encoded
        arrays = [replace(r, codec=parse_codec(r.codec, shared.codec)[1]) if r.path in split else r for r in exact.records]
        snapshot = apply_lossy(replace(exact, records=arrays), self.lossy_safety, shared.codec, self._open(),
                               delta.keyframe, self.lossy_buffers)
        requested = {r.path: r.codec for r in exact.records if r.path in split}
        note = "stored exactly on every rank: the ranks' shards came out as {}"
        records = [replace(r, lossy=LossyInfo(codec="lossless", requested=requested[r.path],
                                              notes=(note.format(sorted(split[r.path])),)))
                   if r.kind == "torch" and r.path in split else r for r in snapshot.records]
        return nodes, exact, replace(snapshot, records=records), delta

    def _store(self, plan: SavePlan, encoded: _Encoded) -> list[WriteResult]:
        """Write this rank's chunks (durable on return) and place each item's records and chunks."""
        nodes, _exact, snapshot, delta = encoded
        vault = self._open()
        chunks, pieces = write_chunks(vault, snapshot, self.progress, delta)
        table = tuple(ChunkRef(c.id, c.raw, c.stored, c.new, c.base) for c in chunks)
        out = []
        for item, node in zip(plan.items, nodes, strict=True):
            placement = _placement(item, node, snapshot.records, pieces, table)
            out.append(WriteResult(item.index, sum(r.nbytes for r in placement.records), placement))
        return out

    def _rank_delta(self, vault: Vault, shared: _VaultPlan) -> DeltaContext:
        """This rank's view of the coordinator's delta decision: the keyframe (None for a keyframe save) and the
        chunks of the manifests it read, which this rank reuses without a touch (the commit checks them again)."""
        manifests = [self._read(vault, key, seen) for key, seen in shared.watched]
        known = {cid: base for m in manifests for cid, base in m.chunk_bases().items()}
        stored = {c.id: c.stored for m in manifests for c in m.chunks}
        keyframe = next((m for m in manifests if m.step == shared.keyframe_step), None)
        if shared.keyframe_step is not None and keyframe is None:
            raise SaveError(f"the coordinator chose keyframe {shared.keyframe_step}, which it did not read")
        guard = ManifestGuard(dict(shared.watched), known)
        cache = self.keyframe_cache
        if cache is not None and keyframe is None:
            cache.begin(shared.step)  # filled from this keyframe's chunks once its commit is known (the owner's call)
        return DeltaContext(keyframe, known, stored, shared.since_keyframe, cache, guard)

    def _read(self, vault: Vault, key: str, seen: tuple[int, float]) -> Manifest:
        """The manifest at ``key`` as the coordinator stat'ed it, read once per writer (it may save again)."""
        cached = self._manifests.get((key, seen))
        if cached is None:
            step = step_of_manifest_key(key)
            if step is None:
                raise SaveError(f"the coordinator named {key!r}, which is not a manifest's key")
            cached = vault.read_manifest(step)
            for stale in [k for k in self._manifests if k[0] == key]:  # in place: a manager shares it between saves
                del self._manifests[stale]
            self._manifests[(key, seen)] = cached
        return cached

    def _value(self, item: WriteItem, planner: SavePlanner) -> Any:
        """The value of a BYTE_IO item: the object itself where the planner offers ``lookup_object`` (DCP's
        default planner does), else DCP's torch.save stream, loaded only with ``allow_pickle``."""
        lookup = getattr(planner, "lookup_object", None)
        if lookup is not None:
            return lookup(item.index)
        stream = planner.resolve_data(item)
        if not isinstance(stream, io.BytesIO):
            raise SaveError(f"the planner resolved the value of {item.index.fqn!r} to a {type(stream).__name__}")
        if not self.allow_pickle:
            raise UnsupportedObjectError(item.index.fqn, stream, "This planner hands non-tensor values over only as "
                                         "torch.save streams (pickle); use VaultSavePlanner or DCP's default planner.")
        stream.seek(0)
        return torch.load(stream, weights_only=False)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator, after every rank's write_data: build ONE manifest of every rank's items, check it as a
        reader would, and commit it (create-if-absent; StepExistsError if the step was committed meanwhile unless
        ``overwrite``). Atomic: the checkpoint exists afterwards, or not at all."""
        try:
            with _typed_errors(f"the commit of step {self.step} failed, nothing committed"):
                self._commit(metadata, results)
        finally:
            self.close()

    def _commit(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        vault = self._open()
        placements: dict[MetadataIndex, Placement] = {}
        for result in (r for rank in results for r in rank):
            if not isinstance(result.storage_data, Placement):
                raise SaveError(f"the result of {result.index.fqn!r} was not written by VaultWriter")
            placements[result.index] = result.storage_data
        delta = self._delta or DeltaContext()
        keyframe = self.step if delta.keyframe_step is None else delta.keyframe_step
        manifest = build_manifest(self.step, placements, metadata, self.metrics, self.metadata, keyframe,
                                  delta.since_keyframe)
        _check_before_commit(manifest, vault)
        guard = delta.guard  # the ranks reused its manifests' chunks untouched: commit() checks them again
        guard.skipped.update(c.id for c in manifest.chunks if not c.new and c.id in guard.chunk_ids)
        commit(vault, self.step, manifest, self.overwrite, guard)
        self.manifest, self._delta = manifest, None



def _shard(item: WriteItem, value: Any) -> torch.Tensor:
    """The host bytes of a tensor item, checked against the box DCP planned for it."""
    if not isinstance(value, torch.Tensor) or item.tensor_data is None:
        raise SaveError(f"the planner resolved {item.index.fqn!r} to a {type(value).__name__}, not a tensor")
    tensor = host_contiguous(value)
    if tuple(tensor.shape) != tuple(item.tensor_data.chunk.sizes) or tensor.dtype != item.tensor_data.properties.dtype:
        raise SaveError(f"{item.index.fqn!r} resolved to {tensor.dtype}{list(tensor.shape)}, but DCP planned "
                        f"{item.tensor_data.properties.dtype}{list(item.tensor_data.chunk.sizes)}")
    return tensor


def _array_record(leaf: Leaf, rules: CodecRules, offsets: tuple[int, ...] | None) -> ArrayRecord:
    value = leaf.value
    if leaf.kind == "torch":
        dtype = torch_dtype_name(value.dtype)
        return ArrayRecord(leaf.path, "torch", dtype, list(value.shape), value.numel() * value.dtype.itemsize,
                           value.dtype.itemsize, rules.codec_for(leaf.path, dtype), offsets=offsets)
    codec = rules.codec_for(leaf.path, value.dtype.str) if leaf.kind == "numpy" else rules.default
    return ArrayRecord(leaf.path, leaf.kind, value.dtype.str, list(value.shape), value.nbytes, value.dtype.itemsize, codec)


def checked_rules(rules: Mapping[str, str] | Iterable[tuple[str, str]] | None,
                  codec: str | None) -> list[tuple[str, str]]:
    """``codec_rules`` as (pattern, codec) pairs, each codec name checked (InvalidArgumentError naming it)."""
    pairs = list(rules.items()) if isinstance(rules, Mapping) else list(rules or [])
    CodecRules(pairs, codec or DEFAULT_CODEC)
    return pairs


def _placement(item: WriteItem, node: Node, arrays: list[ArrayRecord], pieces: list[list[Any]],
               table: tuple[ChunkRef, ...]) -> Placement:
    """The records and chunks of one item, numbered from 0 within it (``finish`` renumbers them): the item's arrays,
    then the ``part`` records (block scales) of those stored lossily; a residual's keyframe copy names its chunks
    among the item's."""
    leaves = leaf_indices(node)
    order = leaves + [part for leaf in leaves for part in _parts(arrays[leaf])]
    local = {index: i for i, index in enumerate(order)}
    refs: dict[str, int] = {}
    used: list[ChunkRef] = []

    def chunk(ref: ChunkRef) -> int:
        if ref.id not in refs:
            refs[ref.id] = len(used)
            used.append(ref)
        return refs[ref.id]

    out = []
    for index in order:
        array = arrays[index]
        mine = tuple(records.Piece(chunk(table[p.chunk]), p.offset, p.length) for p in pieces[index])
        box: dict[str, Any] = {}
        if item.tensor_data is not None and index in leaves:
            box = {"global_shape": tuple(item.tensor_data.size), "offsets": tuple(item.tensor_data.chunk.offsets)}
        lossy = array.lossy
        if lossy is not None:
            base = tuple(records.Piece(chunk(replace(p.chunk, new=False)), p.offset, p.length)
                         for p in array.keyframe_pieces) or lossy.base_pieces
            lossy = replace(lossy, parts={name: local[i] for name, i in lossy.parts.items()}, base_pieces=base)
        out.append(TensorRecord(path=array.path, kind=array.kind, dtype=array.dtype, shape=tuple(array.shape),
                                nbytes=array.nbytes, codec=array.codec, pieces=mine, lossy=lossy, **box))
    return Placement(renumber(node, {leaf: i for i, leaf in enumerate(leaves)}), tuple(out), tuple(used))


#: an item list's tree nodes, its records before and after the lossy step, and the save's delta context
_Encoded = tuple[list[Node], Snapshot, Snapshot, DeltaContext]


def _lossy_forms(snapshot: Snapshot) -> dict[str, str]:
    """{key path: how it is stored} of each record a lossy rule asked for (its lossy codec, or ``lossless``)."""
    return {r.path: r.lossy.codec for r in snapshot.records if r.kind == "torch" and r.lossy is not None}


def _parts(array: ArrayRecord) -> list[int]:
    return [] if array.lossy is None else list(array.lossy.parts.values())


def _check_before_commit(manifest: Manifest, vault: Vault) -> None:
    """Refuse to commit what a reader would refuse (SaveError naming the field): a writer bug must not commit."""
    what = f"the manifest of step {manifest.step}"
    try:
        check_manifest(manifest.to_json(), what, manifest.step, vault.require().chunk_size)
    except CorruptDataError as exc:
        raise SaveError(f"{exc}; nothing was committed") from exc


class VaultReader(_OnVault, StorageReader):
    """Load step ``step`` (default: the latest) of the vault at ``url`` with DCP, at any world size.

    ``dcp.load(state, storage_reader=VaultReader(url, step))`` on every rank. Reads a checkpoint VaultWriter saved,
    or one ``CheckpointManager.save`` saved (its tensors at DCP's keys, its other values as values). DCP's call
    order: ``reset`` (``checkpoint_id``: the step), ``read_metadata`` (the manifest, checked; DCP's Metadata rebuilt
    from it, nothing unpickled), ``set_up_storage_reader``, ``prepare_local_plan``, ``prepare_global_plan``,
    ``read_data``. DCP's planner intersects the saved boxes with the loading rank's; ``read_data`` reads just the
    shards its items need, verifying every chunk, and copies each intersection into place. Values stored with
    pickle are loaded only with ``allow_pickle`` (else PickleNotAllowedError naming the key, before any read).
    """

    def __init__(self, url: Url, step: int | None = None, *, allow_pickle: bool = False,
                 storage_options: StorageOptions | None = None, workers: int | None = None) -> None:
        super().__init__()
        check_kind("allow_pickle", allow_pickle, bool)
        self.url, self.step, self.allow_pickle = url, None if step is None else check_step(step), allow_pickle
        self.storage_options, self.workers = storage_options, workers
        self._vault: Vault | None = None
        self._manifest: Manifest | None = None
        self._layout: Layout | None = None

    def reset(self, checkpoint_id: Any = None) -> None:
        super().reset(checkpoint_id)
        self._manifest = self._layout = None

    def read_metadata(self) -> Metadata:
        """DCP's Metadata of the step, from its verified manifest (``_layout.dcp_layout``)."""
        vault = self._open()
        step = self.step
        if step is None:
            steps = vault.steps()
            if not steps:
                vault.require()
                raise VaultNotFoundError(f"the vault at {vault.url} has no committed checkpoint")
            step = steps[-1]
        self._manifest = vault.read_manifest(step)
        self._layout = dcp_layout(self._manifest)
        return self._layout.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._layout is None:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read this rank's items: a tensor item whose box is one run of its shard's bytes (a shard cut along the
        first dimension, as FSDP cuts) straight into ``planner.resolve_tensor``'s target when that is a plain host
        tensor, fetching only the chunks that hold the run; any other item from its shard read whole (verified),
        narrowed to ``storage_offsets`` and ``lengths`` and copied; then ``planner.commit_tensor``. Each value is
        decoded from its tree node and handed over unpickled (``load_value``) or, to a planner without it, as a
        torch.save stream made here. The future is already done."""
        assert self._manifest is not None and self._layout is not None, "read_metadata() comes first"
        manifest, layout = self._manifest, self._layout
        storage: dict[MetadataIndex, int] = layout.metadata.storage_data
        by_record: dict[int, list[ReadItem]] = defaultdict(list)
        values = []
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                self._refuse_pickle(item.storage_index.fqn, layout.values[item.storage_index.fqn])
                values.append(item)
            else:
                by_record[storage[item.storage_index]].append(item)
        direct: dict[Dest, memoryview] = {}
        targets: dict[Dest, tuple[ReadItem, torch.Tensor]] = {}
        for index, items in list(by_record.items()):
            for item in list(items):
                run = _run_in(manifest, index, item, planner)
                if run is not None and run[0] not in direct:
                    key, target = run
                    direct[key] = tensor_bytes(target)
                    targets[key] = (item, target)
                    items.remove(item)
        for key in sharing_memory(direct, []):  # targets tied here but saved apart: read whole, copied in below
            item, _target = targets.pop(key)
            del direct[key]
            by_record[storage[item.storage_index]].append(item)
        for index in [i for i, items in by_record.items() if not items]:
            del by_record[index]
        if direct:
            read_into(self._open(), manifest, dict(direct))
            for item, target in targets.values():
                planner.commit_tensor(item, target)
        for batch in _batches(manifest, list(by_record)):
            shards = _read_records(self._open(), manifest, batch)
            for index in batch:
                for item in by_record[index]:
                    _copy_into(planner, item, shards[index])
        for item in values:
            _hand_over(planner, item, self._value(layout.values[item.storage_index.fqn]))
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _refuse_pickle(self, fqn: str, node: Node) -> None:
        if self.allow_pickle:
            return
        for path, leaf in leaf_paths(node, fqn).items():
            if "pickle" in leaf:
                raise PickleNotAllowedError(f"key {path!r} was saved with pickle; pass allow_pickle=True to "
                                            "VaultReader to load it (only for checkpoints you trust)")

    def _value(self, node: Node) -> Any:
        assert self._manifest is not None
        indices = leaf_indices(node)
        arrays = _read_records(self._open(), self._manifest, indices) if indices else {}
        return unflatten(node, arrays, allow_pickle=self.allow_pickle)



def _batches(manifest: Manifest, indices: list[int]) -> list[list[int]]:
    """``indices`` in groups of about READ_BATCH_BYTES (a larger record alone)."""
    out: list[list[int]] = []
    size = 0
    for index in sorted(indices):
        nbytes = manifest.tensors[index].restored_nbytes
        if not out or size + nbytes > READ_BATCH_BYTES:
            out.append([])
            size = 0
        out[-1].append(index)
        size += nbytes
    return out


def _read_records(vault: Vault, manifest: Manifest, indices: list[int]) -> dict[int, Any]:
    """Records ``indices`` read whole into new arrays, every chunk verified (``_restore.read_into``)."""
    tensors = manifest.tensors
    lossy = LossyReads(tensors, [i for i in indices if tensors[i].is_lossy])
    values = {i: empty_like_record(tensors[i].kind, tensors[i].dtype, list(tensors[i].shape))
              for i in indices if i not in lossy.buffers}
    dests: dict[Dest, Any] = {i: writable_bytes(v) for i, v in values.items()}
    read_into(vault, manifest, {**dests, **lossy.dests()})
    values.update({i: lossy.decoded(i) for i in indices if i in lossy.buffers})
    return {i: finish_ndarray(v, tensors[i].dtype) if tensors[i].kind == "numpy" else v for i, v in values.items()}


def _run_in(manifest: Manifest, index: int, item: ReadItem, planner: LoadPlanner) -> tuple[Dest, torch.Tensor] | None:
    """``(("range", index, start, length), target)`` if ``item``'s box is one run of record ``index``'s bytes
    (every dimension after the first whole) and its target a plain host tensor of the record's dtype, else None."""
    record = manifest.tensors[index]
    if record.is_lossy or record.kind != "torch" or not record.shape:
        return None
    offsets, lengths, shape = list(item.storage_offsets), list(item.lengths), list(record.shape)
    if len(offsets) != len(shape) or any(o or n != s for o, n, s in zip(offsets[1:], lengths[1:], shape[1:], strict=True)):
        return None
    target = planner.resolve_tensor(item).detach()
    if not plain_cpu(target) or torch_dtype_name(target.dtype) != record.dtype or list(target.shape) != lengths:
        return None
    row = math.prod(shape[1:]) * target.element_size()
    return ("range", index, offsets[0] * row, lengths[0] * row), target


def _copy_into(planner: LoadPlanner, item: ReadItem, shard: torch.Tensor) -> None:
    source = narrow_tensor_by_index(shard, item.storage_offsets, item.lengths)
    target = planner.resolve_tensor(item).detach()
    if target.size() != source.size():
        raise CorruptDataError(f"{item.dest_index.fqn!r}: the target box is {list(target.size())}, the stored box "
                               f"{list(source.size())}")
    target.copy_(source)
    planner.commit_tensor(item, target)


def _hand_over(planner: LoadPlanner, item: ReadItem, value: Any) -> None:
    """``value`` to the planner: as it is where the planner takes values (VaultLoadPlanner), else as a torch.save
    stream of it, which DCP's default planner loads (ckptvault's own bytes: nothing of the vault is unpickled)."""
    load_value = getattr(planner, "load_value", None)
    if load_value is not None:
        load_value(item, value)
        return
    stream = io.BytesIO()
    torch.save(value, stream)
    stream.seek(0)
    planner.load_bytes(item, stream)
