"""Storage backends, selected by URL.

``open_store("./ckpts")`` or ``file:///...`` -> :class:`LocalStore`;
``memory://name`` -> :class:`MemoryStore`.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import InvalidArgumentError
from .base import ObjectInfo, Store
from .local import LocalStore
from .memory import MemoryStore

__all__ = ["LocalStore", "MemoryStore", "ObjectInfo", "Store", "open_store"]


def open_store(url: str | os.PathLike[str] | Store, storage_options: dict[str, Any] | None = None) -> Store:
    """Return the store for ``url``; a Store instance is returned as is."""
    if isinstance(url, Store):
        return url
    text = os.fspath(url)
    scheme, sep, rest = text.partition("://")
    if not sep:
        return LocalStore(text)
    if storage_options:
        raise InvalidArgumentError(f"storage_options are not used by {scheme}:// stores; remove them")
    if scheme == "file":
        return LocalStore(rest)
    if scheme == "memory":
        return MemoryStore(rest)
    raise InvalidArgumentError(
        f"unsupported vault URL scheme {scheme!r} in {text!r}: use a local path, file:// or memory://"
    )
