"""Unit tests of chunk planning (``ckptvault._save.chunking.plan_chunks``), a pure function.

Properties: the pieces of every leaf tile it exactly once, in order; every chunk's sources and the
pieces pointing into it agree; no chunk exceeds ``chunk_size``; every cut falls on an element boundary;
large leaves start on a chunk boundary (so an unchanged tensor yields identical chunks whatever precedes
it); small leaves share packs per (codec, element size); empty leaves get no pieces.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ckptvault._save.chunking import LeafSpec, Piece, plan_chunks

CHUNK = 1024
THRESHOLD = CHUNK // 4


@st.composite
def leaf_specs(draw: st.DrawFn) -> LeafSpec:
    itemsize = draw(st.sampled_from([1, 2, 4, 8, 16]))
    count = draw(st.one_of(st.integers(0, THRESHOLD // itemsize + 2), st.integers(0, 5 * CHUNK // itemsize)))
    return LeafSpec(count * itemsize, itemsize, draw(st.sampled_from(["zstd", "lz4", "none"])))


@given(st.lists(leaf_specs(), max_size=40))
def test_pieces_tile_every_leaf_exactly_once(leaves: list[LeafSpec]) -> None:
    plans, pieces = plan_chunks(leaves, CHUNK, THRESHOLD)
    assert len(pieces) == len(leaves)
    covered: dict[int, list[tuple[int, int, int]]] = {}  # chunk -> (offset, length, leaf)
    for index, (leaf, leaf_pieces) in enumerate(zip(leaves, pieces)):
        assert sum(p.length for p in leaf_pieces) == leaf.nbytes
        assert all(p.length > 0 for p in leaf_pieces)
        if leaf.nbytes == 0:
            assert leaf_pieces == []
        start = 0
        for piece in leaf_pieces:
            source = _source_at(plans[piece.chunk], piece)
            assert (source.leaf, source.start, source.length) == (index, start, piece.length)  # in order, contiguous
            assert start % leaf.itemsize == 0 and piece.length % leaf.itemsize == 0  # element boundaries
            covered.setdefault(piece.chunk, []).append((piece.offset, piece.length, index))
            start += piece.length
    for chunk, plan in enumerate(plans):
        assert 0 < plan.nbytes <= CHUNK
        spans = sorted(covered[chunk])
        assert [s[:2] for s in spans] == [(off, n) for off, n in _offsets(plan)]  # sources == pieces, no gap/overlap
        assert all(leaves[s.leaf].codec == plan.codec and leaves[s.leaf].itemsize == plan.itemsize for s in plan.sources)


def _source_at(plan, piece: Piece):  # type: ignore[no-untyped-def]
    offset = 0
    for source in plan.sources:
        if offset == piece.offset:
            return source
        offset += source.length
    raise AssertionError(f"no source starts at offset {piece.offset}")


def _offsets(plan) -> list[tuple[int, int]]:  # type: ignore[no-untyped-def]
    out, offset = [], 0
    for source in plan.sources:
        out.append((offset, source.length))
        offset += source.length
    return out


@given(st.lists(leaf_specs(), max_size=20), st.sampled_from([1, 2, 4, 8]), st.integers(1, 6))
def test_large_leaf_chunks_do_not_depend_on_what_precedes(prefix: list[LeafSpec], itemsize: int, chunks: int) -> None:
    big = LeafSpec(chunks * CHUNK - 3 * itemsize, itemsize, "zstd")
    alone_plans, alone = plan_chunks([big], CHUNK, THRESHOLD)
    plans, pieces = plan_chunks([*prefix, big], CHUNK, THRESHOLD)
    assert [(p.offset, p.length) for p in pieces[-1]] == [(p.offset, p.length) for p in alone[-1]]
    assert all(p.offset == 0 and len(plans[p.chunk].sources) == 1 for p in pieces[-1])  # owns its chunks
    assert [p.length for p in pieces[-1]] == [CHUNK] * (chunks - 1) + [CHUNK - 3 * itemsize]


def test_big_array_cut_into_full_chunks_with_short_tail() -> None:
    plans, pieces = plan_chunks([LeafSpec(2 * CHUNK + 100, 4, "zstd")], CHUNK, THRESHOLD)
    assert [(p.chunk, p.offset, p.length) for p in pieces[0]] == [(0, 0, CHUNK), (1, 0, CHUNK), (2, 0, 100)]
    assert [plan.nbytes for plan in plans] == [CHUNK, CHUNK, 100]


def test_threshold_boundary() -> None:
    plans, pieces = plan_chunks([LeafSpec(THRESHOLD - 4, 4, "zstd"), LeafSpec(THRESHOLD, 4, "zstd")], CHUNK, THRESHOLD)
    assert len(plans) == 2 and pieces[1] == [Piece(1, 0, THRESHOLD)]  # at the threshold: its own chunk
    assert [len(p.sources) for p in plans] == [1, 1]


def test_small_arrays_packed_per_codec_and_itemsize() -> None:
    leaves = [LeafSpec(8, 4, "zstd"), LeafSpec(8, 2, "zstd"), LeafSpec(12, 4, "zstd"), LeafSpec(8, 4, "none"),
              LeafSpec(0, 4, "zstd"), LeafSpec(4, 2, "zstd")]
    plans, pieces = plan_chunks(leaves, CHUNK, THRESHOLD)
    assert [(p.codec, p.itemsize, [s.leaf for s in p.sources]) for p in plans] == [
        ("zstd", 4, [0, 2]), ("zstd", 2, [1, 5]), ("none", 4, [3])]
    assert pieces[2] == [Piece(0, 8, 12)] and pieces[5] == [Piece(1, 8, 4)] and pieces[4] == []


def test_full_pack_opens_a_new_one() -> None:
    leaves = [LeafSpec(200, 4, "zstd") for _ in range(12)]  # 5 fit in 1024 bytes
    plans, pieces = plan_chunks(leaves, CHUNK, THRESHOLD)
    assert [len(p.sources) for p in plans] == [5, 5, 2]
    assert pieces[5] == [Piece(1, 0, 200)]


def test_ten_thousand_tiny_leaves_make_few_chunks() -> None:
    leaves = [LeafSpec(12, 4, "zstd") for _ in range(10_000)]
    plans, _ = plan_chunks(leaves, 4 << 20, 1 << 20)
    assert len(plans) == 1
