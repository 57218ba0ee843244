"""Zstandard compression (the ``zstandard`` package; releases the GIL).

Level 1, the default, is tuned for byte planes of floats, which are short-range data where most of the gain is
the entropy coding of literals, not long matches. Its frames are ordinary zstd frames: only the compressor's
search changes, and any zstd decoder reads them.

* A small match table (``LEVEL1_HASH_LOG``) instead of level 1's own: on exponent planes it finds matches as
  good, and faster.
* Acceleration ``LEVEL1_ACCELERATION`` of the fast strategy (what negative levels use) with the literals still
  Huffman-coded: the search skips ahead faster where it finds no match, and the literals it leaves cost the same
  to code. zstd turns literal coding off with acceleration unless told otherwise, and only its advanced API can
  tell it, which the ``zstandard`` package reaches through its CFFI backend (the ``zstandard[cffi]`` extra).
  Acceleration finds fewer of the runs in mostly-zero planes (XOR deltas), so a plane whose sample compressed to
  under ``SPARSE_BELOW`` of its size (:meth:`Zstd.encode_sampled`) is compressed without it, where the search is
  fast anyway. Without ``cffi`` level 1 falls back to the plain fast strategy with the same match table
  (:data:`ACCELERATED`).
* No search at all where a sample shows nothing for it to find: a plane whose sample compressed to
  ``LITERALS_FROM`` of its size or more is written as literals only, Huffman-coded in zstd's own blocks (zstd's
  ``ZSTD_compressSequences`` given no sequences; :data:`LITERALS_ONLY`). The matches a search finds in such
  planes save less than the literals they take out cost to code, and the frames decode faster. Below
  ``LITERALS_FROM`` runs pay, since Huffman codes cost at least a bit per byte.

Figures (speed and stored fraction per plane, ``bench/plane_zstd.py``, ``bench/accel_zstd.py``):
docs/benchmarks/incremental.md and docs/benchmarks/lossy.md.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Literal

import zstandard

from .base import BytesStage, Spec, int_setting

log = logging.getLogger(__name__)

_local = threading.local()

#: hash table size (log2 entries) for level 1, the default (both compressors)
LEVEL1_HASH_LOG = 7
#: the fast strategy's acceleration at level 1 where the literals can stay Huffman-coded
LEVEL1_ACCELERATION = 32
#: data whose sample compressed below this fraction is mostly runs (a sparse XOR plane): level 1 compresses it
#: without acceleration, which finds those runs (smaller output, and it decodes faster)
SPARSE_BELOW = 0.1
#: data whose sample compressed to at least this fraction has no runs worth a search: level 1 writes it as
#: Huffman-coded literals only (planes above it come out about as small that way: docs/benchmarks/lossy.md)
LITERALS_FROM = 0.2
#: the compression levels zstd takes (``ZSTD_minCLevel()`` .. ``ZSTD_maxCLevel()``); a reader needs no level, but a
#: spec outside them was not written by zstd's levels
MIN_LEVEL, MAX_LEVEL = -(1 << 17), zstandard.MAX_COMPRESSION_LEVEL


def _cffi_lib() -> Any:
    """zstd's C API through ``zstandard``'s CFFI backend, or None where ``cffi`` is not installed."""
    try:
        from zstandard.backend_cffi import ffi, lib
    except ImportError:
        return None
    if not hasattr(lib, "ZSTD_c_literalCompressionMode"):  # a build without zstd's advanced API
        return None
    return ffi, lib


_CFFI = _cffi_lib()
#: whether level 1 runs accelerated with Huffman-coded literals (``zstandard[cffi]`` installed)
ACCELERATED = _CFFI is not None
#: whether level 1 can write literals only, with no search, where a sample says so (``zstandard[cffi]`` installed)
LITERALS_ONLY = ACCELERATED and hasattr(_CFFI[1], "ZSTD_compressSequences")
if not ACCELERATED:
    log.debug("zstandard's CFFI backend is not available (pip install 'zstandard[cffi]'); "
              "level 1 compresses without acceleration")


class _CffiContext:
    """A zstd compression context set up through the advanced API; one per thread, like the output buffer that
    the thread's contexts share."""

    def __init__(self, parameters: tuple[tuple[str, Any], ...]) -> None:
        ffi, lib = _CFFI
        self._ffi, self._lib = ffi, lib
        self._cctx = ffi.gc(lib.ZSTD_createCCtx(), lib.ZSTD_freeCCtx)
        if self._cctx == ffi.NULL:
            raise MemoryError("zstd could not allocate a compression context")
        for name, value in parameters:
            self._check(lib.ZSTD_CCtx_setParameter(self._cctx, getattr(lib, name), value))

    def _check(self, code: int) -> int:
        if self._lib.ZSTD_isError(code):
            raise zstandard.ZstdError(self._ffi.string(self._lib.ZSTD_getErrorName(code)).decode())
        return code

    def compress(self, data: Any) -> bytes:
        """``data`` as one zstd frame. Compresses into this thread's reused output buffer (fresh memory would
        page-fault on every call), then copies the frame out."""
        source = self._ffi.from_buffer(data)
        out = _output_buffer(self._lib.ZSTD_compressBound(len(source)))
        return self._ffi.buffer(out, self._check(self._frame(source, out)))[:]

    def _frame(self, source: Any, out: Any) -> int:
        """Write ``source``'s frame into ``out``; its size (or a zstd error code)."""
        raise NotImplementedError


