"""Fused lossy kernels: cast or quantise float32 values and measure the error in one pass (numba).

Each kernel reads a block of float32 values once, writes what is stored (16-bit floats, or int8 values and
per-block scales), decodes each value exactly as :func:`ckptvault._codecs.lossy.decode` does, and returns the sums
that :func:`ckptvault._codecs.lossy.measure` reports, as a :data:`Sums` tuple:

``(max_abs_bits, err_sq, ref_sq, nonzero, flushed, overflow, nan)``

* ``max_abs_bits``: the bit pattern of the largest ``|restored - original|`` over finite originals (compared
  as integers, which orders non-negative floats; a NaN difference is larger than any number, as in torch);
* ``err_sq``, ``ref_sq``: sums of squared errors and of squared originals, over finite originals, in float64
  (the fast passes sum each block in float32, to about 1e-6 relative);
* counts of finite non-zero originals, of those restored as zero, of finite originals restored as ±inf,
  and of non-NaN originals restored as NaN.

The bf16/fp16 kernels cast each block of :data:`_BLOCK` values in a fast pass that counts only zeros and
flushes and notes the block's smallest non-zero and largest magnitude; only a block that may hold an
overflowing, infinite or NaN value (or magnitudes outside its float32 sums' range) is cast again, counting
each case: the blocks of training states are almost all ordinary, so most values are handled by the fast pass
alone. The int8 kernels likewise count overflows and NaNs only in blocks whose magnitudes reach 2^125
(figures: docs/benchmarks/lossy.md).

Contracts: the stored values are bit for bit what torch stores (``Tensor.to`` for bf16/fp16, which rounds to
nearest even, NaN included as torch's vectorised cast writes it; ``round(x / scale)`` clamped to ±127 for
int8). Sums may differ from a float64 reference in the last bits (they are reassociated to vectorise).
All kernels release the GIL, so blocks of different tensors encode in parallel threads. They compile on first
use and are cached on disk by numba.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit
from numba.core import types
from numba.extending import intrinsic

Sums = tuple[int, float, float, int, int, int, int]

_U32 = np.uint32
_SIGN, _MAG, _INF = _U32(0x80000000), _U32(0x7FFFFFFF), _U32(0x7F800000)
_FAST = {"reassoc"}  # lets the float64 sums vectorise; no contraction, so a decode equals torch's mul then add
_BLOCK = 4096  # values per block of the cast kernels' fast pass (a block's counts fit in uint32)
#: the largest float32 magnitudes (as bits) that cast to a zero bfloat16 / float16: the ties next to the smallest
#: subnormal, which round to even, so to zero (2^-25 for float16). Casts are monotonic: every non-zero value at
#: or below flushes, and none above.
_FLUSH_BF16 = _U32(0x00008000)
_FLUSH_HALF = _U32(0x33000000)
#: float32 magnitudes (as bits) from which a value may cast to an infinite bfloat16 / float16, or is inf or
#: NaN: the ties next to the largest finite value (bfloat16's, and 65520 for float16). Below them every value
#: casts to a finite one (perhaps zero: the fast pass counts those flushes).
_OVERFLOW_BF16 = _U32(0x7F7F8000)
_OVERFLOW_HALF = _U32(0x477FF000)
#: the fast pass sums squares in float32, of values and differences scaled by 2^32 (exact), and only blocks
#: whose magnitudes lie strictly between these bounds (2^-72 and 2^24, as bits) keep those sums: there a
#: scaled square is a normal float32 (a non-zero difference is at least one float32 ulp of its value, or the
#: value itself where it flushes, so at least 2^-95 before scaling) and a block's 4096 squares sum to below
#: 2^124. float16's largest finite values lie inside; for bfloat16 it narrows the range in which a block
#: takes the fast pass.
_FLOAT32_SUMS = (_U32(0x1B7FFFFF), _U32(0x4B800000))
_SCALE, _UNSCALE = np.float32(2.0**32), 2.0**-64
#: blocks cast exactly, without a fast pass, after a block that needed the exact cast: where special values
#: are common (infs, NaNs, values outside the float32 sums' range) a fast pass would mostly be wasted
_EXACT_RUN = 8
#: 2^125 as float32 bits: int8 blocks whose values (and, for residuals, differences from the base) are all
#: smaller in magnitude restore finite values (at most |value| + 2 x the block's largest difference < 2^127),
#: so their quantisation needs no overflow or NaN counts
_INT8_ORDINARY = _U32(0x7E000000)
#: int8 blocks (of at most ``_BLOCK`` values, not residuals) whose non-zero magnitudes lie strictly between
#: these bounds (2^-60 and 2^24, as bits) sum their squares in float32, scaled like the casts' (a non-zero
#: error is at least 2^-24 of the smaller of the value and the scale, absmax / 127, so at least 2^-91)
_INT8_FLOAT32_SUMS = (_U32(0x1D7FFFFF), _U32(0x4B800000))


@intrinsic
def _as_float(typingctx, bits):  # type: ignore[no-untyped-def]
    """The float32 whose bit pattern is uint32 ``bits``."""
    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@intrinsic
def _as_bits(typingctx, value):  # type: ignore[no-untyped-def]
    """The uint32 bit pattern of float32 ``value``."""
    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


# numba widens uint32 arithmetic to 64 bits, which halves the lanes of a vectorised loop: each step below is
# truncated back to uint32 (LLVM then keeps it 32-bit), and each choice is a select, not a branch.
@njit(inline="always")
def _bf16_bits(u):  # type: ignore[no-untyped-def]
    """bfloat16 of float32 bits ``u``, rounded to nearest even; every NaN becomes 0xFFFF, as in torch's cast."""
    rounded = _U32(_U32(u + _U32(0x7FFF) + _U32(_U32(u >> _U32(16)) & _U32(1))) >> _U32(16))
    return _U32(0xFFFF) if _U32(u & _MAG) > _INF else rounded


