"""Zstandard compression (the ``zstandard`` package; releases the GIL).

Level 1, the default, is tuned for byte planes of floats, which are short-range data where most of the gain is
the entropy coding of literals, not long matches. Its frames are ordinary zstd frames: only the compressor's
search changes, and any zstd decoder reads them.

* A 128-entry match table (``LEVEL1_HASH_LOG``) instead of level 1's own 2^14 or more: better matches on exponent
  planes of real training states, 1.5-2.5x faster.
* Acceleration ``LEVEL1_ACCELERATION`` of the fast strategy (what negative levels use) with the literals still
  Huffman-coded: the search skips ahead faster where it finds no match, and the literals it leaves cost the same
  to code. zstd turns literal coding off with acceleration unless told otherwise, and only its advanced API can
  tell it, which the ``zstandard`` package reaches through its CFFI backend (the ``zstandard[cffi]`` extra). On
  W1's planes (``bench/plane_zstd.py``, one thread, ns per byte and stored fraction, before -> after): the weights'
  high mantissa byte XORed with the keyframe's one step earlier 3.70 -> 1.35 ns/B, 0.337 -> 0.315; exp_avg_sq's
  2.49 -> 1.36 on its sign-and-exponent byte at 0.307 either way; fp16's top byte of exp_avg 2.93 -> 1.57,
  0.288 -> 0.279; the weights' sign-and-exponent byte 1.20 -> 1.01 at 0.339. Runs of zeros find fewer matches:
  the weights' sign-and-exponent byte XORed one step apart grows from 0.013 to 0.029 of its size, and a delta of
  a fine-tuning run (W2) from 0.3528 to 0.3552 of torch.save. So a plane whose sample compressed to under
  ``SPARSE_BELOW`` of its size (:meth:`Zstd.encode_sampled`) is compressed without acceleration, where the
  search is fast anyway. Without ``cffi`` level 1 falls back to the plain fast strategy with the same match table
  (:data:`ACCELERATED`).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import zstandard

from .base import BytesStage, Spec

log = logging.getLogger(__name__)

_local = threading.local()

#: hash table size (log2 entries) for level 1, the default (both compressors)
LEVEL1_HASH_LOG = 7
#: the fast strategy's acceleration at level 1 where the literals can stay Huffman-coded
LEVEL1_ACCELERATION = 32
#: data whose sample compressed below this fraction is mostly runs (a sparse XOR plane): level 1 compresses it
#: without acceleration, which finds those runs (smaller output, and it decodes faster)
SPARSE_BELOW = 0.1


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
if not ACCELERATED:
    log.debug("zstandard's CFFI backend is not available (pip install 'zstandard[cffi]'); "
              "level 1 compresses without acceleration")


class _AcceleratedLevel1:
    """A level-1 compression context with acceleration and Huffman-coded literals; one per thread."""

    def __init__(self) -> None:
        ffi, lib = _CFFI
        self._ffi, self._lib = ffi, lib
        self._alloc = ffi.new_allocator(should_clear_after_alloc=False)  # zero-filling would cost a pass
        self._out = self._alloc("char[]", 0)  # grown on demand, reused
        self._cctx = ffi.gc(lib.ZSTD_createCCtx(), lib.ZSTD_freeCCtx)
        if self._cctx == ffi.NULL:
            raise MemoryError("zstd could not allocate a compression context")
        for parameter, value in ((lib.ZSTD_c_compressionLevel, 1), (lib.ZSTD_c_strategy, lib.ZSTD_fast),
                                 (lib.ZSTD_c_hashLog, LEVEL1_HASH_LOG), (lib.ZSTD_c_targetLength, LEVEL1_ACCELERATION),
                                 (lib.ZSTD_c_literalCompressionMode, lib.ZSTD_ps_enable),
                                 (lib.ZSTD_c_contentSizeFlag, 1)):
            self._check(lib.ZSTD_CCtx_setParameter(self._cctx, parameter, value))

    def _check(self, code: int) -> int:
        if self._lib.ZSTD_isError(code):
            raise zstandard.ZstdError(self._ffi.string(self._lib.ZSTD_getErrorName(code)).decode())
        return code

    def compress(self, data: Any) -> bytes:
        """``data`` as one zstd frame. Compresses into this context's reused buffer (fresh memory would page-fault
        on every call), then copies the frame out."""
        source = self._ffi.from_buffer(data)
        bound = self._lib.ZSTD_compressBound(len(source))
        if len(self._out) < bound:
            self._out = self._alloc("char[]", bound)
        size = self._check(self._lib.ZSTD_compress2(self._cctx, self._out, len(self._out), source, len(source)))
        return self._ffi.buffer(self._out, size)[:]


def _compressor(level: int, sparse: bool = False) -> Any:
    """This thread's compressor for ``level`` (an object with ``compress(data) -> bytes``); ``sparse``: for data
    that is mostly runs, which level 1 compresses without acceleration."""
    accelerated = level == 1 and ACCELERATED and not sparse
    cache = _local.__dict__.setdefault("compressors", {})
    key = (level, accelerated)
    if key not in cache:
        if accelerated:
            cache[key] = _AcceleratedLevel1()
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

    def __init__(self, level: int = 1) -> None:
        self.level = level

    def encode(self, data: memoryview) -> bytes:
        return _compressor(self.level).compress(data)

    def encode_sampled(self, data: memoryview, sample_ratio: float | None) -> bytes:
        """:meth:`encode`; data whose sample compressed below ``SPARSE_BELOW`` is compressed without acceleration."""
        return _compressor(self.level, sparse=sample_ratio is not None and sample_ratio < SPARSE_BELOW).compress(data)

    def decode(self, data: memoryview, out_size: int) -> bytes:
        return _decompressor().decompress(data, max_output_size=out_size)

    def spec(self) -> Spec:
        return {"id": self.id, "level": self.level}

    @classmethod
    def from_spec(cls, spec: Spec) -> Zstd:
        return cls(int(spec.get("level", 1)))
