"""Byte planes: split elements into byte planes and compress only the planes that pay.

For ``typesize`` t, plane k holds byte k of every element (a byte shuffle).
In floating point data the plane holding sign and exponent bits is highly
repetitive while low mantissa planes are noise; in XOR deltas of nearby
states, the high planes are mostly zero. Each plane is compressed with the
inner codec only if a sample of it (8 pieces spread over the plane) shrinks
and the whole plane then shrinks by at least 5%; otherwise it is stored raw, which costs a copy instead of
an entropy coder's time. Bytes past the last whole element are stored raw.

Payload layout (little-endian)::

    u8      number of planes P (= typesize)
    P x u32 stored length of each plane; the high bit set means "compressed";
            bit 30 set means "XOR with the base's plane" (``xplanes`` deltas only)
    ...     the P plane payloads, in order, then the raw tail bytes
"""

from __future__ import annotations

import bisect
import itertools
import logging
import struct
import sys
import threading
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from .base import BytesStage, Spec, int_setting, stage_from_spec

_Planes = TypeVar("_Planes", bound="BytePlanes")

log = logging.getLogger(__name__)

_kernels: Any = None  # the plane_kernels module once imported and ready, False where numba is missing

#: bytes the numpy loops may split and join in a process before the kernels are loaded, in the background
LOAD_AFTER = 256 << 20
_numpy_bytes = 0  # bytes split or joined by the numpy loops so far (approximate: counted without a lock)


def _plane_kernels() -> Any:
    """``plane_kernels``, imported now (importing numba is slow), or None without numba: the numpy loops below
    do the same, several times slower. For callers that want the kernels at once (tests, benchmarks); the
    split and join paths use :func:`_ready_kernels`, which never waits for numba."""
    global _kernels
    if _kernels is None:
        try:
            from . import plane_kernels as kernels
        except ImportError:
            _kernels = False
        else:
            _kernels = kernels
    return _kernels or None


def _ready_kernels(nbytes: int) -> Any:
    """``plane_kernels`` if it is loaded, else None (use the numpy loops), counting ``nbytes`` towards
    :data:`LOAD_AFTER`: a split or join never waits for numba, nor starts loading it (see :func:`load_if_worth_it`)."""
    global _numpy_bytes
    kernels = _kernels
    if kernels is not None:
        return kernels or None
    _numpy_bytes += nbytes
    return None


def kernels_ready() -> bool:
    """Whether the kernels are loaded (so numba is imported): other numba kernels are then cheap to add."""
    return bool(_kernels)


def load_if_worth_it() -> threading.Thread | None:
    """Start :func:`load_kernels_in_background` if the kernels now pay for their loading; returns its thread, or None.

    The kernels save 0.2 to 0.5 s per GiB saved, and loading them costs about 0.7 s of CPU, most of it
    holding the GIL, and 100 MB of memory (figures: docs/benchmarks/small.md). So they are loaded once the numpy
    loops of this process have split or joined :data:`LOAD_AFTER` bytes, or if numba is imported already (a lossy
    codec loaded it): small states are saved and restored without importing numba. Called between saves and
    restores (a manager calls it after each commit and each restore), where the loading thread contends with no
    save for the GIL; splits and joins use the kernels once every one is loaded."""
    if _kernels is not None or (_numpy_bytes < LOAD_AFTER and "numba" not in sys.modules):
        return None
    return load_kernels_in_background()


_loading: threading.Thread | None = None  # the thread load_kernels_in_background started
_loading_lock = threading.Lock()


def load_kernels_in_background() -> threading.Thread | None:
    """Import ``plane_kernels`` and load every split and join kernel on a daemon thread; returns the thread,
    or None where that was started before (once per process), the module is imported already, or numba is
    missing. Splits and joins use the kernels once all are loaded, the numpy loops until then.

    The first use of the kernels in a process imports numba and loads their compiled code from numba's
    cache, which takes a while and mostly holds the GIL: a caller that will save or restore a large state
    can start it early, well before its first save. Safe to call any number of times, from any thread."""
    global _loading
    with _loading_lock:
        if _kernels is not None or _loading is not None:
            return None
        _loading = threading.Thread(target=_load_kernels, name="ckptvault-load-kernels", daemon=True)
        _loading.start()
        return _loading


