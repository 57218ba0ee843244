"""Codec stages: bytes -> bytes transforms with JSON-serialisable settings.

A stage is described by a spec, a small JSON object such as
``{"id": "zstd", "level": 1}``. Specs are stored in every chunk header, so a
chunk decodes with nothing but its own bytes. Stages must be deterministic and
exactly invertible (lossless); lossy casts are array -> array stages and live
elsewhere.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

from ..errors import FormatVersionError

Spec = dict[str, Any]

_REGISTRY: dict[str, type[BytesStage]] = {}


def copy_into_parts(data: bytes | memoryview, parts: list[memoryview]) -> None:
    """Copy ``data`` across ``parts``, consecutive byte views whose lengths must add up to its length."""
    source = memoryview(data).cast("B")
    if len(source) != sum(len(p) for p in parts):
        raise ValueError(f"decoded to {len(source)} bytes, expected {sum(len(p) for p in parts)}")
    at = 0
    for part in parts:
        part[:] = source[at : at + len(part)]
        at += len(part)


class BytesStage(abc.ABC):
    """One bytes -> bytes transform. Instances are immutable and thread-safe."""

    id: ClassVar[str]
    #: the keys a spec of this stage may hold besides ``id`` (its :meth:`from_spec` checks their values)
    settings: ClassVar[frozenset[str]] = frozenset()
    #: whether the stage wraps an ``inner`` stage (which may not wrap one of its own)
    takes_inner: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if getattr(cls, "id", None):
            _REGISTRY[cls.id] = cls

    @abc.abstractmethod
    def encode(self, data: memoryview) -> bytes | memoryview:
        """Transform ``data``; must not modify it."""

    def encode_sampled(self, data: memoryview, sample_ratio: float | None) -> bytes | memoryview:
        """:meth:`encode`, told how well a sample of ``data`` compressed with this stage (compressed / raw; None:
        not sampled), for a stage that searches differently on sparse data. The output decodes the same way."""
        return self.encode(data)

    @abc.abstractmethod
    def decode(self, data: memoryview, out_size: int) -> bytes | memoryview:
        """Invert :meth:`encode`; ``out_size`` is the length of the decoded bytes. Never allocates or returns
        more than ``out_size`` bytes (``data`` that claims more raises ValueError before anything is decoded)."""

    def decode_into(self, data: memoryview, out_size: int, out: memoryview) -> bytes | memoryview:
        """:meth:`decode`, into the writable ``out`` (at least ``out_size`` bytes) where this stage can write there
        (the result is then a view of ``out``), else into memory of its own, as :meth:`decode`. Reusing ``out``
        spares a restore fresh memory, which is slow to fault in."""
        return self.decode(data, out_size)

    def decode_into_parts(self, data: memoryview, out_size: int, parts: list[memoryview]) -> None:
        """:meth:`decode`, its bytes written across ``parts`` in order (writable byte views whose lengths add up to
        ``out_size``). This stage decodes into memory of its own and copies; a stage that can write each part in
        place overrides it."""
        copy_into_parts(self.decode(data, out_size), parts)

    @abc.abstractmethod
    def spec(self) -> Spec:
        """The JSON spec that :func:`stage_from_spec` turns back into this stage."""

    @classmethod
    @abc.abstractmethod
    def from_spec(cls, spec: Spec) -> BytesStage:
        """Build the stage from its spec (only known keys, :func:`stage_from_spec` checked); raises ValueError or
        TypeError naming the setting whose value is out of range or of the wrong type."""


def stage_from_spec(spec: Spec, inner: bool = False) -> BytesStage:
    """Instantiate a stage from its JSON spec (``inner``: the spec is another stage's ``inner``).

    Unknown ids raise FormatVersionError (a newer ckptvault adds stages, never settings of a stage: DESIGN.md
    sections 3 and 10); a spec that is not an object, holds keys its stage does not know, nests an inner stage in an
    inner one, or whose settings are of the wrong type or out of range raises TypeError or ValueError.
    """
    if not isinstance(spec, dict):
        raise TypeError(f"a stage spec must be a JSON object, got {shown(spec)}")
    stage_id = spec.get("id")
    if not isinstance(stage_id, str):
        raise TypeError(f"a stage spec's 'id' must be a string, got {shown(stage_id)}")
    cls = _REGISTRY.get(stage_id)
    if cls is None:
        raise FormatVersionError(
            f"unknown codec stage {stage_id[:40]!r}; this chunk was written by a newer ckptvault, upgrade to read it"
        )
    unknown = sorted(set(spec) - {"id"} - cls.settings)
    if unknown:
        raise ValueError(f"stage {stage_id!r} has settings it does not take: {[k[:40] for k in unknown[:5]]}")
    if inner and cls.takes_inner:  # bounds the nesting: what the planes stages write is one level deep
        raise ValueError(f"stage {stage_id!r} wraps a stage of its own, so it cannot be another stage's inner stage")
    return cls.from_spec(spec)


def int_setting(spec: Spec, name: str, low: int, high: int, default: int | None = None) -> int:
    """Setting ``name`` of ``spec``: an int (not a bool) in ``low..high``; ``default`` where it may be absent.
    Raises ValueError if it is absent without a default or out of range, TypeError if it is not an int."""
    if name not in spec:
        if default is None:
            raise ValueError(f"stage {spec.get('id')!r} lacks its setting {name!r}")
        return default
    value = spec[name]
    if type(value) is not int:  # JSON gives int, float, bool, str...: only a plain int is a setting
        raise TypeError(f"setting {name!r} of stage {spec.get('id')!r} must be an integer, got {shown(value)}")
    if not low <= value <= high:
        raise ValueError(f"setting {name!r} of stage {spec.get('id')!r} is {value}, outside {low}..{high}")
    return value


def shown(value: Any) -> str:
    """A value as an error message shows it: its repr, cut short (a hostile header may hold 64 KB of it)."""
    text = repr(value)
    return f"{text[:60]}... ({type(value).__name__})" if len(text) > 60 else f"{text} ({type(value).__name__})"
