"""Plane deltas (``xplanes``): byte planes, each stored either on its own or XORed with the base chunk's plane.

A delta of two nearby float states pays only in some planes: XOR leaves the
sign and exponent plane (and, for small updates, the high mantissa plane)
mostly zero, while the low mantissa planes are noise either way. Choosing per
plane keeps the XOR only where it compresses better than the plane on its
own, so restoring the chunk needs just those planes of the base, which a
reader fetches by range; the noise planes come from the delta alone.

The payload is a ``planes`` payload (see ``planes.py``) whose table marks each
XORed plane with bit 30. The stage cannot run without the base's planes, so it
has no plain :meth:`encode`/:meth:`decode`: the save pipeline calls
:meth:`encode_against` and ``Vault.read_chunk`` calls :meth:`decode_against`.
Readers that do not know the ``xplanes`` id refuse the chunk as written by a
newer version.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from .planes import KEEP_BELOW, SAMPLE, Buffer, BytePlanes, StoredPlane, assemble, sample_pieces, scratch, split_planes

#: a candidate whose sample compresses to under this fraction of the other's is chosen without
#: compressing the other; closer calls compress both and keep the smaller
CLEAR_WIN = 0.9
#: with only the base's high planes at hand: if the lowest of them changed in fewer than this fraction of
#: the sampled elements, most elements may be unchanged in every plane (rows a sparse optimizer did not
#: touch), so the low planes may XOR to zeros too, and the whole base is fetched. Nearby dense float
#: states change that plane in far more of their elements (figures: docs/benchmarks/incremental.md).
BARELY_CHANGED = 0.1


class PlaneDelta(BytePlanes):
    id = "xplanes"

    def encode(self, data: memoryview) -> bytes:
        raise ValueError("an xplanes payload is made against a base chunk's planes: use encode_against()")

    def decode(self, data: memoryview, out_size: int) -> memoryview:
        raise ValueError("an xplanes payload needs its base chunk's planes: read the chunk with Vault.read_chunk()")

    def decode_into_parts(self, data: memoryview, out_size: int, parts: list[memoryview]) -> None:
        self.decode(data, out_size)  # raises: as for decode, the base's planes are needed

    def encode_against(self, data: memoryview, base_planes: Sequence[np.ndarray | None],
                       whole_base: Callable[[], Sequence[np.ndarray]] | None = None) -> tuple[list[Buffer], bool]:
        """(payload as a list of buffers to concatenate, whether any plane is XORed) for ``data`` against the
        base chunk's planes. The buffers may view this thread's scratch memory: join them before this thread
        encodes again.

        A base plane may be None (not at hand: the keyframe cache keeps only high planes); that plane is
        stored on its own, unless the chunk barely changed in the planes at hand (``BARELY_CHANGED``) and
        ``whole_base`` is given: then it is called for all of the base's planes. With no plane XORed the
        payload reads as a plain ``planes`` payload and the chunk needs no base.
        """
        planes, tail = split_planes(data, self.typesize, scratch(len(data), "planes"))  # joined before returning
        if len(base_planes) != self.typesize or any(b is not None and len(b) != planes.shape[1] for b in base_planes):
            raise ValueError("base planes do not match the chunk's element count")
        if whole_base is not None and _barely_changed(planes, base_planes):
            base_planes = whole_base()
        stored = [self._choose(memoryview(planes[k]), base_planes[k]) for k in range(self.typesize)]
        return self.pack_parts(stored, tail), any(p.xor for p in stored)

    def _choose(self, plane: memoryview, base: np.ndarray | None) -> StoredPlane:
        """The smaller of ``plane`` stored on its own and ``plane`` XOR ``base``; an XOR must compress to win.

        Judged on samples: a plane whose samples both stay above ``KEEP_BELOW`` is stored raw, on its own;
        where one sample is clearly smaller only that one is compressed; otherwise both are, and compared.
        Without ``base`` the plane is stored on its own (compressed if that pays).
        """
        if base is None:
            return self.store_plane(plane)
        own, delta = self.sample_ratio(plane), self.sample_ratio(plane, xor_with=base)
        if min(own, delta) >= KEEP_BELOW:
            return StoredPlane(plane)  # noise either way: the XOR is never computed in full
        if delta < CLEAR_WIN * own:
            chosen = self.store_plane(_xored(plane, base), xor=True, ratio=delta)
            return chosen if chosen.compressed else StoredPlane(plane)
        alone = self.store_plane(plane, ratio=own)
        if own < CLEAR_WIN * delta:
            return alone
        chosen = self.store_plane(_xored(plane, base), xor=True, ratio=delta)
        return chosen if chosen.compressed and _size(chosen) < _size(alone) else alone

    def decode_against(self, data: memoryview, out_size: int, base_planes: Mapping[int, np.ndarray]) -> memoryview:
        """Invert :meth:`encode_against`; ``base_planes`` holds at least the base's planes that are XORed."""
        planes, entries, tail = self.decode_planes(data, out_size)
        for k, entry in enumerate(entries):
            if entry.xor:
                base = base_planes.get(k)
                if base is None or len(base) != len(planes[k]):
                    raise ValueError(f"plane {k} is XORed with the base, but the base's plane {k} is missing")
                planes[k] = np.bitwise_xor(planes[k], base, out=scratch(len(base), f"xor{k}"))
        return assemble(planes, tail, np.empty(out_size, dtype=np.uint8)).data


def _barely_changed(planes: np.ndarray, base_planes: Sequence[np.ndarray | None]) -> bool:
    """Whether some base planes are missing and the lowest one present changed in few sampled elements."""
    present = [k for k, b in enumerate(base_planes) if b is not None]
    if not present or len(present) == len(base_planes):
        return False
    k = present[0]
    plane, base, n = planes[k], base_planes[k], planes.shape[1]
    assert base is not None
    pieces = [slice(0, n)] if n <= 4 * SAMPLE else sample_pieces(n)  # where sample_ratio() looks
    changed = sum(np.count_nonzero(plane[piece] != base[piece]) for piece in pieces)
    return changed < BARELY_CHANGED * sum(piece.stop - piece.start for piece in pieces)


def _xored(plane: memoryview, base: np.ndarray) -> memoryview:
    """``plane`` XOR ``base`` in this thread's scratch memory: a chosen XOR is kept only compressed (a copy),
    so the scratch is free again once :meth:`PlaneDelta._choose` returns."""
    out = scratch(len(base), "xor")
    return np.bitwise_xor(np.frombuffer(plane, dtype=np.uint8), base, out=out).data


def _size(plane: StoredPlane) -> int:
    return len(memoryview(plane.data).cast("B"))