def wait_for_kernel_loading() -> None:
    """Return once the thread :func:`load_kernels_in_background` started (if any) has finished, so that no
    thread is left importing numba while the interpreter exits."""
    thread = _loading
    if thread is not None and thread is not threading.current_thread():
        thread.join()


def _load_kernels() -> None:
    """Import ``plane_kernels`` and call every kernel once (each element size is its own compiled kernel,
    loaded from numba's cache on its first call); only then publish the module to the split and join paths."""
    global _kernels
    try:
        from . import plane_kernels as kernels
    except ImportError:
        _kernels = False
        return
    try:
        for wide in _UINT.values():
            words, planes = np.zeros(1, wide), np.zeros((np.dtype(wide).itemsize, 1), np.uint8)
            kernels.split(words, planes)
            kernels.join(list(planes), words)
    except Exception as exc:  # noqa: BLE001 - a broken numba cache or compiler: the numpy loops stay in use
        log.warning("could not load the byte-plane kernels (%s: %s); using the numpy loops", type(exc).__name__, exc)
        _kernels = False
        return
    _kernels = kernels


_COMPRESSED = 1 << 31
XOR_BASE = 1 << 30
_LENGTH = XOR_BASE - 1
SAMPLE = 64 << 10
PIECES = 8
KEEP_BELOW = 0.95

_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
#: the element sizes a planes payload holds: its table counts the planes in one byte
MAX_TYPESIZE = 255

#: a piece of a payload as :meth:`BytePlanes.pack_parts` returns it, for ``b"".join`` or a store to write
Buffer = bytes | memoryview


@dataclass(frozen=True)
class PlaneEntry:
    """Where one stored plane lies in a payload, and how it is stored."""

    offset: int
    length: int
    compressed: bool
    xor: bool


@dataclass(frozen=True)
class StoredPlane:
    """One plane as it goes into a payload: bytes plus flags."""

    data: bytes | memoryview
    compressed: bool = False
    xor: bool = False


