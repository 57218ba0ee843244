"""The local (POSIX file system) store: the embedded default.

Atomicity rests on three POSIX guarantees, which local disks and shared file
systems such as NFS (v3+), CephFS, Lustre and CFS provide:

* ``rename(2)`` within one directory tree replaces the target atomically;
* ``link(2)`` fails with EEXIST if the target exists (create-if-absent);
* ``fsync`` on a file and then on its directory makes both durable.

Every write goes to a uniquely named temporary file under ``<root>/tmp/``,
is fsynced, then renamed or linked into place, then the parent directory is
fsynced (where the write made folders for it, one ``syncfs`` makes all the new
names durable instead). A crash leaves at most stray files in ``tmp/``, never a
partial object under its final name.

A save's chunks go through a :class:`LocalWriteBatch` on Linux: each is
written to its temporary file without a sync, then at the end of the save one
``syncfs(2)`` makes all their data durable, each is linked into place, and a
second ``syncfs`` makes the links durable. An object still appears under its
final name only once its bytes are durable, and a save makes two file-system
syncs instead of two per chunk (figures: docs/benchmarks/core.md). ``syncfs``
reports write-back errors since Linux 5.8; elsewhere (and on older kernels)
chunks are synced one by one.

With ``direct_io`` (off by default) a batch writes each chunk with direct I/O
(``O_DIRECT``): its whole 4 KiB blocks go from a page-aligned buffer of the
writing thread straight to the device, and only the last partial block goes
through the page cache. A save then neither copies its bytes into the page
cache nor evicts the training job's cached files with them, but each chunk
writer waits for the device ("auto": on ext4 and XFS; True: wherever the file
system accepts it). Reads stay buffered.

A thread's first few reads of chunk objects (:meth:`LocalStore.get_transient`)
of :data:`MAP_FROM` bytes or more map the file read-only where the page cache
holds it whole (``mincore``) or where the thread's read buffer would be new
memory, and fault it in with one
``madvise(MADV_POPULATE_READ)`` (Linux 5.14+), which reports an I/O error as an
error: no copy out of the page cache and no fresh memory to fault in, which is
most of a small restore's cost in a new process. Later reads go into the
thread's buffer, faulted in by then, which a copy fills faster than a mapping
is set up and torn down; a file the disk must supply is read with ``read``,
whose large requests a mapping's faults do not match, once that buffer is there. A file
truncated from outside while it is mapped ends the process with SIGBUS
(ckptvault never rewrites an object; a delete leaves the mapping whole).

With ``drop_behind`` (on by default where ``posix_fadvise`` exists) what the
store writes leaves the page cache once it is durable or written back. A
single ``put`` drops its object right after the fsync. A batch drops its
chunks as it goes, all but the newest :data:`DROP_BEHIND_WINDOW` bytes
(``POSIX_FADV_DONTNEED`` drops only clean pages), and every one again once
the save is durable and visible, when all are clean. A save then holds about
that window of page cache (plus the chunks its threads are still writing and
what the device has not yet written back) instead of its whole size, evicts
far less of the training job's cached files (datasets), and recycles the same
few pages from chunk to chunk instead of faulting in new ones. The hint never
affects durability.
Reads stay cached: a delta save reads its keyframe's chunks once, then from
memory.

Symbolic links never take an operation out of the vault. On its first
operation the store refuses (:class:`UnsafeLinkError`) a vault whose ``tmp/``,
``chunks/``, ``manifests/``, ``pins/``, ``gc/`` or ``chunks/<xx>/`` folder is a
link leading outside it, unless it was opened with ``external_links=True``,
which makes those links' targets part of the vault. Every read, stat and touch
follows a link on an object file only to a file inside the vault (the file is
opened with ``O_NOFOLLOW``; a link is resolved and checked first), and checks
the folder holding it once per store. A delete resolves the folder it deletes
in every time, unlinks by name in the directory it opened and checked (so a
link removes the link, never its target), and never reaches outside the vault.
Writes go through ``tmp/`` and folders checked when the vault was opened, with
no check per chunk.
"""

from __future__ import annotations

import builtins
import ctypes
import errno
import logging
import mmap
import os
import platform
import stat
import sys
import threading
import uuid
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import numpy as np

from ..errors import (
    InvalidArgumentError,
    ObjectNotFoundError,
    PermanentStorageError,
    StorageError,
    StorageFullError,
    UnsafeLinkError,
)
from .base import ObjectInfo, Store, WriteBatch, check_size

log = logging.getLogger(__name__)

