"""Strict parsers of vault keys (docs/DESIGN.md section 2): one per key kind.

Each accepts exactly the ASCII form ckptvault writes and rejects everything else, so an object whose name only
looks like a key (``manifests/²³.json``: ``str.isdigit`` accepts Unicode digits; ``manifests/sub/<step>.json``;
``chunks/zz/notahash``) is ignored by listings and never deleted by gc, prune or rm.
"""

from __future__ import annotations

import re

#: every manifest key starts with this
MANIFESTS_PREFIX = "manifests/"
#: the prefix of gc's clock markers (``gc/clock-<32 hex>``)
MARKER_PREFIX = "gc/clock-"

_MANIFEST_KEY = re.compile(r"manifests/([0-9]{20})\.json", re.ASCII)
_CHUNK_KEY = re.compile(r"chunks/([0-9a-f]{2})/(\1[0-9a-f]{62})", re.ASCII)  # the fan-out repeats the id's first 2
_PIN_KEY = re.compile(r"pins/([0-9]{20})/([^/]+)", re.ASCII)
_TEMP_KEY = re.compile(r"tmp/[0-9a-f]{32}\.part", re.ASCII)  # LocalStore's temporary files: tmp/<uuid4 hex>.part
_MARKER_KEY = re.compile(r"gc/clock-[0-9a-f]{32}", re.ASCII)
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}", re.ASCII)  # fullmatch: "$" would let "tag\n" in


def is_valid_tag(tag: object) -> bool:
    """Whether ``tag`` is a pin tag: 1-128 ASCII letters, digits, ``._-``, not starting with ``.`` or ``-``."""
    return isinstance(tag, str) and _TAG.fullmatch(tag) is not None


def step_of_manifest_key(key: str) -> int | None:
    """The step of ``manifests/<20 ASCII digits>.json``; None for any other key (subfolders included)."""
    match = _MANIFEST_KEY.fullmatch(key)
    return int(match[1]) if match else None


def chunk_id_of_key(key: str) -> str | None:
    """The chunk id of ``chunks/<2 hex>/<64 lowercase hex>`` whose fan-out is the id's first two digits, else None."""
    match = _CHUNK_KEY.fullmatch(key)
    return match[2] if match else None


def parse_pin_key(key: str) -> tuple[int, str] | None:
    """(step, tag) of ``pins/<20 ASCII digits>/<tag>`` with a tag ``retention.validate_tag`` accepts, else None."""
    match = _PIN_KEY.fullmatch(key)
    if match is None or not is_valid_tag(match[2]):
        return None
    return int(match[1]), match[2]


def is_temp_key(key: str) -> bool:
    """Whether ``key`` names a temporary file exactly as LocalStore names them (``tmp/<32 hex>.part``)."""
    return _TEMP_KEY.fullmatch(key) is not None


def is_marker_key(key: str) -> bool:
    """Whether ``key`` names a clock marker exactly as gc names them (``gc/clock-<32 hex>``)."""
    return _MARKER_KEY.fullmatch(key) is not None
