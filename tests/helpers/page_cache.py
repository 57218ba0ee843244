"""How much of a file the page cache holds: mincore(2) on a mapping that is never touched (Linux)."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def cached_pages(path: Path) -> int:
    """Pages of ``path`` in the page cache."""
    size = path.stat().st_size
    if not size:
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            vec = ctypes.create_string_buffer((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE)
            assert _libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
            return sum(byte & 1 for byte in vec.raw)
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def drops_observable(directory: Path) -> bool:
    """Whether files in ``directory`` stay in the page cache once written and leave it on POSIX_FADV_DONTNEED,
    as mincore shows (not on tmpfs, which keeps its pages, nor on file systems that cache nothing)."""
    probe = directory / ".page-cache-probe"
    probe.write_bytes(os.urandom(16 * mmap.PAGESIZE))
    try:
        fd = os.open(probe, os.O_RDONLY)
        try:
            os.fsync(fd)
            cached = cached_pages(probe)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return cached == 16 and cached_pages(probe) == 0
    finally:
        probe.unlink()
