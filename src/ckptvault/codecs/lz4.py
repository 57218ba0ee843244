"""LZ4 block compression (the ``lz4`` package; releases the GIL)."""

from __future__ import annotations

import lz4.block

from .base import BytesStage, Spec


class Lz4(BytesStage):
    id = "lz4"

    def encode(self, data: memoryview) -> bytes:
        return lz4.block.compress(data, store_size=False)

    def decode(self, data: memoryview, out_size: int) -> bytes:
        return lz4.block.decompress(data, uncompressed_size=out_size)

    def spec(self) -> Spec:
        return {"id": self.id}

    @classmethod
    def from_spec(cls, spec: Spec) -> Lz4:
        return cls()