@intrinsic
def _fp16_bits(typingctx, bits):  # type: ignore[no-untyped-def]
    """float16 bits (in a uint32) of the float32 with bits ``bits``: LLVM's fptrunc, which is the CPU's own
    conversion (F16C's vcvtps2ph on x86, as torch uses): nearest even, NaNs quieted keeping their top bits."""
    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        half = builder.fptrunc(builder.bitcast(args[0], ir.FloatType()), ir.HalfType())
        return builder.zext(builder.bitcast(half, ir.IntType(16)), ir.IntType(32))
    return types.uint32(types.uint32), codegen


@intrinsic
def _fp16_to_bits32(typingctx, half_bits):  # type: ignore[no-untyped-def]
    """float32 bits of the float16 with bits ``half_bits`` (the low 16 of a uint32): exact."""
    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        half = builder.bitcast(builder.trunc(args[0], ir.IntType(16)), ir.HalfType())
        return builder.bitcast(builder.fpext(half, ir.FloatType()), ir.IntType(32))
    return types.uint32(types.uint32), codegen


@njit(inline="always")
def _contribution(u, b):  # type: ignore[no-untyped-def]
    """One value's share of :data:`Sums`: original float32 bits ``u``, restored bits ``b``."""
    finite = _U32(u & _MAG) < _INF
    diff = _as_float(b) - _as_float(u)
    counted = finite and _U32(u & _MAG) != 0
    return (_U32(_as_bits(diff) & _MAG) if finite else _U32(0),
            np.float64(diff) * np.float64(diff) if finite else 0.0,
            np.float64(_as_float(u)) * np.float64(_as_float(u)) if finite else 0.0,
            counted, counted and _U32(b & _MAG) == 0, finite and _U32(b & _MAG) == _INF,
            _U32(u & _MAG) <= _INF and _U32(b & _MAG) > _INF)


@njit(inline="always")
def _count(total, flag):  # type: ignore[no-untyped-def]
    """``total + flag`` kept in uint32: 64-bit counters would halve the lanes of the vectorised loop."""
    return _U32(total + _U32(flag))


@njit(inline="always")
def _cast_value(u, half):  # type: ignore[no-untyped-def]
    """(stored 16-bit pattern, its float32 bits restored) of float32 bits ``u``."""
    if half:
        stored = _fp16_bits(u)
        return stored, _fp16_to_bits32(stored)
    stored = _bf16_bits(u)
    return stored, _U32(stored << _U32(16))


@njit(inline="always")
def _cast_block_exact(xs, qs, half):  # type: ignore[no-untyped-def]
    """Cast one block of at most ``_BLOCK`` values, counting every special case; returns :data:`Sums`."""
    max_bits, err_sq, ref_sq = _U32(0), 0.0, 0.0
    nonzero = flushed = overflow = nan = _U32(0)  # uint32: 64-bit counters would halve the vector lanes
    for i in range(xs.size):
        stored, restored = _cast_value(xs[i], half)
        qs[i] = np.uint16(stored)
        m, e, a, c, f, o, n = _contribution(xs[i], restored)
        max_bits, err_sq, ref_sq = max(max_bits, m), err_sq + e, ref_sq + a
        nonzero, flushed = _count(nonzero, c), _count(flushed, f)
        overflow, nan = _count(overflow, o), _count(nan, n)
    return max_bits, err_sq, ref_sq, nonzero, flushed, overflow, nan


