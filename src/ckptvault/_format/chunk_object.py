"""Chunk objects: an immutable encoded chunk, named by the BLAKE3 hash of its raw bytes.

Byte layout (format version 1)::

    offset  size  field
    0       4     magic b"CKVC"
    4       1     format version (1)
    5       1     reserved, 0
    6       2     header length H, little-endian unsigned
    8       H     header: UTF-8 JSON, keys sorted, no spaces:
                  {"base": null | "<hex id of the chunk this is a delta against>",
                   "codec": [stage spec, ...], "raw": <raw length>}
    8+H     ...   payload: the raw bytes after every codec stage, in order

Decoding runs the stages in reverse and then checks that BLAKE3(raw) equals
the object's name, so a flipped bit anywhere is caught.

A damaged or hostile object costs a reader no more memory than a chunk: the
header is checked in full before anything is decoded (:func:`parse_object`),
``raw`` is bounded by the vault's chunk size, and each decoder refuses data that
claims more than ``raw`` bytes before it allocates them.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import blake3

from .._codecs import MAX_STAGES, Spec, check_chain, decode_chain, decode_chain_into_parts
from .._codecs.base import shown
from .._codecs.xor import xor
from ..errors import CorruptChunkError, FormatVersionError, OversizedObjectError
from . import FORMAT_VERSION
from .schema import MAX_CHUNK_SIZE

MAGIC = b"CKVC"
_PREFIX = struct.Struct("<4sBBH")
#: the most raw bytes a chunk of any vault holds: the bound where no vault is named
MAX_RAW = MAX_CHUNK_SIZE
#: the keys of a header, every one required
HEADER_FIELDS = ("base", "codec", "raw")
#: the most '[' and '{' in a valid header (the header, its chain, a stage and its inner stage per stage): more is
#: refused before the JSON parser recurses into it
MAX_OPENERS = 2 + 2 * MAX_STAGES
_CHUNK_ID = re.compile(r"[0-9a-f]{64}")


def chunk_id(raw: bytes | memoryview) -> str:
    """The name of a chunk: hex BLAKE3-256 of its raw bytes."""
    return blake3.blake3(memoryview(raw).cast("B")).hexdigest()


#: every chunk object's key starts with this
CHUNKS_PREFIX = "chunks/"


def chunk_key(cid: str) -> str:
    """Storage key of a chunk; a two-hex-digit fan-out keeps directories small."""
    return f"{CHUNKS_PREFIX}{cid[:2]}/{cid}"


@dataclass(frozen=True)
class ChunkHeader:
    """A chunk object's header: its codec chain, raw length and delta base. One that :func:`parse_object`
    returns was checked field by field; a header with a key outside ``HEADER_FIELDS`` is refused, not kept."""

    codec: list[Spec]
    raw: int
    base: str | None = None

    def to_bytes(self) -> bytes:
        body = {"base": self.base, "codec": self.codec, "raw": self.raw}
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def encode_object(header: ChunkHeader, payload: bytes | memoryview | list[Any]) -> bytes:
    """Serialise a chunk object (header + payload) into one bytes object. ``payload`` may be a list of
    buffers to concatenate (so a payload in parts is copied once, here)."""
    return b"".join(object_parts(header, payload))


def object_parts(header: ChunkHeader, payload: bytes | memoryview | list[Any]) -> list[Any]:
    """The chunk object of :func:`encode_object` as the list of buffers it concatenates (for a writer that
    copies them to their destination itself: ``WriteBatch.put_parts_if_absent``)."""
    head = header.to_bytes()
    return [_PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(head)) + head, *(payload if isinstance(payload, list) else [payload])]


def parse_object(cid: str, data: bytes | memoryview, *, max_raw: int | None = None,
                 expected_raw: int | None = None) -> tuple[ChunkHeader, memoryview]:
    """Split a chunk object (or just its prefix and header: the payload may be cut off) into its checked header
    and its payload. Nothing is decoded and nothing allocated beyond the header.

    ``max_raw``: the vault's chunk size (None: ``MAX_RAW``, the largest any vault has); ``expected_raw``: the raw
    length the caller knows the chunk has (a manifest's chunk table), refused if the header says otherwise.
    Raises CorruptChunkError naming the field at fault, FormatVersionError for a newer version, stage id or
    header field.
    """
    if len(data) < _PREFIX.size:
        raise CorruptChunkError(cid, f"object is {len(data)} bytes, shorter than its fixed header")
    magic, version, _reserved, head_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise CorruptChunkError(cid, f"bad magic {magic!r}")
    if version > FORMAT_VERSION:
        raise FormatVersionError(
            f"chunk {cid} uses chunk format version {version}; this ckptvault reads up to {FORMAT_VERSION}: upgrade"
        )
    if version < 1:
        raise CorruptChunkError(cid, f"format version {version} (versions start at 1)")
    end = _PREFIX.size + head_len
    if end > len(data):
        raise CorruptChunkError(cid, f"its {head_len}-byte header runs past the end of the {len(data)}-byte object")
    body = _header_body(cid, bytes(data[_PREFIX.size : end]))  # data may be a memoryview
    return _checked_header(cid, body, max_raw, expected_raw), memoryview(data)[end:]


def _header_body(cid: str, head: bytes) -> dict[str, Any]:
    """The header's JSON object. Its nesting is bounded before it is parsed (a deep one would recurse)."""
    openers = head.count(b"[") + head.count(b"{")
    if openers > MAX_OPENERS:
        raise CorruptChunkError(cid, f"header holds {openers} '[' and '{{', more than a chunk header can ({MAX_OPENERS})")
    try:
        body = json.loads(head.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CorruptChunkError(cid, f"unreadable chunk header ({str(exc)[:200]})") from None
    if not isinstance(body, dict):
        raise CorruptChunkError(cid, f"header is a JSON {type(body).__name__}, not an object")
    return body


def _checked_header(cid: str, body: dict[str, Any], max_raw: int | None, expected_raw: int | None) -> ChunkHeader:
    """``body`` as a ChunkHeader once every field checks out. A missing field is damage; an unknown one, with every
    known one present, was added by a newer writer (a flipped bit in a key name loses a required key)."""
    for name in HEADER_FIELDS:
        if name not in body:
            raise CorruptChunkError(cid, f"header lacks field {name!r}")
    unknown = sorted(set(body) - set(HEADER_FIELDS))
    if unknown:
        raise FormatVersionError(f"chunk {cid} has header fields {[k[:40] for k in unknown[:5]]} this ckptvault does "
                                 "not know: it was written by a newer ckptvault, upgrade to read it")
    try:
        check_chain(body["codec"])
    except (TypeError, ValueError) as exc:
        raise CorruptChunkError(cid, f"header field 'codec' {exc}") from None
    except FormatVersionError as exc:  # an unknown stage id: name the chunk, as every chunk error does
        raise FormatVersionError(f"chunk {cid}: header field 'codec': {exc}") from None
    return ChunkHeader(codec=body["codec"], raw=_checked_raw(cid, body["raw"], max_raw, expected_raw),
                       base=_checked_base(cid, body["base"]))


def _checked_raw(cid: str, raw: Any, max_raw: int | None, expected_raw: int | None) -> int:
    """Header field ``raw``: an int (not a bool) in 0..max_raw, equal to ``expected_raw`` where that is known."""
    if type(raw) is not int:
        raise CorruptChunkError(cid, f"header field 'raw' is {shown(raw)}, not an integer")
    if raw < 0:
        raise CorruptChunkError(cid, f"header field 'raw' is {raw}, below 0")
    if raw > (MAX_RAW if max_raw is None else max_raw):
        bound = f"the largest chunk size {MAX_RAW}" if max_raw is None else f"the vault's chunk size {max_raw}"
        raise CorruptChunkError(cid, f"header field 'raw' is {raw}, above {bound}")
    if expected_raw is not None and raw != expected_raw:
        raise CorruptChunkError(cid, f"header field 'raw' is {raw}, but the chunk is listed with {expected_raw} bytes")
    return raw


def _checked_base(cid: str, base: Any) -> str | None:
    """Header field ``base``: null, or the id of another chunk (64 lowercase hex digits)."""
    if base is None:
        return None
    if not isinstance(base, str) or not _CHUNK_ID.fullmatch(base):
        raise CorruptChunkError(cid, f"header field 'base' is {shown(base)}, not null or a chunk id (64 lowercase hex digits)")
    if base == cid:
        raise CorruptChunkError(cid, "header field 'base' names the chunk itself")
    return base


def decode_payload(cid: str, header: ChunkHeader, payload: memoryview,
                   base_raw: bytes | memoryview | None = None, verify: bool = True,
                   out: memoryview | None = None) -> bytes | memoryview:
    """Run the codec stages in reverse, apply the delta base if any, and verify the hash.

    Returns the raw bytes; raises CorruptChunkError on any mismatch. ``verify=False``
    skips only the final hash check: for a delta's base, whose bytes the delta's own
    check covers (a damaged base cannot reproduce the delta's hash). ``out``: where the
    last codec stage may write the raw bytes (:func:`decode_chain`).
    """
    with _decoder_failures(cid):
        data = decode_chain(payload, header.codec, header.raw, out)
    if len(data) != header.raw:
        raise CorruptChunkError(cid, f"decoded to {len(data)} bytes, header says {header.raw}")
    if header.base is not None:
        if base_raw is None or len(base_raw) != header.raw:
            raise CorruptChunkError(cid, f"delta base {header.base} is missing or has the wrong length")
        data = xor(data, base_raw, in_place=True)  # data is this function's own decode output
    if verify and chunk_id(data) != cid:
        raise CorruptChunkError(cid, HASH_MISMATCH)
    return data


def decode_payload_into_parts(cid: str, header: ChunkHeader, payload: memoryview, parts: list[memoryview]) -> None:
    """:func:`decode_payload` of a full chunk (no delta base), its raw bytes written across ``parts`` (consecutive
    writable byte views adding up to ``header.raw``) and verified there. Raises CorruptChunkError on any mismatch,
    with the parts' bytes then unspecified; ValueError if the parts do not add up or the chunk is a delta."""
    if header.base is not None:
        raise ValueError(f"chunk {cid} is a delta: decode it with its base")
    if sum(len(p) for p in parts) != header.raw:
        raise ValueError(f"parts of {sum(len(p) for p in parts)} bytes cannot take chunk {cid} ({header.raw} bytes)")
    with _decoder_failures(cid):
        decode_chain_into_parts(payload, header.codec, header.raw, parts)
    hasher = blake3.blake3()
    for part in parts:
        hasher.update(part)
    if hasher.hexdigest() != cid:
        raise CorruptChunkError(cid, HASH_MISMATCH)


#: why a chunk whose decoded bytes are not what its name says is refused
HASH_MISMATCH = "BLAKE3 hash of the decoded bytes does not match the chunk name"


@contextmanager
def _decoder_failures(cid: str) -> Iterator[None]:
    """Any decoder failure as a CorruptChunkError naming chunk ``cid`` (a newer format's FormatVersionError as
    it is)."""
    try:
        yield
    except FormatVersionError:
        raise
    except Exception as exc:  # any decoder failure means damaged bytes
        raise CorruptChunkError(cid, f"payload does not decode ({type(exc).__name__}: {exc})") from None


def decode_object(cid: str, data: bytes, base_raw: bytes | memoryview | None = None, *,
                  max_raw: int | None = None) -> bytes | memoryview:
    """Decode a whole chunk object (``base_raw``: raw bytes of its base, for a delta) and verify it.
    ``max_raw``: as for :func:`parse_object`."""
    header, payload = parse_object(cid, data, max_raw=max_raw)
    return decode_payload(cid, header, payload, base_raw)


#: bytes a chunk object may hold beyond its raw length: the fixed prefix, the largest header, a plane table
_OBJECT_OVERHEAD = _PREFIX.size + 0xFFFF + 4096


def max_object_size(chunk_size: int) -> int:
    """The most bytes a chunk object of a vault with ``chunk_size`` can hold (its payload is never larger than
    its raw bytes plus a plane table: a chunk that does not shrink is stored raw); readers pass it to
    ``Store.get`` so that an oversized object is refused before it is read."""
    return chunk_size + _OBJECT_OVERHEAD


def read_object(store: Any, cid: str, chunk_size: int, transient: bool = False) -> bytes | memoryview:
    """The stored bytes of chunk object ``cid`` (with ``transient``, in the thread's reused read buffer:
    ``Store.get_transient``), refused as CorruptChunkError if larger than a chunk object can be. Raises
    ObjectNotFoundError if it is missing."""
    get = store.get_transient if transient else store.get
    try:
        return get(chunk_key(cid), max_object_size(chunk_size))
    except OversizedObjectError as exc:
        raise CorruptChunkError(cid, f"the object is {exc.size} bytes, more than a chunk object of this vault can be "
                                     f"({exc.limit})") from None


def header_length(prefix: bytes) -> int:
    """Total bytes of fixed prefix + JSON header, from at least the first 8 bytes of an object."""
    return _PREFIX.size + _PREFIX.unpack_from(prefix)[3]
