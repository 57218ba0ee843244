"""An adapter store over any fsspec filesystem: ``gs://``, ``az://``, ``hdfs://``, ``sftp://``, ... .

URLs: a protocol fsspec knows and ckptvault does not (``gs://bucket/prefix``),
or ``fsspec+PROTO://...`` to force fsspec for a protocol ckptvault serves
natively (``fsspec+memory://name``, ``fsspec+file:///path``, ``fsspec+s3://...``
through s3fs). ``storage_options`` go to the fsspec filesystem.

Atomicity limits (docs/STORAGE.md says more):

* ``put``: on filesystems whose single-object writes are atomic (object
  stores: gs, az/abfs, s3 via s3fs, oss; and memory) the object is written in
  place. Elsewhere (file, hdfs, sftp, webhdfs, ...) it is written to
  ``tmp/<uuid>`` and renamed into place, which is atomic only where the
  filesystem's rename is (POSIX, HDFS).
* ``put_if_absent``: fsspec's ``pipe_file(mode="create")``, exclusive only where
  the backend implements it natively; the generic fallback is check-then-write.
  This adapter also serialises create-if-absent per key within one process,
  so threads of one process always see exactly one winner; across processes
  exactly-one-winner holds only for the local ``file`` protocol (hard link,
  as LocalStore) and for backends with a native exclusive create. Do not let
  two processes save into one vault through a filesystem without it.
* ``touch``: ``fs.touch(truncate=False)`` where supported; otherwise the object
  is rewritten with its own bytes, which sets its modification time.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator, Mapping
from datetime import datetime
from types import TracebackType
from typing import Any, Literal

from ..errors import InvalidArgumentError, ObjectNotFoundError, PermanentStorageError, StorageError
from .base import ObjectInfo, Store, check_size
from .local import _classified

TMP_DIR = "tmp"
#: protocols whose single-object writes are atomic, so put() needs no temp file + rename
ATOMIC_WRITE_PROTOCOLS = {"memory", "gs", "gcs", "az", "abfs", "abfss", "adl", "s3", "s3a", "oss", "r2"}

_KEY_LOCKS: dict[tuple[int, str], threading.Lock] = {}
_KEY_LOCKS_GUARD = threading.Lock()


class FsspecStore(Store):
    """Objects are files under ``root`` of an fsspec filesystem ``fs``."""

    def __init__(self, fs: Any, root: str, url: str | None = None) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        self.protocol = protocol
        self.url = url or f"fsspec+{protocol}://{self.root.lstrip('/') if protocol == 'memory' else self.root}"
        self._atomic_write = protocol in ATOMIC_WRITE_PROTOCOLS
        self._local = _is_local(fs)

    @classmethod
    def from_url(cls, url: str, storage_options: Mapping[str, Any] | None = None) -> FsspecStore:
        """A store for ``url`` (``fsspec+`` prefix optional); raises InvalidArgumentError if fsspec cannot serve it."""
        try:
            import fsspec
        except ImportError:
            raise InvalidArgumentError(f"{url} needs fsspec: pip install 'ckptvault[fsspec]'") from None
        target = url.removeprefix("fsspec+")
        try:
            fs, root = fsspec.core.url_to_fs(target, **(storage_options or {}))
        except (ImportError, ValueError, TypeError) as exc:  # unknown protocol, backend not installed, bad options
            raise InvalidArgumentError(f"fsspec cannot open {url}: {exc}") from exc
        except OSError as exc:  # the filesystem connects on creation (ftp, sftp, hdfs) and could not
            raise StorageError(f"cannot open {url} through fsspec: {exc}") from exc
        return cls(fs, root, url)

    # -- paths -----------------------------------------------------------
    def _path(self, key: str) -> str:
        if not key or key.startswith("/") or ".." in key.split("/"):
            raise PermanentStorageError(f"invalid storage key {key!r}")
        return f"{self.root}/{key}" if self.root else key

    def _key_lock(self, path: str) -> threading.Lock:
        with _KEY_LOCKS_GUARD:
            return _KEY_LOCKS.setdefault((id(self.fs), path), threading.Lock())

    # -- Store interface -------------------------------------------------
    def get(self, key: str, max_size: int | None = None) -> bytes:
        if max_size is not None:
            with _errors(key, self.url):
                size = self.fs.size(self._path(key))
            check_size(self, key, size, max_size)  # outside _errors, which would wrap it as a storage error
        with _errors(key, self.url):
            return bytes(self.fs.cat_file(self._path(key)))

    def get_range(self, key: str, start: int, length: int) -> bytes:
        path = self._path(key)
        with _errors(key, self.url):
            size = self.fs.size(path)
            if length <= 0 or start >= size:
                return b""
            return bytes(self.fs.cat_file(path, start=start, end=min(size, start + length)))

    def put(self, key: str, data: bytes | memoryview) -> None:
        path, body = self._path(key), _as_bytes(data)
        with _errors(key, self.url):
            if self._atomic_write:
                self.fs.pipe_file(path, body)
                return
            tmp = self._write_temp(body)
            try:
                self.fs.makedirs(self.fs._parent(path), exist_ok=True)
                self.fs.mv(tmp, path)
            except BaseException:
                self._remove_quietly(tmp)
                raise

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        path, body = self._path(key), _as_bytes(data)
        with self._key_lock(path), _errors(key, self.url):
            if self.fs.isfile(path):
                return False
            if self._local:
                return self._link_if_absent(body, path)
            if not self._atomic_write:  # the generic create is not atomic for readers: write aside, then rename
                self.put(key, body)
                return True
            try:
                self.fs.pipe_file(path, body, mode="create")
            except FileExistsError:
                return False
            return True

    def exists(self, key: str) -> bool:
        with _errors(key, self.url):
            return bool(self.fs.isfile(self._path(key)))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        base_dir = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self._path(base_dir) if base_dir else self.root
        with _errors(f"listing of {prefix!r}", self.url):
            try:
                found = self.fs.find(start, detail=True) if self.fs.isdir(start) else {}
            except FileNotFoundError:
                found = {}
        root = self.fs._strip_protocol(self.root).rstrip("/") if self.root else ""
        for path, info in found.items():
            key = path[len(root) + 1:] if root else path.lstrip("/")
            if info.get("type") == "file" and key.startswith(prefix) and not key.startswith(TMP_DIR + "/"):
                yield ObjectInfo(key, int(info.get("size") or 0), _mtime(info))

    def delete(self, key: str) -> None:
        with _errors(key, self.url):
            try:
                self.fs.rm_file(self._path(key))
            except FileNotFoundError:
                return

    def stat(self, key: str) -> ObjectInfo:
        path = self._path(key)
        with _errors(key, self.url):
            info = self.fs.info(path)
            if info.get("type") != "file":
                raise FileNotFoundError(path)
            mtime = _mtime(info)
            if mtime == 0.0:
                mtime = self.fs.modified(path).timestamp()
        return ObjectInfo(key, int(info.get("size") or 0), mtime)

    def touch(self, key: str) -> None:
        path = self._path(key)
        with _errors(key, self.url):
            if self._local:
                os.utime(self.fs._strip_protocol(path))
                return
            data = self.fs.cat_file(path)  # raises FileNotFoundError for a missing key; never creates one
            try:
                self.fs.touch(path, truncate=False)
            except NotImplementedError:
                self.put(key, data)

    # -- helpers ---------------------------------------------------------
    def _write_temp(self, body: bytes) -> str:
        tmp = self._path(f"{TMP_DIR}/{uuid.uuid4().hex}.part")
        self.fs.makedirs(self.fs._parent(tmp), exist_ok=True)
        self.fs.pipe_file(tmp, body)
        return tmp

    def _link_if_absent(self, body: bytes, path: str) -> bool:
        """Local filesystem: write a temp file, fsync it, hard-link it into place (EEXIST: another writer won)."""
        tmp = self.fs._strip_protocol(self._write_temp(body))
        final = self.fs._strip_protocol(path)
        try:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.makedirs(os.path.dirname(final), exist_ok=True)
            try:
                os.link(tmp, final)
            except FileExistsError:
                return False
            return True
        finally:
            self._remove_quietly(tmp)

    def _remove_quietly(self, path: str) -> None:
        try:
            self.fs.rm_file(path)
        except (OSError, NotImplementedError):
            pass


def _is_local(fs: Any) -> bool:
    try:
        from fsspec.implementations.local import LocalFileSystem
    except ImportError:
        return False
    return isinstance(fs, LocalFileSystem)


def _as_bytes(data: bytes | memoryview) -> bytes:
    return data if isinstance(data, bytes) else memoryview(data).cast("B").tobytes()


def _mtime(info: dict[str, Any]) -> float:
    """Modification time (seconds since the epoch) from an fsspec info dict; 0.0 when it has none."""
    for field in ("mtime", "LastModified", "last_modified", "updated", "modified", "created", "ctime"):
        value = info.get(field)
        if value is None:
            continue
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
        try:
            return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
        except ValueError:
            continue
    return 0.0


class _errors(_classified):
    """OSError -> ckptvault storage errors (as LocalStore); other backend exceptions -> StorageError."""

    def __init__(self, what: str, url: str) -> None:
        super().__init__(what)
        self.url = url

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> Literal[False]:  # never swallows: returns False or raises another error
        if exc is None or isinstance(exc, StorageError) or not isinstance(exc, Exception):
            return False
        if isinstance(exc, FileNotFoundError):
            raise ObjectNotFoundError(f"no object {self.what!r} in {self.url}") from exc
        if isinstance(exc, OSError):
            return super().__exit__(exc_type, exc, tb)
        raise StorageError(f"storage error on {self.what!r} in {self.url}: {exc}") from exc