@njit(inline="always")
def _cast_block_fast(xs, qs, half):  # type: ignore[no-untyped-def]
    """Cast one block, summing the error as if every value were finite, in float32; returns (max_bits, err_sq,
    ref_sq, zeros, flushed, smallest non-zero magnitude, largest magnitude), magnitudes as bits. The sums and
    counts are those of :data:`Sums` only if the magnitudes lie below the overflow bound and in
    :data:`_FLOAT32_SUMS`."""
    max_bits, err_sq, ref_sq = _U32(0), np.float32(0.0), np.float32(0.0)
    smallest, largest, zeros, flushed = _U32(0xFFFFFFFF), _U32(0), _U32(0), _U32(0)
    for i in range(xs.size):
        u = xs[i]
        stored, restored = _cast_value(u, half)
        qs[i] = np.uint16(stored)
        diff = _as_float(restored) - _as_float(u)
        max_bits = max(max_bits, _U32(_as_bits(diff) & _MAG))
        scaled_diff, scaled = diff * _SCALE, _as_float(u) * _SCALE  # float32 sums: twice the vector lanes
        err_sq += scaled_diff * scaled_diff
        ref_sq += scaled * scaled
        mag = _U32(u & _MAG)
        largest = max(largest, mag)
        smallest = min(smallest, mag if mag != _U32(0) else _U32(0xFFFFFFFF))
        zeros = _count(zeros, mag == _U32(0))
        flushed = _count(flushed, mag != _U32(0) and _U32(restored & _MAG) == _U32(0))
    return max_bits, np.float64(err_sq) * _UNSCALE, np.float64(ref_sq) * _UNSCALE, zeros, flushed, smallest, largest


@njit(inline="always")
def _cast(x, q, half):  # type: ignore[no-untyped-def]
    """The body of :func:`cast_bf16` (``half`` False) and :func:`cast_fp16` (``half`` True, a constant).

    Each block of ``_BLOCK`` values is cast by :func:`_cast_block_fast`; if its smallest non-zero and largest
    magnitudes lie in the range of its float32 sums and below the overflow bound (no value can overflow, or be
    inf or NaN), its counts are its zeros and flushes. Otherwise the block is cast again by
    :func:`_cast_block_exact`, which counts every case (same stored bits) and sums in float64, and so are the
    next :data:`_EXACT_RUN` blocks, without a fast pass.
    """
    lower, upper = _FLOAT32_SUMS[0], min(_OVERFLOW_HALF if half else _OVERFLOW_BF16, _FLOAT32_SUMS[1])
    max_bits, err_sq, ref_sq = _U32(0), 0.0, 0.0
    nonzero = flushed = overflow = nan = 0
    exact_left = 0  # blocks to cast exactly without a fast pass: special blocks come in runs
    for start in range(0, x.size, _BLOCK):
        xs, qs = x[start : start + _BLOCK], q[start : start + _BLOCK]
        if exact_left:
            exact_left -= 1
        else:
            m, e, a, zeros, f, smallest, largest = _cast_block_fast(xs, qs, half)
            if lower < smallest and largest < upper:
                max_bits, err_sq, ref_sq = max(max_bits, m), err_sq + e, ref_sq + a
                nonzero, flushed = nonzero + xs.size - zeros, flushed + f
                continue
            exact_left = _EXACT_RUN
        m, e, a, c, f, o, n = _cast_block_exact(xs, qs, half)
        max_bits, err_sq, ref_sq = max(max_bits, m), err_sq + e, ref_sq + a
        nonzero, flushed, overflow, nan = nonzero + c, flushed + f, overflow + o, nan + n
    return max_bits, err_sq, ref_sq, nonzero, flushed, overflow, nan


@njit(nogil=True, cache=True, fastmath=_FAST)
def cast_bf16(x, q):  # type: ignore[no-untyped-def]
    """Cast float32 bits ``x`` (uint32[n]) into bfloat16 bits ``q`` (uint16[n]); returns :data:`Sums`."""
    return _cast(x, q, False)


@njit(nogil=True, cache=True, fastmath=_FAST)
def cast_fp16(x, q):  # type: ignore[no-untyped-def]
    """Cast float32 bits ``x`` (uint32[n]) into float16 bits ``q`` (uint16[n]); returns :data:`Sums`."""
    return _cast(x, q, True)


