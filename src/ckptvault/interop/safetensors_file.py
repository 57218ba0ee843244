"""The safetensors file format: a little-endian u64 header length, a JSON header, then the tensors' bytes.

The header maps each tensor's name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the
end of the header) plus an optional ``"__metadata__"`` of string keys and values. :func:`read_header` checks every
field before anything is mapped; :func:`map_tensors` gives tensors over a private memory map of the file (read
pages are page cache, not process memory); :func:`encode_header` lays out a file whose tensors are all aligned to
their element size (largest elements first, the header padded to 8 bytes, as the safetensors library writes).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import InvalidArgumentError

#: safetensors dtype names and their torch dtypes
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool, "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
#: the largest header read (the safetensors library refuses headers over 100 MB too)
MAX_HEADER = 100_000_000
METADATA_KEY = "__metadata__"


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: its bytes are [start, end) of the file (absolute offsets)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class Header:
    """A checked header: the tensors in file order and the ``__metadata__`` strings."""

    entries: list[Entry]
    metadata: dict[str, str]


def _bad(path: Path, why: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{path} is not a valid safetensors file: {why}")


def read_header(path: Path) -> Header:
    """The checked header of the safetensors file at ``path``; InvalidArgumentError saying what is wrong."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise _bad(path, f"it is {size} bytes, shorter than the 8-byte header length")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(MAX_HEADER, size - 8):
            raise _bad(path, f"the header length {length} exceeds the file ({size} bytes) or {MAX_HEADER} bytes")
        raw = f.read(length)
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise _bad(path, f"the header is not JSON ({exc})") from None
    if not isinstance(body, dict):
        raise _bad(path, "the header is not a JSON object")
    metadata = body.pop(METADATA_KEY, None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise _bad(path, f"{METADATA_KEY} must map strings to strings")
    data_start = 8 + length
    entries = sorted((_entry(path, name, spec, data_start, size) for name, spec in body.items()),
                     key=lambda e: (e.start, e.end))
    return Header(entries, metadata)


def _entry(path: Path, name: str, spec: object, data_start: int, size: int) -> Entry:
    """One header entry, checked: a known dtype, a shape of non-negative ints, offsets inside the file that hold
    exactly the tensor's bytes."""
    if not isinstance(spec, dict) or not {"dtype", "shape", "data_offsets"} <= set(spec):
        raise _bad(path, f"tensor {name!r} needs dtype, shape and data_offsets")
    dtype = DTYPES.get(spec["dtype"]) if isinstance(spec["dtype"], str) else None
    if dtype is None:
        raise _bad(path, f"tensor {name!r} has dtype {spec['dtype']!r}; known: {', '.join(DTYPES)}")
    shape, offsets = spec["shape"], spec["data_offsets"]
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise _bad(path, f"tensor {name!r} has shape {shape!r}, not a list of non-negative ints")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int for n in offsets)
            and 0 <= offsets[0] <= offsets[1] <= size - data_start):
        raise _bad(path, f"tensor {name!r} has data_offsets {offsets!r} outside the file's data")
    expected = math.prod(shape) * dtype.itemsize
    if offsets[1] - offsets[0] != expected:
        raise _bad(path, f"tensor {name!r} of dtype {spec['dtype']} and shape {shape} needs {expected} bytes, "
                         f"its data_offsets hold {offsets[1] - offsets[0]}")
    return Entry(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def map_tensors(path: Path, header: Header) -> dict[str, torch.Tensor]:
    """Name -> tensor over a private, copy-on-write memory map of the file, in file order (no tensor is copied;
    the pages read are page cache). The map stays open while any of the tensors lives."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if os.fstat(f.fileno()).st_size else None
    out = {}
    for e in header.entries:
        if e.end == e.start or mapped is None:  # frombuffer refuses zero elements
            out[e.name] = torch.empty(e.shape, dtype=e.dtype)
        else:
            out[e.name] = torch.frombuffer(mapped, dtype=e.dtype, count=math.prod(e.shape), offset=e.start).reshape(e.shape)
    return out


def encode_header(tensors: list[tuple[str, torch.dtype, tuple[int, ...]]],
                  metadata: dict[str, str]) -> tuple[bytes, list[int]]:
    """The file's first bytes (length + JSON header, padded to 8 bytes) and each tensor's absolute file offset,
    for tensors written in the order given (callers sort them by element size, largest first, so each is
    aligned). The caller writes tensor ``i``'s bytes at ``offsets[i]``."""
    body: dict[str, object] = {METADATA_KEY: metadata} if metadata else {}
    position, starts = 0, []
    for name, dtype, shape in tensors:
        nbytes = math.prod(shape) * dtype.itemsize
        body[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [position, position + nbytes]}
        starts.append(position)
        position += nbytes
    text = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-(8 + len(text)) % 8)
    head = struct.pack("<Q", len(text)) + text
    return head, [len(head) + s for s in starts]
