"""Compare two checkpoints of a vault tensor by tensor (``ckptvault diff``).

For every array key path present in both checkpoints: how many elements
differ bit for bit, the largest absolute difference of the values (numeric
dtypes only), and the bytes the second checkpoint added to the vault for it
(its share of the chunks that save created). Arrays present in only one of
the two are listed apart; so are Python scalars of the skeleton that differ
(a step counter, a learning rate).

An array of a DCP checkpoint stored as the shards its ranks held is one array
here, of its global shape, compared whole (consolidated from its shards).

Cost: arrays whose chunks are the same objects in both checkpoints (cut into
the same shards) are equal by construction (chunks are named by their content)
and are not read. The
others are read from both checkpoints, ``batch_bytes`` at a time, so memory
stays near two batches (or two copies of the largest differing array).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from .._arrays import itemsize_of, torch_dtype
from .._format.records import Manifest
from .._format.shards import box_of
from .._restore.tensors import Dest, LossyReads, read_into, read_sharded
from .._tree import leaf_paths
from .._vault import Vault
from ..rules import any_match
from .arrays import StoredArray, stored_arrays

log = logging.getLogger(__name__)

Progress = Callable[[int], None]
BATCH_BYTES = 256 << 20
SLICE_ELEMENTS = 4 << 20  # elements compared at a time (bounds temporaries)
_TORCH_TO_NUMPY = {"bool": np.bool_, "uint8": np.uint8, "int8": np.int8, "int16": np.int16, "int32": np.int32,
                   "int64": np.int64, "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64,
                   "float16": np.float16, "float32": np.float32, "float64": np.float64,
                   "complex64": np.complex64, "complex128": np.complex128}


@dataclass
class TensorDiff:
    """One array key path. ``status``: ``same``, ``changed``, or ``retyped`` (dtype or shape differs).

    ``changed``: elements whose bits differ (all of them when retyped);
    ``max_abs_diff``: largest ``|b - a|`` over those elements (complex: modulus of the
    difference; bool and integers as numbers, exactly; NaN if a NaN is involved), None
    when not numeric or retyped; ``added_bytes``: the later checkpoint's share of the
    chunks it created that hold this array.
    """

    path: str
    kind: str
    dtype: str
    shape: list[int]
    numel: int
    nbytes: int
    status: str
    changed: int
    max_abs_diff: float | int | None
    added_bytes: int

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.numel if self.numel else 0.0


@dataclass
class OnlyIn:
    """An array key path present in one checkpoint only (``added_bytes``: for the later one)."""

    path: str
    kind: str
    dtype: str
    shape: list[int]
    nbytes: int
    added_bytes: int = 0


@dataclass
class CheckpointDiff:
    """The comparison of checkpoint ``step_a`` with ``step_b`` (see :func:`diff_steps`)."""

    step_a: int
    step_b: int
    tensors: list[TensorDiff] = field(default_factory=list)
    only_a: list[OnlyIn] = field(default_factory=list)
    only_b: list[OnlyIn] = field(default_factory=list)
    scalars: list[dict[str, Any]] = field(default_factory=list)
    added_bytes_b: int = 0
    stored_bytes_b: int = 0
    logical_bytes_b: int = 0
    keyframe_step_b: int | None = None

    @property
    def totals(self) -> dict[str, Any]:
        numel = sum(t.numel for t in self.tensors)
        changed = sum(t.changed for t in self.tensors)
        return {
            "tensors": len(self.tensors), "tensors_changed": sum(t.status != "same" for t in self.tensors),
            "only_a": len(self.only_a), "only_b": len(self.only_b), "scalars_changed": len(self.scalars),
            "elements": numel, "elements_changed": changed, "changed_fraction": changed / numel if numel else 0.0,
            "added_bytes": self.added_bytes_b, "stored_bytes": self.stored_bytes_b, "logical_bytes": self.logical_bytes_b,
        }

    def to_json(self) -> dict[str, Any]:
        """A JSON-safe dict (non-finite numbers become the strings ``"nan"``, ``"inf"``)."""
        tensors = [asdict(t) | {"changed_fraction": t.changed_fraction, "max_abs_diff": _json_number(t.max_abs_diff)}
                   for t in self.tensors]
        return {"step_a": self.step_a, "step_b": self.step_b, "keyframe_step_b": self.keyframe_step_b,
                "totals": self.totals, "tensors": tensors, "only_a": [asdict(o) for o in self.only_a],
                "only_b": [asdict(o) for o in self.only_b], "scalars": self.scalars}


def diff_steps(vault: Vault, step_a: int, step_b: int, keys: Iterable[str] | None = None,
               progress: Progress | None = None, batch_bytes: int = BATCH_BYTES) -> CheckpointDiff:
    """Compare checkpoint ``step_a`` with ``step_b`` (``keys``: only matching key paths).

    Arrays are compared whole: an array of a DCP checkpoint stored as shards (``_reports/arrays.py``) is
    consolidated from them, so two steps saved at different world sizes (shards cut differently), or one saved by
    DCP and one by ``CheckpointManager.save``, compare by value. Reads and verifies both manifests
    (StepNotFoundError, CorruptManifestError) and every chunk of the arrays that differ (CorruptChunkError).
    ``progress`` receives bytes as they are read.
    """
    ma, mb = vault.read_manifest(step_a), vault.read_manifest(step_b)
    patterns = [keys] if isinstance(keys, str) else list(keys) if keys is not None else None
    ta, tb = _arrays(ma, patterns), _arrays(mb, patterns)
    result = CheckpointDiff(step_a, step_b, added_bytes_b=mb.added_bytes, stored_bytes_b=mb.stored_bytes,
                            logical_bytes_b=mb.logical_bytes, keyframe_step_b=mb.keyframe)
    result.only_a = [_only(ma, r, added=False) for p, r in ta.items() if p not in tb]
    result.only_b = [_only(mb, r, added=True) for p, r in tb.items() if p not in ta]
    to_read: list[tuple[StoredArray, StoredArray]] = []
    for path, array_b in ((p, r) for p, r in tb.items() if p in ta):
        array_a = ta[path]
        added = _added_share(mb, array_b)
        if array_a.dtype != array_b.dtype or array_a.shape != array_b.shape or array_a.kind != array_b.kind:
            result.tensors.append(_tensor_diff(array_b, "retyped", _numel(array_b), None, added))
        elif _chunk_refs(ma, array_a) == _chunk_refs(mb, array_b):
            result.tensors.append(_tensor_diff(array_b, "same", 0, 0, added))
        else:
            to_read.append((array_a, array_b))
    for batch in _batches(to_read, batch_bytes):
        result.tensors.extend(_compare_batch(vault, ma, mb, batch, progress))
    order = {path: position for position, path in enumerate(tb)}
    result.tensors.sort(key=lambda t: order[t.path])
    result.scalars = _scalar_changes(ma, mb, patterns)
    log.info("diff of steps %d and %d: %d of %d arrays changed", step_a, step_b,
             result.totals["tensors_changed"], len(result.tensors))
    return result


# -- records and sizes -------------------------------------------------------------------------------------
def _arrays(manifest: Manifest, patterns: list[str] | None) -> dict[str, StoredArray]:
    """Key path -> array (its shards, if stored as shards, as one), in manifest order, filtered by ``patterns``."""
    return {array.path: array for array in stored_arrays(manifest)
            if patterns is None or any_match(array.path, patterns)}


def _numel(array: StoredArray) -> int:
    return 1 if array.kind == "pickle" else math.prod(array.shape)


def _chunk_refs(manifest: Manifest, array: StoredArray) -> list[Any]:
    """What the restored value depends on: each record's box and chunks and, for a lossy one, its codec, scales
    and keyframe copy. Equal for two arrays stored as the same bytes, cut into the same shards."""
    out: list[Any] = []
    for index in array.indices:
        record = manifest.tensors[index]
        lossy = record.lossy if record.is_lossy else None
        pieces = [*record.pieces]
        if lossy is not None:
            pieces += [p for j in lossy.parts.values() for p in manifest.tensors[j].pieces] + list(lossy.base_pieces or ())
        codec = (lossy.codec, lossy.block) if lossy is not None else (None, None)
        out += [box_of(record)[1], record.shape, codec] + [(manifest.chunks[p.chunk].id, p.offset, p.length)
                                                          for p in pieces]
    return out


def _added_share(manifest: Manifest, array: StoredArray) -> int:
    """The array's share of the stored size of the chunks its checkpoint created (over all its shards)."""
    chunks = manifest.chunks
    share = sum(chunks[p.chunk].stored * p.length / max(chunks[p.chunk].raw, 1)
                for index in array.indices for p in manifest.tensors[index].pieces if chunks[p.chunk].new)
    return round(share)


