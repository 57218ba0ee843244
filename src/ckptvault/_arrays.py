"""Raw little-endian byte views of tensors and arrays, and their inverse.

Stored bytes are the elements in C order, little-endian, no padding. A dtype
is recorded by name: ``torch`` dtypes as ``"float32"``, ``"bfloat16"``...;
numpy dtypes as their ``dtype.str`` (``"<f4"``, ``"|b1"``).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch

from .errors import FormatVersionError

if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
    raise ImportError("ckptvault supports little-endian hosts only")

_TORCH_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}


def address(buffer: bytes | memoryview) -> int:
    """The address of a buffer's first byte (of a non-empty one: an empty buffer's is arbitrary)."""
    return int(np.frombuffer(buffer, dtype=np.uint8).__array_interface__["data"][0])


def torch_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise FormatVersionError(f"torch dtype {name!r} is unknown to this torch {torch.__version__}") from None


def host_contiguous(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor with the same values (no copy when already so)."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous()


def plain_cpu(t: torch.Tensor) -> bool:
    """A CPU tensor whose memory holds exactly its values in C order (no conj/neg bit to resolve)."""
    return t.is_cpu and t.is_contiguous() and not t.is_conj() and not t.is_neg()


#: dtypes whose tensors ``Tensor.numpy()`` views as they are (bfloat16, float8, uint16...: through uint8 instead)
_NUMPY_VIEWABLE = frozenset({torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128, torch.bool,
                             torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})


def host_bytes(t: torch.Tensor) -> memoryview:
    """Bytes of a tensor's values in C order: a view of a CPU tensor whose memory holds them so, else of a
    contiguous host copy (:func:`host_contiguous`)."""
    fast = _numpy_bytes(t.detach()) if t.is_cpu else None
    return fast if fast is not None else tensor_bytes(host_contiguous(t))


def _numpy_bytes(t: torch.Tensor) -> memoryview | None:
    """The bytes of a CPU tensor through its numpy view (cheaper than the uint8 view :func:`tensor_bytes` falls back
    to); None where numpy has no such view: a dtype outside ``_NUMPY_VIEWABLE``, a grad, conj or neg bit, or a
    layout that is not C-contiguous."""
    if t.dtype not in _NUMPY_VIEWABLE or t.requires_grad or t.is_conj() or t.is_neg():
        return None
    array = t.numpy()
    if not array.flags.c_contiguous:
        return None
    return array.data.cast("B") if array.size else memoryview(b"")


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Bytes of a contiguous CPU tensor, without copying."""
    fast = _numpy_bytes(t)
    if fast is not None:
        return fast
    if t.numel() == 0:
        return memoryview(b"")
    # as_strided, not reshape: a "contiguous" tensor may have any stride on size-1 dims (x[::2][:1])
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8).numpy().data


def ndarray_bytes(a: np.ndarray) -> memoryview:
    """Little-endian C-order bytes of an array (copies only if needed)."""
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    a = np.ascontiguousarray(a)
    if a.size == 0:
        return memoryview(b"")
    return a.reshape(-1).view(np.uint8).data


def itemsize_of(kind: str, dtype: str) -> int:
    if kind == "torch":
        return torch_dtype(dtype).itemsize
    return np.dtype(dtype).itemsize


def empty_like_record(kind: str, dtype: str, shape: list[int]) -> Any:
    """A new, uninitialised tensor/array for a manifest record."""
    if kind == "torch":
        return torch.empty(shape, dtype=torch_dtype(dtype))
    if kind == "pickle":
        return np.empty(shape, dtype=np.uint8)
    return np.empty(shape, dtype=np.dtype(dtype).newbyteorder("<"))


def writable_bytes(value: Any) -> memoryview:
    """A writable byte view of a contiguous CPU tensor or array allocated by :func:`empty_like_record`."""
    if isinstance(value, torch.Tensor):
        return tensor_bytes(value)
    if value.size == 0:
        return memoryview(bytearray())
    return memoryview(value.reshape(-1).view(np.uint8))


def finish_ndarray(a: np.ndarray, dtype: str) -> np.ndarray:
    """Restore a big-endian dtype after reading little-endian bytes."""
    target = np.dtype(dtype)
    return a.astype(target) if target.byteorder == ">" else a
