"""Storage backends, selected by URL.

``open_store("./ckpts")`` or ``file:///...`` -> :class:`LocalStore`;
``memory://name`` -> :class:`MemoryStore`; ``s3://bucket/prefix`` -> :class:`~.s3.S3Store`
(needs boto3); any other protocol fsspec knows, or ``fsspec+PROTO://...`` ->
:class:`~.fsspec_store.FsspecStore` (needs fsspec).
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
        return LocalStore.from_options(text, storage_options)
    if scheme == "s3":
        from .s3 import S3Store

        return S3Store(text, **(storage_options or {}))
    if scheme.startswith("fsspec+") or (scheme not in ("file", "memory") and _fsspec_knows(scheme)):
        from .fsspec_store import FsspecStore

        return FsspecStore.from_url(text, storage_options)
    if scheme == "file":
        return LocalStore.from_options(rest, storage_options)
    if storage_options:
        raise InvalidArgumentError(f"storage_options are not used by {scheme}:// stores; remove them")
    if scheme == "memory":
        return MemoryStore(rest)
    raise InvalidArgumentError(
        f"unsupported vault URL scheme {scheme!r} in {text!r}: use a local path, file://, memory://, s3://, "
        "or a protocol fsspec knows (pip install 'ckptvault[fsspec]')"
    )


def _fsspec_knows(scheme: str) -> bool:
    """True if fsspec is installed and has (or names) a filesystem for ``scheme``."""
    try:
        from fsspec.registry import known_implementations, registry
    except ImportError:
        return False
    return scheme in registry or scheme in known_implementations
