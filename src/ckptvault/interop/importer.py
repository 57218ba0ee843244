"""``import_checkpoint``: a safetensors file, a torch file, a DCP folder or a Hugging Face folder saved as one
checkpoint of a vault.

Order of calls: the source's format (``formats.py``), the committed-step check (before anything is read), the
source read as a state of memory-mapped tensors (``sources.py``, ``dcp_source.py``), one synchronous
``CheckpointManager.save`` of it, then the maps dropped. The save aliases the mapped tensors instead of copying
them (a synchronous save stages nothing), so process memory stays at about a chunk per worker whatever the size of
the source; the commit is the manager's (the manifest written last), so a failed import commits nothing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._argcheck import check_kind
from .._format.manifest import check_step
from ..errors import InvalidArgumentError, StepExistsError
from ..info import CheckpointInfo
from ..manager import CheckpointManager
from .formats import source_format
from .sources import Source, read_hf, read_safetensors, read_torch

log = logging.getLogger(__name__)


def import_checkpoint(source: str | os.PathLike[str], url: Any, step: int, *, format: str | None = None,
                      allow_pickle: bool = False, overwrite: bool = False,
                      progress: Callable[..., None] | None = None, **options: Any) -> CheckpointInfo:
    """Save the checkpoint at ``source`` as ``step`` of the vault at ``url``; returns the committed step's info.

    ``source``: a safetensors file, a torch.save file, a torch.distributed.checkpoint folder (``.metadata``) or a
    Hugging Face folder (``model.safetensors``, or shards listed by ``model.safetensors.index.json``, plus
    ``optimizer.pt``, ``scheduler.pt`` and ``trainer_state.json`` where present); the kind is detected, or forced
    by ``format`` (``"safetensors"``, ``"torch"``, ``"dcp"``, ``"hf"``). Key paths: a safetensors file's names as
    they are (a flat state), a torch file's object as it is, a DCP checkpoint nested as it was saved, a Hugging
    Face folder as ``{"model": weights, "optimizer": ..., "scheduler": ..., "trainer_state": ...}``.

    Torch files and DCP values are loaded with ``torch.load(weights_only=True)``: anything needing more pickle
    raises :class:`~ckptvault.errors.PickleNotAllowedError` unless ``allow_pickle=True`` (then such values are
    also stored pickled, and restoring them needs ``allow_pickle=True``). A committed ``step`` raises
    :class:`~ckptvault.errors.StepExistsError` before the source is read, unless ``overwrite``. A missing source
    raises :class:`~ckptvault.errors.SourceNotFoundError`; one of unknown format InvalidArgumentError.
    ``progress`` is the save's (:meth:`CheckpointManager.save`); ``options`` go to :class:`CheckpointManager`
    (``codec``, ``codec_rules``, ``chunk_size``, ``storage_options``, ``workers``, ...), but for ``async_save``:
    an import saves synchronously, so the source is read once, in place.
    """
    check_step(step)
    check_kind("allow_pickle", allow_pickle, bool)
    check_kind("overwrite", overwrite, bool)
    if "async_save" in options:
        raise InvalidArgumentError("import_checkpoint() saves synchronously and takes no async_save")
    path = Path(os.fspath(source))
    kind = source_format(path, format)
    with CheckpointManager(url, async_save=False, **options) as mgr:
        if not overwrite and step in mgr.steps():
            raise StepExistsError(step, mgr.url)
        read = _read(path, kind, allow_pickle)
        try:
            log.info("importing %s (%s) as step %d of %s", path, kind, step, mgr.url)
            info = mgr.save(step, read.state, metrics=read.metrics, metadata=read.metadata, overwrite=overwrite,
                            allow_pickle=allow_pickle, progress=progress).wait()
        finally:
            read.close()
    assert info is not None  # a synchronous save that was not skipped has committed
    return info


def _read(path: Path, kind: str, allow_pickle: bool) -> Source:
    if kind == "safetensors":
        return read_safetensors(path)
    if kind == "torch":
        return read_torch(path, allow_pickle)
    if kind == "hf":
        return read_hf(path, allow_pickle)
    from .dcp_source import read_dcp  # torch.distributed.checkpoint takes a while to import

    return read_dcp(path, allow_pickle)
