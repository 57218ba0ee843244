"""Reading a checkpoint's arrays into caller-provided tensors (an export's memory-mapped output), a batch at a time.

The export's plan (``export.py``) lists the arrays to write and the output gives each a tensor over its place in
the file. :func:`fill` reads them with the restore pipeline's reader (``_restore/tensors.py``: chunks fetched and
verified in parallel, each copied straight into the target's bytes), in batches of about :data:`BATCH_BYTES`: only
lossy arrays (decoded through buffers) and shards that are not contiguous in their array (through temporaries)
need memory beyond the chunks in flight, and a batch bounds it. Arrays stored as shards (multi-rank DCP saves) are
assembled whole in their target.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import torch

from .._arrays import tensor_bytes, torch_dtype
from .._format.records import Manifest
from .._format.shards import box_of
from .._restore.tensors import Dest, LossyReads, ShardedReads, read_into
from .._vault import Vault
from ..errors import InvalidArgumentError

#: restored bytes of the arrays one read covers (a larger array is a batch of its own)
BATCH_BYTES = 64 << 20


@dataclass(frozen=True)
class ArrayLeaf:
    """An array to export: its key path, its first record, and its dtype and shape as written (whole: the global
    shape of an array stored as shards; a numpy array as the torch dtype of its elements)."""

    path: str
    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    sharded: bool = False

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def array_leaf(manifest: Manifest, path: str, tag: str, body: int | list[int]) -> ArrayLeaf:
    """The :class:`ArrayLeaf` of a ``tensor``, ``ndarray`` or ``shards`` node."""
    if tag == "shards":
        assert isinstance(body, list)
        first = manifest.tensors[body[0]]
        return ArrayLeaf(path, body[0], torch_dtype(first.dtype), tuple(box_of(first)[0]), sharded=True)
    assert isinstance(body, int)
    record = manifest.tensors[body]
    if record.kind == "numpy":
        return ArrayLeaf(path, body, numpy_torch_dtype(record.dtype), tuple(record.shape))
    return ArrayLeaf(path, body, torch_dtype(record.dtype), tuple(record.shape))


def map_shared(path: Path, nbytes: int) -> torch.UntypedStorage:
    """The first ``nbytes`` of the file at ``path`` mapped shared: what is written to it reaches the file."""
    return cast(torch.UntypedStorage, torch.UntypedStorage.from_file(str(path), shared=True, nbytes=nbytes))


def tensor_at(storage: torch.UntypedStorage, dtype: torch.dtype, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A contiguous tensor of ``dtype`` and ``shape`` over ``storage``'s bytes from ``offset`` (a multiple of the
    element size)."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return torch.empty(0, dtype=dtype).set_(storage, offset // dtype.itemsize, shape, tuple(reversed(strides)))


def numpy_torch_dtype(dtype: str) -> torch.dtype:
    """The torch dtype of a numpy dtype's elements (little-endian, as stored)."""
    try:
        return torch.from_numpy(np.empty(0, dtype=np.dtype(dtype).newbyteorder("<"))).dtype
    except TypeError:
        raise InvalidArgumentError(f"numpy dtype {dtype} has no torch equivalent to export it as") from None


def batches(leaves: list[ArrayLeaf]) -> Iterator[list[ArrayLeaf]]:
    """Consecutive leaves, about :data:`BATCH_BYTES` of them at a time."""
    batch: list[ArrayLeaf] = []
    size = 0
    for leaf in leaves:
        if batch and size + leaf.nbytes > BATCH_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(leaf)
        size += leaf.nbytes
    if batch:
        yield batch


def fill(vault: Vault, manifest: Manifest, leaves: list[ArrayLeaf], targets: dict[str, torch.Tensor]) -> None:
    """Read every leaf's array into ``targets[leaf.path]`` (plain contiguous CPU tensors of its dtype and shape)."""
    for batch in batches([leaf for leaf in leaves if leaf.nbytes]):
        _fill_batch(vault, manifest, batch, targets)


def _fill_batch(vault: Vault, manifest: Manifest, batch: list[ArrayLeaf], targets: dict[str, torch.Tensor]) -> None:
    dests: dict[Dest, memoryview] = {}
    lossy: dict[int, torch.Tensor] = {}
    sharded: dict[str, torch.Tensor] = {}
    firsts_of: dict[str, int] = {}  # sharded key path -> its first record (where ShardedReads puts the array)
    firsts: dict[int, torch.Tensor] = {}
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # tied key paths: one record, copied after the reads
    for leaf in batch:
        target = targets[leaf.path]
        if leaf.sharded:
            sharded[leaf.path], firsts_of[leaf.path] = target, leaf.index
        elif leaf.index in firsts:
            if firsts[leaf.index].data_ptr() != target.data_ptr():
                copies.append((target, firsts[leaf.index]))
        elif manifest.tensors[leaf.index].is_lossy:
            firsts[leaf.index] = lossy[leaf.index] = target
        else:
            firsts[leaf.index] = target
            dests[leaf.index] = tensor_bytes(target)
    decoding = LossyReads(manifest.tensors, lossy)
    dests.update(decoding.dests())
    shards = ShardedReads(manifest, set(sharded), sharded) if sharded else None
    if shards is not None:
        dests.update(shards.dests)  # type: ignore[arg-type]
    read_into(vault, manifest, dests, None, None if shards is None else shards.copy_in)  # type: ignore[arg-type]
    if shards is not None:
        shards.finish()
        for path, target in sharded.items():
            whole = shards.out[firsts_of[path]]
            if whole is not target:  # read elsewhere (a target ShardedReads could not fill in place)
                target.copy_(whole)
    for index, target in lossy.items():
        target.copy_(decoding.decoded(index))
    for target, source in copies:
        target.copy_(source)
