"""Sharded records: the checks a manifest using the ``sharded`` feature passes (docs/DESIGN.md section 4, "DCP
checkpoints").

A record holds the box ``offsets`` .. ``offsets + shape`` of an array of ``global_shape``. A record whose box is the
whole array (every save of ``CheckpointManager`` writes only those) needs nothing new; any other record, and every
``{"shards": [i, ...]}`` tree node (one array stored as the boxes of several records), needs ``"sharded"`` in the
manifest's ``requires``, so a reader that predates it refuses the manifest instead of returning a shard as if it were
the array. What a shards node must name, so that a reader consolidating it allocates only what the shards hold and
leaves no element unwritten:

- at least one and at most ``MAX_SHARDS`` records, each a ``torch`` record (stored exactly or lossily: each shard's
  ``lossy`` entry is checked as any record's) named by no other shards node;
- records of one ``path``, ``dtype`` and ``global_shape``, at pairwise distinct ``offsets``;
- boxes that tile the array exactly: their volumes sum to its volume and no two overlap.

Every record is also checked on its own: ``global_shape`` and ``offsets`` have as many dimensions as ``shape``, and
the box lies inside the global shape. Called by ``schema.check_manifest``, which has checked each record and the
tree's structure before.
"""

from __future__ import annotations

import math
from typing import Any

from .records import TensorRecord

#: the feature a manifest with sharded records or shards nodes names in ``requires``
FEATURE = "sharded"
#: most records one shards node may name: the overlap check is quadratic in the worst (hostile) case
MAX_SHARDS = 1 << 16


def box_of(record: TensorRecord) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global_shape, offsets) of a record; a record written without them is the whole array."""
    shape = record.shape
    return (shape if record.global_shape is None else record.global_shape,
            (0,) * len(shape) if record.offsets is None else record.offsets)


def is_whole(record: TensorRecord) -> bool:
    """Whether the record holds its whole array (its box starts at zero and has the global shape)."""
    global_shape, offsets = box_of(record)
    return global_shape == record.shape and not any(offsets)


def check_boxes(f: Any, tensors: tuple[TensorRecord, ...]) -> None:
    """Every record's box has the dimensions of its shape and lies inside its global shape."""
    for i, record in enumerate(tensors):
        global_shape, offsets = box_of(record)
        if len(global_shape) != len(record.shape):
            f.fail(f"tensors[{i}].global_shape", f"{list(global_shape)} has not the {len(record.shape)} dimensions "
                                                 f"of shape {list(record.shape)}")
        if len(offsets) != len(record.shape):
            f.fail(f"tensors[{i}].offsets", f"{list(offsets)} has not the {len(record.shape)} dimensions of shape "
                                            f"{list(record.shape)}")
        for d, (offset, size, whole) in enumerate(zip(offsets, record.shape, global_shape, strict=True)):
            if offset + size > whole:
                f.fail(f"tensors[{i}].offsets", f"the box {list(offsets)} + {list(record.shape)} lies outside "
                                                f"global_shape {list(global_shape)} in dimension {d}")


def check_shards_node(f: Any, body: Any, at: str, tensors: tuple[TensorRecord, ...], seen: set[int]) -> None:
    """A ``{"shards": [i, ...]}`` node at ``at`` (see the module docstring); adds its indices to ``seen``."""
    indices = f.list(body, at)
    if not 1 <= len(indices) <= MAX_SHARDS:
        f.fail(at, f"names {len(indices)} records; a shards node names 1 to {MAX_SHARDS}")
    for j, index in enumerate(indices):
        f.int(index, f"{at}[{j}]", 0, len(tensors) - 1)
        if index in seen:
            f.fail(f"{at}[{j}]", f"names tensors[{index}], which another shards node (or this one) names too")
        seen.add(index)
        record = tensors[index]
        if record.kind != "torch":
            f.fail(f"{at}[{j}]", f"names tensors[{index}] of kind {record.kind!r}; shards are torch records")
    first = tensors[indices[0]]
    offsets_seen: dict[tuple[int, ...], int] = {}
    for index in indices:
        record = tensors[index]
        for name in ("path", "dtype"):
            if getattr(record, name) != getattr(first, name):
                f.fail(f"tensors[{index}].{name}", f"is {getattr(record, name)!r}, but the first shard of its array "
                                                   f"(tensors[{indices[0]}]) has {getattr(first, name)!r}")
        if box_of(record)[0] != box_of(first)[0]:
            f.fail(f"tensors[{index}].global_shape", f"is {list(box_of(record)[0])}, but the first shard of its array "
                                                     f"(tensors[{indices[0]}]) has {list(box_of(first)[0])}")
        offsets = box_of(record)[1]
        if offsets in offsets_seen:
            f.fail(f"tensors[{index}].offsets", f"{list(offsets)} are the offsets of tensors[{offsets_seen[offsets]}] "
                                                "too: two shards of one array at the same place")
        offsets_seen[offsets] = index
    _check_tiling(f, at, [tensors[i] for i in indices], indices)


def _check_tiling(f: Any, at: str, shards: list[TensorRecord], indices: list[int]) -> None:
    """The shards' boxes cover the global array exactly once: volumes that sum to its volume, and no overlap
    (a sweep along dimension 0, as DCP's own check, so shards cut along it are compared with their neighbours only)."""
    global_shape = box_of(shards[0])[0]
    volume = sum(r.numel for r in shards)
    if volume != math.prod(global_shape):
        f.fail(at, f"names shards of {volume} elements in all, but their global_shape {list(global_shape)} holds "
                   f"{math.prod(global_shape)}")
    if not global_shape:
        return
    boxes = sorted((box_of(r)[1], r.shape, i) for r, i in zip(shards, indices, strict=True) if r.numel)
    active: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
    for offsets, shape, index in boxes:
        active = [box for box in active if box[0][0] + box[1][0] > offsets[0]]
        for other_offsets, other_shape, other in active:
            if all(o < p + q and p < o + s for o, s, p, q in zip(offsets, shape, other_offsets, other_shape, strict=True)):
                f.fail(f"tensors[{index}].offsets", f"the box of tensors[{index}] overlaps that of tensors[{other}]")
        active.append((offsets, shape, index))


def check_sharding(f: Any, tensors: tuple[TensorRecord, ...], named: set[int], requires: tuple[str, ...]) -> None:
    """After the tree: a record that is not its whole array is named by a shards node (``named``), and a manifest
    with shards names the feature."""
    for i, record in enumerate(tensors):
        if not is_whole(record) and i not in named:
            f.fail(f"tensors[{i}].offsets", "describe a part of an array, but no shards node names the record")
    if named and FEATURE not in requires:
        f.fail("requires", f"must name {FEATURE!r}: the tree has shards nodes (an older reader would misread them)")
