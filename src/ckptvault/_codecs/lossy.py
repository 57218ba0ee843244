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
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .._argcheck import check_kind
from .._feedback import warn_at_caller
from ..errors import InvalidArgumentError, LossyCodecError
from . import validate_codec_name

if TYPE_CHECKING:
    from .lossy_kernels import Sums

log = logging.getLogger(__name__)

LOSSY_KINDS = ("bf16", "fp16", "int8-block", "residual-int8")
ON_UNSAFE = ("fallback", "fail", "keep")
DEFAULT_BLOCK = 256
_NAME = re.compile(r"(?P<kind>bf16|fp16|int8-block|residual-int8)(?::(?P<param>\d+))?(?:\+(?P<lossless>[\w-]+))?$")


@dataclass(frozen=True)
class LossySpec:
    kind: str
    block: int = DEFAULT_BLOCK

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.block}" if self.kind in ("int8-block", "residual-int8") else self.kind


@dataclass(frozen=True)
class LossySafety:
    """What a save does with a lossy result that is unsafe: one that flushes more than ``max_flushed`` of the
    tensor's non-zero values to zero, overflows, or makes NaNs. ``on_unsafe``: ``"fallback"`` (the default)
    tries the next safer codec (fp16 -> bf16, ...; at the end lossless) and notes why in the tensor's manifest
    entry, ``"fail"`` fails the save with LossyCodecError, ``"keep"`` keeps the result and notes it. Each case
    other than a safe result also warns (RuntimeWarning)."""

    on_unsafe: str = "fallback"
    max_flushed: float = 0.05

    def __post_init__(self) -> None:
        if self.on_unsafe not in ON_UNSAFE:
            raise InvalidArgumentError(f"on_unsafe must be one of {ON_UNSAFE}, got {self.on_unsafe!r}")
        check_kind("max_flushed", self.max_flushed, int, float)
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


