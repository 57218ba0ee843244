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
import re
import warnings
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
        return None, validate_codec_name(name)
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
@dataclass
class Encoded:
    """A lossy encoding: the stored parts and the error it causes."""

    spec: LossySpec
    parts: dict[str, torch.Tensor]  # "q" is the primary part
    error: dict[str, float]


def encode(t: torch.Tensor, spec: LossySpec, base: torch.Tensor | None = None) -> Encoded:
    """Encode a contiguous CPU float tensor; ``base`` (same shape) is required for residual-int8."""
    if spec.kind == "bf16":
        parts = {"q": t.to(torch.bfloat16)}
    elif spec.kind == "fp16":
        parts = {"q": t.to(torch.float16)}
    elif spec.kind == "int8-block":
        parts = _int8_block(t.reshape(-1), spec.block)
    else:
        assert base is not None, "residual-int8 needs the keyframe tensor"
        parts = _int8_block((t.float() - base.float()).reshape(-1), spec.block)
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


def _int8_block(flat: torch.Tensor, block: int) -> dict[str, torch.Tensor]:
    padded = torch.nn.functional.pad(flat.float(), (0, -flat.numel() % block)).reshape(-1, block)
    scale = padded.abs().amax(dim=1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(padded / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return {"q": q.reshape(-1)[: flat.numel()].contiguous(), "scale": scale.contiguous()}


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

    Works through the tensors in blocks of ``block`` elements (float32
    scratch), so measuring a large tensor costs little extra memory.
    """
    a_all, b_all = original.reshape(-1), restored.reshape(-1)
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
    return {
        "max_abs": max_abs,
        "rel_l2": (err_sq / ref_sq) ** 0.5 if ref_sq > 0 else err_sq**0.5,
        "flushed": flushed / max(nonzero_total, 1),
        "overflow": overflow,
        "nan": nan,
    }


def unsafe_reason(error: dict[str, float], policy: SafetyPolicy) -> str | None:
    """Why an encoding destroys data, or None if it is acceptable."""
    if error["overflow"]:
        return f"{int(error['overflow'])} values overflowed to inf"
    if error["nan"]:
        return f"{int(error['nan'])} values became NaN"
    if error["flushed"] > policy.max_flushed:
        return f"{error['flushed']:.1%} of non-zero values flushed to zero (limit {policy.max_flushed:.1%})"
    return None


_FALLBACK = {"fp16": "bf16", "int8-block": "bf16", "bf16": None, "residual-int8": None}


def encode_safely(path: str, t: torch.Tensor, spec: LossySpec, policy: SafetyPolicy,
                  base: torch.Tensor | None = None) -> tuple[Encoded | None, list[str]]:
    """Encode per the safety policy. Returns (encoding or None for lossless, notes for the manifest)."""
    notes: list[str] = []
    current: LossySpec | None = spec
    while current is not None and applies_to(current, t.dtype):
        encoded = encode(t, current, base)
        reason = unsafe_reason(encoded.error, policy)
        if reason is None:
            return encoded, notes
        message = f"{current.name} on {path!r} is unsafe: {reason}"
        if policy.on_unsafe == "fail":
            raise LossyCodecError(f"{message}; choose a safer codec for it or pass on_unsafe='fallback'")
        if policy.on_unsafe == "keep":
            warnings.warn(f"{message}; kept because on_unsafe='keep'", RuntimeWarning, stacklevel=2)
            return encoded, [message]
        fallback = _FALLBACK[current.kind]
        notes.append(f"{message}; fell back to {fallback or 'lossless'}")
        warnings.warn(notes[-1], RuntimeWarning, stacklevel=2)
        current = replace(current, kind=fallback) if fallback else None
    return None, notes


def describe(spec: LossySpec) -> dict[str, Any]:
    return {"codec": spec.kind, "block": spec.block} if spec.kind in ("int8-block", "residual-int8") else {"codec": spec.kind}
