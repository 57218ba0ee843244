"""Lossy codecs: array -> array stages chosen per tensor by rules, with measured error.

A codec name in a rule is ``LOSSY[:PARAM][+LOSSLESS]`` or a lossless name:

=====================  =====================================================
``bf16``               round to bfloat16 (nearest even); restore casts back
``fp16``               round to float16 (nearest even)
``int8-block[:B]``     int8 with one float32 scale (absmax/127) per block of B
                       elements (default 256), rounded to nearest
``residual-int8[:B]``  weights as the int8-block-quantised difference from
                       the same tensor in the keyframe, which is stored exactly;
                       the error scales with how far the weights moved and
                       never accumulates (every residual is against the exact
                       keyframe). In a keyframe the tensor is stored exactly.
``+zstd``, ``+lz4``..  the lossless codec for the stored bytes (default: the
                       vault's codec); ``lossless`` names the vault's codec
=====================  =====================================================

Lossy codecs apply only to floating-point tensors wider than the target
(bf16/fp16 apply to float32/float64; int8 to any float); any other tensor is
stored losslessly. Every lossy tensor's error is measured on the whole tensor:
max abs error, relative L2 error, the fraction of non-zero values flushed to
zero, and values that became inf or NaN. A result is *unsafe* when more than
``max_flushed`` of the non-zero values were flushed or any value overflowed or
became NaN; then, per ``on_unsafe``: ``"fallback"`` (default) tries the next
safer codec (fp16 -> bf16 -> lossless, int8 -> bf16 -> lossless, residual ->
lossless) and warns, ``"fail"`` raises :class:`LossyCodecError`, ``"keep"``
keeps the result and warns.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from .codecs import validate_codec_name
from .errors import InvalidArgumentError, VaultError

log = logging.getLogger(__name__)

LOSSY_KINDS = ("bf16", "fp16", "int8-block", "residual-int8")
ON_UNSAFE = ("fallback", "fail", "keep")
DEFAULT_BLOCK = 256
_NAME = re.compile(r"(?P<kind>bf16|fp16|int8-block|residual-int8)(?::(?P<param>\d+))?(?:\+(?P<lossless>[\w-]+))?$")


class LossyCodecError(VaultError, ValueError):
    """A lossy codec would destroy data (flush, overflow, NaN) and ``on_unsafe="fail"``."""


@dataclass(frozen=True)
class LossySpec:
    kind: str
    block: int = DEFAULT_BLOCK

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.block}" if self.kind in ("int8-block", "residual-int8") else self.kind


@dataclass(frozen=True)
class SafetyPolicy:
    on_unsafe: str = "fallback"
    max_flushed: float = 0.05

    def __post_init__(self) -> None:
        if self.on_unsafe not in ON_UNSAFE:
            raise InvalidArgumentError(f"on_unsafe must be one of {ON_UNSAFE}, got {self.on_unsafe!r}")
        if not 0 <= self.max_flushed <= 1:
            raise InvalidArgumentError(f"max_flushed must be within [0, 1], got {self.max_flushed}")


def parse_codec(name: str, default_lossless: str) -> tuple[LossySpec | None, str]:
    """Split a rule's codec name into (lossy spec or None, lossless codec name)."""
    if name == "lossless":
        return None, default_lossless
    match = _NAME.fullmatch(name)
    if match is None:
        try:
            return None, validate_codec_name(name)
        except InvalidArgumentError as exc:
            if name.startswith("zstd-"):
                raise
            raise InvalidArgumentError(f"{exc}, 'lossless', or a lossy codec: bf16, fp16, int8-block[:B], "
                                       "residual-int8[:B], optionally +LOSSLESS (e.g. 'fp16+lz4')") from None
    block = int(match["param"]) if match["param"] else DEFAULT_BLOCK
    if match["param"] and match["kind"] in ("bf16", "fp16"):
        raise InvalidArgumentError(f"{match['kind']} takes no parameter, got {name!r}")
    if not 8 <= block <= 1 << 20:
        raise InvalidArgumentError(f"block size must be 8..1048576, got {block} in {name!r}")
    lossless = match["lossless"] or "lossless"
    return LossySpec(match["kind"], block), default_lossless if lossless == "lossless" else validate_codec_name(lossless)


