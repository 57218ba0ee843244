"""Cutting a checkpoint's arrays into fixed-size chunks (a pure function).

* A large array (at least ``pack_threshold`` bytes) starts its own run of
  chunks of ``chunk_size`` bytes, the last one shorter. Because each large
  array starts on a chunk boundary, an unchanged array produces identical
  chunks in every checkpoint, whatever changed before it.
* Small arrays are packed one after another into shared chunks, one pack per
  (codec, element size, group), so a state of 10,000 tiny tensors writes a
  handful of objects and shuffle still sees whole elements. The group keeps
  apart arrays of unlike content: the residuals of predictions that are nearly
  exact (almost all zero bits) from noisy arrays, so that each chunk's byte
  planes compress as one kind of data.

``chunk_size`` is a multiple of 64, so cuts always fall on element boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Source:
    """``length`` bytes of leaf ``leaf`` starting at byte ``start``."""

    leaf: int
    start: int
    length: int


@dataclass
class ChunkPlan:
    codec: str
    itemsize: int
    sources: list[Source] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(s.length for s in self.sources)


@dataclass(frozen=True)
class Piece:
    """Where a part of a leaf lives: ``length`` bytes at ``offset`` in chunk ``chunk``."""

    chunk: int
    offset: int
    length: int


@dataclass(frozen=True)
class LeafSpec:
    nbytes: int
    itemsize: int
    codec: str
    group: str = ""


def plan_chunks(
    leaves: list[LeafSpec], chunk_size: int, pack_threshold: int
) -> tuple[list[ChunkPlan], list[list[Piece]]]:
    """Return the chunks to build and, per leaf, the pieces that locate its bytes."""
    plans: list[ChunkPlan] = []
    pieces: list[list[Piece]] = [[] for _ in leaves]
    open_packs: dict[tuple[str, int, str], int] = {}
    filled: dict[int, int] = {}  # bytes in each pack so far (ChunkPlan.nbytes would make packing quadratic)
    for index, leaf in enumerate(leaves):
        if leaf.nbytes == 0:
            continue
        if leaf.nbytes >= pack_threshold:
            for start in range(0, leaf.nbytes, chunk_size):
                length = min(chunk_size, leaf.nbytes - start)
                plans.append(ChunkPlan(leaf.codec, leaf.itemsize, [Source(index, start, length)]))
                pieces[index].append(Piece(len(plans) - 1, 0, length))
            continue
        key = (leaf.codec, leaf.itemsize, leaf.group)
        slot = open_packs.get(key)
        if slot is None or filled[slot] + leaf.nbytes > chunk_size:
            plans.append(ChunkPlan(leaf.codec, leaf.itemsize))
            slot = open_packs[key] = len(plans) - 1
            filled[slot] = 0
        pieces[index].append(Piece(slot, filled[slot], leaf.nbytes))
        plans[slot].sources.append(Source(index, 0, leaf.nbytes))
        filled[slot] += leaf.nbytes
    return plans, pieces
