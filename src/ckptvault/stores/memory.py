"""An in-process store, for tests and ephemeral use (``memory://name``).

Stores with the same name share their objects within one process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from ..errors import ObjectNotFoundError
from .base import ObjectInfo, Store, check_size

_SHARED: dict[str, dict[str, tuple[bytes, float]]] = {}
_LOCKS: dict[str, threading.Lock] = {}  # one per name: put_if_absent must exclude every handle of that name
_SHARED_LOCK = threading.Lock()


class MemoryStore(Store):
    """A dict of immutable bytes guarded by one lock."""

    def __init__(self, name: str = "") -> None:
        self.url = f"memory://{name}"
        with _SHARED_LOCK:
            self._objects = _SHARED.setdefault(name, {})
            self._lock = _LOCKS.setdefault(name, threading.Lock())

    def get(self, key: str, max_size: int | None = None) -> bytes:
        try:
            data = self._objects[key][0]
        except KeyError:
            raise ObjectNotFoundError(f"no object {key!r} in {self.url}") from None
        check_size(self, key, len(data), max_size)
        return data

    def put(self, key: str, data: bytes | memoryview) -> None:
        with self._lock:
            self._objects[key] = (bytes(data), time.time())

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        with self._lock:
            if key in self._objects:
                return False
            self._objects[key] = (bytes(data), time.time())
            return True

    def exists(self, key: str) -> bool:
        return key in self._objects

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        with self._lock:
            items = [(k, len(v[0]), v[1]) for k, v in self._objects.items() if k.startswith(prefix)]
        for key, size, mtime in items:
            yield ObjectInfo(key, size, mtime)

    def delete(self, key: str) -> None:
        with self._lock:
            self._objects.pop(key, None)

    def touch(self, key: str) -> None:
        with self._lock:
            if key not in self._objects:
                raise ObjectNotFoundError(f"no object {key!r} in {self.url}")
            self._objects[key] = (self._objects[key][0], time.time())

    def stat(self, key: str) -> ObjectInfo:
        try:
            data, mtime = self._objects[key]
        except KeyError:
            raise ObjectNotFoundError(f"no object {key!r} in {self.url}") from None
        return ObjectInfo(key, len(data), mtime)
