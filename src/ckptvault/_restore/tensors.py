"""Reading checkpoints back: select tensors, fetch and verify chunks, scatter bytes.

Every chunk read is decoded and checked against its BLAKE3 name before any of
its bytes reach a caller's tensor. Chunks are fetched in parallel on the
vault's pool; each is held in memory only while its bytes are copied out, so
a restore needs the output tensors plus about one chunk per worker.
"""

from __future__ import annotations

import difflib
import functools
import threading
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from .._arrays import address, empty_like_record, finish_ndarray, plain_cpu, tensor_bytes, torch_dtype, writable_bytes
from .._codecs.lossy import DEFAULT_BLOCK, LossySpec, decode
from .._feedback import Progress, metered
from .._format.records import LossyInfo, Manifest, Piece, TensorRecord
from .._format.shards import box_of
from .._parallel import map_all
from .._tree import array_leaves, join_path, leaf_paths, unflatten
from .._vault import Vault
from ..errors import InvalidArgumentError, KeyMismatchError, PickleNotAllowedError
from ..rules import any_match
from .predicted import fill_predicted, is_predicted
from .readahead import read_ahead
from .verified import read_verified, read_verified_into_parts

#: where read_into writes: a record index, or ("base", index) for a residual's keyframe copy
#: a record index; ``("base", i)``: residual record i's keyframe copy; ``("range", i, start, length)``: bytes
#: [start, start + length) of record i (stored exactly), read alone: only the chunks holding them are fetched
Dest = int | tuple[str, int] | tuple[str, int, int, int]


#: a function the reads of a restore in this context hand each whole record they filled (its index and its bytes,
#: to copy before it returns), or None; set by a caller around its restore (a manager with predicted deltas keeps a
#: resumed run's arrays to predict its first save from)
RESTORED: ContextVar[Callable[[Manifest, int, memoryview], None] | None] = ContextVar("restored", default=None)


def read_into(vault: Vault, manifest: Manifest, dests: dict[Dest, memoryview | Callable[[], memoryview]],
              progress: Progress | None = None, on_filled: Callable[[Dest], None] | None = None) -> None:
    """Fill ``dests`` as :func:`read_stored` does, predicted records rebuilt (``predicted.py``) after the others
    (their extra reads are not reported to ``progress``); each whole record filled goes to :data:`RESTORED`'s
    function, if one is set."""
    noted = RESTORED.get()
    if noted is not None:
        _read_noting(noted, vault, manifest, dests, progress, on_filled)
        return
    predicted = {key: dests[key] for key in dests if is_predicted(manifest.tensors, key)}
    if not predicted:
        read_stored(vault, manifest, dests, progress, on_filled)
        return
    for key in predicted:
        del dests[key]
    read_stored(vault, manifest, dests, progress, on_filled)
    fill_predicted(vault, manifest, predicted, read_stored, on_filled)
    if on_filled is None:  # as read_stored leaves them
        dests.update(predicted)


def _read_noting(noted: Callable[[Manifest, int, memoryview], None], vault: Vault, manifest: Manifest,
                 dests: dict[Dest, memoryview | Callable[[], memoryview]], progress: Progress | None,
                 on_filled: Callable[[Dest], None] | None) -> None:
    """:func:`read_into` handing each whole record it filled to ``noted``: each whole-record destination becomes
    a function that notes its view as it is made; a record goes to ``noted`` once filled (with ``on_filled``, just
    before it: its buffer may be freed once ``on_filled`` returns; without, after every read)."""
    seen: dict[int, memoryview] = {}
    originals = {key: value for key, value in dests.items() if isinstance(key, int)}

    def resolving(key: int, value: memoryview | Callable[[], memoryview]) -> Callable[[], memoryview]:
        def make() -> memoryview:
            view = seen[key] = value if isinstance(value, memoryview) else value()
            return view
        return make

    dests.update({key: resolving(key, value) for key, value in originals.items()})
    if on_filled is not None:
        inner = on_filled

        def filled(key: Dest) -> None:
            view = seen.pop(key, None) if isinstance(key, int) else None
            if view is not None:
                noted(manifest, key, view)  # type: ignore[arg-type]
            inner(key)

        with _no_noting():
            read_into(vault, manifest, dests, progress, filled)
        return
    with _no_noting():
        read_into(vault, manifest, dests, progress)
    for key, original in originals.items():  # every record is filled now
        view = seen.get(key)
        if view is not None:
            noted(manifest, key, view)
        dests[key] = original if view is None else view