def applies_to(spec: LossySpec, dtype: torch.dtype) -> bool:
    """Whether ``spec`` may shrink a tensor of ``dtype``."""
    if not dtype.is_floating_point or dtype.itemsize < 2:
        return False
    if spec.kind in ("bf16", "fp16"):
        return dtype.itemsize > 2
    return True


# -- encoding ---------------------------------------------------------------
#: where an encoding puts its output parts: (part name, shape, dtype) -> an uninitialised tensor
Alloc = Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]


def fresh(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The default :data:`Alloc`: new memory for every part."""
    return torch.empty(shape, dtype=dtype)


@dataclass
class Encoded:
    """A lossy encoding: the stored parts and the error it causes."""

    spec: LossySpec
    parts: dict[str, torch.Tensor]  # "q" is the primary part
    error: dict[str, float]


def encode(t: torch.Tensor, spec: LossySpec, base: torch.Tensor | None = None, give_up: float | None = None,
           alloc: Alloc = fresh) -> Encoded:
    """Encode a contiguous CPU float tensor; ``base`` (same shape) is required for residual-int8.

    The primary part ``"q"`` goes to memory from ``alloc`` (a reused buffer makes the cast several
    times faster than fresh memory, which page-faults).

    The error is that of ``decode`` of the parts against ``t``: float32 tensors are measured block by
    block in scratch buffers (:func:`_measure_parts`), others through a full decode and :func:`measure`.
    ``give_up``: stop measuring a float32 tensor as soon as more than this fraction of all its values is
    known to be flushed, or one overflowed or became NaN; the error then covers the blocks measured and
    says ``"partial": True`` (the result is unsafe for any ``max_flushed <= give_up``, and a bf16/fp16
    result is cast only as far as it was measured: such a result is for deciding, never for storing).
    """
    base = base if spec.kind == "residual-int8" else None  # only a residual has a base
    fast = t.dtype == torch.float32 and (base is None or base.dtype == torch.float32)
    if spec.kind in ("bf16", "fp16"):  # copy_ rounds to nearest even, exactly as .to() does
        q = alloc("q", tuple(t.shape), _CAST[spec.kind])
        if fast:  # cast block by block while measuring, so each block is read from memory once
            parts = {"q": q}
            return Encoded(spec, parts, _measure_parts(t.reshape(-1), spec, parts, None, give_up, cast=True))
        parts = {"q": q.copy_(t)}
    elif spec.kind == "int8-block":
        parts = _int8_block(t.reshape(-1), spec.block, alloc)
    else:
        assert base is not None, "residual-int8 needs the keyframe tensor"
        parts = _int8_block((t.float() - base.float()).reshape(-1), spec.block, alloc)
    if fast:
        return Encoded(spec, parts, _measure_parts(t.reshape(-1), spec, parts, base, give_up))
    restored = decode(spec, parts, t.dtype, list(t.shape), base)
    return Encoded(spec, parts, measure(t, restored))


def decode(spec: LossySpec, parts: dict[str, torch.Tensor], dtype: torch.dtype, shape: list[int],
           base: torch.Tensor | None = None) -> torch.Tensor:
    """Invert :func:`encode` into a tensor of the original ``dtype`` and ``shape``."""
    if spec.kind in ("bf16", "fp16"):
        return parts["q"].to(dtype).reshape(shape)
    values = _int8_unblock(parts["q"], parts["scale"], spec.block, _numel(shape))
    if spec.kind == "residual-int8":
        assert base is not None, "residual-int8 needs the keyframe tensor"
        values = base.float().reshape(-1) + values
    return values.to(dtype).reshape(shape)


_CAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _int8_block(flat: torch.Tensor, block: int, alloc: Alloc = fresh) -> dict[str, torch.Tensor]:
    """q = round(x / scale) per block of ``block`` elements, scale = absmax / 127 (a NaN or inf block gives a
    NaN scale, which ``measure`` reports). Works through rows in slices with one scratch buffer."""
    x = flat.float()
    full = x.numel() - x.numel() % block
    rows = x[:full].view(-1, block)
    if full < x.numel():
        rows = torch.cat([rows, torch.nn.functional.pad(x[full:], (0, block - x.numel() + full)).view(1, block)])
    scale = torch.maximum(torch.amax(rows, dim=1), torch.amin(rows, dim=1).neg_()) / 127.0  # aminmax(dim) is slower
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = alloc("q", tuple(rows.shape), torch.int8)
    step = max(1, _MEASURE_BLOCK // block)
    scratch = _scratch("quantise", 1, min(step, rows.shape[0]) * block, torch.float32).view(-1, block)
    for r0 in range(0, rows.shape[0], step):
        buf = scratch[: min(step, rows.shape[0] - r0)]
        torch.div(rows[r0 : r0 + step], safe[r0 : r0 + step, None], out=buf)
        q[r0 : r0 + step].copy_(buf.round_().clamp_(-127, 127))
    return {"q": q.reshape(-1)[: flat.numel()], "scale": scale.contiguous()}


def _int8_unblock(q: torch.Tensor, scale: torch.Tensor, block: int, numel: int) -> torch.Tensor:
    padded = torch.nn.functional.pad(q.float(), (0, -numel % block)).reshape(-1, block)
    return (padded * scale[:, None]).reshape(-1)[:numel]


_MEASURE_BLOCK = 1 << 20  # elements per block of the fast measurement (4 MiB of float32 scratch)
_CAST_BLOCK = 1 << 18  # elements per block of a bf16/fp16 cast and its measurement: small enough to stay in cache
_local = threading.local()
_TINY = 2.0**-60  # a block's sum of squares above this: squares that underflow (< 2^-126 each) are negligible


def _scratch(name: str, rows: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """A (rows, n) scratch buffer of this thread, kept for the next call: fresh memory costs a page fault per
    4 KiB, which made small tensors several times slower to encode than large ones."""
    cache = _local.__dict__.setdefault("scratch", {})
    buf = cache.get(name)
    if buf is None or buf.shape[1] < n or buf.shape[0] != rows:
        buf = cache[name] = torch.empty((rows, max(n, _MEASURE_BLOCK)), dtype=dtype)
    return buf[:, :n]


def _measure_parts(flat: torch.Tensor, spec: LossySpec, parts: dict[str, torch.Tensor],
                   base: torch.Tensor | None, give_up: float | None = None, cast: bool = False) -> dict[str, float]:
    """``measure(flat, decode(spec, parts, ...))`` for float32 ``flat``, without full-size temporaries.

    ``cast`` (bf16/fp16): ``parts["q"]`` is still empty; each block is cast into it just before it is
    measured, while the block is in cache. When measuring stops early, the rest is never cast.

    Each block is decoded into a scratch buffer exactly as :func:`decode` computes it. Sums of squares
    are float32 dot products (relative error ~1e-5). A block whose sums or extremes are not finite, or
    whose sum of squares is so small (< 2^-60) that squares lost to underflow could matter, is measured
    again in float64 (as :func:`measure` does).
    """
    n = flat.numel()
    step = _CAST_BLOCK if spec.kind in ("bf16", "fp16") else max(1, _MEASURE_BLOCK // spec.block) * spec.block
    scratch = _scratch("measure", 3, min(step, n), torch.float32)
    flags = _scratch("flags", 2, min(step, n), torch.bool)
    base_flat = None if base is None else base.reshape(-1)
    total = _Totals()
    for start in range(0, n, step):
        a = flat[start : start + step]
        restored, diff, squares = (buf[: a.numel()] for buf in scratch)
        if cast:
            parts["q"].view(-1)[start : start + step].copy_(a)
        _decode_range(spec, parts, start, base_flat, restored)
        zeros = _cast_has_zeros(parts["q"].view(-1)[start : start + step], squares) if cast else None
        total.add(a, restored, diff, squares, flags[:, : a.numel()], spec.kind != "residual-int8", zeros)
        if give_up is not None and (total.overflow or total.nan or total.flushed > give_up * n) and start + step < n:
            return {**total.result(), "partial": True}  # certainly unsafe: the rest would not change that
    return total.result()


def _decode_range(spec: LossySpec, parts: dict[str, torch.Tensor], start: int, base: torch.Tensor | None,
                  out: torch.Tensor) -> None:
    """Elements ``start:start+len(out)`` of ``decode(spec, parts, float32, ...)`` into ``out``
    (``start`` is a multiple of the int8 block)."""
    out.copy_(parts["q"].reshape(-1)[start : start + out.numel()])
    if spec.kind in ("bf16", "fp16"):
        return
    first, full = start // spec.block, out.numel() // spec.block
    out[: full * spec.block].view(full, spec.block).mul_(parts["scale"][first : first + full, None])
    if full * spec.block < out.numel():
        out[full * spec.block :].mul_(parts["scale"][first + full])
    if base is not None:
        torch.add(base[start : start + out.numel()], out, out=out)


def _cast_has_zeros(q: torch.Tensor, scratch: torch.Tensor) -> bool | None:
    """False if 16-bit float ``q`` certainly has no zero (either sign), else None (count them). On the int16
    view, whose abs is <= 0 only for +0.0 (0) and -0.0 (-32768 stays negative): half the bytes of float32."""
    bits = q.view(torch.int16)
    return None if int(torch.abs(bits, out=scratch.view(torch.int16)[: bits.numel()]).amin()) <= 0 else False


def _zeros(x: torch.Tensor, scratch: torch.Tensor) -> int:
    """How many elements of float32 ``x`` are zero (either sign). |x| goes to ``scratch``; the count runs
    only if its minimum is 0, on the int32 view (3x faster than counting floats)."""
    if not x.numel() or float(torch.abs(x, out=scratch).amin()) != 0.0:
        return 0
    return x.numel() - int(torch.count_nonzero(scratch.view(torch.int32)))


class _Totals:
    """Running sums of :func:`measure`'s statistics over blocks."""

    def __init__(self) -> None:
        self.max_abs = self.err_sq = self.ref_sq = 0.0
        self.flushed = self.nonzero = self.overflow = self.nan = 0

    def add(self, a: torch.Tensor, b: torch.Tensor, diff: torch.Tensor, squares: torch.Tensor,
            flags: torch.Tensor, keeps_zeros: bool, b_has_zeros: bool | None = None) -> None:
        """Add block ``a`` (original) / ``b`` (restored); ``keeps_zeros``: ``a == 0`` implies ``b == 0``;
        ``b_has_zeros=False``: already known, so ``b``'s zeros are not counted."""
        torch.sub(b, a, out=diff)
        lo, hi = (float(v) for v in torch.aminmax(diff))
        err, ref = float(torch.dot(diff, diff)), float(torch.dot(a, a))
        zeros = 0 if b_has_zeros is False else _zeros(b, squares)
        exact_zeros = keeps_zeros and not zeros  # then a has no zeros either: no need to look
        nonzero = a.numel() - (0 if exact_zeros else _zeros(a, squares))
        if not all(math.isfinite(v) for v in (lo, hi, err, ref)) or (ref < _TINY and nonzero):
            self._merge(_measure_sums(a, b))  # float64, exact for any values
            return
        self.max_abs = max(self.max_abs, -lo, hi)
        self.err_sq, self.ref_sq, self.nonzero = self.err_sq + err, self.ref_sq + ref, self.nonzero + nonzero
        if not zeros:
            return
        if keeps_zeros:
            self.flushed += nonzero - (b.numel() - zeros)
        else:  # count the zeros of b where a was not zero
            torch.logical_and(torch.ne(a, 0, out=flags[0]), torch.eq(b, 0, out=flags[1]), out=flags[0])
            self.flushed += int(torch.count_nonzero(flags[0]))

    def _merge(self, block: dict[str, float]) -> None:
        self.max_abs = max(self.max_abs, block["max_abs"])
        self.err_sq, self.ref_sq = self.err_sq + block["err_sq"], self.ref_sq + block["ref_sq"]
        self.flushed, self.nonzero = self.flushed + int(block["flushed"]), self.nonzero + int(block["nonzero"])
        self.overflow, self.nan = self.overflow + int(block["overflow"]), self.nan + int(block["nan"])

    def result(self) -> dict[str, float]:
        return _error_dict(self.max_abs, self.err_sq, self.ref_sq, self.flushed, self.nonzero, self.overflow, self.nan)


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def measure(original: torch.Tensor, restored: torch.Tensor, block: int = 1 << 22) -> dict[str, float]:
    """Max abs error, relative L2 error, flushed fraction, and new infs/NaNs of ``restored``.

    The reference implementation (float64 sums, exact for any values): works through the tensors in
    blocks of ``block`` elements, so measuring a large tensor costs little extra memory.
    """
    sums = _measure_sums(original.reshape(-1), restored.reshape(-1), block)
    return _error_dict(sums["max_abs"], sums["err_sq"], sums["ref_sq"], int(sums["flushed"]), int(sums["nonzero"]),
                       int(sums["overflow"]), int(sums["nan"]))


def _measure_sums(a_all: torch.Tensor, b_all: torch.Tensor, block: int = 1 << 22) -> dict[str, float]:
    max_abs, err_sq, ref_sq = 0.0, 0.0, 0.0
    flushed = nonzero_total = overflow = nan = 0
    for start in range(0, a_all.numel(), block):
        a, b = a_all[start : start + block].float(), b_all[start : start + block].float()
        finite = torch.isfinite(a)
        diff = torch.where(finite, b - a, torch.zeros_like(a))
        if diff.numel():
            max_abs = max(max_abs, float(diff.abs().max()))
        err_sq += float(torch.sum(diff.double() ** 2))
        ref_sq += float(torch.sum(torch.where(finite, a, torch.zeros_like(a)).double() ** 2))
        nonzero = (a != 0) & finite
        nonzero_total += int(nonzero.sum())
        flushed += int((nonzero & (b == 0)).sum())
        overflow += int((finite & torch.isinf(b)).sum())
        nan += int((~torch.isnan(a) & torch.isnan(b)).sum())
    return {"max_abs": max_abs, "err_sq": err_sq, "ref_sq": ref_sq, "flushed": flushed, "nonzero": nonzero_total,
            "overflow": overflow, "nan": nan}


def _error_dict(max_abs: float, err_sq: float, ref_sq: float, flushed: int, nonzero: int, overflow: int,
                nan: int) -> dict[str, float]:
    return {
        "max_abs": max_abs,
        "rel_l2": (err_sq / ref_sq) ** 0.5 if ref_sq > 0 else err_sq**0.5,
        "flushed": flushed / max(nonzero, 1),
        "overflow": overflow,
        "nan": nan,
    }


def unsafe_reason(error: dict[str, float], policy: SafetyPolicy) -> str | None:
    """Why an encoding destroys data, or None if it is acceptable."""
    least, part = ("at least ", "; measured on part of the tensor") if error.get("partial") else ("", "")
    if error["overflow"]:
        return f"{least}{int(error['overflow'])} values overflowed to inf"
    if error["nan"]:
        return f"{least}{int(error['nan'])} values became NaN"
    if error["flushed"] > policy.max_flushed:
        return f"{error['flushed']:.1%} of non-zero values flushed to zero (limit {policy.max_flushed:.1%}{part})"
    return None


_FALLBACK = {"fp16": "bf16", "int8-block": "bf16", "bf16": None, "residual-int8": None}


def encode_safely(path: str, t: torch.Tensor, spec: LossySpec, policy: SafetyPolicy,
                  base: torch.Tensor | None = None, alloc: Alloc = fresh) -> tuple[Encoded | None, list[str]]:
    """Encode per the safety policy. Returns (encoding or None for lossless, notes for the manifest).
    ``alloc``: as for :func:`encode`; each attempt of a fallback reuses it."""
    notes: list[str] = []
    current: LossySpec | None = spec
    while current is not None and applies_to(current, t.dtype):
        encoded = encode(t, current, base, None if policy.on_unsafe == "keep" else policy.max_flushed, alloc)
        reason = unsafe_reason(encoded.error, policy)
        if reason is None:
            return encoded, notes
        message = f"{current.name} on {path!r} is unsafe: {reason}"
        if policy.on_unsafe == "fail":
            raise LossyCodecError(f"{message}; choose a safer codec for it or pass on_unsafe='fallback'")
        if policy.on_unsafe == "keep":
            notes.append(f"{message}; kept because on_unsafe='keep'")
            warnings.warn(notes[-1], RuntimeWarning, stacklevel=2)
            return encoded, notes
        fallback = _FALLBACK[current.kind]
        notes.append(f"{message}; fell back to {fallback or 'lossless'}")
        warnings.warn(notes[-1], RuntimeWarning, stacklevel=2)
        current = replace(current, kind=fallback) if fallback else None
    return None, notes


def describe(spec: LossySpec) -> dict[str, Any]:
    return {"codec": spec.kind, "block": spec.block} if spec.kind in ("int8-block", "residual-int8") else {"codec": spec.kind}
