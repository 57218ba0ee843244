"""Bytewise XOR of two buffers: how whole-chunk deltas (format version 1, still read) apply to their base."""

from __future__ import annotations

import numpy as np


def xor(data: bytes | memoryview, base: bytes | memoryview, in_place: bool = False) -> memoryview:
    """Bytewise XOR of two equal-length buffers (its own inverse).

    With ``in_place=True`` the result overwrites ``data`` if it is writable (only for a
    scratch buffer the caller owns, such as freshly decoded bytes); otherwise, and by
    default, it goes to a new buffer and neither input is modified.
    """
    a = np.frombuffer(data, dtype=np.uint8)
    b = np.frombuffer(base, dtype=np.uint8)
    if a.shape != b.shape:
        raise ValueError(f"delta and base differ in length ({a.size} vs {b.size})")
    wide = a.size - a.size % 8
    out = a if in_place and a.flags.writeable else np.empty_like(a)
    np.bitwise_xor(a[:wide].view(np.uint64), b[:wide].view(np.uint64), out=out[:wide].view(np.uint64))
    np.bitwise_xor(a[wide:], b[wide:], out=out[wide:])
    return out.data