@njit(inline="always")
def _quantise_int8_exact(xs, bs, qs, s, divisor, residual):  # type: ignore[no-untyped-def]
    """Quantise one block with scale ``s``, counting every special case; returns :data:`Sums`."""
    max_bits, err_sq, ref_sq = _U32(0), 0.0, 0.0
    nonzero = flushed = overflow = nan = _U32(0)  # a block is at most 2^20 values
    for i in range(xs.size):
        v = xs[i] - bs[i] if residual else xs[i]
        r = np.rint(v / divisor)
        r = min(max(r, np.float32(-127.0)), np.float32(127.0)) if r == r else np.float32(0.0)
        qs[i] = np.int8(r)
        restored = bs[i] + r * s if residual else r * s
        m, e, a, c, f, o, n = _contribution(_as_bits(xs[i]), _as_bits(restored))
        max_bits, err_sq, ref_sq = max(max_bits, m), err_sq + e, ref_sq + a
        nonzero, flushed = _count(nonzero, c), _count(flushed, f)
        overflow, nan = _count(overflow, o), _count(nan, n)
    return max_bits, err_sq, ref_sq, nonzero, flushed, overflow, nan


@njit(inline="always")
def _quantise_int8_ordinary(xs, bs, qs, s, divisor, residual, zero, scale):  # type: ignore[no-untyped-def]
    """:func:`_quantise_int8_exact` of a block whose values, residuals and restored values are all finite (see
    :data:`_INT8_ORDINARY`): nothing overflows or is NaN, so only zeros and flushes are counted. The squares are
    of the values and errors times ``scale`` and summed in the type of ``zero``: float64 with scale 1, or, for a
    block in :data:`_INT8_FLOAT32_SUMS`, float32 with :data:`_SCALE` (twice the vector lanes)."""
    max_bits, err_sq, ref_sq = _U32(0), zero, zero
    nonzero = flushed = _U32(0)
    for i in range(xs.size):
        v = xs[i] - bs[i] if residual else xs[i]
        r = min(max(np.rint(v / divisor), np.float32(-127.0)), np.float32(127.0))
        qs[i] = np.int8(r)
        restored = bs[i] + r * s if residual else r * s
        diff = restored - xs[i]
        max_bits = max(max_bits, _U32(_as_bits(diff) & _MAG))
        scaled_diff, scaled = diff * scale, xs[i] * scale
        err_sq += scaled_diff * scaled_diff
        ref_sq += scaled * scaled
        counted = xs[i] != np.float32(0.0)
        nonzero, flushed = _count(nonzero, counted), _count(flushed, counted and restored == np.float32(0.0))
    unscale = 1.0 / (np.float64(scale) * np.float64(scale))
    return max_bits, np.float64(err_sq) * unscale, np.float64(ref_sq) * unscale, nonzero, flushed, _U32(0), _U32(0)