def _allocate(alloc: Alloc, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``alloc(name, shape, dtype)``, checked: the kernels write through its memory without bounds checks, so
    memory of another size, type or layout would be overrun, not refused."""
    t = alloc(name, shape, dtype)
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
        raise RuntimeError(f"the allocator returned a {t.dtype} tensor of shape {tuple(t.shape)} on {t.device} "
                           f"(contiguous: {t.is_contiguous()}) for {name!r}; asked for {dtype} {tuple(shape)}, "
                           "contiguous, on the CPU")
    return t


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

    The error is that of ``decode`` of the parts against ``t``. float32 tensors (with a float32 base) are
    encoded and measured in one pass per block by the fused kernels of :mod:`ckptvault._codecs.lossy_kernels`;
    others through torch, a full decode and :func:`measure`.
    ``give_up``: stop a float32 encoding as soon as more than this fraction of its non-zero values is known
    to flush, or one value overflowed or became NaN; the error then says ``"partial": True``, its flushed
    fraction covers the first ``"examined"`` of its ``"values"`` values (encoded, or counted without
    encoding), its other entries cover the blocks encoded, and the parts hold only those blocks (the result
    is unsafe for any ``max_flushed <= give_up``: such a result is for deciding, never for storing).
    """
    base = base if spec.kind == "residual-int8" else None  # only a residual has a base
    if t.dtype == torch.float32 and (base is None or base.dtype == torch.float32):
        return _encode_float32(t, spec, base, give_up, alloc)
    if spec.kind in ("bf16", "fp16"):  # copy_ rounds to nearest even, exactly as .to() does
        parts = {"q": _allocate(alloc, "q", tuple(t.shape), _CAST[spec.kind]).copy_(t)}
    elif spec.kind == "int8-block":
        parts = _int8_block(t.reshape(-1), spec.block, alloc)
    else:
        assert base is not None, "residual-int8 needs the keyframe tensor"
        parts = _int8_block((t.float() - base.float()).reshape(-1), spec.block, alloc)
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
#: values per fused-kernel call, first and at most: the calls grow from the first to the last size, so a doomed
#: attempt (one that will fall back) gives up after little work, and a long tensor costs few calls
_KERNEL_BLOCKS = (1 << 16, 1 << 20)


def _encode_float32(t: torch.Tensor, spec: LossySpec, base: torch.Tensor | None, give_up: float | None,
                    alloc: Alloc) -> Encoded:
    """:func:`encode` of a float32 tensor by the fused kernels, in calls of :data:`_KERNEL_BLOCKS` values.

    With ``give_up``: after each call, an overflow or NaN stops the encoding. Once the values encoded flush
    more than ``give_up`` of their non-zero values, :func:`_certainly_unsafe` counts the flushes of the rest
    without encoding them (``count_*_flushes``: about twice as cheap); a doomed attempt so stops after its
    first call and a count of a small part of the tensor, instead of encoding a large part of it."""
    from . import lossy_kernels  # numba: imported (and its kernels loaded) on first lossy use only

    flat = t.detach().reshape(-1)
    n = flat.numel()
    if spec.kind in ("bf16", "fp16"):
        q = _allocate(alloc, "q", tuple(t.shape), _CAST[spec.kind])
        parts, unit = {"q": q}, 1
        bits, out = _numpy(flat, torch.int32).view(np.uint32), _numpy(q.reshape(-1), torch.int16).view(np.uint16)
        cast = lossy_kernels.cast_bf16 if spec.kind == "bf16" else lossy_kernels.cast_fp16

        def run(lo: int, hi: int) -> Sums:
            return cast(bits[lo:hi], out[lo:hi])

        def count_cast(lo: int, hi: int) -> tuple[int, int]:
            return lossy_kernels.count_cast_flushes(bits[lo:hi], spec.kind == "fp16")
        count_flushes: Callable[[int, int], tuple[int, int]] | None = count_cast
    else:
        block = spec.block
        q = _allocate(alloc, "q", (-(-n // block), block), torch.int8)
        scale = _allocate(alloc, "scale", (q.shape[0],), torch.float32)
        parts, unit = {"q": q.reshape(-1)[:n], "scale": scale}, block
        values, out, scales = _numpy(flat), _numpy(q.reshape(-1)), _numpy(scale)
        bases = None if base is None else _numpy(base.detach().reshape(-1))

        def run(lo: int, hi: int) -> Sums:
            blocks = scales[lo // block : -(-hi // block)]
            if bases is None:
                return lossy_kernels.quantise_int8(values[lo:hi], block, out[lo:hi], blocks)
            return lossy_kernels.quantise_int8_residual(values[lo:hi], bases[lo:hi], block, out[lo:hi], blocks)

        def count_int8(lo: int, hi: int) -> tuple[int, int]:
            return lossy_kernels.count_int8_flushes(values[lo:hi], block)
        count_flushes = count_int8 if bases is None else None  # residuals: no cheap count
    total = _Sums()
    lo, step, counted = 0, _KERNEL_BLOCKS[0], False
    while lo < n:
        hi = min(n, lo + _whole(step, unit))
        total.add(run(lo, hi))
        lo, step = hi, min(2 * step, _KERNEL_BLOCKS[1])
        if give_up is None or lo >= n:
            continue
        if total.overflow or total.nan:
            return Encoded(spec, parts, {**total.result(), "partial": True, "examined": lo, "values": n})
        if not counted and total.flushed > give_up * total.nonzero:  # unsafe so far: is the whole tensor?
            counted = count_flushes is not None  # once; without a count, the worst case after every call
            examined = _certainly_unsafe(total, lo, n, give_up, count_flushes, unit)
            if examined is not None:
                return Encoded(spec, parts, {**total.result(), "partial": True, "examined": examined, "values": n})
    return Encoded(spec, parts, total.result())


def _whole(step: int, unit: int) -> int:
    """``step`` values rounded down to whole int8 blocks of ``unit`` (at least one)."""
    return max(unit, step - step % unit)


def _certainly_unsafe(total: _Sums, lo: int, n: int, give_up: float,
                      count_flushes: Callable[[int, int], tuple[int, int]] | None, unit: int) -> int | None:
    """With values ``[0, lo)`` of ``n`` encoded into ``total``: count the flushes of the values after them in
    pieces that double in size (none without ``count_flushes``), until more than ``give_up`` of the tensor's
    non-zero values certainly flush (even if every value not yet counted is non-zero and does not flush).
    Then ``total`` holds the counts of the values examined and their number is returned; None if that never
    happens (the tensor may be safe: it must be encoded to the end). The counts are exact for casts and a
    lower bound on the flushes for int8, which is all this needs."""
    nonzero, flushed, end, step = total.nonzero, total.flushed, lo, _KERNEL_BLOCKS[0]
    while flushed <= give_up * (nonzero + n - end):
        if count_flushes is None or end >= n:
            return None
        hi = min(n, end + _whole(step, unit))
        c, f = count_flushes(end, hi)
        nonzero, flushed, end, step = nonzero + c, flushed + f, hi, 2 * step
    total.nonzero, total.flushed = nonzero, flushed
    return end


def _numpy(t: torch.Tensor, dtype: torch.dtype | None = None) -> np.ndarray:
    """A numpy view of CPU tensor ``t`` (reinterpreted as ``dtype``): the kernels write through it."""
    return (t if dtype is None else t.view(dtype)).numpy()


class _Sums:
    """Running :data:`~ckptvault._codecs.lossy_kernels.Sums` over the blocks of one tensor."""

    def __init__(self) -> None:
        self.max_bits, self.err_sq, self.ref_sq = 0, 0.0, 0.0
        self.nonzero = self.flushed = self.overflow = self.nan = 0

    def add(self, sums: Sums) -> None:
        self.max_bits = max(self.max_bits, int(sums[0]))
        self.err_sq, self.ref_sq = self.err_sq + sums[1], self.ref_sq + sums[2]
        self.nonzero, self.flushed = self.nonzero + sums[3], self.flushed + sums[4]
        self.overflow, self.nan = self.overflow + sums[5], self.nan + sums[6]

    def result(self) -> dict[str, float]:
        max_abs = float(np.array(self.max_bits, dtype=np.uint32).view(np.float32))
        return _error_dict(max_abs, self.err_sq, self.ref_sq, self.flushed, self.nonzero, self.overflow, self.nan)


def _int8_block(flat: torch.Tensor, block: int, alloc: Alloc = fresh) -> dict[str, torch.Tensor]:
    """q = round(x / scale) per block of ``block`` elements, scale = absmax / 127 (a NaN or inf block gives a
    NaN scale, which ``measure`` reports); the torch reference of :func:`lossy_kernels.quantise_int8`."""
    x = flat.float()
    rows = torch.nn.functional.pad(x, (0, -x.numel() % block)).view(-1, block)
    scale = torch.maximum(torch.amax(rows, dim=1), torch.amin(rows, dim=1).neg_()) / 127.0  # aminmax(dim) is slower
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = _allocate(alloc, "q", tuple(rows.shape), torch.int8)
    q.copy_(torch.div(rows, safe[:, None]).round_().clamp_(-127, 127))
    return {"q": q.reshape(-1)[: flat.numel()], "scale": scale.contiguous()}


def _int8_unblock(q: torch.Tensor, scale: torch.Tensor, block: int, numel: int) -> torch.Tensor:
    padded = torch.nn.functional.pad(q.float(), (0, -numel % block)).reshape(-1, block)
    return (padded * scale[:, None]).reshape(-1)[:numel]


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
            block_max = float(diff.abs().max())
            max_abs = block_max if math.isnan(block_max) or block_max > max_abs else max_abs  # NaN sticks
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


def error_for_manifest(error: dict[str, float]) -> dict[str, float | str]:
    """``error`` with its non-finite numbers (an overflow's inf, a NaN's NaN) as the strings ``"inf"``,
    ``"-inf"``, ``"nan"``: manifests are strict JSON. ``float()`` of each string gives the number back."""
    return {k: v if isinstance(v, int) or math.isfinite(v) else str(v) for k, v in error.items()}


def unsafe_reason(error: dict[str, float], policy: LossySafety) -> str | None:
    """Why an encoding destroys data, or None if it is acceptable."""
    partial = error.get("partial")
    least = "at least " if partial else ""
    if error["overflow"]:
        return f"{least}{int(error['overflow'])} values overflowed to inf"
    if error["nan"]:
        return f"{least}{int(error['nan'])} values became NaN"
    if error["flushed"] > policy.max_flushed:
        part = f"; measured on the first {int(error['examined'])} of {int(error['values'])} values" if partial else ""
        return f"{error['flushed']:.1%} of non-zero values flushed to zero (limit {policy.max_flushed:.1%}{part})"
    return None


_FALLBACK = {"fp16": "bf16", "int8-block": "bf16", "bf16": None, "residual-int8": None}


def encode_safely(path: str, t: torch.Tensor, spec: LossySpec, policy: LossySafety,
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
            warn_at_caller(notes[-1], RuntimeWarning)  # the user's save() line, also from a worker
            return encoded, notes
        fallback = _FALLBACK[current.kind]
        notes.append(f"{message}; fell back to {fallback or 'lossless'}")
        warn_at_caller(notes[-1], RuntimeWarning)  # the user's save() line, also from a worker
        current = replace(current, kind=fallback) if fallback else None
    return None, notes


def describe(spec: LossySpec) -> dict[str, Any]:
    return {"codec": spec.kind, "block": spec.block} if spec.kind in ("int8-block", "residual-int8") else {"codec": spec.kind}
