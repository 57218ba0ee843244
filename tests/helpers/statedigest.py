"""A digest of a nested training state that any process can compute and compare.

Kept free of side effects (no torch settings) so tests can import it by path.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch


def state_digest(state: Any) -> str:
    """SHA-256 over every value of a nested state, in key order, with types, dtypes and shapes."""
    h = hashlib.sha256()
    for path, kind, data in _walk(state, ""):
        h.update(f"{path}\0{kind}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def _walk(value: Any, path: str) -> Iterator[tuple[str, str, bytes]]:
    if isinstance(value, dict):
        yield path, f"{type(value).__name__}[{len(value)}]", b""
        for key, item in value.items():
            yield from _walk(item, f"{path}/{key!r}")
    elif isinstance(value, (list, tuple)):
        yield path, f"{type(value).__name__}[{len(value)}]", b""
        for index, item in enumerate(value):
            yield from _walk(item, f"{path}/{index}")
    elif isinstance(value, torch.Tensor):
        flat = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        yield path, f"torch:{value.dtype}:{tuple(value.shape)}", flat.numpy().tobytes()
    elif isinstance(value, np.ndarray):
        yield path, f"numpy:{value.dtype.str}:{value.shape}", np.ascontiguousarray(value).tobytes()
    else:
        yield path, type(value).__name__, repr(value).encode()