@contextmanager
def _no_noting() -> Iterator[None]:
    """:data:`RESTORED` unset for the reads inside (:func:`_read_noting` notes them itself)."""
    token = RESTORED.set(None)
    try:
        yield
    finally:
        RESTORED.reset(token)


def read_stored(vault: Vault, manifest: Manifest, dests: dict[Dest, memoryview | Callable[[], memoryview]],
                progress: Progress | None = None, on_filled: Callable[[Dest], None] | None = None) -> None:
    """Fill ``dests`` (record index -> writable byte view of its stored bytes) from the vault.

    A key ``("base", i)`` reads the keyframe copy that residual record ``i`` is
    relative to. A value may instead be a function that makes the view: it is
    called once, just before the key's first byte is written.

    With ``on_filled``, each key is removed from ``dests`` as soon as its last
    byte is written and ``on_filled(key)`` is called, on the worker thread that
    wrote it, while other chunks are still being read (keys with no bytes
    first, on the calling thread); an error it raises fails the read like a bad
    chunk.
    """
    tensors, chunks = manifest.tensors, manifest.chunks
    jobs: dict[int, list[tuple[Dest, int, int, int]]] = defaultdict(list)
    left: dict[Dest, int] = {}  # pieces of each key not yet written
    for key in dests:
        dest_offset = 0
        pieces = _pieces(tensors, key)
        for piece in pieces:
            jobs[piece.chunk].append((key, dest_offset, piece.offset, piece.length))
            dest_offset += piece.length
        left[key] = len(pieces)
    lock = threading.Lock()

    def view_of(key: Dest) -> memoryview:
        view = dests[key]
        if not isinstance(view, memoryview):
            with lock:
                view = dests[key]
                if not isinstance(view, memoryview):
                    view = dests[key] = view()
        return view

    def filled(key: Dest) -> None:
        del dests[key]  # the caller's buffer may be freed once on_filled let go of it
        on_filled(key)  # type: ignore[misc]

    def written(keys: list[Dest]) -> None:
        with lock:
            for key in keys:
                left[key] -= 1
            done = [key for key in dict.fromkeys(keys) if left[key] == 0]
        for key in done:
            filled(key)

    def fetch(chunk: int) -> None:
        first_key = jobs[chunk][0][0]
        path = tensors[first_key[1] if isinstance(first_key, tuple) else first_key].path
        (index, dest_offset, offset, length), *others = jobs[chunk]
        if not others and offset == 0 and length == chunks[chunk].raw:  # the chunk is one piece: decoded in place
            read_verified(vault, manifest, chunk, path, into=view_of(index)[dest_offset : dest_offset + length])
        elif _tiles(pieces := sorted(jobs[chunk], key=lambda job: job[2]), chunks[chunk].raw):
            # pieces that fill it: decoded straight into them
            parts = [view_of(index)[dest_offset : dest_offset + length] for index, dest_offset, _, length in pieces]
            read_verified_into_parts(vault, manifest, chunk, path, parts)
        else:
            raw = read_verified(vault, manifest, chunk, path)
            for index, dest_offset, offset, length in jobs[chunk]:
                view_of(index)[dest_offset : dest_offset + length] = raw[offset : offset + length]
        if progress:
            progress(chunks[chunk].raw)
        if on_filled:
            written([index for index, *_ in jobs[chunk]])

    if on_filled:
        for key in [key for key, count in left.items() if count == 0]:
            filled(key)
    order = sorted(jobs)
    with read_ahead(vault.store, [[(chunks[c].id, chunks[c].raw)] for c in order]) as ahead:

        def fetch_at(position: int) -> None:
            ahead.started(position)
            fetch(order[position])

        map_all(vault.pool, fetch_at, range(len(order)))


def _tiles(pieces: list[tuple[Dest, int, int, int]], raw: int) -> bool:
    """Whether ``pieces`` (key, dest offset, chunk offset, length; in chunk order) cover a chunk of ``raw`` bytes
    exactly once."""
    position = 0
    for _key, _dest, offset, length in pieces:
        if offset != position:
            return False
        position += length
    return position == raw


def clipped(pieces: tuple[Piece, ...], start: int, length: int) -> tuple[Piece, ...]:
    """The parts of ``pieces`` (a record's, in byte order) that hold its bytes [start, start + length)."""
    out, position, end = [], 0, start + length
    for piece in pieces:
        low, high = max(position, start), min(position + piece.length, end)
        if low < high:
            out.append(Piece(piece.chunk, piece.offset + low - position, high - low))
        position += piece.length
    return tuple(out)


