"""Manifests: the one object per checkpoint whose creation commits it.

A manifest file is JSON with its own checksum around the exact bytes of the
body (verified without re-encoding)::

    {"blake3":"<64 hex digits>","manifest":<body JSON>}

The prefix has a fixed length of 88 bytes; the body is every byte between it
and the final ``}``. A body of ``PACK_FROM`` bytes or more is stored packed:
zstd-compressed, in base64, as the one field of a small body that requires the
``packed`` feature (readers that do not know it refuse it with
FormatVersionError); smaller ones stay readable with ``jq``, and ``ckptvault
show URL STEP --manifest`` prints any. Body fields are documented in docs/DESIGN.md.
"""

from __future__ import annotations

import base64
import json
from dataclasses import replace
from typing import Any

import blake3
import zstandard

from ..errors import CorruptManifestError, InvalidArgumentError
from . import jsontext
from .keys import step_of_manifest_key
from .records import Manifest
from .remembered import Remembered
from .schema import MANIFEST_FORMAT, MAX_CHUNK_SIZE, MAX_STEP, PACKED, check_manifest, packed_text

_PREFIX = b'{"blake3":"'
_MIDDLE = b'","manifest":'
_BODY_START = len(_PREFIX) + 64 + len(_MIDDLE)
#: bodies of at least this many bytes are stored packed (a state of some 40 tensors and more; the demo GPT's
#: manifest with predictions shrinks about 5.6 times)
PACK_FROM = 8 << 10
#: the most bytes a packed body may unpack to, and to how many times its frame's size (manifests pack about 6
#: times): a larger claim is refused as damaged, never inflated
MAX_UNPACKED, MAX_RATIO = 1 << 30, 256


def check_step(step: Any) -> int:
    """``step`` if it is an int a manifest key can name (20 decimal digits), else InvalidArgumentError."""
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        raise InvalidArgumentError(f"step must be an int from 0 to {MAX_STEP} (20 digits), got {step!r}")
    return step


def manifest_key(step: int) -> str:
    """Storage key of a step's manifest; zero-padded so keys sort by step."""
    return f"manifests/{step:020d}.json"


def step_of_key(key: str) -> int | None:
    """The step a manifest key names (exactly ``manifests/<20 ASCII digits>.json``), or None for any other key."""
    return step_of_manifest_key(key)


def encode_manifest(body: dict[str, Any] | Manifest) -> bytes:
    """Serialise a manifest (or a manifest body, as JSON) with its checksum. Both give the same bytes for the same
    manifest. ValueError for a body with a non-finite float (manifests are strict JSON)."""
    if isinstance(body, Manifest):
        data = _manifest_text(body)
    else:  # a body made by hand (tools, tests): checked as a Manifest's fields are where they are made
        json.dumps(body, allow_nan=False)
        data = jsontext.dumps(body)
    if len(data) >= PACK_FROM:
        data = _pack(data)
    digest = blake3.blake3(data).hexdigest().encode()
    return b"".join((_PREFIX, digest, _MIDDLE, data, b"}"))


def _pack(text: bytes) -> bytes:
    """The packed body holding body ``text``: zstd level 1 (fast; the JSON's repetition is what it removes)."""
    frame = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(text)
    return b'{"format":"%s","version":1,"requires":["%s"],"%s":"%s"}' % (
        MANIFEST_FORMAT.encode(), PACKED.encode(), PACKED.encode(), base64.b64encode(frame))


def _unpack(body: Any, what: str) -> Any:
    """The body a packed ``body`` holds, parsed; ``body`` itself if it is not packed. CorruptManifestError for
    a packed body that does not unpack to a JSON object, or holds another packed body."""
    text = packed_text(body, what)
    if text is None:
        return body
    try:
        frame = base64.b64decode(text, validate=True)
        size, most = zstandard.frame_content_size(frame), min(MAX_UNPACKED, MAX_RATIO * len(frame))
        if not 0 <= size <= most:  # checked first: decompress() allocates what the frame claims
            raise zstandard.ZstdError(f"its frame of {len(frame)} bytes claims {size} (-1: unknown), not 0..{most}")
        stream = zstandard.ZstdDecompressor().decompressobj()
        inner = stream.decompress(frame)
        if not stream.eof or stream.unused_data:
            raise zstandard.ZstdError("it is not exactly one complete zstd frame")
    except (ValueError, zstandard.ZstdError) as exc:  # binascii.Error, or a text that is not ASCII
        raise CorruptManifestError(f"{what}: its packed body does not unpack ({type(exc).__name__}: "
                                   f"{_first_line(exc)})") from None
    unpacked = parse_json(inner, f"{what} (unpacked)", CorruptManifestError)
    if not isinstance(unpacked, dict) or packed_text(unpacked, what) is not None:
        raise CorruptManifestError(f"{what}: its packed body must hold a manifest body, not "
                                   f"{'another packed one' if isinstance(unpacked, dict) else type(unpacked).__name__}")
    return unpacked