def _only(manifest: Manifest, array: StoredArray, added: bool) -> OnlyIn:
    return OnlyIn(array.path, array.kind, array.dtype, list(array.shape), array.nbytes,
                  _added_share(manifest, array) if added else 0)


def _tensor_diff(array: StoredArray, status: str, changed: int, max_abs: float | int | None, added: int) -> TensorDiff:
    return TensorDiff(array.path, array.kind, array.dtype, list(array.shape), _numel(array), array.nbytes,
                      status, changed, max_abs, added)


def _batches(items: list[tuple[StoredArray, StoredArray]], limit: int
             ) -> Iterable[list[tuple[StoredArray, StoredArray]]]:
    batch: list[tuple[StoredArray, StoredArray]] = []
    size = 0
    for item in items:
        nbytes = item[1].nbytes
        if batch and size + nbytes > limit:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += nbytes
    if batch:
        yield batch


# -- comparing values ----------------------------------------------------------------------------------------
def _compare_batch(vault: Vault, ma: Manifest, mb: Manifest, batch: list[tuple[StoredArray, StoredArray]],
                   progress: Progress | None) -> list[TensorDiff]:
    bufs_a = _read_values(vault, ma, [a for a, _b in batch], progress)
    bufs_b = _read_values(vault, mb, [b for _a, b in batch], progress)
    out = []
    for array_a, array_b in batch:
        changed, max_abs = compare_bytes(bufs_a.pop(array_a.key), bufs_b.pop(array_b.key), array_b.kind,
                                         array_b.dtype)
        out.append(_tensor_diff(array_b, "changed" if changed else "same", changed, max_abs,
                                _added_share(mb, array_b)))
    return out


