"""``export_checkpoint``: one checkpoint of a vault written as a safetensors file or a torch file.

Order of calls: the output format (``formats.py``), the step resolved and its manifest read, the plan (which key
paths, arrays and plain values; :func:`plan_export`), then the output written (``output.py``): its layout first,
from the manifest's records, then the arrays read into it batch by batch (``fill.py``), then synced and renamed
into place. Nothing of the state is held in memory beyond a batch; arrays stored as shards by several ranks are
written whole.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._arrays import empty_like_record, finish_ndarray, writable_bytes
from .._format.records import Manifest
from .._restore.tensors import read_into, select
from .._tree import leaf_paths, scalar_value
from .._vault import Vault
from ..errors import InvalidArgumentError, PickleNotAllowedError
from ..manager import CheckpointManager
from ..stores import StorageOptions
from .fill import ArrayLeaf, array_leaf
from .formats import export_format
from .output import write_safetensors, write_torch


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_checkpoint` wrote: the file, its format, the step, how many arrays (``tensors``) and
    plain values it holds, and the bytes of the arrays' data."""

    path: Path
    format: str
    step: int
    tensors: int
    values: int
    nbytes: int


@dataclass
class ExportPlan:
    """The selected leaves of a checkpoint: arrays in tree order, plain values by key path, numpy scalars by
    record index (read before writing: a few bytes each)."""

    selected: set[str] | None
    arrays: list[ArrayLeaf]
    values: dict[str, Any]
    scalars: dict[int, Any]


def export_checkpoint(url: Any, step: int | str | None, path: str | os.PathLike[str], *, format: str | None = None,
                      keys: Iterable[str] | str | None = None, storage_options: StorageOptions | None = None,
                      workers: int | None = None) -> ExportResult:
    """Write checkpoint ``step`` of the vault at ``url`` to the file ``path``; returns what was written.

    ``step``: a step, a pin tag, or None for the latest. ``format``: ``"safetensors"`` or ``"torch"``; by default
    from the suffix (``.safetensors``; ``.pt``, ``.pth``, ``.bin``, ``.ckpt``). ``keys``: key path patterns, as
    :meth:`CheckpointManager.restore` takes them (``"model.*"``; a bare prefix names its subtree); a pattern
    list matching nothing raises :class:`~ckptvault.errors.KeyMismatchError`.

    safetensors: one tensor per array, named by its key path (``model.fc.weight``, ``optimizer.state.0.exp_avg``),
    numpy arrays as tensors of the same element type, an array tied to several key paths written under each;
    plain values (ints, floats, strings, ...) go to ``__metadata__`` as JSON text under their key paths, with
    ``"format": "pt"`` and a ``"ckptvault"`` entry holding the step, metrics, metadata and the list of those
    values (``import_checkpoint`` reads them back). torch: ``torch.save`` of the state as :meth:`restore` returns
    it (loadable with ``torch.load(weights_only=True)``), numpy arrays as tensors, numpy scalars as Python numbers.
    Values saved with pickle are refused (:class:`~ckptvault.errors.PickleNotAllowedError`): leave them out with
    ``keys``. Arrays saved as shards by several ranks are written whole.

    The file is written under a temporary name beside ``path`` and renamed onto it when complete (replacing a file
    there); memory stays at about one batch of arrays plus the chunks being read, whatever the checkpoint's size.
    """
    out = Path(os.fspath(path))
    kind = export_format(out, format)
    if not out.parent.is_dir():
        raise InvalidArgumentError(f"cannot write {out}: the folder {out.parent} does not exist; create it first")
    if out.is_dir():
        raise InvalidArgumentError(f"cannot write {out}: it is a folder; name a file")
    with CheckpointManager(url, storage_options=storage_options, workers=workers) as mgr:
        mgr.vault.require()
        resolved = mgr.info(step).step
        manifest = mgr.vault.read_manifest(resolved)
        plan = plan_export(mgr.vault, manifest, keys)
        if kind == "safetensors":
            values = {**plan.values, **{p: plan.scalars[i] for p, i in _scalar_paths(manifest, plan).items()}}
            write_safetensors(mgr.vault, manifest, plan.arrays, values, out)
        else:
            values = {**plan.values, **_scalar_paths(manifest, plan)}
            write_torch(mgr.vault, manifest, plan.arrays, plan.scalars, plan.selected, out)
    return ExportResult(out, kind, resolved, len(plan.arrays), len(values), sum(a.nbytes for a in plan.arrays))


def plan_export(vault: Vault, manifest: Manifest, keys: Iterable[str] | str | None) -> ExportPlan:
    """The leaves ``keys`` selects, sorted into arrays, plain values and numpy scalars (read here)."""
    selected = select(manifest, keys)
    arrays, values, scalars = [], {}, {}
    for path, node in leaf_paths(manifest.tree).items():
        if selected is not None and path not in selected:
            continue
        tag, body = next(iter(node.items()))
        if tag == "pickle" or (tag == "tensor" and manifest.tensors[body].kind == "pickle"):
            raise PickleNotAllowedError(f"key path {path!r} was saved with pickle, which export does not write; "
                                        "leave it out with keys= (--keys), or restore it with allow_pickle=True")
        if tag in ("tensor", "ndarray", "shards"):
            arrays.append(array_leaf(manifest, path, tag, body))
        elif tag == "npscalar":
            scalars[body] = _read_scalar(vault, manifest, body)
        else:
            values[path] = scalar_value(node)
    return ExportPlan(selected, arrays, values, scalars)


def _scalar_paths(manifest: Manifest, plan: ExportPlan) -> dict[str, int]:
    """Key path -> record index of each selected numpy scalar."""
    return {path: node["npscalar"] for path, node in leaf_paths(manifest.tree).items()
            if "npscalar" in node and (plan.selected is None or path in plan.selected)}


def _read_scalar(vault: Vault, manifest: Manifest, index: int) -> Any:
    """A numpy scalar's value as a Python number."""
    record = manifest.tensors[index]
    array = empty_like_record(record.kind, record.dtype, list(record.shape))
    read_into(vault, manifest, {index: writable_bytes(array)})
    value: np.ndarray = finish_ndarray(array, record.dtype)
    return value[()].item()
