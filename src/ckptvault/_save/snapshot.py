"""Step 1 of a save: capture the state as a skeleton plus host byte views.

This is the only part of a save that must see the live state. After
:func:`take_snapshot` returns, every later step reads only the snapshot.
Without a staging buffer the views alias the caller's CPU tensors (the caller
must not modify them until the save completes); with one, the bytes are
copied into it, after which training may modify the state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .._arrays import host_bytes, ndarray_bytes, torch_dtype_name
from .._format.records import ChunkRef, LossyInfo, PredictInfo
from .._tree import Leaf, Node, flatten
from ..rules import CodecRules
from .staging import StagingBuffer, aligned_offsets


@dataclass(frozen=True)
class KeyframePiece:
    """A piece of the keyframe's exact copy a residual is stored against: the keyframe's chunk (by reference: this
    save's manifest has not indexed its chunks yet), and where in it the bytes lie."""

    chunk: ChunkRef
    offset: int
    length: int


@dataclass
class ArrayRecord:
    """What the manifest says about one array leaf (before chunking)."""

    path: str
    kind: str  # torch | numpy | pickle
    dtype: str
    shape: list[int]
    nbytes: int
    itemsize: int
    codec: str
    requires_grad: bool = False
    device: str = "cpu"
    #: set by the lossy step (``lossy.py``): the manifest's lossy entry, but for ``base_pieces``, which a residual
    #: names in ``keyframe_pieces`` until the commit indexes them in its chunk table
    lossy: LossyInfo | None = None
    keyframe_pieces: tuple[KeyframePiece, ...] = ()
    #: where a shard's box starts in its global array (DCP saves); None: the record is the whole array
    offsets: tuple[int, ...] | None = None
    #: set by the prediction step (``_delta/predict.py``): the view holds the residual against this prediction
    predict: PredictInfo | None = None

    def with_predict(self, predict: PredictInfo) -> ArrayRecord:
        """A copy holding ``predict`` (``dataclasses.replace`` checks every field, which costs more than the rest of a
        small record's prediction)."""
        copy = object.__new__(ArrayRecord)
        copy.__dict__.update(self.__dict__, predict=predict)
        return copy

    @property
    def logical_nbytes(self) -> int:
        """Bytes of the array as the user holds it (before any lossy encoding)."""
        original = None if self.lossy is None else self.lossy.original_nbytes
        return self.nbytes if original is None else original


@dataclass
class Snapshot:
    tree: Node
    records: list[ArrayRecord]
    views: list[memoryview]
    allow_pickle: bool
    staged: bool = False  # True: views are private copies, the live state may change

    @property
    def logical_bytes(self) -> int:
        return sum(r.logical_nbytes for r in self.records if r.kind != "part")


def take_snapshot(state: Any, rules: CodecRules, allow_pickle: bool = False,
                  staging: StagingBuffer | None = None, staging_limit: int | None = None) -> Snapshot:
    """Flatten ``state`` and capture host bytes of every array leaf.

    Without ``staging`` the views alias the caller's CPU tensors (no copy).
    With it, every leaf is copied into the staging buffer and the snapshot is
    ``staged`` -- unless that would need more than ``staging_limit`` bytes, in
    which case it falls back to aliasing views (the caller must then finish
    the save before the state changes).
    """
    tree, leaves = flatten(state, allow_pickle)
    records = [_record(leaf, rules) for leaf in leaves]
    rules.warn_unmatched([(r.path, r.dtype) for r in records if r.kind != "pickle"])  # before anything is written
    needed = aligned_offsets([r.nbytes for r in records])[1]
    if staging is None or (staging_limit is not None and needed > staging_limit):
        return Snapshot(tree, records, [_live_view(leaf) for leaf in leaves], allow_pickle, staged=False)
    views = staging.copy_in([(leaf.kind, leaf.value) for leaf in leaves], [r.nbytes for r in records])
    return Snapshot(tree, records, views, allow_pickle, staged=True)


def _nbytes(leaf: Leaf) -> int:
    value = leaf.value
    return value.numel() * value.dtype.itemsize if leaf.kind == "torch" else value.nbytes


def _record(leaf: Leaf, rules: CodecRules) -> ArrayRecord:
    value = leaf.value
    if leaf.kind == "torch":
        grad = value.requires_grad and isinstance(value, torch.nn.Parameter)  # the cheap test first
        dtype = torch_dtype_name(value.dtype)
        return ArrayRecord(leaf.path, "torch", dtype, list(value.shape), _nbytes(leaf), value.dtype.itemsize,
                           rules.codec_for(leaf.path, dtype), grad, "cpu" if value.is_cpu else str(value.device))
    codec = rules.codec_for(leaf.path, value.dtype.str) if leaf.kind == "numpy" else "zstd"
    return ArrayRecord(leaf.path, leaf.kind, value.dtype.str, list(value.shape), value.nbytes,
                       value.dtype.itemsize, codec)


def _live_view(leaf: Leaf) -> memoryview:
    if leaf.kind == "torch":
        return host_bytes(leaf.value)
    return ndarray_bytes(leaf.value)