def _read_values(vault: Vault, manifest: Manifest, arrays: list[StoredArray], progress: Progress | None
                 ) -> dict[int, np.ndarray]:
    """Array key (first record index) -> its bytes as restore returns them (a lossy record decoded to its
    original dtype, an array stored as shards consolidated)."""
    tensors = manifest.tensors
    whole = [a.key for a in arrays if not a.sharded]
    lossy = LossyReads(tensors, [i for i in whole if tensors[i].is_lossy])
    bufs = {i: np.empty(tensors[i].nbytes, np.uint8) for i in whole if not tensors[i].is_lossy}
    dests: dict[Dest, memoryview | Callable[[], memoryview]] = {i: b.data for i, b in bufs.items()}
    read_into(vault, manifest, {**dests, **lossy.dests()}, progress)
    for i in whole:
        if tensors[i].is_lossy:
            bufs[i] = lossy.decoded(i).reshape(-1).view(torch.uint8).numpy()
    sharded = {a.tree_path for a in arrays if a.sharded and a.tree_path is not None}
    if sharded:
        for i, value in read_sharded(vault, manifest, sharded, progress).items():
            bufs[i] = value.reshape(-1).view(torch.uint8).numpy()
    return bufs


def compare_bytes(a: np.ndarray, b: np.ndarray, kind: str, dtype: str) -> tuple[int, float | int | None]:
    """(elements whose bits differ, max |b - a| over them or None) of two equal-length little-endian buffers."""
    if kind == "pickle":
        changed = int(not np.array_equal(a, b))
        return changed, None
    itemsize = itemsize_of(kind, dtype)
    if itemsize == 0 or a.size == 0:
        return 0, 0
    changed = 0
    worst: float | int | None = 0
    step = SLICE_ELEMENTS * itemsize
    for start in range(0, a.size, step):
        sa, sb = a[start : start + step], b[start : start + step]
        mask = _differs(sa, sb, itemsize)
        count = int(mask.sum())
        if not count:
            continue
        changed += count
        worst = _max_merge(worst, _max_abs(sa, sb, mask, kind, dtype))
    return changed, worst