def _pieces(tensors: tuple[TensorRecord, ...], key: Dest) -> tuple[Piece, ...]:
    if isinstance(key, tuple) and key[0] == "range":
        _tag, index, start, length = key  # type: ignore[misc]
        return clipped(tensors[index].pieces, start, length)
    if isinstance(key, tuple):
        lossy = tensors[key[1]].lossy
        assert lossy is not None and lossy.base_pieces is not None  # only residual records have a base key
        return lossy.base_pieces
    return tensors[key].pieces


def read_bytes(manifest: Manifest, keys: Iterable[Dest]) -> int:
    """What :func:`read_into` with these ``dests`` keys passes to ``progress`` in all: the raw bytes of each chunk
    holding a piece of them (a packed chunk whole, once)."""
    chunks = {piece.chunk for key in keys for piece in _pieces(manifest.tensors, key)}
    return sum(manifest.chunks[c].raw for c in chunks)


class LossyReads:
    """Buffers to read lossy records into (stored form, parts, keyframe copy), and their decoding."""

    def __init__(self, tensors: tuple[TensorRecord, ...], indices: Iterable[int]) -> None:
        self.tensors = tensors
        self.buffers: dict[Dest, torch.Tensor] = {}
        for i in indices:
            lossy = _lossy(tensors[i])
            self.buffers[i] = torch.empty(lossy.stored_shape or (), dtype=torch_dtype(lossy.stored_dtype or ""))
            for j in lossy.parts.values():
                self.buffers[j] = torch.empty(tensors[j].shape, dtype=torch_dtype(tensors[j].dtype))
            if lossy.base_pieces is not None:
                self.buffers[("base", i)] = torch.empty(tensors[i].shape, dtype=torch_dtype(tensors[i].dtype))

    def dests(self) -> dict[Dest, memoryview]:
        return {key: tensor_bytes(buffer) for key, buffer in self.buffers.items()}

    def decoded(self, i: int) -> torch.Tensor:
        """Record ``i`` in its original dtype and shape (after the buffers were read)."""
        record = self.tensors[i]
        lossy = _lossy(record)
        spec = LossySpec(lossy.codec, DEFAULT_BLOCK if lossy.block is None else lossy.block)
        parts = {"q": self.buffers[i], **{name: self.buffers[j] for name, j in lossy.parts.items()}}
        return decode(spec, parts, torch_dtype(record.dtype), list(record.shape), self.buffers.get(("base", i)))


def _lossy(record: TensorRecord) -> LossyInfo:
    assert record.lossy is not None  # a record LossyReads was given is lossy
    return record.lossy


K = TypeVar("K")

_last_leaves: tuple[weakref.ref[Manifest], dict[str, Any]] | None = None


def manifest_leaves(manifest: Manifest) -> dict[str, Any]:
    """``leaf_paths(manifest.tree)`` (not to be modified), kept for the manifest last asked about: a restore asks
    several times, and walking the tree of a large state takes a millisecond each time."""
    global _last_leaves
    last = _last_leaves
    if last is not None and last[0]() is manifest:
        return last[1]
    leaves = leaf_paths(manifest.tree)
    _last_leaves = (weakref.ref(manifest), leaves)
    return leaves


def select(manifest: Manifest, keys: Iterable[str] | None) -> set[str] | None:
    """Leaf key paths matching ``keys`` (None = everything). Raises if nothing matches."""
    if keys is None:
        return None
    patterns = list(keys) if isinstance(keys, Iterable) and not isinstance(keys, str) else [keys]  # one, or a list
    if not all(isinstance(p, str) for p in patterns):
        raise InvalidArgumentError(f"keys must be a key path pattern or a list of them (such as 'model.*'), got {keys!r}")
    paths = manifest_leaves(manifest)
    chosen = {p for p in paths if any_match(p, patterns)}
    if not chosen:
        tops = sorted({p.split(".", 1)[0] for p in paths})
        raise KeyMismatchError(f"no key path matches {patterns}; top-level keys are {tops[:20]}")
    return chosen


def copied_record(record: TensorRecord, view: memoryview) -> Any:
    """A new tensor or array holding a copy of ``view``: record ``record``'s bytes as a restore filled them."""
    value = empty_like_record(record.kind, record.dtype, list(record.shape))
    np.frombuffer(writable_bytes(value), dtype=np.uint8)[:] = np.frombuffer(view, dtype=np.uint8)
    return value


def tree_of(manifest: Manifest, values: dict[int, Any], selected: set[str]) -> Any:
    """The part of ``manifest``'s state at the leaf key paths ``selected``, its arrays taken from ``values`` (record
    index -> tensor or array as :func:`empty_like_record` makes them), as :func:`restore_paths` returns it."""
    return unflatten(manifest.tree, {i: _finish(manifest.tensors[i], v) for i, v in values.items()}, selected, False)


