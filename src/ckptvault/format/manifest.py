"""Manifests: the one object per checkpoint whose creation commits it.

A manifest file is JSON with its own checksum around the exact bytes of the
body (so it stays readable with ``jq`` and is verified without re-encoding)::

    {"blake3":"<64 hex digits>","manifest":<body JSON>}

The prefix has a fixed length of 88 bytes; the body is every byte between it
and the final ``}``. Body fields are documented in docs/DESIGN.md.
"""

from __future__ import annotations

import json
from typing import Any

import blake3

from ..errors import CorruptManifestError, FormatVersionError
from . import FORMAT_VERSION

MANIFEST_FORMAT = "ckptvault.manifest"
#: optional features a manifest may declare in "requires"; a reader refuses any it does not know
KNOWN_FEATURES = frozenset({"lossy", "xplanes"})
_PREFIX = b'{"blake3":"'
_MIDDLE = b'","manifest":'
_BODY_START = len(_PREFIX) + 64 + len(_MIDDLE)


def manifest_key(step: int) -> str:
    """Storage key of a step's manifest; zero-padded so keys sort by step."""
    return f"manifests/{step:020d}.json"


def step_of_key(key: str) -> int | None:
    """The step a manifest key names, or None for any other key."""
    name = key.rsplit("/", 1)[-1]
    if not key.startswith("manifests/") or not name.endswith(".json"):
        return None
    stem = name[: -len(".json")]
    return int(stem) if stem.isdigit() else None


def encode_manifest(body: dict[str, Any]) -> bytes:
    """Serialise a manifest body with its checksum."""
    data = json.dumps(body, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    digest = blake3.blake3(data).hexdigest().encode()
    return b"".join((_PREFIX, digest, _MIDDLE, data, b"}"))


def decode_manifest(data: bytes, where: str) -> dict[str, Any]:
    """Verify and parse a manifest; raises CorruptManifestError or FormatVersionError."""
    if len(data) <= _BODY_START or not data.startswith(_PREFIX) or data[_BODY_START - len(_MIDDLE) : _BODY_START] != _MIDDLE:
        raise CorruptManifestError(f"manifest {where} is truncated or not a ckptvault manifest ({len(data)} bytes)")
    if not data.endswith(b"}"):
        raise CorruptManifestError(f"manifest {where} is truncated")
    body = data[_BODY_START:-1]
    expected = data[len(_PREFIX) : len(_PREFIX) + 64].decode("ascii", "replace")
    if blake3.blake3(body).hexdigest() != expected:
        raise CorruptManifestError(f"manifest {where} fails its BLAKE3 checksum: it was damaged after writing")
    try:
        parsed = json.loads(body)
    except ValueError as exc:
        raise CorruptManifestError(f"manifest {where} is not valid JSON: {exc}") from None
    if parsed.get("format") != MANIFEST_FORMAT:
        raise CorruptManifestError(f"manifest {where} has format {parsed.get('format')!r}")
    if int(parsed.get("version", 0)) > FORMAT_VERSION:
        raise FormatVersionError(
            f"manifest {where} uses format version {parsed['version']}; this ckptvault reads up to "
            f"{FORMAT_VERSION}: upgrade ckptvault"
        )
    unknown = sorted(set(parsed.get("requires", ())) - KNOWN_FEATURES)
    if unknown:
        raise FormatVersionError(
            f"manifest {where} requires features {unknown} this ckptvault does not know: upgrade ckptvault"
        )
    return parsed