def _output_buffer(nbytes: int) -> Any:
    """This thread's buffer for compressed frames, grown to at least ``nbytes`` (contents undefined)."""
    out = getattr(_local, "out", None)
    if out is None or len(out) < nbytes:
        ffi = _CFFI[0]
        out = _local.out = ffi.new_allocator(should_clear_after_alloc=False)("char[]", nbytes)  # no zero-fill pass
    return out


class _AcceleratedLevel1(_CffiContext):
    """Level 1 with acceleration and Huffman-coded literals."""

    def __init__(self) -> None:
        lib = _CFFI[1]
        super().__init__((("ZSTD_c_compressionLevel", 1), ("ZSTD_c_strategy", lib.ZSTD_fast),
                          ("ZSTD_c_hashLog", LEVEL1_HASH_LOG), ("ZSTD_c_targetLength", LEVEL1_ACCELERATION),
                          ("ZSTD_c_literalCompressionMode", lib.ZSTD_ps_enable), ("ZSTD_c_contentSizeFlag", 1)))

    def _frame(self, source: Any, out: Any) -> int:
        return self._lib.ZSTD_compress2(self._cctx, out, len(out), source, len(source))


class _LiteralsOnly(_CffiContext):
    """Level 1 with no search: every byte a literal, Huffman-coded per block (a block of one repeated byte is
    stored as a run, one whose literals would not shrink as raw bytes, as zstd does at any level)."""

    def __init__(self) -> None:
        lib = _CFFI[1]
        super().__init__((("ZSTD_c_compressionLevel", 1), ("ZSTD_c_blockDelimiters", lib.ZSTD_sf_noBlockDelimiters),
                          ("ZSTD_c_literalCompressionMode", lib.ZSTD_ps_enable), ("ZSTD_c_contentSizeFlag", 1)))
        self._no_sequences = self._ffi.new("ZSTD_Sequence[]", 1)  # the API wants an array even for none

    def _frame(self, source: Any, out: Any) -> int:
        return self._lib.ZSTD_compressSequences(self._cctx, out, len(out), self._no_sequences, 0, source, len(source))


#: how level 1 compresses data, by what its sample says: ``search`` (accelerated), ``runs`` (unaccelerated,
#: for data that is mostly runs), ``literals`` (no search)
Search = Literal["search", "runs", "literals"]


def _search_for(sample_ratio: float | None) -> Search:
    if sample_ratio is None:
        return "search"
    if sample_ratio < SPARSE_BELOW:
        return "runs"
    return "literals" if sample_ratio >= LITERALS_FROM else "search"


def _compressor(level: int, search: Search = "search") -> Any:
    """This thread's compressor for ``level`` (an object with ``compress(data) -> bytes``) and ``search`` (which
    only level 1 distinguishes, and only where ``zstandard[cffi]`` is installed)."""
    if level != 1 or not ACCELERATED or search == "runs":
        kind = "plain"
    else:
        kind = "literals" if search == "literals" and LITERALS_ONLY else "search"
    cache = _local.__dict__.setdefault("compressors", {})
    key = (level, kind)
    if key not in cache:
        if kind == "search":
            cache[key] = _AcceleratedLevel1()
        elif kind == "literals":
            cache[key] = _LiteralsOnly()
        else:
            tuned = {"hash_log": LEVEL1_HASH_LOG} if level == 1 else {}
            params = zstandard.ZstdCompressionParameters.from_level(level, write_content_size=1, **tuned)
            cache[key] = zstandard.ZstdCompressor(compression_params=params)
    return cache[key]


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    return _local.decompressor


class Zstd(BytesStage):
    id = "zstd"
    settings = frozenset({"level"})

    def __init__(self, level: int = 1) -> None:
        self.level = level

    def encode(self, data: memoryview) -> bytes:
        return _compressor(self.level).compress(data)

    def encode_sampled(self, data: memoryview, sample_ratio: float | None) -> bytes:
        """:meth:`encode`, at level 1 searching as the sample says: without acceleration below ``SPARSE_BELOW``
        (mostly runs), not at all from ``LITERALS_FROM`` (literals only)."""
        return _compressor(self.level, _search_for(sample_ratio)).compress(data)

    def decode(self, data: memoryview, out_size: int) -> bytes:
        """One zstd frame of ``out_size`` bytes, nothing after it. ``zstandard`` allocates the size a frame
        declares whatever ``max_output_size`` says, so a declared size other than ``out_size`` is refused
        first; a frame that declares none is decoded into ``out_size`` bytes at most."""
        declared = zstandard.frame_content_size(data)  # -1: not declared
        if declared not in (-1, out_size):
            raise ValueError(f"zstd frame declares {declared} bytes, {out_size} expected")
        return _decompressor().decompress(data, max_output_size=out_size, allow_extra_data=False)

    def spec(self) -> Spec:
        return {"id": self.id, "level": self.level}

    @classmethod
    def from_spec(cls, spec: Spec) -> Zstd:
        return cls(int_setting(spec, "level", MIN_LEVEL, MAX_LEVEL, default=1))
