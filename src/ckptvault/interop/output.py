"""Export output files: laid out first, then filled in place through a shared memory map, then published.

Order of calls for both formats: the file is created under a temporary name next to the output
(:func:`temp_output`), its layout written (a safetensors header; a ``torch.save`` of the state's structure with
``skip_data``, whose tensor bytes are left as holes), the tensors' places mapped shared, :func:`~.fill.fill`
reads the checkpoint into them, and the file is synced and renamed onto the output: a reader sees the old file
or the complete new one, never a partial one. Written pages are page cache, not process memory.
"""

from __future__ import annotations

import json
import mmap
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from .._format.records import Manifest
from .._tree import array_leaves, unflatten
from .._vault import Vault
from ..errors import InvalidArgumentError
from .fill import ArrayLeaf, fill, map_shared, tensor_at
from .safetensors_file import NAMES, encode_header
from .sources import EXPORT_KEY, encode_value


@contextmanager
def temp_output(out: Path) -> Iterator[Path]:
    """A temporary path next to ``out``; once the block ends without error, synced and renamed onto ``out``
    (replacing it), else removed."""
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:
        fd = os.open(out.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)  # the rename itself, durable
    finally:
        os.close(fd)


def safetensors_metadata(manifest: Manifest, values: dict[str, Any]) -> dict[str, str]:
    """``__metadata__``: ``"format": "pt"``, each plain value at its key path as JSON text, and under
    ``"ckptvault"`` the step, metrics, metadata and which entries are values (so an import restores them)."""
    if EXPORT_KEY in values:
        raise InvalidArgumentError(f"the key path {EXPORT_KEY!r} is the name safetensors export gives its own "
                                   "metadata entry; leave it out with keys=, or export in the torch format")
    out = {"format": "pt"} | {path: encode_value(v) for path, v in values.items()}
    out[EXPORT_KEY] = json.dumps({"step": manifest.step, "metrics": manifest.metrics, "metadata": manifest.metadata,
                                  "values": list(values)})
    return out


def write_safetensors(vault: Vault, manifest: Manifest, leaves: list[ArrayLeaf], values: dict[str, Any],
                      out: Path) -> None:
    """A safetensors file of ``leaves`` (names: their key paths; largest elements first, so each is aligned) and
    ``values`` in its metadata."""
    unsupported = [f"{leaf.path!r} ({leaf.dtype})" for leaf in leaves if leaf.dtype not in NAMES]
    if unsupported:
        raise InvalidArgumentError(f"safetensors has no dtype for {', '.join(unsupported[:5])}; export them in the "
                                   "torch format (format='torch', --format torch), or leave them out with keys=")
    order = sorted(leaves, key=lambda leaf: -leaf.dtype.itemsize)  # stable: key path order within a size
    head, offsets = encode_header([(leaf.path, leaf.dtype, leaf.shape) for leaf in order],
                                  safetensors_metadata(manifest, values))
    total = max([len(head)] + [o + leaf.nbytes for o, leaf in zip(offsets, order, strict=True)])
    with temp_output(out) as tmp:
        with open(tmp, "wb") as f:
            f.write(head)
            f.truncate(total)
        storage = map_shared(tmp, total)
        targets = {leaf.path: tensor_at(storage, leaf.dtype, offset, leaf.shape)
                   for leaf, offset in zip(order, offsets, strict=True)}
        fill(vault, manifest, order, targets)
        del targets, storage  # unmapped before the sync


class _Value:
    """A placeholder :func:`unflatten` indexes with ``[()]`` (as it does a numpy scalar's array): the value."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __getitem__(self, _key: Any) -> Any:
        return self.value


def write_torch(vault: Vault, manifest: Manifest, leaves: list[ArrayLeaf], scalars: dict[int, Any],
                selected: set[str] | None, out: Path) -> None:
    """A ``torch.save`` file of the state as restored (the ``selected`` key paths), numpy arrays as tensors and
    numpy scalars (``scalars``: record index -> value) as Python numbers."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # tensors with a dtype and shape but no memory: the file's layout only
        arrays: dict[int, Any] = {leaf.index: torch.empty(leaf.shape, dtype=leaf.dtype) for leaf in leaves}
    arrays.update({index: _Value(value) for index, value in scalars.items()})
    state = unflatten(manifest.tree, arrays, selected)
    with temp_output(out) as tmp:
        with torch.serialization.skip_data(materialize_fake_tensors=True):
            torch.save(state, tmp)
        del state, arrays
        with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):  # writes reach the file
            mapped = torch.load(tmp, mmap=True, weights_only=True)
        targets = dict(array_leaves(mapped))  # torch.load gives tensors only
        missing = [leaf.path for leaf in leaves if leaf.path not in targets]
        assert not missing, f"torch.load of the layout lacks {missing[:3]}"  # the same tree, walked the same way
        fill(vault, manifest, leaves, targets)
        del targets, mapped
