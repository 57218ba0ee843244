"""The local (POSIX file system) store: the embedded default.

Atomicity rests on three POSIX guarantees, which local disks and shared file
systems such as NFS (v3+), CephFS, Lustre and CFS provide:

* ``rename(2)`` within one directory tree replaces the target atomically;
* ``link(2)`` fails with EEXIST if the target exists (create-if-absent);
* ``fsync`` on a file and then on its directory makes both durable.

Every write goes to a uniquely named temporary file under ``<root>/tmp/``,
is fsynced, then renamed or linked into place, then the parent directory is
fsynced. A crash leaves at most stray files in ``tmp/``, never a partial
object under its final name.

A save's chunks go through a :class:`LocalWriteBatch` on Linux: each is
written to its temporary file without a sync, then at the end of the save one
``syncfs(2)`` makes all their data durable, each is linked into place, and a
second ``syncfs`` makes the links durable. An object still appears under its
final name only once its bytes are durable, and a save of 1 GB in 4 MiB chunks
makes two file-system syncs instead of two per chunk (measured here: 160
chunks written in 0.43 s every time, against 0.52-2.17 s with a sync each).
``syncfs`` reports write-back errors since Linux 5.8; elsewhere (and on older
kernels) chunks are synced one by one.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

from ..errors import ObjectNotFoundError, PermanentStorageError, StorageError, StorageFullError
from .base import ObjectInfo, Store, WriteBatch

TMP_DIR = "tmp"


class LocalStore(Store):
    """Objects are files under ``root``; keys map to relative paths."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().absolute()
        self.url = str(self.root)
        self._made_dirs: set[Path] = set()

    # -- paths -----------------------------------------------------------
    def _path(self, key: str) -> Path:
        if not key or key.startswith("/") or ".." in key.split("/"):
            raise PermanentStorageError(f"invalid storage key {key!r}")
        return self.root / key

    def _ensure_dir(self, path: Path) -> None:
        if path in self._made_dirs:
            return
        with _classified(str(path)):
            path.mkdir(parents=True, exist_ok=True)
        self._made_dirs.add(path)

    def _write_temp(self, data: bytes | memoryview, final: Path, sync: bool = True) -> Path:
        """Write ``data`` to a new temp file for ``final`` (named in errors, e.g. when space runs out), fsynced;
        with ``sync`` False, its write-back is only started (where the OS allows), so that a later
        ``syncfs`` finds most of it already on disk."""
        tmp_dir = self.root / TMP_DIR
        self._ensure_dir(tmp_dir)
        tmp = tmp_dir / f"{uuid.uuid4().hex}.part"
        try:
            with _classified(str(final)):
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    view = memoryview(data).cast("B")
                    while view:
                        written = os.write(fd, view)
                        view = view[written:]
                    if sync:
                        os.fsync(fd)
                    elif _start_writeback is not None:
                        _start_writeback(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)  # a hint: its result is not needed
                finally:
                    os.close(fd)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        return tmp

    # -- Store interface -------------------------------------------------
    def get(self, key: str) -> bytes:
        path = self._path(key)
        with _classified(key):
            return path.read_bytes()

    def get_range(self, key: str, start: int, length: int) -> bytes:
        with _classified(key), open(self._path(key), "rb") as f:
            f.seek(start)
            return f.read(length)

    def put(self, key: str, data: bytes | memoryview) -> None:
        final = self._path(key)
        self._ensure_dir(final.parent)
        tmp = self._write_temp(data, final)
        try:
            with _classified(str(final)):
                os.replace(tmp, final)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        _fsync_dir(final.parent)

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        final = self._path(key)
        if final.exists():
            return False
        self._ensure_dir(final.parent)
        tmp = self._write_temp(data, final)
        try:
            with _classified(str(final)):  # link(2) can fail with ENOSPC too (tmpfs counts links against inodes)
                try:
                    os.link(tmp, final)
                    created = True
                except FileExistsError:  # a concurrent writer won; inside _classified, which would wrap it
                    created = False
        finally:
            _unlink_quietly(tmp)
        if created:
            _fsync_dir(final.parent)
        return created

    def write_batch(self) -> WriteBatch:
        return LocalWriteBatch(self) if _syncfs is not None else WriteBatch(self)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()  # a key prefix ("chunks") is a directory, not an object

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        base_dir = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self.root / base_dir if base_dir else self.root
        if not start.is_dir():
            return
        for dirpath, dirnames, filenames in os.walk(start):
            rel_dir = os.path.relpath(dirpath, self.root)
            if rel_dir == TMP_DIR:
                dirnames[:] = []
                continue
            for name in filenames:
                key = name if rel_dir == "." else f"{rel_dir}/{name}".replace(os.sep, "/")
                if key.startswith(prefix) and not key.startswith(TMP_DIR + "/"):
                    try:
                        st = os.stat(os.path.join(dirpath, name))
                    except FileNotFoundError:
                        continue
                    yield ObjectInfo(key, st.st_size, st.st_mtime)

    def delete(self, key: str) -> None:
        path = self._path(key)
        with _classified(key):
            try:
                path.unlink()
            except FileNotFoundError:
                return
        _fsync_dir(path.parent)

    def stat(self, key: str) -> ObjectInfo:
        with _classified(key):
            st = self._path(key).stat()
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def touch(self, key: str) -> None:
        with _classified(key):
            os.utime(self._path(key))

    def temp_files(self) -> list[ObjectInfo]:
        """Leftover temporary files of interrupted writes (invisible to :meth:`list`)."""
        tmp_dir = self.root / TMP_DIR
        if not tmp_dir.is_dir():
            return []
        out = []
        for entry in os.scandir(tmp_dir):
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue
            out.append(ObjectInfo(f"{TMP_DIR}/{entry.name}", st.st_size, st.st_mtime))
        return out