def _differs(a: np.ndarray, b: np.ndarray, itemsize: int) -> np.ndarray:
    """Per element: do the bytes differ?"""
    if itemsize in (1, 2, 4, 8):
        view = np.dtype(f"<u{itemsize}")
        return a.view(view) != b.view(view)
    return (a.reshape(-1, itemsize) != b.reshape(-1, itemsize)).any(axis=1)


def _max_abs(a: np.ndarray, b: np.ndarray, mask: np.ndarray, kind: str, dtype: str) -> float | int | None:
    """Largest ``|b - a|`` over the ``mask``ed elements, or None for non-numeric dtypes."""
    va, vb = _numeric(a, kind, dtype), _numeric(b, kind, dtype)
    if va is None or vb is None:
        return None
    va, vb = va[mask], vb[mask]
    if va.dtype.kind in "iub":
        ha, hb = _ordered_u64(va), _ordered_u64(vb)
        return int((np.maximum(ha, hb) - np.minimum(ha, hb)).max())
    if va.dtype.kind == "c":
        d = np.abs(va.astype(np.complex128) - vb.astype(np.complex128))
    else:
        with np.errstate(over="ignore", invalid="ignore"):
            d = np.abs(va.astype(np.float64) - vb.astype(np.float64))
    return float("nan") if np.isnan(d).any() else float(d.max())


def _numeric(raw: np.ndarray, kind: str, dtype: str) -> np.ndarray | None:
    """The values of little-endian bytes ``raw`` as a numpy array, or None when not numeric."""
    if kind == "torch":
        if dtype in _TORCH_TO_NUMPY:
            return raw.view(np.dtype(_TORCH_TO_NUMPY[dtype]).newbyteorder("<"))
        t = torch_dtype(dtype)
        if t.is_floating_point or t.is_complex:  # bfloat16, float8 variants, complex32: widen with torch
            wide = torch.complex64 if t.is_complex else torch.float64
            return torch.frombuffer(raw, dtype=t).to(wide).numpy()
        return None
    np_dtype = np.dtype(dtype).newbyteorder("<")
    return raw.view(np_dtype) if np_dtype.kind in "fciub" else None


def _ordered_u64(values: np.ndarray) -> np.ndarray:
    """Integers (and bools) mapped order-preservingly into uint64, so differences are exact."""
    if values.dtype.kind == "i":
        return values.astype(np.int64).view(np.uint64) ^ np.uint64(1 << 63)
    return values.astype(np.uint64)


def _max_merge(a: float | int | None, b: float | int | None) -> float | int | None:
    if a is None or b is None:
        return None
    if isinstance(a, float) and math.isnan(a) or isinstance(b, float) and math.isnan(b):
        return float("nan")
    return max(a, b)


def _json_number(value: float | int | None) -> float | int | str | None:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


# -- skeleton scalars ------------------------------------------------------------------------------------------
def _scalar_changes(ma: Manifest, mb: Manifest, patterns: list[str] | None) -> list[dict[str, Any]]:
    """Scalar leaves of the skeletons (ints, floats, strings...) that differ, are added or removed."""
    sa, sb = _scalars(ma.tree, patterns), _scalars(mb.tree, patterns)
    out = []
    for path in list(sa) + [p for p in sb if p not in sa]:
        a, b = sa.get(path), sb.get(path)
        if a != b:
            status = "only_b" if a is None else "only_a" if b is None else "changed"
            out.append({"path": path, "status": status, "a": _scalar_json(a), "b": _scalar_json(b)})
    return out


def _scalars(tree: dict[str, Any], patterns: list[str] | None) -> dict[str, Any]:
    out = {}
    for path, node in leaf_paths(tree).items():
        tag = next(iter(node))
        if tag not in ("tensor", "ndarray", "npscalar", "pickle", "shards") and (patterns is None or any_match(path, patterns)):
            out[path] = node
    return out


def _scalar_json(node: dict[str, Any] | None) -> Any:
    """A skeleton scalar node as a plain JSON value (floats as numbers; None when absent: see ``status``)."""
    if node is None:
        return None
    tag, body = next(iter(node.items()))
    if tag == "float":
        value = float.fromhex(body)
        return value if math.isfinite(value) else str(value)
    return body
