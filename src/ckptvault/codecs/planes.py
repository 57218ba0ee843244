"""Byte planes: split elements into byte planes and compress only the planes that pay.

For ``typesize`` t, plane k holds byte k of every element (a byte shuffle).
In floating point data the plane holding sign and exponent bits is highly
repetitive while low mantissa planes are noise; in XOR deltas of nearby
states, the high planes are mostly zero. Each plane is compressed with the
inner codec only if a sample of it shrinks and the whole plane then shrinks
by at least 5%; otherwise it is stored raw, which costs a copy instead of
an entropy coder's time. Bytes past the last whole element are stored raw.

Payload layout (little-endian)::

    u8      number of planes P (= typesize)
    P x u32 stored length of each plane; the high bit set means "compressed"
    ...     the P plane payloads, in order, then the raw tail bytes
"""

from __future__ import annotations

import struct
import threading

import numpy as np

from .base import BytesStage, Spec, stage_from_spec

_COMPRESSED = 1 << 31
SAMPLE = 64 << 10
KEEP_BELOW = 0.95

_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


class BytePlanes(BytesStage):
    id = "planes"

    def __init__(self, typesize: int, inner: BytesStage) -> None:
        if not 1 <= typesize <= 255:
            raise ValueError("typesize must be 1..255")
        self.typesize, self.inner = typesize, inner

    def encode(self, data: memoryview) -> bytes:
        arr = np.frombuffer(data, dtype=np.uint8)
        whole = len(arr) - len(arr) % self.typesize
        planes = arr[:whole].reshape(-1, self.typesize).T.copy()  # one transposed copy: ~3x faster than per-plane gathers
        sizes, parts = [], []
        for k in range(self.typesize):
            plane = planes[k]
            packed = self._compress(memoryview(plane))
            sizes.append(len(packed) | _COMPRESSED if packed is not None else plane.nbytes)
            parts.append(packed if packed is not None else plane)
        head = struct.pack(f"<B{self.typesize}I", self.typesize, *sizes)
        return b"".join([head, *parts, arr[whole:]])

    def _compress(self, plane: memoryview) -> bytes | memoryview | None:
        """The plane compressed, or None if compressing it does not pay."""
        if len(plane) > 4 * SAMPLE:
            middle = len(plane) // 2
            sample = plane[middle : middle + SAMPLE]
            if len(self.inner.encode(sample)) >= KEEP_BELOW * len(sample):
                return None
        packed = self.inner.encode(plane) if len(plane) else b""
        return packed if len(packed) < KEEP_BELOW * len(plane) else None

    def decode(self, data: memoryview, out_size: int) -> memoryview:
        count = data[0]
        sizes = struct.unpack_from(f"<{count}I", data, 1)
        if count != self.typesize:
            raise ValueError(f"payload has {count} planes, spec says {self.typesize}")
        plane_len = out_size // count
        position = 1 + 4 * count
        planes = []
        for size in sizes:
            length = size & ~_COMPRESSED
            chunk = data[position : position + length]
            plane = self.inner.decode(chunk, plane_len) if size & _COMPRESSED else chunk
            if len(plane) != plane_len:
                raise ValueError(f"plane decoded to {len(plane)} bytes, expected {plane_len}")
            planes.append(np.frombuffer(plane, dtype=np.uint8))
            position += length
        out = np.empty(out_size, dtype=np.uint8)
        _interleave(planes, out[: plane_len * count])
        tail = data[position:]
        if len(tail) != out_size - plane_len * count:
            raise ValueError("tail length does not match")
        out[plane_len * count :] = np.frombuffer(tail, dtype=np.uint8)
        return memoryview(out)

    def spec(self) -> Spec:
        return {"id": self.id, "typesize": self.typesize, "inner": self.inner.spec()}

    @classmethod
    def from_spec(cls, spec: Spec) -> BytePlanes:
        return cls(int(spec["typesize"]), stage_from_spec(spec["inner"]))


_local = threading.local()


def _scratch(nbytes: int) -> np.ndarray:
    """A per-thread reusable byte buffer of ``nbytes`` (a fresh one each call would page-fault every time)."""
    buffer = getattr(_local, "buffer", None)
    if buffer is None or buffer.nbytes < nbytes:
        buffer = _local.buffer = np.empty(nbytes, dtype=np.uint8)
    return buffer[:nbytes]


def _interleave(planes: list[np.ndarray], out: np.ndarray) -> None:
    """Write element i's byte k from ``planes[k][i]`` into ``out`` (the inverse shuffle).

    For 2-, 4- and 8-byte elements this assembles whole little-endian words
    with shifts, which numpy runs several times faster than a strided copy.
    """
    count = len(planes)
    if count == 1:
        out[:] = planes[0]
        return
    wide = _UINT.get(count)
    if wide is None:
        out.reshape(-1, count)[...] = np.stack(planes, axis=1)
        return
    words = out.view(wide)
    scratch = _scratch(words.nbytes).view(wide)
    words[...] = planes[count - 1]
    for k in range(count - 2, -1, -1):
        np.left_shift(words, 8, out=words)
        scratch[...] = planes[k]
        np.bitwise_or(words, scratch, out=words)
