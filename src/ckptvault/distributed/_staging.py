"""Host copies of a distributed state for asynchronous saves, in buffers kept from one save to the next.

An asynchronous save may let training go on once every rank's tensors are copied: a DTensor's local shard, a plain
tensor, an array. :class:`HostStaging` makes that copy into host buffers it keeps, so a second save of a state of the
same layout allocates nothing (fresh memory is slow to fault in, as the single-process staging buffer shows).
Values other than tensors are deep-copied (they are small: steps, RNG states, configs).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.tensor import DTensor

#: a buffer's identity: key path, dtype and shape
BufferKey = tuple[str, torch.dtype, tuple[int, ...]]


class HostStaging:
    """Copies of states in reused host buffers. Not thread-safe: one staging at a time (the saver's order)."""

    def __init__(self) -> None:
        self._buffers: dict[BufferKey, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, state: Any) -> Any:
        """A copy of ``state`` (nested dicts, lists and tuples as they are) whose tensors live in this staging's
        buffers; a buffer the previous staging used for another layout is dropped."""
        used: dict[BufferKey, torch.Tensor] = {}
        staged = self._copy(state, "", used)
        self._buffers = used
        return staged

    def _copy(self, value: Any, path: str, used: dict[BufferKey, torch.Tensor]) -> Any:
        if isinstance(value, DTensor):
            local = self._tensor(value.to_local(), path, used)
            return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False,
                                      shape=value.size(), stride=value.stride())
        if isinstance(value, torch.Tensor):
            return self._tensor(value, path, used)
        if isinstance(value, dict):
            out = {key: self._copy(child, f"{path}.{key}", used) for key, child in value.items()}
            return out if type(value) is dict else _same_kind(value, out)
        if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
            items = [self._copy(child, f"{path}.{i}", used) for i, child in enumerate(value)]
            return type(value)(items) if type(value) in (list, tuple) else copy.deepcopy(value)
        return copy.deepcopy(value)

    def _tensor(self, tensor: torch.Tensor, path: str, used: dict[BufferKey, torch.Tensor]) -> torch.Tensor:
        key = (path, tensor.dtype, tuple(tensor.shape))
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        buffer.copy_(tensor.detach())
        used[key] = buffer
        if isinstance(tensor, torch.nn.Parameter):
            return torch.nn.Parameter(buffer, requires_grad=tensor.requires_grad)
        return buffer


def _same_kind(original: dict[Any, Any], items: dict[Any, Any]) -> dict[Any, Any]:
    """A dict subclass (an OrderedDict state dict, say) rebuilt with the staged items, its attributes kept."""
    out = copy.copy(original)
    out.clear()
    out.update(items)
    return out
