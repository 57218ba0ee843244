"""The arrays of a manifest as users see them: one per array, however many records hold it.

A checkpoint ``CheckpointManager.save`` wrote has one record per array. A DCP checkpoint (``VaultWriter``,
docs/DESIGN.md section 4, "DCP checkpoints") stores an array as the boxes of several records (one per rank that
held a shard), all named by one ``{"shards": [i, ...]}`` node of the tree; the array is their ``global_shape``.
:func:`stored_arrays` groups them, so ``ckptvault show`` lists each array once with its global shape and
``ckptvault diff`` compares whole arrays (two steps saved at different world sizes cut them differently).
"""

from __future__ import annotations

from dataclasses import dataclass

from .._format.records import Manifest, TensorRecord
from .._format.shards import FEATURE, box_of
from .._tree import leaf_paths

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape)


@dataclass(frozen=True)
class StoredArray:
    """One array of a checkpoint. ``indices``: its records (one, unless ``sharded``), in manifest order;
    ``shape``: the whole array's (its ``global_shape``); ``nbytes``: its bytes as restored; ``boxes``: the
    (offsets, shape) of each shard, in the order of ``indices`` (empty unless ``sharded``); ``tree_path``: the
    key path of its shards node in the tree (None unless ``sharded``)."""

    path: str
    indices: tuple[int, ...]
    first: TensorRecord
    shape: tuple[int, ...]
    nbytes: int
    sharded: bool = False
    boxes: tuple[Box, ...] = ()
    tree_path: str | None = None

    @property
    def kind(self) -> str:
        return self.first.kind

    @property
    def dtype(self) -> str:
        return self.first.dtype

    @property
    def shards(self) -> int:
        """How many records hold the array (1 for a whole record)."""
        return len(self.indices)

    @property
    def key(self) -> int:
        """The index of its first record: the array's identity within its manifest."""
        return self.indices[0]


def stored_arrays(manifest: Manifest) -> list[StoredArray]:
    """Every array of ``manifest`` (lossy tensors' scale ``part`` records left out: they belong to their tensor),
    in the order of their first record. Records a shards node names form one array; any other record is one."""
    records = manifest.tensors
    groups: dict[int, tuple[str, list[int]]] = {}
    member: set[int] = set()
    if FEATURE in manifest.requires:  # the schema refuses shards nodes in a manifest without the feature
        for path, node in leaf_paths(manifest.tree).items():
            if "shards" in node:
                indices = list(node["shards"])
                groups[indices[0]] = (path, indices)
                member.update(indices[1:])
    out = []
    for index, record in enumerate(records):
        if record.kind == "part" or index in member:
            continue
        if index not in groups:
            out.append(StoredArray(record.path, (index,), record, record.shape, record.restored_nbytes))
            continue
        tree_path, indices = groups[index]
        shards = [records[i] for i in indices]
        out.append(StoredArray(record.path, tuple(indices), record, box_of(record)[0],
                               sum(r.restored_nbytes for r in shards), True,
                               tuple((box_of(r)[1], r.shape) for r in shards), tree_path))
    return out