def split_planes(data: bytes | memoryview, typesize: int, out: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(planes, tail): a C-contiguous ``typesize x n`` array of byte planes, and the bytes past the last element.

    ``out``: where to put the planes (at least ``typesize * n`` bytes; e.g. a :func:`scratch` buffer when
    the planes are consumed before the thread splits again); default: new memory.
    """
    arr = np.frombuffer(data, dtype=np.uint8)
    count = len(arr) // typesize
    whole = count * typesize
    planes = np.empty((typesize, count), np.uint8) if out is None else out[:whole].reshape(typesize, count)
    wide = _UINT.get(typesize)
    if wide is None:
        planes[...] = arr[:whole].reshape(-1, typesize).T
        return planes, arr[whole:]
    words = arr[:whole].view(wide)  # plane k is byte k of each little-endian word
    kernels = _ready_kernels(whole)
    if kernels is not None:
        kernels.split(words, planes)
    else:
        _split_numpy(words, planes)
    return planes, arr[whole:]


#: elements per block of the numpy join: its temporaries stay in the CPU's cache (and need no fresh memory)
NUMPY_BLOCK = 1 << 15
#: elements per block of the numpy split. Larger: each numpy call releases the GIL and takes it back, and a save
#: splits chunks on several threads that contend for it, where fewer, longer calls wait less in all
SPLIT_BLOCK = 1 << 18


def _split_numpy(words: np.ndarray, planes: np.ndarray) -> None:
    """What ``plane_kernels.split`` does, with numpy: per block of :data:`SPLIT_BLOCK` words, shift, then
    truncate into each plane."""
    shifted = scratch(min(len(words), SPLIT_BLOCK) * words.itemsize, "split").view(words.dtype)
    for lo in range(0, len(words), SPLIT_BLOCK):
        block = words[lo : lo + SPLIT_BLOCK]
        rows, tmp = planes[:, lo : lo + len(block)], shifted[: len(block)]
        rows[0] = block
        for k in range(1, words.itemsize):
            np.right_shift(block, 8 * k, out=tmp)
            rows[k] = tmp


def plane_table(payload: bytes | memoryview, typesize: int, raw_size: int | None = None) -> tuple[list[PlaneEntry], int]:
    """The entries of a planes payload's table, and where the tail starts. Needs only the table's bytes.

    With ``raw_size`` (the chunk's raw length) every plane is checked to fit the chunk: a plane stored raw holds
    exactly ``raw_size // typesize`` bytes and a compressed one no more (it is kept only if it shrank), so no
    reader is sent to read or decode more than the chunk holds. Raises ValueError if the table is malformed.
    """
    if len(payload) < 1 + 4 * typesize:
        raise ValueError(f"payload of {len(payload)} bytes is too short for a {typesize}-plane table")
    count = payload[0]
    if count != typesize:
        raise ValueError(f"payload has {count} planes, spec says {typesize}")
    sizes = struct.unpack_from(f"<{count}I", payload, 1)
    plane_len = None if raw_size is None else raw_size // typesize
    entries, position = [], 1 + 4 * count
    for k, size in enumerate(sizes):
        entry = PlaneEntry(position, size & _LENGTH, bool(size & _COMPRESSED), bool(size & XOR_BASE))
        if plane_len is not None and (entry.length > plane_len or (not entry.compressed and entry.length != plane_len)):
            kind = "compressed" if entry.compressed else "raw"
            raise ValueError(f"plane {k} is stored as {entry.length} {kind} bytes, but the chunk's planes hold {plane_len}")
        entries.append(entry)
        position += entry.length
    return entries, position


class BytePlanes(BytesStage):
    id = "planes"
    settings = frozenset({"typesize", "inner"})
    takes_inner = True

    def __init__(self, typesize: int, inner: BytesStage) -> None:
        if not 1 <= typesize <= MAX_TYPESIZE:
            raise ValueError(f"typesize must be 1..{MAX_TYPESIZE}")
        self.typesize, self.inner = typesize, inner

    def encode(self, data: memoryview) -> bytes:
        return b"".join(self.encode_parts(data))

    def encode_parts(self, data: memoryview) -> list[Buffer]:
        """The payload of :meth:`encode` as a list of buffers, for a caller that joins it with more bytes.
        The buffers may view this thread's scratch memory: join them before this thread encodes again."""
        planes, tail = split_planes(data, self.typesize, scratch(len(data), "planes"))
        return self.pack_parts([self.store_plane(memoryview(plane)) for plane in planes], tail)

    def pack_parts(self, planes: list[StoredPlane], tail: np.ndarray | memoryview) -> list[Buffer]:
        """A payload from stored planes and the tail bytes, as the list of buffers to concatenate."""
        sizes = [len(memoryview(p.data).cast("B")) | (_COMPRESSED if p.compressed else 0) | (XOR_BASE if p.xor else 0)
                 for p in planes]
        head = struct.pack(f"<B{self.typesize}I", self.typesize, *sizes)
        return [head, *(p.data for p in planes), tail.data if isinstance(tail, np.ndarray) else tail]

    def store_plane(self, plane: memoryview, xor: bool = False, ratio: float | None = None) -> StoredPlane:
        """``plane`` compressed if that pays, else raw (``ratio``: its sample ratio, if known)."""
        packed = self.compress_if_pays(plane, ratio)
        return StoredPlane(plane if packed is None else packed, packed is not None, xor)

    def sample_ratio(self, plane: memoryview, xor_with: np.ndarray | None = None) -> float:
        """Compressed / raw size of ``SAMPLE`` bytes of ``plane``, taken as ``PIECES`` pieces spread over it and
        compressed as one (the whole plane if it is small). Spread pieces judge tensors whose halves differ
        (rows a batch touched, rows it did not) where one piece from the middle misjudged them; one call
        instead of one per piece costs a third of the time. ``xor_with``: judge ``plane`` XOR this (same
        length) instead, XORing only the pieces sampled."""
        n = len(plane)
        if not n:
            return 1.0
        values = np.frombuffer(plane, dtype=np.uint8)
        if n <= 4 * SAMPLE:
            sample = values if xor_with is None else values ^ xor_with
        else:
            sample = scratch(SAMPLE, "sample").reshape(PIECES, SAMPLE // PIECES)
            for row, piece in zip(sample, sample_pieces(n)):
                if xor_with is None:
                    row[:] = values[piece]
                else:
                    np.bitwise_xor(values[piece], xor_with[piece], out=row)
        return len(self.inner.encode(sample.data.cast("B"))) / sample.size

    def compress_if_pays(self, plane: memoryview, ratio: float | None = None) -> bytes | memoryview | None:
        """The plane compressed, or None if compressing it does not pay. ``ratio``: its sample ratio, if known."""
        if ratio is None and len(plane) > 4 * SAMPLE:
            ratio = self.sample_ratio(plane)
        if ratio is not None and ratio >= KEEP_BELOW:
            return None
        packed = self.inner.encode_sampled(plane, ratio) if len(plane) else b""
        return packed if len(packed) < KEEP_BELOW * len(plane) else None

    def decode_planes(self, data: memoryview, out_size: int) -> tuple[list[np.ndarray], list[PlaneEntry], memoryview]:
        """Decoded planes, the table, and the tail bytes. Planes stored raw are read-only views of ``data``.
        Raises ValueError if the table does not fit ``data`` and ``out_size`` (before decoding any plane)."""
        entries, tail_start = plane_table(data, self.typesize, out_size)
        if tail_start > len(data):
            raise ValueError(f"plane table describes {tail_start} bytes, the payload holds {len(data)}")
        plane_len = out_size // self.typesize
        planes = [self.decode_plane(k, data[e.offset : e.offset + e.length], e, plane_len) for k, e in enumerate(entries)]
        tail = data[tail_start:]
        if len(tail) != out_size - plane_len * self.typesize:
            raise ValueError("tail length does not match")
        return planes, entries, tail

    def decode_plane(self, k: int, stored: memoryview, entry: PlaneEntry, plane_len: int) -> np.ndarray:
        """Plane ``k`` from its ``stored`` bytes, as ``entry`` of the table describes them (raw: a view).
        Raises ValueError if it does not decode to ``plane_len`` bytes."""
        try:
            plane = self.inner.decode(stored, plane_len) if entry.compressed else stored
        except Exception as exc:  # any decoder failure means damaged bytes
            raise ValueError(f"plane {k} does not decode ({type(exc).__name__}: {exc})") from None
        if len(plane) != plane_len:
            raise ValueError(f"plane {k} decoded to {len(plane)} bytes, expected {plane_len}")
        return np.frombuffer(plane, dtype=np.uint8)

    def decode(self, data: memoryview, out_size: int) -> memoryview:
        return self._decode(data, out_size, np.empty(out_size, dtype=np.uint8))

    def decode_into(self, data: memoryview, out_size: int, out: memoryview) -> memoryview:
        return self._decode(data, out_size, np.frombuffer(out, dtype=np.uint8)[:out_size])

    def decode_into_parts(self, data: memoryview, out_size: int, parts: list[memoryview]) -> None:
        """Interleaves the planes straight into ``parts``: no buffer of the whole chunk, no copy."""
        assemble_into_parts(*self._planes(data, out_size), [np.frombuffer(p, dtype=np.uint8) for p in parts])

    def _decode(self, data: memoryview, out_size: int, out: np.ndarray) -> memoryview:
        return assemble(*self._planes(data, out_size), out).data

    def _planes(self, data: memoryview, out_size: int) -> tuple[list[np.ndarray], memoryview]:
        planes, entries, tail = self.decode_planes(data, out_size)
        if any(e.xor for e in entries):
            raise ValueError("payload has planes XORed with a delta base, but its stage is not 'xplanes'")
        return planes, tail

    def spec(self) -> Spec:
        return {"id": self.id, "typesize": self.typesize, "inner": self.inner.spec()}

    @classmethod
    def from_spec(cls: type[_Planes], spec: Spec) -> _Planes:  # PlaneDelta.from_spec() returns a PlaneDelta
        if "inner" not in spec:
            raise ValueError(f"stage {cls.id!r} lacks its setting 'inner'")
        return cls(int_setting(spec, "typesize", 1, MAX_TYPESIZE), stage_from_spec(spec["inner"], inner=True))


def sample_pieces(n: int) -> list[slice]:
    """Where a plane of ``n`` > 4 x ``SAMPLE`` bytes is sampled: ``PIECES`` pieces of ``SAMPLE // PIECES`` bytes,
    centred in equal parts of the plane."""
    size = SAMPLE // PIECES
    return [slice(start, start + size) for start in ((2 * i + 1) * n // (2 * PIECES) for i in range(PIECES))]


def assemble(planes: list[np.ndarray], tail: memoryview | np.ndarray, out: np.ndarray) -> np.ndarray:
    """Interleave ``planes`` and append ``tail`` into ``out`` (the inverse of :func:`split_planes`)."""
    whole = len(planes) * len(planes[0]) if planes else 0
    _interleave(planes, out[:whole])
    out[whole:] = np.frombuffer(tail, dtype=np.uint8)
    return out


def assemble_into_parts(planes: list[np.ndarray], tail: memoryview | np.ndarray, parts: list[np.ndarray]) -> None:
    """:func:`assemble` across ``parts``, consecutive byte arrays whose lengths add up to the raw size. Elements are
    interleaved a block at a time: a block inside one part (and aligned in it) straight into the part, a block
    across parts through this thread's scratch memory."""
    count = len(planes)
    words = len(planes[0]) if planes else 0
    into = _Parts(parts)
    for lo in range(0, words, NUMPY_BLOCK):
        hi = min(lo + NUMPY_BLOCK, words)
        target = into.inside(lo * count, hi * count, count)
        out = scratch((hi - lo) * count, "parts") if target is None else target
        _interleave([p[lo:hi] for p in planes], out)
        if target is None:
            into.write(lo * count, out)
    into.write(words * count, np.frombuffer(tail, dtype=np.uint8))


class _Parts:
    """Consecutive byte arrays addressed as one range of bytes."""

    def __init__(self, parts: list[np.ndarray]) -> None:
        self.parts = [p for p in parts if len(p)]
        self.starts = list(itertools.accumulate((len(p) for p in self.parts), initial=0))
        self.addresses = [p.__array_interface__["data"][0] for p in self.parts]
        self._at = 0  # the part the last lookup found: blocks come in order

    def _find(self, position: int) -> int:
        if not self.starts[self._at] <= position < self.starts[self._at + 1]:
            self._at = bisect.bisect_right(self.starts, position) - 1
        return self._at

    def inside(self, begin: int, end: int, align: int) -> np.ndarray | None:
        """Bytes [begin, end) as a view of one part if they lie in one and start at an address that is a multiple
        of ``align``, else None."""
        if begin == end:
            return None
        i = self._find(begin)
        if end > self.starts[i + 1] or (self.addresses[i] + begin - self.starts[i]) % align:
            return None
        return self.parts[i][begin - self.starts[i] : end - self.starts[i]]

    def write(self, position: int, data: np.ndarray) -> None:
        """Copy ``data`` into the bytes from ``position`` on, across as many parts as it spans."""
        done = 0
        while done < len(data):
            i = self._find(position + done)
            offset = position + done - self.starts[i]
            take = min(len(data) - done, len(self.parts[i]) - offset)
            self.parts[i][offset : offset + take] = data[done : done + take]
            done += take


_local = threading.local()


def scratch(nbytes: int, name: str = "interleave") -> np.ndarray:
    """A per-thread reusable byte buffer of ``nbytes`` per ``name`` (a fresh one each call would page-fault
    every time). Valid until the same thread asks for the same name again."""
    buffers = getattr(_local, "buffers", None)
    if buffers is None:
        buffers = _local.buffers = {}
    buffer = buffers.get(name)
    if buffer is None or buffer.nbytes < nbytes:
        buffer = buffers[name] = np.empty(nbytes, dtype=np.uint8)
    return buffer[:nbytes]


def _interleave(planes: list[np.ndarray], out: np.ndarray) -> None:
    """Write element i's byte k from ``planes[k][i]`` into ``out`` (the inverse shuffle).

    For 2-, 4- and 8-byte elements this assembles whole little-endian words:
    in one pass with ``plane_kernels``, else with numpy shifts, which numpy
    runs several times faster than a strided copy.
    """
    count = len(planes)
    if count == 1:
        out[:] = planes[0]
        return
    wide = _UINT.get(count)
    if wide is None:
        out.reshape(-1, count)[...] = np.stack(planes, axis=1)
        return
    words = out.view(wide)
    kernels = _ready_kernels(out.nbytes)
    if kernels is not None:
        kernels.join(planes, words)
        return
    shifted = scratch(min(len(words), NUMPY_BLOCK) * count).view(wide)
    for lo in range(0, len(words), NUMPY_BLOCK):  # per block, so that the words stay in the CPU's cache
        block = words[lo : lo + NUMPY_BLOCK]
        tmp = shifted[: len(block)]
        block[...] = planes[count - 1][lo : lo + NUMPY_BLOCK]
        for k in range(count - 2, -1, -1):
            np.left_shift(block, 8, out=block)
            tmp[...] = planes[k][lo : lo + NUMPY_BLOCK]
            np.bitwise_or(block, tmp, out=block)
