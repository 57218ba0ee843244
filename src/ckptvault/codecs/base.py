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


class BytesStage(abc.ABC):
    """One bytes -> bytes transform. Instances are immutable and thread-safe."""

    id: ClassVar[str]

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
        """Invert :meth:`encode`; ``out_size`` is the length of the decoded bytes."""

    @abc.abstractmethod
    def spec(self) -> Spec:
        """The JSON spec that :func:`stage_from_spec` turns back into this stage."""

    @classmethod
    @abc.abstractmethod
    def from_spec(cls, spec: Spec) -> BytesStage:
        """Build the stage from its spec."""


def stage_from_spec(spec: Spec) -> BytesStage:
    """Instantiate a stage from its JSON spec; unknown ids raise FormatVersionError."""
    try:
        cls = _REGISTRY[spec["id"]]
    except KeyError:
        raise FormatVersionError(
            f"unknown codec stage {spec.get('id')!r}; this chunk was written by a newer ckptvault, upgrade to read it"
        ) from None
    return cls.from_spec(spec)
