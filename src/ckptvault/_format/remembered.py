"""A thread-safe memo of the last results by key, the least recently used dropped first: for results that are a
function of their key alone (a manifest's check, and maintenance's summary of it, by the manifest's bytes)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Remembered(Generic[K, V]):
    """The last ``keep`` values put, by key."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._lock = threading.Lock()
        self._found: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        with self._lock:
            value = self._found.get(key)
            if value is not None:
                self._found.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._found[key] = value
            while len(self._found) > self.keep:
                self._found.popitem(last=False)