def restore_tree(vault: Vault, manifest: Manifest, keys: Iterable[str] | None, allow_pickle: bool,
                 progress: Progress | None = None) -> Any:
    """Rebuild the saved state (or the part ``keys`` selects) in new tensors and arrays."""
    return restore_paths(vault, manifest, select(manifest, keys), allow_pickle, progress)


def restore_paths(vault: Vault, manifest: Manifest, selected: set[str] | None, allow_pickle: bool = False,
                  progress: Progress | None = None) -> Any:
    """Rebuild the saved state, or the leaves at the key paths ``selected`` names (None: all), in new tensors and
    arrays."""
    if not allow_pickle:
        _refuse_pickle(manifest, selected)
    needed = _leaf_indices(manifest, selected)
    tensors = manifest.tensors
    lossy = LossyReads(tensors, [i for i in needed if tensors[i].is_lossy])
    values = {i: empty_like_record(tensors[i].kind, tensors[i].dtype, list(tensors[i].shape))
              for i in needed if i not in lossy.buffers}
    dests: dict[Dest, memoryview | Callable[[], memoryview]] = {i: writable_bytes(v) for i, v in values.items()}
    dests.update(lossy.dests())
    progress = metered(progress, read_bytes(manifest, dests) + read_bytes(manifest, shard_indices(manifest, selected)))
    read_into(vault, manifest, dests, progress)
    values.update({i: lossy.decoded(i) for i in needed if i in lossy.buffers})
    values.update(read_sharded(vault, manifest, selected, progress))
    finished = {i: _finish(tensors[i], v) for i, v in values.items()}
    return unflatten(manifest.tree, finished, selected, allow_pickle)


def shard_indices(manifest: Manifest, selected: set[str] | None) -> list[int]:
    """The records :func:`read_sharded` reads: every shard of each selected array stored as shards."""
    return [index for path, node in manifest_leaves(manifest).items()
            if "shards" in node and (selected is None or path in selected) for index in node["shards"]]


def read_sharded(vault: Vault, manifest: Manifest, selected: set[str] | None,
                 progress: Progress | None = None) -> dict[int, torch.Tensor]:
    """Each selected array stored as shards (a ``{"shards": [...]}`` node), whole, keyed by its first record."""
    plan = ShardedReads(manifest, selected)
    read_into(vault, manifest, plan.dests, progress, plan.copy_in)
    plan.finish()
    return plan.out