TMP_DIR = "tmp"
#: file systems where ``direct_io="auto"`` writes chunks with O_DIRECT (statfs magic numbers)
DIRECT_IO_FILE_SYSTEMS = {0xEF53: "ext4", 0x58465342: "xfs"}
#: O_DIRECT writes whole blocks of this size from a buffer aligned to it (covers 512 B and 4 KiB devices)
DIRECT_ALIGN = 4096
#: the most bytes one O_DIRECT write copies into the thread's aligned buffer
DIRECT_PIECE = 8 << 20
#: with drop_behind, the newest bytes of a save's chunks that may stay cached while it writes
DROP_BEHIND_WINDOW = 64 << 20
#: folders under the root whose links are checked when the store opens a vault (and each chunks/<xx>)
KEY_FOLDERS = (TMP_DIR, "chunks", "manifests", "pins", "gc")
#: how object files are opened for reading: a link on the file itself is never followed by open(2)
_OPEN_READ = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_OPEN_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
#: what open(O_NOFOLLOW) of a link fails with: ELOOP (Linux, macOS), EMLINK (FreeBSD)
_LINK_ERRNOS = (errno.ELOOP, errno.EMLINK)
_UNLINK_AT = os.unlink in os.supports_dir_fd
_UTIME_NOFOLLOW = os.utime in os.supports_follow_symlinks
#: what external_links covers, for messages
_LINKABLE = "tmp/, chunks/, chunks/<xx>/, manifests/, pins/ and gc/"


@dataclass(frozen=True)
class LocalOptions:
    """The storage options of a local vault (``storage_options=LocalOptions(...)``, or the same keys in a dict).

    ``direct_io``: how a save's chunks are written: False (the default) through the page cache, "auto" with
    O_DIRECT on ext4 and XFS, True with O_DIRECT on any file system that accepts it (one that refuses fails the
    save). ``drop_behind``: whether what the store writes leaves the page cache once it is on disk (module
    docstring); None (the default) means wherever ``posix_fadvise`` exists, True requires it.
    ``external_links``: whether the vault's key folders may be links leading outside its root
    (:class:`LocalStore`).
    """

    direct_io: bool | str = False
    drop_behind: bool | None = None
    external_links: bool = False

    def __post_init__(self) -> None:
        direct_io, drop_behind, external_links = self.direct_io, self.drop_behind, self.external_links
        if not (isinstance(direct_io, bool) or direct_io == "auto"):  # 1 and 0 are == True/False but not "is"
            raise InvalidArgumentError(f"direct_io must be true, false or 'auto', got {direct_io!r}")
        if direct_io is True and not hasattr(os, "O_DIRECT"):
            raise InvalidArgumentError(f"direct_io=True needs O_DIRECT, which {sys.platform} does not have; "
                                       "use direct_io='auto' or False")
        if drop_behind is not None and not isinstance(drop_behind, bool):
            raise InvalidArgumentError(f"drop_behind must be true or false, got {drop_behind!r}")
        if drop_behind and not _CAN_DROP:
            raise InvalidArgumentError(f"drop_behind=True needs posix_fadvise, which {sys.platform} does not have; "
                                       "leave drop_behind unset or pass False")
        if not isinstance(external_links, bool):
            raise InvalidArgumentError(f"external_links must be true or false, got {external_links!r}")

    @classmethod
    def from_dict(cls, options: Mapping[str, Any] | None) -> LocalOptions:
        """Options from a ``storage_options`` dict; unknown keys are an InvalidArgumentError naming the known ones."""
        options = dict(options or {})
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise InvalidArgumentError(f"unknown storage_options for local vaults: {unknown}; known: {known}")
        return cls(**options)


