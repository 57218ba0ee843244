"""Manifests: the one object per checkpoint whose creation commits it.

A manifest file is JSON with its own checksum around the exact bytes of the
body (so it stays readable with ``jq`` and is verified without re-encoding)::

    {"blake3":"<64 hex digits>","manifest":<body JSON>}

The prefix has a fixed length of 88 bytes; the body is every byte between it
and the final ``}``. Body fields are documented in docs/DESIGN.md.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import blake3

from ..errors import CorruptManifestError, InvalidArgumentError
from . import jsontext
from .keys import step_of_manifest_key
from .records import Manifest
from .remembered import Remembered
from .schema import MAX_CHUNK_SIZE, MAX_STEP, check_manifest

_PREFIX = b'{"blake3":"'
_MIDDLE = b'","manifest":'
_BODY_START = len(_PREFIX) + 64 + len(_MIDDLE)


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
    digest = blake3.blake3(data).hexdigest().encode()
    return b"".join((_PREFIX, digest, _MIDDLE, data, b"}"))


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
    if len(data) <= _BODY_START or not data.startswith(_PREFIX) or data[_BODY_START - len(_MIDDLE) : _BODY_START] != _MIDDLE:
        raise CorruptManifestError(f"manifest {where} is truncated or not a ckptvault manifest ({len(data)} bytes)")
    if not data.endswith(b"}"):
        raise CorruptManifestError(f"manifest {where} is truncated")
    body = data[_BODY_START:-1]
    expected = data[len(_PREFIX) : len(_PREFIX) + 64].decode("ascii", "replace")
    if blake3.blake3(body).hexdigest() != expected:
        raise CorruptManifestError(f"manifest {where} fails its BLAKE3 checksum: it was damaged after writing")
    parsed = parse_json(body, f"manifest {where}", CorruptManifestError)
    key = (bytes(data), step, chunk_size) if len(data) <= CHECKED_MAX_BYTES else None
    checked = _checked.get(key) if key is not None else None
    if checked is not None:  # the tree, metrics and metadata from this parse: no caller shares a mutable part
        return replace(checked, tree=parsed["tree"], metrics=parsed["metrics"], metadata=parsed["metadata"])
    manifest = check_manifest(parsed, f"manifest {where}", step, chunk_size)
    if key is not None:
        _checked.put(key, manifest)
    return manifest


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
