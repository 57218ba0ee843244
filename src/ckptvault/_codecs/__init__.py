"""Lossless codec chains and the named settings users pick them by.

Named codecs (per vault, overridable per tensor by key-path rules):

=========  ====================================================
``zstd``   byte planes by element size, zstd level 1 on planes that pay (default)
``lz4``    byte planes, LZ4 on planes that pay (faster, compresses less)
``none``   stored raw; ``fast`` is an alias, for fast local disks
=========  ====================================================

``zstd-N`` picks zstd level N. Whatever the name, a chunk that does not shrink
is stored raw, so no chunk grows by more than its small header.
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import InvalidArgumentError
from .base import BytesStage, Spec, copy_into_parts, stage_from_spec
from .lz4 import Lz4
from .planes import BytePlanes
from .shuffle import Shuffle
from .xplanes import PlaneDelta
from .zstd import Zstd

__all__ = [
    "CODEC_NAMES", "MAX_STAGES", "BytePlanes", "BytesStage", "PlaneDelta", "Shuffle", "Spec", "chain_for", "check_chain",
    "decode_chain", "decode_chain_into_parts", "encode_chain", "stage_from_spec",
]

CODEC_NAMES = ("zstd", "lz4", "none", "fast")
DEFAULT_CODEC = "zstd"
#: the most stages a chunk's chain may hold: every writer so far chains at most one (planes over zstd is one)
MAX_STAGES = 4


def validate_codec_name(name: str) -> str:
    """Return ``name`` if it names a codec, else raise InvalidArgumentError."""
    if name in CODEC_NAMES or re.fullmatch(r"zstd-(\d{1,2})", name):
        if name.startswith("zstd-") and not 1 <= int(name[5:]) <= 22:
            raise InvalidArgumentError(f"zstd level must be 1..22, got {name!r}")
        return name
    raise InvalidArgumentError(f"unknown codec {name!r}; choose one of {', '.join(CODEC_NAMES)} or zstd-N (N=1..22)")


def chain_for(name: str, itemsize: int) -> list[BytesStage]:
    """The stages of codec ``name`` for data whose elements are ``itemsize`` bytes."""
    name = validate_codec_name(name)
    if name in ("none", "fast"):
        return []
    level = int(name[5:]) if name.startswith("zstd-") else 1
    inner: BytesStage = Lz4() if name == "lz4" else Zstd(level)
    return [BytePlanes(itemsize, inner)]


def encode_chain(raw: memoryview, stages: list[BytesStage]) -> tuple[list[Spec], bytes | memoryview]:
    """Run ``stages`` over ``raw``; fall back to no stages if the result is not smaller."""
    data: bytes | memoryview = raw
    for stage in stages:
        data = stage.encode(memoryview(data))
    if stages and len(data) < len(raw):
        return [s.spec() for s in stages], data
    return [], raw


def check_chain(specs: Any) -> None:
    """Check a chunk header's codec chain without decoding anything: a list of at most ``MAX_STAGES`` stage
    specs that :func:`stage_from_spec` accepts. Raises TypeError or ValueError naming the stage and setting,
    FormatVersionError for an unknown stage id."""
    if not isinstance(specs, list):
        raise TypeError(f"must be a list of stage specs, got {type(specs).__name__}")
    if len(specs) > MAX_STAGES:
        raise ValueError(f"holds {len(specs)} stages, more than {MAX_STAGES}")
    for i, spec in enumerate(specs):
        try:
            stage_from_spec(spec)
        except TypeError as exc:
            raise TypeError(f"stage {i}: {exc}") from None
        except ValueError as exc:
            raise ValueError(f"stage {i}: {exc}") from None


def decode_chain(payload: memoryview, specs: list[Spec], raw_size: int,
                 out: memoryview | None = None) -> bytes | memoryview:
    """Invert :func:`encode_chain`. Sizes of intermediate stages equal ``raw_size``
    (shuffle preserves length), so every decoder is bounded by it. ``out``: where the last stage may write the
    raw bytes (``BytesStage.decode_into``); the result is a view of it or memory of the chain's own."""
    data: bytes | memoryview = payload
    for n, spec in enumerate(reversed(specs)):
        stage = stage_from_spec(spec)
        last = n == len(specs) - 1
        data = stage.decode_into(memoryview(data), raw_size, out) if last and out is not None else \
            stage.decode(memoryview(data), raw_size)
    return data


def decode_chain_into_parts(payload: memoryview, specs: list[Spec], raw_size: int, parts: list[memoryview]) -> None:
    """:func:`decode_chain`, the raw bytes written across ``parts`` (consecutive byte views adding up to
    ``raw_size``) by the last stage (``BytesStage.decode_into_parts``)."""
    data: bytes | memoryview = payload
    for spec in reversed(specs[1:]):
        data = stage_from_spec(spec).decode(memoryview(data), raw_size)
    if specs:
        stage_from_spec(specs[0]).decode_into_parts(memoryview(data), raw_size, parts)
    else:
        copy_into_parts(data, parts)