@njit(inline="always")
def _quantise_int8(x, base, block, q, scale, residual):  # type: ignore[no-untyped-def]
    """The body of :func:`quantise_int8` and :func:`quantise_int8_residual` (``residual`` is a constant).

    A block whose largest magnitude (of its values and, for residuals, of its differences) is below
    :data:`_INT8_ORDINARY` is quantised by :func:`_quantise_int8_ordinary` (summing in float32 if its
    magnitudes also lie in :data:`_INT8_FLOAT32_SUMS`), any other by :func:`_quantise_int8_exact`; all store
    the same values and sum the same error (float32 sums to about 1e-6).
    """
    max_bits, err_sq, ref_sq = _U32(0), 0.0, 0.0
    nonzero = flushed = overflow = nan = 0
    for k in range((x.size + block - 1) // block):
        # each block through slices: loops over range(lo, hi) of the whole arrays do not vectorise
        xs, bs, qs = x[k * block : (k + 1) * block], base[k * block : (k + 1) * block], q[k * block : (k + 1) * block]
        absmax_bits = largest = _U32(0)  # as integers, NaN > inf > any number: the NaN propagates, as in torch.amax
        smallest = _U32(0xFFFFFFFF)  # of the non-zero values' magnitudes (not of residuals)
        for i in range(xs.size):
            v = xs[i] - bs[i] if residual else xs[i]
            mag = _U32(_as_bits(v) & _MAG)
            absmax_bits = max(absmax_bits, mag)
            if residual:
                largest = max(largest, _U32(_as_bits(xs[i]) & _MAG))
            else:
                smallest = min(smallest, mag if mag != _U32(0) else _U32(0xFFFFFFFF))
        s = _as_float(absmax_bits) / np.float32(127.0)
        scale[k] = s
        divisor = s if s > 0 else np.float32(1.0)
        if not residual and xs.size <= _BLOCK and _INT8_FLOAT32_SUMS[0] < smallest and absmax_bits < _INT8_FLOAT32_SUMS[1]:
            m, e, a, c, f, o, n = _quantise_int8_ordinary(xs, bs, qs, s, divisor, residual, np.float32(0.0), _SCALE)
        elif absmax_bits < _INT8_ORDINARY and largest < _INT8_ORDINARY:
            m, e, a, c, f, o, n = _quantise_int8_ordinary(xs, bs, qs, s, divisor, residual, 0.0, 1.0)
        else:
            m, e, a, c, f, o, n = _quantise_int8_exact(xs, bs, qs, s, divisor, residual)
        max_bits, err_sq, ref_sq = max(max_bits, m), err_sq + e, ref_sq + a
        nonzero, flushed, overflow, nan = nonzero + c, flushed + f, overflow + o, nan + n
    return max_bits, err_sq, ref_sq, nonzero, flushed, overflow, nan


@njit(nogil=True, cache=True, fastmath=_FAST)
def quantise_int8(x, block, q, scale):  # type: ignore[no-untyped-def]
    """Per-block int8 of float32 ``x``; returns :data:`Sums` against ``x``.

    Block ``k`` holds values ``k*block`` up to ``(k+1)*block`` (the last may be short); ``scale[k]`` =
    absmax / 127 (NaN if the block holds a NaN, inf if it holds an inf); ``q = round(v / scale)`` clamped to
    ±127, with a scale that is not > 0 replaced by 1 and a NaN quotient stored as 0. Decoding is
    ``q * scale``.
    """
    return _quantise_int8(x, x, block, q, scale, False)


@njit(nogil=True, cache=True, fastmath=_FAST)
def quantise_int8_residual(x, base, block, q, scale):  # type: ignore[no-untyped-def]
    """:func:`quantise_int8` of ``x - base`` (float32, same length); decoding is ``base + q * scale``.
    Returns :data:`Sums` against ``x``."""
    return _quantise_int8(x, base, block, q, scale, True)


# -- counting flushes without encoding: how a doomed attempt gives up early ----------------------------------------
@njit(inline="always")
def _count_flushes_below(xs, bound):  # type: ignore[no-untyped-def]
    """(finite non-zero values, those whose magnitude is at most float32 bits ``bound``) of float32 bits ``xs``,
    at most ``_BLOCK`` of them (uint32 counts)."""
    nonzero = flushed = _U32(0)
    for i in range(xs.size):
        mag = _U32(xs[i] & _MAG)
        nonzero = _count(nonzero, mag != _U32(0) and mag < _INF)
        flushed = _count(flushed, mag != _U32(0) and mag <= bound)
    return nonzero, flushed


@njit(nogil=True, cache=True)
def count_cast_flushes(x, half):  # type: ignore[no-untyped-def]
    """(finite non-zero values, values the cast flushes) of float32 bits ``x`` (uint32[n]) cast to float16
    (``half``) or bfloat16, without casting: exactly the ``nonzero`` and ``flushed`` of :data:`Sums`."""
    bound = _FLUSH_HALF if half else _FLUSH_BF16
    nonzero = flushed = 0
    for start in range(0, x.size, _BLOCK):
        c, f = _count_flushes_below(x[start : start + _BLOCK], bound)
        nonzero, flushed = nonzero + c, flushed + f
    return nonzero, flushed


@njit(nogil=True, cache=True)
def count_int8_flushes(x, block):  # type: ignore[no-untyped-def]
    """(finite non-zero values, a lower bound on the values :func:`quantise_int8` flushes) of float32 ``x`` in
    blocks of ``block``, without quantising: a value at most half its block's scale in magnitude flushes for
    certain (its quotient is at most 0.5, which rounds to 0). Counted only in blocks whose scale is a normal
    float32 (so half of it is exact) and finite; other blocks add only their non-zero values."""
    nonzero = flushed = 0
    for k in range((x.size + block - 1) // block):
        xs = x[k * block : (k + 1) * block].view(np.uint32)
        absmax_bits = _U32(0)
        for i in range(xs.size):
            absmax_bits = max(absmax_bits, _U32(xs[i] & _MAG))
        s = _as_float(absmax_bits) / np.float32(127.0)  # as quantise_int8 computes it
        normal = absmax_bits < _INF and _U32(_as_bits(s) & _MAG) >= _U32(0x00800000)
        bound = _as_bits(s * np.float32(0.5)) if normal else _U32(0)
        for start in range(0, xs.size, _BLOCK):
            c, f = _count_flushes_below(xs[start : start + _BLOCK], bound)
            nonzero, flushed = nonzero + c, flushed + f
    return nonzero, flushed
