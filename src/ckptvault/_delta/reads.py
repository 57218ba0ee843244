"""Reading delta bases: a base chunk's byte planes, whole and verified for a save, by range for a restore.

A plane delta (``_codecs/xplanes.py``) needs only the base's planes that it
XORs. A restore reads the base's header and plane table, then one range
holding those planes, so a delta chunk costs about as much I/O as a full
one. A save reads the whole base and checks it against its hash before
encoding against it, so a delta is never built on damaged bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from .._codecs import stage_from_spec
from .._codecs.planes import BytePlanes, assemble, plane_table, scratch, split_planes
from .._codecs.xplanes import PlaneDelta
from .._format.chunk_object import (
    HASH_MISMATCH,
    ChunkHeader,
    chunk_id,
    chunk_key,
    decode_payload,
    header_length,
    parse_object,
    read_object,
)
from ..errors import CorruptChunkError, ObjectNotFoundError
from ..stores import Store

#: bytes read first from a base: the fixed prefix, the JSON header and the plane table fit in it
HEAD_READ = 4096


def is_plane_delta(header: ChunkHeader) -> bool:
    return header.base is not None and len(header.codec) == 1 and header.codec[0].get("id") == PlaneDelta.id


def base_planes_for_save(store: Store, base_id: str, typesize: int, *, max_raw: int) -> list[np.ndarray]:
    """Every byte plane of full chunk ``base_id``, checked against its hash. The planes may view this
    thread's read buffer (``Store.get_transient``): use them before this thread reads a base again.
    ``max_raw``: the vault's chunk size (a header claiming more is refused before decoding).

    Raises ObjectNotFoundError if it is gone, CorruptChunkError if it is damaged or is itself a delta.
    """
    header, payload = parse_object(base_id, read_object(store, base_id, max_raw, transient=True), max_raw=max_raw)
    if header.base is not None:
        raise CorruptChunkError(base_id, "it is itself a delta, so it cannot be a delta base")
    stage = _planes_stage(header)
    if stage is None or stage.typesize != typesize:
        return list(split_planes(decode_payload(base_id, header, payload), typesize)[0])
    try:
        planes, _entries, tail = stage.decode_planes(payload, header.raw)
    except Exception as exc:  # any decoder failure means damaged bytes
        raise CorruptChunkError(base_id, f"payload does not decode ({type(exc).__name__}: {exc})") from None
    if chunk_id(assemble(planes, tail, scratch(header.raw, "verify")).data) != base_id:
        raise CorruptChunkError(base_id, HASH_MISMATCH)
    return planes


def read_plane_delta(store: Store, cid: str, header: ChunkHeader, payload: memoryview, max_raw: int) -> memoryview:
    """Raw bytes of plane-delta chunk ``cid`` (``header`` as :func:`parse_object` checked it), verified. ``max_raw``:
    the vault's chunk size, for the base's header. Raises CorruptChunkError naming the damaged object."""
    assert header.base is not None
    try:
        stage = PlaneDelta.from_spec(header.codec[0])
        entries, _ = plane_table(payload, stage.typesize, header.raw)
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptChunkError(cid, f"payload does not decode ({type(exc).__name__}: {exc})") from None
    needed = [k for k, entry in enumerate(entries) if entry.xor]
    base = _base_planes_by_range(store, cid, header.base, stage.typesize, needed, header.raw, max_raw)
    try:
        data = stage.decode_against(payload, header.raw, base)
    except Exception as exc:
        raise CorruptChunkError(cid, f"payload does not decode ({type(exc).__name__}: {exc})") from None
    if chunk_id(data) != cid:
        _blame_base(store, cid, header.base, max_raw)
        raise CorruptChunkError(cid, HASH_MISMATCH)
    return data


def _base_planes_by_range(store: Store, cid: str, base_id: str, typesize: int, needed: list[int],
                          raw_size: int, max_raw: int) -> dict[int, np.ndarray]:
    """Planes ``needed`` of base ``base_id``, read with as few ranged reads as the base's layout allows; its plane
    table is checked against ``raw_size`` first, so no range asked for exceeds the chunk."""
    if not needed:
        return {}
    key = chunk_key(base_id)
    with _blamed_on_base(cid, base_id):
        head = store.get_range(key, 0, HEAD_READ)
        start = header_length(head) if len(head) >= 8 else 0
        if start + 1 + 4 * typesize > len(head):
            head = store.get_range(key, 0, start + 1 + 4 * typesize)
        base_header, table = parse_object(base_id, head, max_raw=max_raw)
    if base_header.base is not None:
        raise CorruptChunkError(cid, f"its delta base {base_id} is itself a delta (chains are limited to 1)")
    if base_header.raw != raw_size:
        raise CorruptChunkError(cid, f"its delta base {base_id} holds {base_header.raw} bytes, the delta {raw_size}")
    stage = _planes_stage(base_header)
    with _blamed_on_base(cid, base_id):
        if stage is None or stage.typesize != typesize:  # stored raw or in another layout: read it whole
            planes = split_planes(_decode_base(store, base_id, False, max_raw), typesize)[0]  # the delta's check covers it
            return {k: planes[k] for k in needed}
        entries = plane_table(table, typesize, raw_size)[0]
        return _ranged_planes(store, key, start, stage, entries, needed, raw_size // typesize)


def _ranged_planes(store: Store, key: str, payload_start: int, stage: BytePlanes, entries: list, needed: list[int],
                   plane_len: int) -> dict[int, np.ndarray]:
    first = min(entries[k].offset for k in needed)
    last = max(entries[k].offset + entries[k].length for k in needed)
    span = memoryview(store.get_range(key, payload_start + first, last - first))
    if len(span) != last - first:
        raise ValueError(f"object ends {last - first - len(span)} bytes before its plane table says")
    return {k: stage.decode_plane(k, span[entries[k].offset - first : entries[k].offset - first + entries[k].length],
                                  entries[k], plane_len) for k in needed}


def _decode_base(store: Store, base_id: str, verify: bool, max_raw: int) -> bytes | memoryview:
    header, payload = parse_object(base_id, read_object(store, base_id, max_raw), max_raw=max_raw)
    return decode_payload(base_id, header, payload, verify=verify)


def _blame_base(store: Store, cid: str, base_id: str, max_raw: int) -> None:
    """After a delta failed its hash check: raise naming the base if the base is the damaged object."""
    with _blamed_on_base(cid, base_id):
        _decode_base(store, base_id, True, max_raw)


@contextmanager
def _blamed_on_base(cid: str, base_id: str) -> Iterator[None]:
    """Turn a missing or damaged base (or a malformed plane table, ValueError) into the delta's CorruptChunkError."""
    try:
        yield
    except ObjectNotFoundError:
        raise CorruptChunkError(cid, f"its delta base {base_id} is missing") from None
    except CorruptChunkError as exc:  # before ValueError: it is one
        raise CorruptChunkError(cid, f"its delta base {base_id} is corrupt: {exc.reason}") from None
    except ValueError as exc:
        raise CorruptChunkError(cid, f"its delta base {base_id} is corrupt: {exc}") from None


def _planes_stage(header: ChunkHeader) -> BytePlanes | None:
    """The chunk's byte-planes stage if that is its whole codec chain, else None."""
    if len(header.codec) != 1 or header.codec[0].get("id") != BytePlanes.id:
        return None
    stage = stage_from_spec(header.codec[0])
    return stage if isinstance(stage, BytePlanes) else None
