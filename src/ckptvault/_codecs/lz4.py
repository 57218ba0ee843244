"""LZ4 block compression (the ``lz4`` package; releases the GIL)."""

from __future__ import annotations

import lz4.block

from .base import BytesStage, Spec

#: an LZ4 block decodes to at most about 255 bytes per byte (a match length grows by 255 per extra byte)
MAX_RATIO = 256


class Lz4(BytesStage):
    id = "lz4"

    def encode(self, data: memoryview) -> bytes:
        return lz4.block.compress(data, store_size=False)

    def decode(self, data: memoryview, out_size: int) -> bytes:
        """``out_size`` bytes (the block stores no size; the decoder writes at most ``out_size``). A block expands
        at most ``MAX_RATIO`` times, so a claim beyond that is refused before the output is allocated."""
        if out_size > MAX_RATIO * len(data) + 16:
            raise ValueError(f"an LZ4 block of {len(data)} bytes cannot hold {out_size} bytes")
        return lz4.block.decompress(data, uncompressed_size=out_size)

    def spec(self) -> Spec:
        return {"id": self.id}

    @classmethod
    def from_spec(cls, spec: Spec) -> Lz4:
        return cls()