def _manifest_text(manifest: Manifest) -> bytes:
    """The JSON of ``manifest.to_json()``, its restore chain (the last field) spliced in from each level's text made
    once (a chain passes from manifest to manifest and grows with it)."""
    head = jsontext.dumps(manifest.to_json(chain=False))
    if not manifest.chain:
        return head
    return b"".join((head[:-1], b',"chain":[', b",".join(level.json_text for level in manifest.chain), b"]}"))


def decode_manifest(data: bytes, where: str, step: int | None = None,
                    chunk_size: int = MAX_CHUNK_SIZE) -> Manifest:
    """Verify, parse and check a manifest (``_format.schema``) of ``step`` (None: any) in a vault of ``chunk_size``;
    ``where`` names it in messages. Raises CorruptManifestError or FormatVersionError."""
    parsed = manifest_body(data, where)
    key = (bytes(data), step, chunk_size) if len(data) <= CHECKED_MAX_BYTES else None
    checked = _checked.get(key) if key is not None else None
    if checked is not None:  # the tree, metrics and metadata from this parse: no caller shares a mutable part
        return replace(checked, tree=parsed["tree"], metrics=parsed["metrics"], metadata=parsed["metadata"])
    manifest = check_manifest(parsed, f"manifest {where}", step, chunk_size)
    if key is not None:
        _checked.put(key, manifest)
    return manifest


def manifest_body(data: bytes, where: str) -> Any:
    """The body of manifest file ``data`` (unpacked, if packed) as parsed JSON, its checksum verified but its fields
    not checked (:func:`decode_manifest` does). Raises CorruptManifestError or FormatVersionError."""
    if len(data) <= _BODY_START or not data.startswith(_PREFIX) or data[_BODY_START - len(_MIDDLE) : _BODY_START] != _MIDDLE:
        raise CorruptManifestError(f"manifest {where} is truncated or not a ckptvault manifest ({len(data)} bytes)")
    if not data.endswith(b"}"):
        raise CorruptManifestError(f"manifest {where} is truncated")
    body = data[_BODY_START:-1]
    expected = data[len(_PREFIX) : len(_PREFIX) + 64].decode("ascii", "replace")
    if blake3.blake3(body).hexdigest() != expected:
        raise CorruptManifestError(f"manifest {where} fails its BLAKE3 checksum: it was damaged after writing")
    return _unpack(parse_json(body, f"manifest {where}", CorruptManifestError), f"manifest {where}")


#: manifests whose check is remembered, and the largest remembered (larger ones are checked every time)
CHECKED_KEPT, CHECKED_MAX_BYTES = 8, 1 << 20
#: the last CHECKED_KEPT manifests this process checked, by their exact bytes, step and chunk size: the schema check
#: is a function of those alone, so the same bytes read again (a repeated restore, a manager reading its own
#: manifests) skip it and are only parsed
_checked: Remembered[tuple[bytes, int | None, int], Manifest] = Remembered(CHECKED_KEPT)


def parse_json(data: bytes, what: str, error: type[Exception]) -> Any:
    """Strict JSON (no NaN or Infinity) of a file named ``what`` in messages; ``error`` for anything unreadable,
    nesting too deep for the parser included."""
    try:
        return json.loads(data, parse_constant=_refuse_constant)
    except RecursionError:
        raise error(f"{what} is nested too deeply to be a ckptvault file") from None
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise error(f"{what} is not valid JSON: {_first_line(exc)}") from None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _first_line(exc: Exception) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."
