"""ckptvault: crash-safe, content-addressed, compressed checkpoints for PyTorch training.

Quick start::

    import ckptvault
    with ckptvault.CheckpointManager("./ckpts") as mgr:
        mgr.save(step, {"model": model.state_dict(), "optimizer": opt.state_dict()})
        state = mgr.restore()
"""

from __future__ import annotations

from . import errors
from ._version import __version__
from .handle import SaveHandle
from .info import CheckpointInfo, TensorInfo
from .manager import CheckpointManager

__all__ = ["CheckpointInfo", "CheckpointManager", "SaveHandle", "TensorInfo", "__version__", "errors", "load", "save"]


def save(state, url, step: int, **kwargs):  # type: ignore[no-untyped-def]
    """Save ``state`` as ``step`` into the vault at ``url`` and wait until committed.

    The save is synchronous: it returns once committed, so copying the state into
    staging memory first (or keeping a keyframe cache for a manager that ends
    with the call) would only cost time and memory. For saves that return early
    and for cached keyframes, keep a :class:`CheckpointManager` open.

    Keyword arguments are those of :meth:`CheckpointManager.save`, plus the
    manager's own (``codec``, ``codec_rules``, ``chunk_size``, ``storage_options``, ``on_unsafe``, ``max_flushed``).
    """
    manager_kwargs = {k: kwargs.pop(k) for k in ("codec", "codec_rules", "chunk_size", "storage_options", "workers",
                                                 "on_unsafe", "max_flushed") if k in kwargs}
    with CheckpointManager(url, async_save=False, **manager_kwargs) as mgr:
        return mgr.save(step, state, **kwargs).wait()


def load(url, step: int | None = None, **kwargs):  # type: ignore[no-untyped-def]
    """Restore ``step`` (default: latest) from the vault at ``url``; see :meth:`CheckpointManager.restore`."""
    manager_kwargs = {k: kwargs.pop(k) for k in ("storage_options", "workers") if k in kwargs}
    with CheckpointManager(url, **manager_kwargs) as mgr:
        return mgr.restore(step, **kwargs)
