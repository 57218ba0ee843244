"""Real local stores that make an asynchronous save slow or fail on purpose, for tests/test_async.py.

* :class:`GatedStore`: a LocalStore whose ``list`` and ``put_if_absent`` block, when called from any
  thread other than the one that created the store, until ``gate`` is set. A background save's first
  store call is ``list("manifests/")`` (choosing its delta base), made before it reads a byte of the
  staged state; so while the gate is closed a submitted save is deterministically in flight and has
  read nothing. The caller's thread is never blocked.
* :class:`QuotaStore`: a LocalStore with a byte quota on chunk objects. A chunk write that would
  exceed it fails the way a full disk does (ENOSPC, classified by LocalStore into StorageFullError).

Both store every object for real, on the local file system.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from ckptvault.errors import RetryableStorageError
from ckptvault.stores import LocalStore
from ckptvault.stores.base import ObjectInfo, WriteBatch
from ckptvault.stores.local import _classified

GATE_TIMEOUT = 60.0


class GatedStore(LocalStore):
    """LocalStore whose background-thread ``list``/``put_if_absent`` wait for ``gate`` (see the module docstring)."""

    def __init__(self, root: str | os.PathLike[str], timeout: float = GATE_TIMEOUT) -> None:
        super().__init__(root)
        self.gate = threading.Event()
        self.blocked = threading.Event()  # set once a background call waits at the closed gate
        self.timeout = timeout
        self._owner = threading.get_ident()

    def _pass_gate(self, what: str) -> None:
        if threading.get_ident() == self._owner or self.gate.is_set():
            return
        self.blocked.set()
        if not self.gate.wait(self.timeout):
            raise RetryableStorageError(f"test gate stayed closed for {self.timeout:.0f} s at {what}")

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        self._pass_gate(f"list({prefix!r})")
        return super().list(prefix)

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        self._pass_gate(f"put_if_absent({key!r})")
        return super().put_if_absent(key, data)

    def write_batch(self) -> WriteBatch:
        return WriteBatch(self)  # chunk writes through put_if_absent, at the gate


class QuotaStore(LocalStore):
    """LocalStore that holds at most ``quota`` bytes of new chunk objects (None: no limit)."""

    def __init__(self, root: str | os.PathLike[str], quota: int | None) -> None:
        super().__init__(root)
        self.quota = quota
        self.used = 0
        self.refused = 0  # chunk writes refused for lack of space
        self._lock = threading.Lock()

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        if key.startswith("chunks/"):
            size = memoryview(data).nbytes
            with self._lock:
                full = self.quota is not None and self.used + size > self.quota
                self.refused += full
                self.used += 0 if full else size
            if full:
                with _classified(str(Path(self.root, key))):  # the same error a full disk gives
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().put_if_absent(key, data)

    def write_batch(self) -> WriteBatch:
        return WriteBatch(self)  # chunk writes through put_if_absent, under the quota