class LocalStore(Store):
    """Objects are files under ``root``; keys map to relative paths.

    No operation leaves the vault through a symbolic link (module docstring). ``external_links=True`` (the
    storage option of the same name) accepts ``tmp/``, ``chunks/``, ``manifests/``, ``pins/``, ``gc/`` and
    ``chunks/<xx>/`` folders that are links to folders outside the root (another disk): their targets then count
    as part of the vault, and reads and deletes inside them are allowed. Without it (the default) the first
    operation on such a vault raises UnsafeLinkError naming the link. Either way a link on a single object file
    that leads outside is never followed (reads, stats and touches of it raise UnsafeLinkError), and deleting
    such an object removes at most the link.
    """

    def __init__(self, root: str | os.PathLike[str], direct_io: bool | str = False,
                 drop_behind: bool | None = None, external_links: bool = False) -> None:
        """``direct_io``: how write batches (a save's chunks) write: False (the default) through the page
        cache, "auto" with O_DIRECT on ext4 and XFS, True with O_DIRECT on any file system that accepts it
        (one that refuses fails the save). ``drop_behind``: whether what the store writes leaves the page
        cache once it is on disk (module docstring); None (the default) means wherever ``posix_fadvise``
        exists, True requires it. ``external_links``: whether key folders may be links leading outside the
        root (class docstring)."""
        LocalOptions(direct_io, drop_behind, external_links)  # checks them
        self.root = Path(root).expanduser().absolute()
        self.url = str(self.root)
        self.direct_io = direct_io
        self.drop_behind = _CAN_DROP if drop_behind is None else drop_behind
        self._direct: bool | None = None  # decided at the first batch write, once the root exists
        self._made_dirs: set[Path] = set()
        self.external_links = external_links
        #: resolved folders that are the vault: the root and, with external_links, the targets of its folder links
        self._inside: tuple[str, ...] = (os.path.realpath(self.root),)
        self._layout_checked = False  # set by the first operation that finds the root (_check_layout)
        self._layout_lock = threading.Lock()
        self._safe_folders: set[str] = set()  # key folders ("chunks/ab") already found to resolve inside the vault

    @classmethod
    def from_options(cls, root: str, options: LocalOptions | Mapping[str, Any] | None) -> LocalStore:
        """A store for ``root`` with its :class:`LocalOptions` (or a dict of them; unknown keys are an error)."""
        opts = options if isinstance(options, LocalOptions) else LocalOptions.from_dict(options)
        return cls(root, opts.direct_io, opts.drop_behind, opts.external_links)

    def writes_direct(self) -> bool:
        """Whether write batches use O_DIRECT here (decides on first call; the root must exist)."""
        if self._direct is None:
            if self.direct_io is False or not hasattr(os, "O_DIRECT"):
                self._direct = False
            elif self.direct_io is True:
                self._direct = True
            else:
                self._direct = _file_system_type(self.root) in DIRECT_IO_FILE_SYSTEMS
        return self._direct

    # -- paths -----------------------------------------------------------
    def _path(self, key: str) -> Path:
        if not key or key.startswith("/") or ".." in key.split("/"):
            raise PermanentStorageError(f"invalid storage key {key!r}")
        return self.root / key

    # -- links -----------------------------------------------------------
    def _ready(self) -> None:
        """Check the vault's folder links once (:meth:`_check_layout`), at the first operation that finds the root."""
        if not self._layout_checked:
            with self._layout_lock:
                if not self._layout_checked:
                    self._check_layout()

    def _check_layout(self) -> None:
        """Raise UnsafeLinkError if a key folder (or chunks/<xx>) is a link leading outside the vault, unless
        ``external_links``, which adds its target to the vault. Until the root exists there is nothing to check:
        the folders a first save makes are real ones."""
        real_root = os.path.realpath(self.root)
        if not os.path.isdir(real_root):
            return
        inside = [real_root]
        for rel in self._folder_links():  # top folders first, so a chunks/<xx> link into a linked chunks/ is inside
            target = os.path.realpath(self.root / rel)
            if _within(target, inside):
                continue
            if not self.external_links:
                raise UnsafeLinkError(
                    f"{self.root / rel} is a symbolic link to {target}, outside the vault {self.root}: ckptvault "
                    f"refuses to read, write or delete through it (gc deletes old files in {rel}/). Replace the link "
                    "with the folder itself, or, if the vault is meant to span it, open the vault with "
                    "storage_options={'external_links': True} (CLI: ckptvault --storage-option external_links=true ...)")
            log.info("%s: %s links to %s, outside the root; part of the vault (external_links)", self.url, rel, target)
            inside.append(target)
        self._inside = tuple(inside)
        self._layout_checked = True

    def _folder_links(self) -> list[str]:
        """The key folders and chunks/<xx> fan-out folders (paths relative to the root) that are symbolic links."""
        links = [name for name in KEY_FOLDERS if os.path.islink(self.root / name)]
        try:
            with os.scandir(self.root / "chunks") as entries:
                links += [f"chunks/{entry.name}" for entry in entries if entry.is_symlink()]
        except (FileNotFoundError, NotADirectoryError):
            pass
        return links

    def _outside(self, folder: Path | str, real: str, what: str) -> UnsafeLinkError:
        """The error for ``what`` (an action on a key) through ``folder``, which resolves to ``real`` outside."""
        return UnsafeLinkError(
            f"{folder} leads to {real}, outside the vault {self.root}: ckptvault refuses to {what} through it. "
            f"Replace the link with the folder itself (external_links covers only {_LINKABLE} links)")

    def _check_folder(self, key: str, path: Path) -> None:
        """Raise UnsafeLinkError if the folder of ``key`` (at ``path``) resolves outside the vault; each folder is
        resolved once per store (reads and writes of thousands of chunks share a few hundred folders)."""
        folder = key.rpartition("/")[0]
        if folder in self._safe_folders:
            return
        real = os.path.realpath(path.parent)
        if not _within(real, self._inside):
            raise self._outside(path.parent, real, f"use {key!r}")
        self._safe_folders.add(folder)

    def _follow(self, key: str, path: Path) -> str:
        """Where the link at ``path`` (object ``key``) leads, if that is inside the vault; UnsafeLinkError if not."""
        real = os.path.realpath(path)
        if not _within(real, self._inside):
            raise UnsafeLinkError(
                f"{path} (object {key!r}) is a symbolic link to {real}, outside the vault {self.root}: ckptvault "
                "never follows a link on an object out of the vault (external_links covers folders only). Replace "
                "the link with a copy of the file it points to, or delete it")
        return real

    def _open_object(self, key: str) -> int:
        """A read-only descriptor of ``key``'s file. The file is opened with O_NOFOLLOW, so a link on it is
        followed only by resolving and checking it first (what was checked is what is read)."""
        self._ready()
        path = self._path(key)
        self._check_folder(key, path)
        try:
            return os.open(path, _OPEN_READ)
        except OSError as exc:
            if exc.errno not in _LINK_ERRNOS:
                raise
        return os.open(self._follow(key, path), _OPEN_READ)  # a link swapped in since the check fails with ELOOP

    def _lstat_object(self, key: str) -> tuple[Path | str, os.stat_result]:
        """The file behind ``key`` (a link inside the vault resolved; one leading outside refused) and its stat."""
        self._ready()
        path = self._path(key)
        self._check_folder(key, path)
        st = os.lstat(path)
        if not stat.S_ISLNK(st.st_mode):
            return path, st
        real = self._follow(key, path)
        return real, os.stat(real)

    def _open_folder(self, key: str, folder: Path) -> int | None:
        """A descriptor of ``folder`` to delete ``key`` in, once the directory it opened is found inside the vault
        (resolved at every call, never from a cache); None if there is no such folder (so no object)."""
        try:
            fd = os.open(folder, _OPEN_DIR)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            real = os.path.realpath(folder)
            if not _within(real, self._inside):
                raise self._outside(folder, real, f"delete {key!r}")
            if not os.path.samestat(os.fstat(fd), os.stat(real)):  # swapped between the open and the check
                raise UnsafeLinkError(f"{folder} changed while ckptvault checked where it leads; {key!r} was not deleted")
        except FileNotFoundError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _walk(self, folder: str, rel: str, trail: tuple[str, ...]) -> Iterator[tuple[str, os.stat_result]]:
        """(key, stat) of every object file under ``folder``, whose keys start with ``rel`` (``tmp/`` left out).
        ``trail``: the resolved folder the walk began in and those it entered through links (see :meth:`_walk_link`)."""
        try:
            with os.scandir(folder) as it:
                entries = list(it)
        except (FileNotFoundError, NotADirectoryError):
            return
        for entry in entries:
            key = f"{rel}/{entry.name}" if rel else entry.name
            if key == TMP_DIR:
                continue  # temporary files are not objects
            if entry.is_symlink():
                yield from self._walk_link(entry.path, key, trail)
            elif entry.is_dir(follow_symlinks=False):
                yield from self._walk(entry.path, key, trail)
            elif entry.is_file(follow_symlinks=False):
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # deleted while listed
                yield key, st

    def _walk_link(self, path: str, key: str, trail: tuple[str, ...]) -> Iterator[tuple[str, os.stat_result]]:
        """What :meth:`_walk` lists for the link ``path``: the folder it leads to, if inside the vault and neither
        on ``trail`` nor above it (so a link loop ends); the regular file it leads to, if inside; a link on a file
        outside as itself (its own size and time: reading it is refused)."""
        real = os.path.realpath(path)
        inside = _within(real, self._inside)
        if os.path.isdir(real):
            if inside and not any(_within(t, (real,)) for t in trail):
                yield from self._walk(path, key, (*trail, real))
            else:
                log.warning("%s: not listing %s, a link to %s (%s)", self.url, path, real,
                            "a folder this listing is already in" if inside else "outside the vault")
            return
        try:
            st = os.stat(real) if inside else os.lstat(path)
        except FileNotFoundError:
            return  # a dangling link is no object
        if stat.S_ISREG(st.st_mode) or not inside:
            yield key, st

    def _ensure_dir(self, path: Path) -> list[Path]:
        """Make folder ``path`` (and its parents); the folders this made, innermost first. Their names are not
        synced: a caller whose object must survive a crash makes them durable with it (:meth:`_sync_names`; a
        write batch's ``syncfs`` covers them)."""
        if path in self._made_dirs:
            return []
        with _classified(str(path)):
            missing = []
            folder = path
            while not folder.exists() and folder.parent != folder:
                missing.append(folder)
                folder = folder.parent
            path.mkdir(parents=True, exist_ok=True)
        self._made_dirs.add(path)
        return missing

    def _sync_names(self, folder: Path, made: list[Path]) -> None:
        """Make the name just linked into ``folder`` durable, and the names of the folders ``made`` for it: an
        fsync of ``folder`` alone, or where folders were made, one ``syncfs`` (where there is one) instead of an
        fsync of each folder that holds a new name."""
        if not made:
            _fsync_dir(folder)
        elif _syncfs is not None:
            _syncfs_at(self.root, self.url)
        else:
            for path in [folder, *(m.parent for m in made)]:
                _fsync_dir(path)

    def write_unsynced(self, parts: list[Any], final: Path) -> Path:
        """A new temp file for ``final`` holding the concatenated ``parts`` (buffers), written back but not
        synced (a write batch's chunk), with O_DIRECT where :meth:`writes_direct` says. Under "auto", a file
        system that refuses O_DIRECT gets buffered writes from then on; under True it fails with
        PermanentStorageError."""
        if self.writes_direct():
            try:
                return self._write_temp(parts, final, sync=False, direct=True)
            except _DirectIORefused as exc:
                if self.direct_io is True:
                    raise PermanentStorageError(
                        f"the file system of {self.url} refused a direct (O_DIRECT) write ({exc}); open the vault "
                        "with storage_options={'direct_io': 'auto'} or {'direct_io': False}") from None
                log.warning("%s refused a direct (O_DIRECT) write (%s); writing chunks through the page cache",
                            self.url, exc)
                self._direct = False
        return self._write_temp(parts, final, sync=False)

    def _write_temp(self, data: bytes | memoryview | list[Any], final: Path, sync: bool = True,
                    direct: bool = False) -> Path:
        """Write ``data`` (or the concatenation of a list of buffers) to a new temp file for ``final`` (named
        in errors, e.g. when space runs out), fsynced; with ``sync`` False, its write-back is only started
        (where the OS allows), so that a later ``syncfs`` finds most of it already on disk. ``direct``: write
        its whole blocks with O_DIRECT."""
        tmp_dir = self.root / TMP_DIR
        self._ensure_dir(tmp_dir)
        tmp = tmp_dir / f"{uuid.uuid4().hex}.part"
        parts = [memoryview(p).cast("B") for p in (data if isinstance(data, list) else [data])]
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        try:
            with _classified(str(final)):
                fd = _open_direct(tmp, flags) if direct else os.open(tmp, flags, 0o644)
                try:
                    if direct:
                        parts = _write_blocks_direct(fd, parts)
                    for view in parts:
                        while view:
                            written = os.write(fd, view)
                            view = view[written:]
                    if sync:
                        os.fsync(fd)
                        if self.drop_behind:  # clean now: the object's pages go at once
                            _drop_cached_fd(fd, tmp)
                    elif _start_writeback is not None:
                        _start_writeback(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)  # a hint: its result is not needed
                finally:
                    os.close(fd)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        return tmp

    def get_transient(self, key: str, max_size: int | None = None) -> memoryview:
        """The object's bytes, for a reader that is done with them (and with views of them) before this thread's
        next call. Of a thread's first :data:`MAPPED_READS` reads of :data:`MAP_FROM` bytes or more, those of
        objects the page cache holds whole, and any that this thread's read buffer is too small for, are mapped
        read-only, their pages faulted in with one call (:func:`_map_populated`): no copy, and no fresh memory to
        fault in, which a new buffer would need (slow, above all in a new process). Every other object is read into
        this thread's reusable read buffer, which, once faulted in, a copy fills faster than a mapping is set up and
        torn down."""
        with _classified(key), open(self._open_object(key), "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            check_size(self, key, size, max_size)
            large_reads = getattr(_buffers, "large_reads", 0)
            if size >= MAP_FROM and large_reads < MAPPED_READS:
                _buffers.large_reads = large_reads + 1
                held = getattr(_buffers, "read", None)
                mapped = _map_populated(f.fileno(), size, key, cold=held is None or len(held) < size)
                if mapped is not None:
                    return mapped
            buffer = _thread_buffer("read", size)
            got = 0
            while got < size:
                n = f.readinto(buffer[got:size])
                if not n:
                    break
                got += n
        return buffer[:got]

    # -- Store interface -------------------------------------------------
    def get(self, key: str, max_size: int | None = None) -> bytes:
        with _classified(key), open(self._open_object(key), "rb", buffering=0) as f:
            if max_size is not None:
                check_size(self, key, os.fstat(f.fileno()).st_size, max_size)
            return f.read()

    def get_range(self, key: str, start: int, length: int) -> bytes:
        with _classified(key), open(self._open_object(key), "rb") as f:
            f.seek(start)
            return f.read(length)

    def prefetch(self, keys: list[str]) -> None:
        """Ask the kernel to read the files of ``keys`` into the page cache in the background (``WILLNEED``): a
        restore that reads them later finds them there instead of waiting on the disk between its CPU work.
        Opened as :meth:`get` opens them (links checked); a key that cannot be opened is skipped."""
        if not _CAN_PREFETCH:
            return
        for key in keys:
            try:
                fd = self._open_object(key)
            except OSError:  # missing or unsafe (store errors are OSErrors): the read that follows reports it
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            except OSError as exc:
                log.debug("could not prefetch %s: %s", key, exc)
            finally:
                os.close(fd)

    def put(self, key: str, data: bytes | memoryview) -> None:
        final = self._checked_path(key)
        made = self._ensure_dir(final.parent)
        self._place(self._write_temp(data, final), final, made, overwrite=True)

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        if self.exists(key):
            return False
        final = self._path(key)
        made = self._ensure_dir(final.parent)
        return self._place(self._write_temp(data, final), final, made, overwrite=False)

    def _checked_path(self, key: str) -> Path:
        """The path of ``key``, its folder checked for links leading outside the vault."""
        final = self._path(key)
        with _classified(key):
            self._ready()
            self._check_folder(key, final)
        return final

    def _place(self, tmp: Path, final: Path, made: list[Path], overwrite: bool) -> bool:
        """Put synced temporary file ``tmp`` in place as ``final``: renamed over it (``overwrite``) or linked,
        create-if-absent (False: an object was there, and is left as it was); ``tmp`` is removed either way. The
        new name is made durable, with the names of the folders ``made`` for it (:meth:`_sync_names`)."""
        try:
            with _classified(str(final)):  # link(2) can fail with ENOSPC too (tmpfs counts links against inodes)
                if overwrite:
                    os.replace(tmp, final)
                    created = True
                else:
                    try:
                        os.link(tmp, final)
                        created = True
                    except FileExistsError:  # a concurrent writer won; inside _classified, which would wrap it
                        created = False
        finally:
            _unlink_quietly(tmp)  # after a rename, already gone
        if created or made:
            self._sync_names(final.parent, made)
        return created

    def write_batch(self) -> WriteBatch:
        return LocalWriteBatch(self) if _syncfs is not None else WriteBatch(self)

    def exists(self, key: str) -> bool:
        """True if ``key`` is a regular file (or a link to one inside the vault); UnsafeLinkError for a link
        leading outside, which must not pass for an object a save may reuse."""
        with _classified(key):
            try:
                _, st = self._lstat_object(key)
            except (FileNotFoundError, NotADirectoryError):
                return False
        return stat.S_ISREG(st.st_mode)  # a key prefix ("chunks") is a directory, not an object

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object file whose key starts with ``prefix`` (``tmp/`` left out). Folder links are followed
        only where they stay inside the vault; a link on a file leading outside is listed as itself (reading it
        is refused). UnsafeLinkError if the folder ``prefix`` names resolves outside the vault."""
        base_dir = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self.root / base_dir if base_dir else self.root
        with _classified(prefix or self.url):
            self._ready()
            real = os.path.realpath(start)
            if not os.path.isdir(real):
                return
            if not _within(real, self._inside):
                raise self._outside(start, real, f"list {prefix!r}")
        for key, st in self._walk(str(start), base_dir, (real,)):
            if key.startswith(prefix) and not key.startswith(TMP_DIR + "/"):  # list("tmp/") too: never objects
                yield ObjectInfo(key, st.st_size, st.st_mtime)

    def delete(self, key: str) -> None:
        """Remove ``key``'s file (a link: the link itself, never its target), and only inside the vault: the
        folder is opened and checked first (UnsafeLinkError if it resolves outside), then the name unlinked in it."""
        path = self._path(key)
        with _classified(key):
            self._ready()
            folder = self._open_folder(key, path.parent)
            if folder is None:
                return
            try:
                try:
                    if _UNLINK_AT:
                        os.unlink(path.name, dir_fd=folder)
                    else:  # no unlinkat here: the folder was checked just now by path
                        os.unlink(path)
                except FileNotFoundError:
                    return
                _fsync_fd(folder)
            finally:
                os.close(folder)

    def stat(self, key: str) -> ObjectInfo:
        """Size and mtime of ``key``'s file (of its target, for a link inside the vault; UnsafeLinkError outside)."""
        with _classified(key):
            _, st = self._lstat_object(key)
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def touch(self, key: str) -> None:
        """Set the mtime of ``key``'s file (of its target, for a link inside the vault; UnsafeLinkError outside)."""
        with _classified(key):
            target, _ = self._lstat_object(key)
            os.utime(target, follow_symlinks=not _UTIME_NOFOLLOW)  # a link swapped in since the check: the link's own

    def temp_files(self) -> builtins.list[ObjectInfo]:  # builtins.: in the class body, ``list`` is the method
        """Leftover temporary files of interrupted writes (invisible to :meth:`list`): the regular files in
        ``tmp/``; a folder or link there is nobody's temporary file."""
        with _classified(TMP_DIR):
            self._ready()
        try:
            with os.scandir(self.root / TMP_DIR) as it:
                entries = [entry for entry in it if entry.is_file(follow_symlinks=False)]
        except (FileNotFoundError, NotADirectoryError):
            return []
        out = []
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
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

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> Literal[False]:  # never swallows: returns False or raises another error
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

    :meth:`put_if_absent` (and :meth:`put_parts_if_absent`, which copies the parts straight to the file)
    returns after writing the temporary file; the object is invisible until
    :meth:`finish`, which syncs the file system, links every temporary file to its final name (an existing
    object with that name wins: it holds the same bytes), removes the temporary files and syncs again.
    :meth:`stage_final` writes its temporary file unsynced too, so the first sync makes its bytes durable;
    :meth:`publish_final` links (or renames) it into place and fsyncs its directory: three syncs for a save
    that writes chunks and its manifest, where a ``put`` of the manifest after the batch would make four.
    With the store's ``drop_behind``, chunks older than the newest :data:`DROP_BEHIND_WINDOW` bytes are
    dropped from the page cache as the batch goes (their clean pages), and all of them after the second sync.
    """

    def __init__(self, store: LocalStore) -> None:
        super().__init__(store)
        self.local = store
        self._pending: list[tuple[Path, Path]] = []
        self._lock = threading.Lock()
        self._cached: deque[tuple[Path, int]] = deque()  # written, not yet dropped (with drop_behind)
        self._cached_bytes = 0
        self._staged: tuple[Path, Path] | None = None  # stage_final's (temporary file, final path)
        self._staged_made = False  # whether stage_final made the staged object's folder

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        return self.put_parts_if_absent(key, [data])

    def put_parts_if_absent(self, key: str, parts: list[Any]) -> bool:
        if self.local.exists(key):
            return False
        final = self.local._path(key)
        tmp = self.local.write_unsynced(parts, final)
        with self._lock:
            self._pending.append((tmp, final))
        if self.local.drop_behind and not self.local.writes_direct():  # O_DIRECT cached at most a page: finish()
            self._drop_beyond_window(tmp, sum(memoryview(p).nbytes for p in parts))
        return True

    def _drop_beyond_window(self, written: Path, nbytes: int) -> None:
        """Note ``written``; drop the oldest noted files from the page cache while the rest exceed the window
        (what is still dirty stays cached until :meth:`finish` syncs it)."""
        with self._lock:
            self._cached.append((written, nbytes))
            self._cached_bytes += nbytes
            old = []
            while self._cached_bytes - self._cached[0][1] >= DROP_BEHIND_WINDOW:
                path, size = self._cached.popleft()
                self._cached_bytes -= size
                old.append(path)
        for path in old:
            _drop_cached(path)

    def stage_final(self, key: str, data: bytes) -> None:
        final = self.local._checked_path(key)
        made = self.local._ensure_dir(final.parent)  # named durably by finish()'s syncfs
        self._staged = (self.local._write_temp(data, final, sync=False), final)
        self._staged_made = bool(made)

    def finish(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            if self._staged_made:  # the new folder's name too
                self._sync()
            elif self._staged is not None:  # nothing else to sync: its fsync, not a sync of the whole file system
                with _classified(str(self._staged[1])):
                    _fsync_file(self._staged[0])
            return
        try:
            self._sync()  # the data of every temporary file (the staged one's too)
            for tmp, final in pending:
                self.local._ensure_dir(final.parent)
                with _classified(str(final)):
                    try:
                        os.link(tmp, final)
                    except FileExistsError:
                        pass  # a concurrent writer made it, with the same bytes (names are content hashes)
                    except FileNotFoundError:
                        if tmp.exists():
                            raise
                        raise ObjectNotFoundError(
                            f"the temporary file {tmp} of {final} was removed before the batch could link it into "
                            "place (by a gc whose grace period is shorter than this save?)") from None
            self._sync()  # the new names
            if self.local.drop_behind:  # once the save is visible: clean now, every page goes
                with self._lock:
                    self._cached, self._cached_bytes = deque(), 0
                for tmp, _final in pending:  # also the pages of chunks dropped while still dirty
                    _drop_cached(tmp)
        finally:
            for tmp, _final in pending:
                _unlink_quietly(tmp)

    def publish_final(self, overwrite: bool = False) -> bool:
        if self._staged is None:
            raise RuntimeError("publish_final() without stage_final(): nothing is staged")
        (tmp, final), self._staged = self._staged, None
        return self.local._place(tmp, final, [], overwrite)  # finish() synced its bytes and any new folder's name

    def abandon(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            self._cached, self._cached_bytes = deque(), 0
            staged, self._staged = self._staged, None
        for tmp, _final in pending + ([staged] if staged else []):
            _unlink_quietly(tmp)

    def _sync(self) -> None:
        _syncfs_at(self.local.root, self.local.url)


def _syncfs_at(root: Path, url: str) -> None:
    """``syncfs(2)`` of the file system holding ``root``; an error is classified as one of the store at ``url``."""
    assert _syncfs is not None
    with _classified(url):
        fd = os.open(root, os.O_RDONLY)
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
#: statfs(path, buf), to tell the file system type for direct_io="auto"
_statfs = _linux_call("statfs", [ctypes.c_char_p, ctypes.c_char_p], (2, 6))


#: objects of this size or more are read by mapping them where the page cache holds all of them
#: (:meth:`LocalStore.get_transient`); below it a read into a reused buffer costs less than setting up a mapping
MAP_FROM = 256 << 10
#: large reads a thread may map before it reads into its buffer: enough for a small state's few chunks, while a
#: large restore's many reads go through buffers that are faulted in by then
MAPPED_READS = 4
#: madvise(MADV_POPULATE_READ) (Linux 5.14+): faults a file mapping's pages in, reporting an I/O error as an
#: error instead of a SIGBUS at the first touch; it is what makes mapped reads safe, so without it there are none
_MADV_POPULATE_READ = 22
#: mincore(addr, length, vec): which pages of a mapping the page cache holds (wanted only with the advice above)
_mincore = _linux_call("mincore", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p], (5, 14))
_can_map = _mincore is not None and hasattr(mmap, "MAP_SHARED")


def _map_populated(fd: int, size: int, key: str, cold: bool = False) -> memoryview | None:
    """A read-only view of the open file ``fd``'s ``size`` bytes, mapped with every page in memory, if the page
    cache holds all of them or ``cold`` allows the disk to supply them; else None and the caller reads the file,
    as it does where mapped reads are not available (found once: then no later call tries). A file the disk must
    supply is mapped only where the caller's buffer would be new memory (``cold``): faults read a mapping in smaller
    pieces than one ``read`` of the file asks for, which costs less than faulting in a new buffer, not more than
    copying into a warm one. Such a file is asked for whole first (``WILLNEED``)."""
    global _can_map
    if not _can_map:
        return None
    try:
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    except OSError as exc:  # a file system that cannot map files
        log.debug("could not map %s (%s): reading it", key, exc)
        return None
    try:
        if cold:
            if _CAN_PREFETCH:
                os.posix_fadvise(fd, 0, size, os.POSIX_FADV_WILLNEED)
        elif not _all_cached(mapped, size):
            mapped.close()
            return None
        mapped.madvise(_MADV_POPULATE_READ)
    except OSError as exc:
        mapped.close()
        if exc.errno in (errno.EINVAL, errno.ENOSYS):  # a kernel without MADV_POPULATE_READ or mincore
            _can_map = False
        log.debug("could not map %s (%s): reading it", key, exc)
        return None
    return memoryview(mapped)


def _all_cached(mapped: mmap.mmap, size: int) -> bool:
    """Whether the page cache holds every page of the file ``mapped`` maps (``mincore(2)``)."""
    assert _mincore is not None
    pages = -(-size // mmap.PAGESIZE)
    resident = ctypes.create_string_buffer(pages)
    view = np.frombuffer(mapped, dtype=np.uint8)  # its address; released before the caller may close the map
    try:
        if _mincore(view.ctypes.data, size, resident) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
    finally:
        del view
    return bool((np.frombuffer(resident.raw, dtype=np.uint8) & 1).all())


_buffers = threading.local()


def _thread_buffer(name: str, nbytes: int) -> memoryview:
    """This thread's reusable buffer ``name``, at least ``nbytes`` long: an anonymous mmap, so page-aligned
    as O_DIRECT needs ("direct": the aligned write buffer; "read": :meth:`LocalStore.get_transient`'s)."""
    buffer = getattr(_buffers, name, None)
    if buffer is None or len(buffer) < nbytes:
        buffer = mmap.mmap(-1, max(nbytes, DIRECT_ALIGN))
        setattr(_buffers, name, buffer)
    return memoryview(buffer)


#: posix_fadvise and POSIX_FADV_WILLNEED exist here (Linux, most Unix; not macOS or Windows)
_CAN_PREFETCH = hasattr(os, "posix_fadvise") and hasattr(os, "POSIX_FADV_WILLNEED")
#: posix_fadvise and POSIX_FADV_DONTNEED exist here (Linux, most Unix; not macOS or Windows)
_CAN_DROP = hasattr(os, "posix_fadvise") and hasattr(os, "POSIX_FADV_DONTNEED")


def _drop_cached(path: Path) -> None:
    """Ask the kernel to drop ``path``'s clean pages from the page cache (dirty ones are left): a hint, so a
    failure is only logged."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        log.debug("could not drop %s from the page cache: %s", path, exc)
        return
    try:
        _drop_cached_fd(fd, path)
    finally:
        os.close(fd)


def _drop_cached_fd(fd: int, path: Path) -> None:
    """:func:`_drop_cached` of the file open as ``fd``."""
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError as exc:
        log.debug("could not drop %s from the page cache: %s", path, exc)


class _DirectIORefused(Exception):
    """The file system refused O_DIRECT (EINVAL on open or write)."""


def _open_direct(path: Path, flags: int) -> int:
    try:
        return os.open(path, flags | os.O_DIRECT, 0o644)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            _unlink_quietly(path)
            raise _DirectIORefused(f"open: {exc.strerror}") from None
        raise


def _write_blocks_direct(fd: int, parts: list[memoryview]) -> list[memoryview]:
    """Write the concatenated ``parts`` to ``fd`` (opened with O_DIRECT, at offset 0) in whole
    ``DIRECT_ALIGN`` blocks copied through this thread's aligned buffer, then clear O_DIRECT on ``fd``.
    Returns what is left to write through the page cache: the last partial block (and, after a short
    write, everything not yet written). Raises _DirectIORefused on EINVAL."""
    total = sum(len(p) for p in parts)
    capacity = min(DIRECT_PIECE, total - total % DIRECT_ALIGN)
    left: list[memoryview] = list(parts)
    if capacity:
        buffer, filled = _thread_buffer("direct", capacity), 0
        try:
            while left:
                n = min(len(left[0]), capacity - filled)
                buffer[filled : filled + n] = left[0][:n]
                filled += n
                left[0] = left[0][n:]
                if not left[0]:
                    left.pop(0)
                if filled == capacity:
                    written = os.write(fd, buffer[:filled])
                    if written != filled:  # a short write: the rest goes through the page cache
                        left.insert(0, memoryview(bytes(buffer[written:filled])))
                        break
                    filled = 0
            else:  # everything copied: write its whole blocks; the last partial one goes through the page cache
                whole = filled - filled % DIRECT_ALIGN
                written = os.write(fd, buffer[:whole]) if whole else 0
                left = [memoryview(bytes(buffer[written:filled]))] if filled > written else []
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                raise _DirectIORefused(f"write: {exc.strerror}") from None
            raise
    import fcntl  # POSIX only, like O_DIRECT itself

    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
    return left


def _file_system_type(path: Path) -> int | None:
    """The statfs(2) magic number of the file system holding ``path``, or None where it cannot be read."""
    if _statfs is None:
        return None
    buffer = ctypes.create_string_buffer(512)  # struct statfs is 120 bytes on 64-bit Linux; f_type comes first
    if _statfs(os.fsencode(path), buffer) != 0:
        return None
    return ctypes.c_long.from_buffer(buffer).value & 0xFFFFFFFF


def _within(real: str, bases: tuple[str, ...] | list[str]) -> bool:
    """Whether the resolved path ``real`` is one of the resolved folders ``bases`` or lies under one."""
    probe = real.rstrip(os.sep) + os.sep
    return any(probe.startswith(base.rstrip(os.sep) + os.sep) for base in bases)


def _fsync_fd(fd: int) -> None:
    """fsync a directory descriptor; a file system that cannot sync directories makes this a no-op."""
    try:
        os.fsync(fd)
    except OSError:
        pass


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
