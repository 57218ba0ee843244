"""Compact JSON for what every save writes (manifests and restore chains): orjson, with the standard library where
orjson would write something else.

Both write compact UTF-8 JSON with keys in insertion order; a float may be spelled differently (``1e-9`` against
``1e-09``) but reads back as the same double. Readers parse with the standard library (``manifest.parse_json``),
which is strict about nesting and reads any integer exactly. Where orjson differs:

* integers beyond 64 bits, types it does not know and nesting deeper than 254 levels: it refuses them, and
  :func:`dumps` writes with ``json`` instead (which raises for what JSON cannot hold);
* non-finite floats: orjson writes them as ``null``. A manifest's floats are all finite before they reach
  :func:`dumps` (metrics and lossy errors keep non-finite values as strings, user metadata with one is refused,
  ``PredictInfo.to_json`` checks its scalars), so :func:`dumps` does not check again.
"""

from __future__ import annotations

import json
from typing import Any

import orjson


def dumps(value: Any) -> bytes:
    """``value`` as compact UTF-8 JSON. Its floats must be finite (see the module docstring)."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
