"""Byte shuffle: groups byte k of every element together.

For floating point data this puts the sign/exponent bytes of all elements next
to each other, where they are highly repetitive, and leaves the noisy mantissa
bytes in their own runs; a following entropy coder then compresses better.
Trailing bytes that do not fill a whole element are passed through.
"""

from __future__ import annotations

import numpy as np

from .base import BytesStage, Spec, int_setting
from .planes import MAX_TYPESIZE


class Shuffle(BytesStage):
    id = "shuffle"
    settings = frozenset({"typesize"})

    def __init__(self, typesize: int) -> None:
        if typesize < 1:
            raise ValueError("typesize must be >= 1")
        self.typesize = typesize

    def encode(self, data: memoryview) -> bytes | memoryview:
        if self.typesize == 1:
            return data
        arr = np.frombuffer(data, dtype=np.uint8)
        whole = len(arr) - len(arr) % self.typesize
        out = np.empty_like(arr)
        out[:whole].reshape(self.typesize, -1)[...] = arr[:whole].reshape(-1, self.typesize).T
        out[whole:] = arr[whole:]
        return out.data

    def decode(self, data: memoryview, out_size: int) -> bytes | memoryview:
        if len(data) != out_size:  # a shuffle keeps the length: refused before the output is allocated
            raise ValueError(f"shuffled payload of {len(data)} bytes, {out_size} expected")
        if self.typesize == 1:
            return data
        arr = np.frombuffer(data, dtype=np.uint8)
        whole = len(arr) - len(arr) % self.typesize
        out = np.empty_like(arr)
        out[:whole].reshape(-1, self.typesize)[...] = arr[:whole].reshape(self.typesize, -1).T
        out[whole:] = arr[whole:]
        return out.data

    def spec(self) -> Spec:
        return {"id": self.id, "typesize": self.typesize}

    @classmethod
    def from_spec(cls, spec: Spec) -> Shuffle:
        return cls(int_setting(spec, "typesize", 1, MAX_TYPESIZE))