class ShardedReads:
    """The reads that rebuild arrays stored as shards whole: into ``into``'s tensor at the array's key path where it
    is a plain host tensor (in place), else into a new one (``out``, keyed by the array's first record).

    The array is allocated from its ``global_shape``, which the schema matched against the elements its shards
    hold (they tile it exactly: ``_format/shards.py``). A shard whose box is contiguous in it (cut along the first
    dimension) is read in place; any other is read into a temporary, copied into its box as soon as it is filled
    (:meth:`copy_in`, read_into's ``done``). A shard stored lossily is read in its stored form and decoded into its
    box by :meth:`finish`, after the reads."""

    def __init__(self, manifest: Manifest, selected: set[str] | None, into: dict[str, torch.Tensor] | None = None) -> None:
        self.manifest = manifest
        self.out: dict[int, torch.Tensor] = {}
        self.dests: dict[Dest, memoryview | Callable[[], memoryview]] = {}
        self._boxes: dict[Dest, torch.Tensor] = {}
        self._temps: dict[Dest, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._lossy_boxes: dict[int, torch.Tensor] = {}
        for path, node in manifest_leaves(manifest).items():
            if "shards" not in node or (selected is not None and path not in selected):
                continue
            first = manifest.tensors[node["shards"][0]]
            target = (into or {}).get(path)
            whole = target.detach() if target is not None and plain_cpu(target) else None
            if whole is None:
                whole = torch.empty(box_of(first)[0], dtype=torch_dtype(first.dtype))
            self.out[node["shards"][0]] = whole
            for index in node["shards"]:
                record = manifest.tensors[index]
                box = whole[tuple(slice(o, o + n) for o, n in zip(box_of(record)[1], record.shape, strict=True))]
                if record.is_lossy:
                    self._lossy_boxes[index] = box
                elif box.is_contiguous():
                    self.dests[index] = tensor_bytes(box)
                else:
                    self._boxes[index], self.dests[index] = box, functools.partial(self._temp, index)

        self.lossy = LossyReads(manifest.tensors, self._lossy_boxes)
        self.dests.update(self.lossy.dests())

    def finish(self) -> None:
        """After the reads: decode each lossy shard into its box."""
        for index, box in self._lossy_boxes.items():
            box.copy_(self.lossy.decoded(index))

    def _temp(self, index: int) -> memoryview:
        record = self.manifest.tensors[index]
        temp = torch.empty(record.shape, dtype=torch_dtype(record.dtype))
        with self._lock:
            self._temps[index] = temp
        return tensor_bytes(temp)

    def copy_in(self, index: Dest) -> None:
        with self._lock:
            temp = self._temps.pop(index, None)
        if temp is not None:
            self._boxes[index].copy_(temp)


def sharded_array_paths(manifest: Manifest) -> dict[str, int]:
    """Key path -> first record of every array stored as shards."""
    return {path: node["shards"][0] for path, node in manifest_leaves(manifest).items() if "shards" in node}


def _refuse_pickle(manifest: Manifest, selected: set[str] | None) -> None:
    """Raise before any I/O if a selected leaf was saved with pickle."""
    for path, node in manifest_leaves(manifest).items():
        if "pickle" in node and (selected is None or path in selected):
            raise PickleNotAllowedError(
                f"key path {path!r} was saved with pickle; pass allow_pickle=True to load it "
                "(only for checkpoints you trust: unpickling can run arbitrary code)"
            )


def restore_into(vault: Vault, manifest: Manifest, into: Any, strict: bool,
                 progress: Progress | None = None) -> Any:
    """Copy saved tensors into the tensors/arrays of ``into`` in place; returns ``into``.

    The target decides what is read, as in torch.distributed.checkpoint: only
    the tensors ``into`` names are read, and only their chunks fetched (a
    packed chunk is fetched whole, small tensors it also holds included). Saved
    entries it does not name (another subtree, or a sibling inside a subtree it
    names) are neither read nor an error. ``into`` mirrors the saved tree from
    its root, or one saved subtree (:func:`_mount_prefix`). A target tensor the
    checkpoint lacks is a :class:`KeyMismatchError` when ``strict``; otherwise
    it is skipped and left unchanged. A dtype or shape mismatch is always an
    error; leaves of ``into`` that are not tensors or arrays are left alone.

    Contiguous CPU targets are read into directly. Any other target (on a GPU,
    strided, ...) is read into a host temporary, made when its first chunk is
    read and copied into the target as soon as its last chunk is in, while
    other chunks are still being read; the temporary is then reused for a later
    target of the same dtype and shape (:class:`ThroughTemps`). So host memory
    holds only the temporaries being filled, not a copy of the state.
    """
    plan = plan_into(manifest, into, strict)
    plan.read(vault, manifest, metered(progress, read_bytes(manifest, plan.dests)))
    return into


@dataclass
class IntoPlan:
    """What :func:`restore_into` reads and where (:func:`plan_into`), checked before anything is read."""

    dests: dict[Dest, memoryview | Callable[[], memoryview]]
    temps: ThroughTemps
    lossy: LossyReads
    lossy_targets: dict[int, Any]
    copies: list[tuple[Any, Any]]  # made after every read, in order: tied tensors' other key paths
    sharded: ShardedReads | None = None  # arrays stored as shards (a DCP checkpoint), rebuilt whole in the targets
    sharded_targets: dict[int, Any] | None = None  # first record -> target, where not read in place

    def read(self, vault: Vault, manifest: Manifest, progress: Progress | None) -> None:
        sharded = self.sharded

        def done(key: Dest) -> None:
            self.temps.copy_in(key)
            if sharded is not None:
                sharded.copy_in(key)

        read_into(vault, manifest, self.dests, progress, done)
        if sharded is not None:
            sharded.finish()
        for i, target in self.lossy_targets.items():
            _copy(target, self.lossy.decoded(i))
        for i, target in (self.sharded_targets or {}).items():
            assert sharded is not None
            if sharded.out[i] is not target:
                _copy(target, sharded.out[i])
        for target, source in self.copies:
            _copy(target, source)


def plan_into(manifest: Manifest, into: Any, strict: bool) -> IntoPlan:
    """The reads of :func:`restore_into` (raises KeyMismatchError for missing keys, dtypes and shapes)."""
    targets = dict(array_leaves(into))
    saved = _saved_array_paths(manifest)
    sharded = sharded_array_paths(manifest)
    prefix = _mount_prefix(list(targets), {**saved, **sharded}, strict, manifest.step)
    shard_targets = {full: t for p, t in targets.items() if (full := join_path(prefix, p) if prefix else p) in sharded}
    if shard_targets:
        _check_whole_targets(manifest, sharded, shard_targets)
        targets = {p: t for p, t in targets.items() if (join_path(prefix, p) if prefix else p) not in sharded}
    dests: dict[Dest, memoryview | Callable[[], memoryview]] = {}
    temps = ThroughTemps()
    lossy_targets: dict[int, Any] = {}
    firsts: dict[int, Any] = {}
    copies: list[tuple[Any, Any]] = []  # made after every read, in order: tied tensors' other key paths
    for path, target in targets.items():
        index = saved.get(join_path(prefix, path) if prefix else path)
        if index is None:  # only when not strict: _mount_prefix raised otherwise
            continue
        target = target.detach() if isinstance(target, torch.Tensor) else target
        record = manifest.tensors[index]
        if _mismatch(record, path, target):
            continue  # raised below, with every other mismatch, before anything is read
        if index in firsts:  # another key path of a tied tensor (saved once): copied from the first after reading
            if not _same_memory(target, firsts[index]):
                copies.append((target, firsts[index]))
            continue
        if record.is_lossy:
            lossy_targets[index] = target
        elif (view := _direct_view(target)) is not None:
            dests[index] = view
        else:
            dests[index] = temps.add(index, target, record)
        firsts[index] = target
    check_targets(manifest, ((saved[join_path(prefix, p) if prefix else p], p, t) for p, t in targets.items()
                             if (join_path(prefix, p) if prefix else p) in saved))
    shard_views = {p: tensor_bytes(t) for p, t in shard_targets.items() if isinstance(t, torch.Tensor) and plain_cpu(t)}
    direct = {i: v for i, v in dests.items() if isinstance(i, int) and isinstance(v, memoryview)}
    sharing = set(sharing_memory(direct, list(shard_views.values())))
    shared_shards = set(sharing_memory(shard_views, list(direct.values())))  # rebuilt apart, copied in after the reads
    own = {i: empty_like_record(manifest.tensors[i].kind, manifest.tensors[i].dtype, list(manifest.tensors[i].shape))
           for i in direct if i in sharing}  # in the order of the key paths, which the copies keep
    dests.update({i: writable_bytes(buffer) for i, buffer in own.items()})
    copies[:0] = [(firsts[i], buffer) for i, buffer in own.items()]  # before the tied paths copied from them
    lossy = LossyReads(manifest.tensors, lossy_targets)
    dests.update(lossy.dests())
    if not shard_targets:
        return IntoPlan(dests, temps, lossy, lossy_targets, copies)
    reads = ShardedReads(manifest, set(shard_targets), {p: t for p, t in shard_targets.items() if p not in shared_shards})
    dests.update(reads.dests)
    by_first = {sharded[path]: target.detach() if isinstance(target, torch.Tensor) else target
                for path, target in shard_targets.items()}
    return IntoPlan(dests, temps, lossy, lossy_targets, copies, reads, by_first)


def sharing_memory(views: dict[K, memoryview], others: list[memoryview]) -> list[K]:
    """The keys of ``views`` whose bytes overlap those of another view (of ``views`` or ``others``).

    Different saved tensors restored into the same memory (targets tied now but saved apart) cannot be decoded in
    place: a chunk is hashed where it was decoded, and another tensor's bytes written there meanwhile would read as
    a damaged chunk. Such targets are read into memory of their own and copied in after every read, in order, the
    last one winning as with ``load_state_dict``."""
    spans: list[tuple[int, int, K | None]] = [(address(v), address(v) + len(v), key) for key, v in views.items()]
    spans += [(address(view), address(view) + len(view), None) for view in others]
    spans = sorted((span for span in spans if span[1] > span[0]), key=lambda span: span[:2])
    shared: list[K] = []
    cluster: list[K | None] = []
    end = -1
    for start, stop, key in spans:
        if start >= end:
            if len(cluster) > 1:
                shared.extend(k for k in cluster if k is not None)
            cluster, end = [], stop
        cluster.append(key)
        end = max(end, stop)
    if len(cluster) > 1:
        shared.extend(k for k in cluster if k is not None)
    return shared


def _check_whole_targets(manifest: Manifest, sharded: dict[str, int], targets: dict[str, Any]) -> None:
    """KeyMismatchError (before anything is read) for a target of an array stored as shards whose dtype or shape
    is not the array's (its global shape)."""
    found = []
    for path, target in targets.items():
        first = manifest.tensors[sharded[path]]
        shape, dtype = list(box_of(first)[0]), first.dtype
        if list(target.shape) != shape or _dtype_name(target) != dtype:
            found.append(f"{path!r}: saved {dtype}{shape} (as shards), target is {_dtype_name(target)}{list(target.shape)}")
    if found:
        raise KeyMismatchError("; ".join(found[:SHOWN_MISMATCHES]) + "; restore without into= and convert, or fix "
                               "the target")


class ThroughTemps:
    """The ``into=`` targets read through host temporaries, and those temporaries.

    A target's temporary is made when its first chunk is read (:meth:`add`
    returns the function that makes it, for :func:`read_into`), copied into the
    target once its last chunk is in (:meth:`copy_in`), and then reused for a
    later target of the same kind, dtype and shape. Fresh memory costs a page
    fault per 4 KiB when first written (figures: docs/benchmarks/gpu.md), and
    the layers of a model repeat their shapes, so most temporaries are written
    into pages already mapped. Thread-safe.
    """

    def __init__(self) -> None:
        self._targets: dict[Dest, tuple[Any, tuple[str, str, tuple[int, ...]]]] = {}  # index -> (target, spec)
        self._made: dict[Dest, Any] = {}  # index -> its temporary, once its first chunk is read
        self._free: dict[tuple[str, str, tuple[int, ...]], list[Any]] = defaultdict(list)
        self._lock = threading.Lock()

    def add(self, index: Dest, target: Any, record: TensorRecord) -> Callable[[], memoryview]:
        kind = "torch" if isinstance(target, torch.Tensor) else "numpy"
        self._targets[index] = (target, (kind, record.dtype, record.shape))
        return functools.partial(self._make, index)

    def _make(self, index: Dest) -> memoryview:
        spec = self._targets[index][1]
        with self._lock:
            temp = self._free[spec].pop() if self._free[spec] else None
        if temp is None:
            temp = empty_like_record(spec[0], spec[1], list(spec[2]))
        self._made[index] = temp
        return writable_bytes(temp)

    def copy_in(self, key: Dest) -> None:
        """Copy the filled temporary of ``key`` into its target (nothing for keys not added)."""
        if key not in self._targets:
            return
        target, spec = self._targets.pop(key)
        temp = self._made.pop(key, None)
        if temp is None:  # an empty target: no chunk was read for it
            return
        _copy(target, temp)
        with self._lock:
            self._free[spec].append(temp)


def _copy(target: Any, source: Any) -> None:
    target.copy_(source) if isinstance(target, torch.Tensor) else np.copyto(target, source)


def _saved_array_paths(manifest: Manifest) -> dict[str, int]:
    """Key path -> record index of every saved array, tied aliases (one record, several paths) included."""
    kinds = [t.kind for t in manifest.tensors]
    out = {}
    for path, node in leaf_paths(manifest.tree).items():
        tag, index = next(iter(node.items()))
        if tag in ("tensor", "ndarray") and kinds[index] != "pickle":
            out[path] = index
    return out


def _same_memory(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.data_ptr() == b.data_ptr() and a.stride() == b.stride()
    return False


#: how many dtype or shape mismatches a KeyMismatchError lists ("and N more" for the rest)
SHOWN_MISMATCHES = 10


def _mismatch(record: TensorRecord, path: str, target: Any) -> str | None:
    """``"'path': saved float32[2, 3], target is float32[3, 2]"`` if the target's dtype or shape differs, else None."""
    shape, dtype = list(target.shape), _dtype_name(target)
    if shape != list(record.shape) or dtype != record.dtype:
        return f"{path!r}: saved {record.dtype}{list(record.shape)}, target is {dtype}{shape}"
    return None


def check_targets(manifest: Manifest, targets: Iterable[tuple[int, str, Any]]) -> None:
    """One KeyMismatchError listing every (record index, key path in ``into``, target) whose dtype or shape differs
    from the saved record (the first :data:`SHOWN_MISMATCHES`, then how many more), as ``load_state_dict`` lists
    them all. Called before anything is read, so a refused target is left unchanged."""
    found = [m for index, path, target in targets
             if (m := _mismatch(manifest.tensors[index], path, target.detach() if isinstance(target, torch.Tensor)
                                else target))]
    if not found:
        return
    more = f"; and {len(found) - SHOWN_MISMATCHES} more" if len(found) > SHOWN_MISMATCHES else ""
    head = f"{len(found)} into= tensors differ in dtype or shape from the checkpoint of step {manifest.step}: "
    raise KeyMismatchError(
        (head if len(found) > 1 else "") + "; ".join(found[:SHOWN_MISMATCHES]) + more
        + "; restore without into= and convert, or fix the target")


def _direct_view(target: Any) -> memoryview | None:
    """A writable view of the target's own bytes, if they are its values in C order on the host; else None."""
    if isinstance(target, torch.Tensor):
        return tensor_bytes(target) if plain_cpu(target) else None
    if target.flags.c_contiguous and target.flags.writeable and target.dtype.byteorder != ">":
        return writable_bytes(target)
    return None


def _dtype_name(value: Any) -> str:
    return str(value.dtype).removeprefix("torch.") if isinstance(value, torch.Tensor) else value.dtype.str


def _mount_prefix(paths: list[str], saved: dict[str, int], strict: bool, step: int) -> str:
    """Where ``into`` sits in the saved tree: "" (the root) or the key path of one saved subtree.

    The root if every target tensor is there, else the one subtree holding
    them all (``into=model.state_dict()`` sits under ``model``). When not
    ``strict``, target tensors the checkpoint lacks may be left out: the place
    holding the most of them is taken. Raises :class:`KeyMismatchError` when
    no place holds them all (``strict``) or any (not ``strict``), or when
    several places fit equally.
    """
    if not paths or all(p in saved for p in paths):
        return ""
    found = _found_under(paths, saved)
    fits = sorted(c for c, n in found.items() if n == len(paths))
    if not fits and not strict and found:
        most = max(found.values())
        fits = sorted(c for c, n in found.items() if n == most)
    if len(fits) == 1:
        return fits[0]
    if fits:
        shown = [c or "<root>" for c in fits[:5]]
        raise KeyMismatchError(
            f"into= matches several places in the checkpoint of step {step}: {shown}; "
            "pass a target that mirrors the saved tree from its root (e.g. {'model': model.state_dict()})"
        )
    if not found:
        tops = sorted({s.split(".", 1)[0] for s in saved})
        missing = [p for p in paths if p not in saved][:5]
        raise KeyMismatchError(
            f"into= tensors {missing} are not in the checkpoint of step {step}, at its root or under any one key "
            f"(its top-level keys are {tops[:20]}); check the target's key paths, or restore without into= to see the saved tree"
        )
    best = max(found.values())
    places = sorted(c for c, n in found.items() if n == best)
    place = places[0]
    missing = [p for p in paths if (join_path(place, p) if place else p) not in saved]
    where = f"under {place!r}" if place else "at its root"
    raise KeyMismatchError(
        f"into= holds {len(missing)} tensors the checkpoint of step {step} does not ({where}): {missing[:5]}"
        f"{_near(missing[:5], place, saved, set(paths))}; "
        "remove them from into=, or pass strict=False to skip them (they are left unchanged)"
    )


def _near(missing: list[str], place: str, saved: dict[str, int], named: set[str]) -> str:
    """``"; saved keys near them: {'extra.weight': ['0.weight']}"``: for each missing key path (relative to
    ``into``), the most similar saved key paths under the same mount point ``place`` (relative to it too) that
    ``into`` does not name already; "" if none is similar."""
    prefix = f"{place}." if place else ""
    candidates = [s[len(prefix):] for s in saved if s.startswith(prefix) and s[len(prefix):] not in named]
    near = {p: close for p in missing if (close := difflib.get_close_matches(p, candidates, n=3, cutoff=0.6))}
    return f"; saved keys near them: {near}" if near else ""


def _found_under(paths: list[str], saved: dict[str, int]) -> dict[str, int]:
    """Saved subtree path ("" = the root) -> how many of ``paths`` are saved under it; places holding none are left out."""
    wanted = set(paths)
    found: dict[str, int] = defaultdict(int)
    at_root = sum(p in saved for p in wanted)
    if at_root:
        found[""] = at_root
    for s in saved:
        dot = s.find(".")
        while dot != -1:
            if s[dot + 1 :] in wanted:
                found[s[:dot]] += 1
            dot = s.find(".", dot + 1)
    return dict(found)


def _leaf_indices(manifest: Manifest, selected: set[str] | None) -> set[int]:
    out = set()
    for path, node in manifest_leaves(manifest).items():
        tag = next(iter(node))
        if tag in ("tensor", "ndarray", "npscalar", "pickle") and (selected is None or path in selected):
            out.add(node[tag])
    return out


def _finish(record: TensorRecord, value: Any) -> Any:
    if record.kind == "numpy":
        return finish_ndarray(value, record.dtype)
    if record.kind == "torch" and record.requires_grad:
        return torch.nn.Parameter(value, requires_grad=True)
    return value


