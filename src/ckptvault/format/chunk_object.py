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
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any

import blake3

from ..codecs import Spec, decode_chain
from ..errors import CorruptChunkError, FormatVersionError
from . import FORMAT_VERSION

MAGIC = b"CKVC"
_PREFIX = struct.Struct("<4sBBH")
HASH_NAME = "blake3"


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
    codec: list[Spec]
    raw: int
    base: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        body = {"base": self.base, "codec": self.codec, "raw": self.raw, **self.extra}
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


def parse_object(cid: str, data: bytes | memoryview) -> tuple[ChunkHeader, memoryview]:
    """Split a chunk object into header and payload; raises CorruptChunkError or FormatVersionError."""
    if len(data) < _PREFIX.size:
        raise CorruptChunkError(cid, f"object is {len(data)} bytes, shorter than its fixed header")
    magic, version, _reserved, head_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise CorruptChunkError(cid, f"bad magic {magic!r}")
    if version > FORMAT_VERSION:
        raise FormatVersionError(
            f"chunk {cid} uses chunk format version {version}; this ckptvault reads up to {FORMAT_VERSION}: upgrade"
        )
    end = _PREFIX.size + head_len
    try:
        body = json.loads(bytes(data[_PREFIX.size : end]))  # data may be a memoryview
        header = ChunkHeader(codec=list(body.pop("codec")), raw=int(body.pop("raw")), base=body.pop("base"), extra=body)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptChunkError(cid, f"unreadable chunk header ({exc})") from None
    return header, memoryview(data)[end:]


def decode_payload(cid: str, header: ChunkHeader, payload: memoryview,
                   base_raw: bytes | memoryview | None = None, verify: bool = True) -> bytes | memoryview:
    """Run the codec stages in reverse, apply the delta base if any, and verify the hash.

    Returns the raw bytes; raises CorruptChunkError on any mismatch. ``verify=False``
    skips only the final hash check: for a delta's base, whose bytes the delta's own
    check covers (a damaged base cannot reproduce the delta's hash).
    """
    try:
        data = decode_chain(payload, header.codec, header.raw)
    except FormatVersionError:
        raise
    except Exception as exc:  # any decoder failure means damaged bytes
        raise CorruptChunkError(cid, f"payload does not decode ({type(exc).__name__}: {exc})") from None
    if len(data) != header.raw:
        raise CorruptChunkError(cid, f"decoded to {len(data)} bytes, header says {header.raw}")
    if header.base is not None:
        if base_raw is None or len(base_raw) != header.raw:
            raise CorruptChunkError(cid, f"delta base {header.base} is missing or has the wrong length")
        from ..delta import xor

        data = xor(data, base_raw, in_place=True)  # data is this function's own decode output
    if verify and chunk_id(data) != cid:
        raise CorruptChunkError(cid, "BLAKE3 hash of the decoded bytes does not match the chunk name")
    return data


def decode_object(cid: str, data: bytes, base_raw: bytes | memoryview | None = None) -> bytes | memoryview:
    """Decode a whole chunk object (``base_raw``: raw bytes of its base, for a delta) and verify it."""
    header, payload = parse_object(cid, data)
    return decode_payload(cid, header, payload, base_raw)


def header_length(prefix: bytes) -> int:
    """Total bytes of fixed prefix + JSON header, from at least the first 8 bytes of an object."""
    return _PREFIX.size + _PREFIX.unpack_from(prefix)[3]