class _classified:
    """Context manager translating OSError into ckptvault's storage errors."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:  # type: ignore[no-untyped-def]
        if exc is None or not isinstance(exc, OSError) or isinstance(exc, StorageError):
            return False
        if isinstance(exc, FileNotFoundError):
            raise ObjectNotFoundError(f"no object {self.what!r} in the store") from exc
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            full = StorageFullError(
                f"no space left while writing {self.what!r}: {exc.strerror}. Committed checkpoints are intact; "
                "free space (for example `ckptvault rm` old steps, then `ckptvault gc`) and save again"
            )
            full.errno = exc.errno  # `except OSError as e: e.errno == ENOSPC` keeps working (not strerror: str() uses it)
            raise full from exc
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise PermanentStorageError(f"permission denied for {self.what!r}: {exc.strerror}") from exc
        raise StorageError(f"storage error on {self.what!r}: {exc}") from exc


class LocalWriteBatch(WriteBatch):
    """Chunks written unsynced to temporary files, then synced with one ``syncfs`` and linked into place.

    :meth:`put_if_absent` returns after writing the temporary file; the object is invisible until
    :meth:`finish`, which syncs the file system, links every temporary file to its final name (an existing
    object with that name wins: it holds the same bytes), removes the temporary files and syncs again.
    """

    def __init__(self, store: LocalStore) -> None:
        super().__init__(store)
        self.local = store
        self._pending: list[tuple[Path, Path]] = []
        self._lock = threading.Lock()

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        final = self.local._path(key)
        if final.exists():
            return False
        tmp = self.local._write_temp(data, final, sync=False)
        with self._lock:
            self._pending.append((tmp, final))
        return True

    def finish(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return
        try:
            self._sync()  # the data of every temporary file
            for tmp, final in pending:
                self.local._ensure_dir(final.parent)
                with _classified(str(final)):
                    try:
                        os.link(tmp, final)
                    except FileExistsError:
                        pass  # a concurrent writer made it, with the same bytes (names are content hashes)
            self._sync()  # the new names
        finally:
            for tmp, _final in pending:
                _unlink_quietly(tmp)

    def abandon(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for tmp, _final in pending:
            _unlink_quietly(tmp)

    def _sync(self) -> None:
        assert _syncfs is not None
        with _classified(self.local.url):
            fd = os.open(self.local.root, os.O_RDONLY)
            try:
                if _syncfs(fd) != 0:
                    code = ctypes.get_errno()
                    raise OSError(code, os.strerror(code))
            finally:
                os.close(fd)


def _linux_call(name: str, argtypes: list[type], minimum: tuple[int, int]):  # type: ignore[no-untyped-def]
    """libc's ``name`` with ``argtypes`` (returning int) on Linux ``minimum`` or later, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        release = tuple(int(x) for x in platform.release().split(".")[:2])
        call = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (ValueError, AttributeError, OSError):
        return None
    if release < minimum:
        return None
    call.argtypes, call.restype = argtypes, ctypes.c_int
    return call


#: syncfs(fd): reports write-back errors since Linux 5.8; without it, write batches are not used
_syncfs = _linux_call("syncfs", [ctypes.c_int], (5, 8))
#: sync_file_range(fd, offset, nbytes, flags), a hint used only alongside syncfs
_start_writeback = _linux_call("sync_file_range", [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint],
                               (5, 8))
_SYNC_FILE_RANGE_WRITE = 2  # start write-back of the dirty pages, without waiting


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
