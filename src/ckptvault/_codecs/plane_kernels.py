"""Byte-plane kernels (numba): split 2-, 4- and 8-byte elements into byte planes, and join planes back.

numpy needs one pass per plane plus a cast for each; these loops read each element once and write each byte
once, several times faster (figures: docs/benchmarks/core.md). Every save splits each chunk it encodes, and
every restore (and every delta save, to check its base) joins each chunk it decodes.

Contract: ``split(words, planes)`` writes byte k of ``words[i]`` (little-endian) to ``planes[k, i]``;
``join(planes, words)`` is its inverse. ``words`` is a 1-D unsigned array of 2, 4 or 8 bytes per element,
``planes`` a C-contiguous ``typesize x len(words)`` uint8 array (for ``join``, a sequence of ``typesize``
uint8 arrays). The kernels release the GIL, compile on first use and are cached on disk by numba.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypedDict

import numpy as np
from numba import njit


class _Options(TypedDict):  # typed, so that njit(**_OPTIONS) is checked against njit's keyword arguments
    nogil: bool
    cache: bool
    boundscheck: bool


_OPTIONS: _Options = {"nogil": True, "cache": True, "boundscheck": False}


@njit(**_OPTIONS)
def _split2(words, planes):  # type: ignore[no-untyped-def]
    for i in range(words.size):
        w = words[i]
        planes[0, i] = np.uint8(w & np.uint16(0xFF))
        planes[1, i] = np.uint8(w >> np.uint16(8))


@njit(**_OPTIONS)
def _split4(words, planes):  # type: ignore[no-untyped-def]
    for i in range(words.size):
        w = words[i]
        planes[0, i] = np.uint8(w & np.uint32(0xFF))
        planes[1, i] = np.uint8((w >> np.uint32(8)) & np.uint32(0xFF))
        planes[2, i] = np.uint8((w >> np.uint32(16)) & np.uint32(0xFF))
        planes[3, i] = np.uint8(w >> np.uint32(24))


@njit(**_OPTIONS)
def _split8(words, planes):  # type: ignore[no-untyped-def]
    for i in range(words.size):
        w = words[i]
        for k in range(8):
            planes[k, i] = np.uint8((w >> np.uint64(8 * k)) & np.uint64(0xFF))


@njit(**_OPTIONS)
def _join2(p0, p1, words):  # type: ignore[no-untyped-def]
    for i in range(words.size):
        words[i] = np.uint16(p0[i]) | np.uint16(np.uint16(p1[i]) << np.uint16(8))


@njit(**_OPTIONS)
def _join4(p0, p1, p2, p3, words):  # type: ignore[no-untyped-def]
    for i in range(words.size):
        words[i] = (np.uint32(p0[i]) | (np.uint32(p1[i]) << np.uint32(8))
                    | (np.uint32(p2[i]) << np.uint32(16)) | (np.uint32(p3[i]) << np.uint32(24)))


@njit(**_OPTIONS)
def _join8(p0, p1, p2, p3, p4, p5, p6, p7, words):  # type: ignore[no-untyped-def]
    for i in range(words.size):
        words[i] = (np.uint64(p0[i]) | (np.uint64(p1[i]) << np.uint64(8)) | (np.uint64(p2[i]) << np.uint64(16))
                    | (np.uint64(p3[i]) << np.uint64(24)) | (np.uint64(p4[i]) << np.uint64(32))
                    | (np.uint64(p5[i]) << np.uint64(40)) | (np.uint64(p6[i]) << np.uint64(48))
                    | (np.uint64(p7[i]) << np.uint64(56)))


_SPLIT = {2: _split2, 4: _split4, 8: _split8}
_JOIN: dict[int, Callable[..., object]] = {2: _join2, 4: _join4, 8: _join8}  # 2, 4 or 8 planes, then words


def split(words: np.ndarray, planes: np.ndarray) -> None:
    """Byte k of each element of ``words`` into row k of ``planes`` (``words.itemsize`` rows)."""
    _SPLIT[words.itemsize](_readonly(words), planes)


def join(planes: Sequence[np.ndarray], words: np.ndarray) -> None:
    """Inverse of :func:`split`: element i of ``words`` from byte i of each plane."""
    _JOIN[words.itemsize](*(_readonly(p) for p in planes), words)


def _readonly(array: np.ndarray) -> np.ndarray:
    """A read-only view: numba compiles (and caches) one version per argument type, and inputs come both
    writable (staging buffers, decoded planes) and read-only (bytes); one type for both keeps it to one."""
    view = array.view()
    view.flags.writeable = False
    return view
