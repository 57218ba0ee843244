"""ckptvault: crash-safe, content-addressed, compressed checkpoints for PyTorch training.

Quick start::

    import ckptvault
    with ckptvault.CheckpointManager("./ckpts") as mgr:
        mgr.save(step, {"model": model.state_dict(), "optimizer": opt.state_dict()})
        state = mgr.restore()

The public API is what ``__all__`` names here, plus :mod:`ckptvault.errors`, :mod:`ckptvault.stores` (to write a
store) and :mod:`ckptvault.testing` (a store's conformance suite). Modules and packages whose names begin with an
underscore are internal and may change in any release.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from . import errors
from ._maintenance.copy import CopyPlan, CopyResult, copy_checkpoints
from ._maintenance.gc import GCPlan, GCResult
from ._maintenance.prune import PrunePlan, PruneResult
from ._maintenance.retention import (
    KeepBest,
    KeepDaily,
    KeepEvery,
    KeepIf,
    KeepInterval,
    KeepLast,
    KeepWeekly,
    Policy,
    Retention,
    RetentionInfo,
)
from ._parallel import pause_collector, resume_collector
from ._reports.verify import VerifyReport
from ._restore.live import RestoredObject, RestoreReport
from ._save.preemption import Preempted
from ._version import __version__
from .handle import SaveHandle
from .info import CheckpointInfo, TensorInfo
from .interop import ExportResult, export_checkpoint, import_checkpoint
from .manager import CheckpointManager
from .options import AsyncOptions, DeltaOptions, DistributedOptions, LossySafety
from .rng import rng_state, set_rng_state
from .rules import CodecRules
from .stores import LocalOptions, LocalStore, MemoryStore, ObjectInfo, S3Options, StorageOptions, Store, open_store

__all__ = [
    "AsyncOptions", "CheckpointInfo", "CheckpointManager", "CodecRules", "CopyPlan", "CopyResult", "DeltaOptions",
    "DistributedOptions", "ExportResult", "GCPlan", "GCResult", "KeepBest", "KeepDaily", "KeepEvery", "KeepIf", "KeepInterval",
    "KeepLast", "KeepWeekly", "LocalOptions", "LocalStore", "LossySafety", "MemoryStore", "ObjectInfo", "Policy",
    "Preempted", "PrunePlan", "PruneResult", "RestoreReport", "RestoredObject", "Retention", "RetentionInfo", "S3Options",
    "SaveHandle", "StorageOptions", "Store", "TensorInfo", "VerifyReport", "__version__", "copy_checkpoints", "errors",
    "export_checkpoint", "import_checkpoint", "load", "open_store", "rng_state", "save", "set_rng_state"
]

_SAVE_KEYWORDS = set(inspect.signature(CheckpointManager.save).parameters) - {"self", "step", "state"}
_RESTORE_KEYWORDS = set(inspect.signature(CheckpointManager.restore).parameters) - {"self", "step"}


def save(state: Any, url: Any, step: int, **options: Any) -> CheckpointInfo | None:
    """Save ``state`` as ``step`` into the vault at ``url``, wait until it is committed, and return its info.

    Takes every keyword of :meth:`CheckpointManager.save` (``metrics``, ``metadata``, ``overwrite``,
    ``allow_pickle``, ``progress``) and every keyword of :class:`CheckpointManager` (``codec_rules``,
    ``storage_options``, ``delta``, ``keyframe_every``, ...), except ``async_save``: this call is synchronous, as
    copying the state into staging memory first (or caching a keyframe for a manager that ends with the call) would
    only cost time and memory. For saves that return early, keep a :class:`CheckpointManager` open.
    """
    if "async_save" in options:
        raise errors.InvalidArgumentError("ckptvault.save() is synchronous and takes no async_save; for saves that "
                                          "return before they are written, use CheckpointManager(...).save()")
    save_kwargs = {k: options.pop(k) for k in _SAVE_KEYWORDS & set(options)}
    delta = options.get("delta")
    if isinstance(delta, DeltaOptions) and delta.cache_keyframe is None:
        options["delta"] = dataclasses.replace(delta, cache_keyframe=False)
    elif delta is None and "cache_keyframe" not in options:
        options["cache_keyframe"] = False  # the manager ends with this save: no later delta would use it
    with CheckpointManager(url, async_save=False, **options) as mgr:
        return mgr.save(step, state, **save_kwargs).wait()


def load(url: Any, step: int | None = None, **options: Any) -> Any:
    """Restore ``step`` (default: latest) from the vault at ``url``.

    Takes every keyword of :meth:`CheckpointManager.restore` (``into``, ``keys``, ``strict``, ``allow_pickle``,
    ``progress``) and the manager's ``storage_options`` and ``workers``.
    """
    pause_collector()  # first: the manager's set-up allocates too
    try:
        restore_kwargs = {k: options.pop(k) for k in _RESTORE_KEYWORDS & set(options)}
        unknown = sorted(set(options) - {"storage_options", "workers"})
        if unknown:
            raise TypeError(f"load() got an unexpected keyword argument {unknown[0]!r}: it takes the keywords of "
                            "CheckpointManager.restore plus storage_options and workers")
        with CheckpointManager(url, **options) as mgr:
            return mgr.restore(step, **restore_kwargs)
    finally:
        resume_collector()
