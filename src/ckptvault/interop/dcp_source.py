"""A torch.distributed.checkpoint folder (``.metadata`` plus ``*.distcp`` files) read for import, one item at a time.

DCP stores each tensor (or each rank's shard of it) as a ``torch.save`` stream inside its ``.distcp`` files, so its
bytes cannot be mapped in place. :func:`read_dcp` lays out every tensor, whole, in a temporary spill file (sparse,
in the system's temporary folder: ``TMPDIR``), maps it shared, and lets ``dcp.load`` copy the items into it one by
one: process memory holds about one item, the spilled bytes are page cache. Shards saved by several ranks are
assembled into whole tensors by DCP's own planner. Non-tensor values are ``torch.load``-ed with
``weights_only=True`` unless ``allow_pickle``. The state is nested as it was saved (DCP's ``planner_data``).
"""

from __future__ import annotations

import math
import pickle
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from ..errors import InvalidArgumentError, VaultError
from .fill import map_shared, tensor_at
from .sources import Source, pickle_refused

#: where each tensor starts in the spill file is a multiple of this (any element size divides it)
ALIGN = 64


def read_dcp(path: Path, allow_pickle: bool) -> Source:
    """The DCP checkpoint in folder ``path`` as a state of tensors in a spill file (removed by ``close``)."""
    reader = dcp.FileSystemReader(str(path))
    try:
        metadata = reader.read_metadata()
    except Exception as exc:  # noqa: BLE001 - DCP raises what its unpickler and file system raise
        raise InvalidArgumentError(f"{path} is not a readable torch.distributed.checkpoint folder: "
                                   f"{type(exc).__name__}: {exc}") from None
    tensors = {fqn: m for fqn, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    values = {fqn: None for fqn, m in metadata.state_dict_metadata.items() if isinstance(m, BytesStorageMetadata)}
    folder = Path(tempfile.mkdtemp(prefix="ckptvault-dcp-import-"))
    try:
        flat: dict[str, Any] = {**_spilled(folder / "spill", tensors), **values}
        _load(path, flat, reader, allow_pickle)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    ordered = {fqn: flat[fqn] for fqn in metadata.state_dict_metadata}  # the order DCP recorded
    state = _nested(ordered, metadata.planner_data)
    return Source(state, {"imported_from": str(path.resolve()), "import_format": "dcp"},
                  close=lambda: shutil.rmtree(folder, ignore_errors=True))


def _spilled(file: Path, tensors: dict[str, Any]) -> dict[str, torch.Tensor]:
    """An uninitialised tensor per entry (its ``size`` and ``properties.dtype``) over one shared map of ``file``."""
    starts, total = {}, 0
    for fqn, meta in tensors.items():
        starts[fqn] = total
        total += -(-math.prod(meta.size) * meta.properties.dtype.itemsize // ALIGN) * ALIGN
    if total == 0:
        return {fqn: torch.empty(tuple(m.size), dtype=m.properties.dtype) for fqn, m in tensors.items()}
    with open(file, "wb") as f:
        f.truncate(total)  # sparse: disk blocks only as items are copied in
    storage = map_shared(file, total)
    return {fqn: tensor_at(storage, meta.properties.dtype, starts[fqn], tuple(meta.size)) for fqn, meta in tensors.items()}


def _nested(flat: dict[str, Any], planner_data: Any) -> Any:
    """The flat ``{fqn: value}`` nested back as saved, where DCP kept each fqn's path (``planner_data``)."""
    if not isinstance(planner_data, dict) or set(planner_data) != set(flat):
        return flat
    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict

    return unflatten_state_dict(flat, planner_data)


def _load(path: Path, flat: dict[str, Any], reader: Any, allow_pickle: bool) -> None:
    """``dcp.load`` into ``flat``; the error of a failed read as itself (DCP wraps it in a CheckpointException)."""
    try:
        with warnings.catch_warnings():  # no_dist is the point: a single process reads it
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(flat, storage_reader=reader, planner=_ValuesPlanner(path, allow_pickle), no_dist=True)
    except CheckpointException as exc:
        causes = [failure[0] if isinstance(failure, tuple) else failure for failure in exc.failures.values()]
        for cause in causes:
            if isinstance(cause, VaultError):
                raise cause from None
        raise InvalidArgumentError(f"cannot read the torch.distributed.checkpoint folder {path}: {causes[:1]}") from exc


class _ValuesPlanner(DefaultLoadPlanner):
    """DCP's default load planner over a flat state, but values are loaded with ``weights_only`` unless allowed."""

    def __init__(self, path: Path, allow_pickle: bool) -> None:
        super().__init__(flatten_state_dict=False)
        self.path, self.allow_pickle = path, allow_pickle

    def load_bytes(self, read_item: Any, value: Any) -> None:
        try:
            loaded = torch.load(value, weights_only=not self.allow_pickle)
        except pickle.UnpicklingError as exc:
            raise pickle_refused(self.path, exc) from None
        self.original_state_dict[read_item.dest_index.fqn] = loaded  # the caller's dict (state_dict is a copy)
