"""Step 1 of a save: capture the state as a skeleton plus host byte views.

This is the only part of a save that must see the live state. After
:func:`take_snapshot` returns, every later step reads only the snapshot.
With ``copy=False`` the views alias the caller's CPU tensors (the caller must
not modify them until the save completes); with ``copy=True`` the bytes are
copied into fresh host buffers, after which training may modify the state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .arrays import host_contiguous, ndarray_bytes, tensor_bytes, torch_dtype_name
from .rules import CodecRules
from .tree import Leaf, Node, flatten


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


@dataclass
class Snapshot:
    tree: Node
    records: list[ArrayRecord]
    views: list[memoryview]
    allow_pickle: bool

    @property
    def logical_bytes(self) -> int:
        return sum(r.nbytes for r in self.records)


def take_snapshot(state: Any, rules: CodecRules, allow_pickle: bool = False, copy: bool = False) -> Snapshot:
    """Flatten ``state`` and capture host bytes of every array leaf."""
    tree, leaves = flatten(state, allow_pickle)
    records, views = [], []
    for leaf in leaves:
        record, view = _capture(leaf, rules)
        if copy and view.nbytes:
            view = memoryview(np.array(view, copy=True)).cast("B")
        records.append(record)
        views.append(view)
    return Snapshot(tree, records, views, allow_pickle)


def _capture(leaf: Leaf, rules: CodecRules) -> tuple[ArrayRecord, memoryview]:
    value = leaf.value
    if leaf.kind == "torch":
        host = host_contiguous(value)
        view = tensor_bytes(host)
        record = ArrayRecord(
            leaf.path, "torch", torch_dtype_name(value.dtype), list(value.shape), view.nbytes,
            value.dtype.itemsize, rules.codec_for(leaf.path), bool(isinstance(value, torch.nn.Parameter)
                                                                   and value.requires_grad), str(value.device),
        )
        return record, view
    view = ndarray_bytes(value)
    codec = rules.codec_for(leaf.path) if leaf.kind == "numpy" else "zstd"
    record = ArrayRecord(leaf.path, leaf.kind, value.dtype.str, list(value.shape), view.nbytes,
                         value.dtype.itemsize, codec)
    return record, view
