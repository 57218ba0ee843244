"""Zstandard compression (the ``zstandard`` package; releases the GIL)."""

from __future__ import annotations

import threading

import zstandard

from .base import BytesStage, Spec

_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cache[level]


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

    def decode(self, data: memoryview, out_size: int) -> bytes:
        return _decompressor().decompress(data, max_output_size=out_size)

    def spec(self) -> Spec:
        return {"id": self.id, "level": self.level}

    @classmethod
    def from_spec(cls, spec: Spec) -> Zstd:
        return cls(int(spec.get("level", 1)))
