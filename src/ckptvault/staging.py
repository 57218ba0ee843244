"""Host staging buffers for asynchronous saves.

An asynchronous save copies the state into one flat host buffer (pinned when
CUDA is available, so device-to-host copies run asynchronously), after which
training may modify the state. The buffer is reused from save to save and
grows only when a state needs more room, so steady-state saves allocate
nothing. Only one save uses the buffer at a time (the saver guarantees it).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from .arrays import ndarray_bytes, plain_cpu, tensor_bytes

log = logging.getLogger(__name__)

ALIGN = 64


def aligned_offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Offsets of each region, each aligned to 64 bytes, and the total size."""
    offsets, position = [], 0
    for size in sizes:
        offsets.append(position)
        position += -(-size // ALIGN) * ALIGN
    return offsets, position


class StagingBuffer:
    """A reusable flat uint8 host buffer."""

    def __init__(self, pin: bool | None = None) -> None:
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._buffer: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def acquire(self, nbytes: int) -> torch.Tensor:
        """The buffer, grown to at least ``nbytes`` (contents undefined)."""
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = None  # free the old one before allocating the new
            log.debug("allocating %d bytes of %sstaging memory", nbytes, "pinned " if self.pin else "")
            self._buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=self.pin)
        return self._buffer

    def copy_in(self, values: list[tuple[str, Any]], sizes: list[int]) -> list[memoryview]:
        """Copy every (kind, value) into the buffer; return a byte view per value.

        CUDA tensors are copied with non-blocking copies and one
        synchronisation at the end per GPU they live on (not only the current
        one); tensors on other devices (mps, xpu, ...) with blocking copies.
        """
        offsets, total = aligned_offsets(sizes)
        buffer = self.acquire(total)
        gpus: set[torch.device] = set()
        views = []
        for (kind, value), offset, size in zip(values, offsets, sizes, strict=True):
            region = buffer[offset : offset + size]
            if size and kind == "torch" and plain_cpu(value):  # as bytes: uint1..7/int1..7 have no copy kernel
                # torch's copy runs on the intra-op threads: ~1.2-2x np.copyto when other processes load the CPU
                region.copy_(torch.from_numpy(np.frombuffer(tensor_bytes(value.detach()), dtype=np.uint8)))
            elif size and kind == "torch":
                target = region.view(value.dtype).view(value.shape)
                cuda = value.device.type == "cuda"
                target.copy_(value.detach(), non_blocking=cuda)
                if cuda:
                    gpus.add(value.device)
            elif size:
                np.copyto(region.numpy(), np.frombuffer(ndarray_bytes(value), dtype=np.uint8))
            views.append(memoryview(region.numpy()) if size else memoryview(b""))
        for gpu in gpus:
            torch.cuda.synchronize(gpu)
        return views
