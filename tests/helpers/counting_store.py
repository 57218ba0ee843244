"""A real local store that counts, per key, the bytes its reads hand out (tests/test_plane_delta.py,
tests/test_incremental.py). Optionally fails chunk writes on demand, the way a storage error would."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from ckptvault.errors import PermanentStorageError
from ckptvault.stores.base import WriteBatch
from ckptvault.stores.local import LocalStore


class CountingStore(LocalStore):
    """A LocalStore that counts the bytes ``get``/``get_range``/``get_transient`` return per key (``read``), and fails
    ``put_if_absent`` of chunk objects while ``fail_chunk_writes`` is set."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.read: dict[str, int] = {}
        self.fail_chunk_writes = False
        self._lock = threading.Lock()

    def _count(self, key: str, data: Any) -> Any:
        with self._lock:
            self.read[key] = self.read.get(key, 0) + len(data)
        return data

    def get(self, key: str, max_size: int | None = None) -> bytes:
        return self._count(key, super().get(key, max_size))

    def get_range(self, key: str, start: int, length: int) -> bytes:
        return self._count(key, super().get_range(key, start, length))

    def get_transient(self, key: str, max_size: int | None = None) -> memoryview:
        return self._count(key, super().get_transient(key, max_size))

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        if self.fail_chunk_writes and key.startswith("chunks/"):
            raise PermanentStorageError(f"injected failure writing {key}")
        return super().put_if_absent(key, data)

    def write_batch(self) -> WriteBatch:
        return WriteBatch(self)  # chunk writes through put_if_absent, where failures are injected

    def chunk_bytes_read(self) -> int:
        with self._lock:
            return sum(n for key, n in self.read.items() if key.startswith("chunks/"))
