"""Host staging buffers for asynchronous saves.

An asynchronous save copies the state into one flat host buffer, after which
training may modify the state. The buffer is pinned (page-locked) once a state
holds CUDA tensors, so device-to-host copies run asynchronously; a state with
none gets ordinary memory, so a CPU-only job neither initialises CUDA nor locks
memory it does not need. The buffer is reused from save to save and grows only
when a state needs more room (or a pinned one when pinning is first needed), so
steady-state saves allocate nothing. Only one save uses the buffer at a time
(the saver guarantees it).

A :class:`SharedStaging` buffer lives in an anonymous shared-memory file instead, which a saver process maps through
the file descriptor it is sent (``_save/process.py``).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import tempfile
from typing import Any

import numpy as np
import torch

from .._arrays import ndarray_bytes, plain_cpu, tensor_bytes

log = logging.getLogger(__name__)

ALIGN = 64
#: CPU tensors from this size on are copied by torch on its intra-op threads, smaller ones byte by byte in this thread:
#: waking the intra-op threads costs more than copying a small tensor, and far more when they sleep between ops
PARALLEL_COPY = 1 << 20


def aligned_offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Offsets of each region, each aligned to 64 bytes, and the total size."""
    offsets, position = [], 0
    for size in sizes:
        offsets.append(position)
        position += -(-size // ALIGN) * ALIGN
    return offsets, position


class StagingBuffer:
    """A reusable flat uint8 host buffer."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._pinned = False  # kept here, not asked of torch: is_pinned() on a CUDA machine may initialise CUDA

    @property
    def capacity(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    @property
    def pinned(self) -> bool:
        """Whether the buffer holds pinned memory (False before the first save)."""
        return self._pinned

    def acquire(self, nbytes: int, pinned: bool = False) -> torch.Tensor:
        """The buffer, grown to at least ``nbytes`` (contents undefined); ``pinned``: it must be pinned memory
        (a pinned buffer also serves saves that do not need it)."""
        if self._buffer is None or self._buffer.numel() < nbytes or (pinned and not self._pinned):
            size = max(nbytes, self.capacity, 1)
            self._buffer = None  # free the old one before allocating the new
            log.debug("allocating %d bytes of %sstaging memory", size, "pinned " if pinned else "")
            self._buffer = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
            self._pinned = pinned
        return self._buffer

    def copy_in(self, values: list[tuple[str, Any]], sizes: list[int]) -> list[memoryview]:
        """Copy every (kind, value) into the buffer; return a byte view per value.

        CUDA tensors are copied with non-blocking copies and one
        synchronisation at the end per GPU they live on (not only the current
        one); tensors on other devices (mps, xpu, ...) with blocking copies.
        """
        offsets, total = aligned_offsets(sizes)
        buffer = self.acquire(total, pinned=any(kind == "torch" and value.device.type == "cuda" for kind, value in values))
        flat = buffer.numpy()
        start = buffer.data_ptr()
        gpus: set[torch.device] = set()
        views = []
        for (kind, value), offset, size in zip(values, offsets, sizes, strict=True):
            if not size:
                views.append(memoryview(b""))
                continue
            region = flat[offset : offset + size]
            if kind == "torch" and plain_cpu(value):  # as bytes: uint1..7/int1..7 have no copy kernel
                if size >= PARALLEL_COPY:  # faster than a plain copy when other processes load the CPU
                    source = np.frombuffer(tensor_bytes(value.detach()), dtype=np.uint8)
                    torch.from_numpy(region).copy_(torch.from_numpy(source))
                else:  # its memory holds exactly its bytes: copied from there, without making views of it
                    ctypes.memmove(start + offset, value.data_ptr(), size)
            elif kind == "torch":
                target = buffer[offset : offset + size].view(value.dtype).view(value.shape)
                cuda = value.device.type == "cuda"
                target.copy_(value.detach(), non_blocking=cuda)
                if cuda:
                    gpus.add(value.device)
            else:
                np.copyto(region, np.frombuffer(ndarray_bytes(value), dtype=np.uint8))
            views.append(region.data)
        for gpu in gpus:
            torch.cuda.synchronize(gpu)
        return views


class SharedStaging(StagingBuffer):
    """A staging buffer in shared memory: an anonymous memory file (``memfd``; elsewhere an unlinked temporary
    file) mapped here, whose descriptor :attr:`fd` another process maps to read the staged bytes.

    It is never page-locked (``pinned`` stays False): CUDA tensors are copied into it with blocking copies.
    :attr:`generation` changes whenever the buffer is replaced by a larger one, so a reader knows to map the new one.
    Nothing is left behind in any file system, whichever process exits first.
    """

    def __init__(self) -> None:
        super().__init__()
        self.fd: int | None = None
        self.generation = 0

    def acquire(self, nbytes: int, pinned: bool = False) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < nbytes:
            size = max(nbytes, self.capacity, 1)
            self._buffer = None  # unmapped once the last view of it is gone
            self.close()
            log.debug("allocating %d bytes of shared staging memory", size)
            self.fd = _memory_file(size)
            self._buffer = torch.frombuffer(mmap.mmap(self.fd, size), dtype=torch.uint8)
            self.generation += 1
        return self._buffer

    def close(self) -> None:
        """Close the descriptor (the mapping stays valid here and in every process that mapped it)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _memory_file(size: int) -> int:
    """The descriptor of a new ``size``-byte file that lives only in memory and has no name anyone can open."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("ckptvault-staging", os.MFD_CLOEXEC)
    else:  # not Linux: a temporary file, unlinked at once
        fd, path = tempfile.mkstemp(prefix="ckptvault-staging-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        os.unlink(path)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd
