"""The peers ckptvault is measured against, each as a save and a restore function.

Every save is durable when it returns: file data and the directory entry are
fsynced (DCP's FileSystemWriter fsyncs its files itself, ``sync_files=True``).
Every restore fills a preallocated target state in place, as resuming a
training job does: torch.load and safetensors load into new tensors and then
copy; DCP loads in place by design.
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from workloads import copy_flat_into, copy_into, flat_tensors

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def torch_save(state: Any, dest: Path) -> None:
    """torch.save to ``dest/state.pt``, then fsync file and directory."""
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / "state.pt"
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(dest)


def torch_load_copy(dest: Path, target: Any) -> None:
    """torch.load (weights_only) of ``dest/state.pt``, then copy every tensor into ``target``."""
    loaded = torch.load(dest / "state.pt", weights_only=True)
    copy_into(target, loaded)
    del loaded


def safetensors_save(state: Any, dest: Path) -> None:
    """safetensors.save_file of the state's tensors (tied ones once; no non-tensor leaves), then fsync."""
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / "state.safetensors"
    save_file(flat_tensors(state), str(path))
    fsync_file(path)
    fsync_dir(dest)


def safetensors_load_copy(dest: Path, target: Any) -> None:
    """safetensors.load_file, then copy every tensor into ``target``."""
    flat = load_file(str(dest / "state.safetensors"))
    copy_flat_into(target, flat)
    del flat


def dcp_save(state: Any, dest: Path) -> None:
    """torch.distributed.checkpoint.save with a FileSystemWriter (single process, no process group)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(dest), sync_files=True))
    fsync_dir(dest)


def dcp_load(dest: Path, target: Any) -> None:
    """torch.distributed.checkpoint.load in place into ``target``."""
    import torch.distributed.checkpoint as dcp

    dcp.load(target, storage_reader=dcp.FileSystemReader(str(dest)))


def ckptvault_save(state: Any, dest: Path, codec: str | None = None, step: int = 1, workers: int | None = None,
                   storage_options: dict | None = None) -> None:
    """A synchronous CheckpointManager.save into the vault at ``dest`` (its local store fsyncs every object)."""
    from ckptvault import CheckpointManager

    with CheckpointManager(dest, codec=codec, workers=workers, async_save=False, storage_options=storage_options) as mgr:
        mgr.save(step, state).wait()


def ckptvault_async_saves(state: Any, dest: Path, steps: tuple[int, ...] = (1, 2)) -> list[tuple[float, float]]:
    """Asynchronous saves (the default) of ``state`` as each of ``steps`` with one manager.

    Returns (seconds save() blocked the caller, seconds until durable) per
    step. The first save allocates the manager's staging buffer; later ones reuse it.
    """
    from ckptvault import CheckpointManager

    out = []
    with CheckpointManager(dest) as mgr:
        for step in steps:
            t0 = time.perf_counter()
            handle = mgr.save(step, state)
            blocked = time.perf_counter() - t0
            handle.wait()
            out.append((blocked, time.perf_counter() - t0))
    return out


def ckptvault_restore_into(dest: Path, target: Any, step: int = 1, workers: int | None = None) -> None:
    """CheckpointManager.restore(step, into=target): in place into preallocated tensors."""
    from ckptvault import CheckpointManager

    with CheckpointManager(dest, workers=workers) as mgr:
        mgr.restore(step, into=target)


def ckptvault_restore_new(dest: Path, step: int = 1, workers: int | None = None) -> Any:
    """CheckpointManager.restore(step): a new state in new tensors."""
    from ckptvault import CheckpointManager

    with CheckpointManager(dest, workers=workers) as mgr:
        return mgr.restore(step)


def disk_bytes(path: Path) -> int:
    """Bytes of every file under ``path`` (apparent sizes)."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
