"""Storage backends, selected by URL.

``open_store("./ckpts")`` or ``file:///...`` -> :class:`LocalStore`;
``memory://name`` -> :class:`MemoryStore`; ``s3://bucket/prefix`` -> :class:`~.s3.S3Store`
(needs boto3); any other protocol fsspec knows, or ``fsspec+PROTO://...`` ->
:class:`~.fsspec_store.FsspecStore` (needs fsspec).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..errors import InvalidArgumentError
from ._s3_support import S3Options
from .base import ObjectInfo, Store
from .local import LocalOptions, LocalStore
from .memory import MemoryStore

__all__ = ["LocalOptions", "LocalStore", "MemoryStore", "ObjectInfo", "S3Options", "StorageOptions", "Store", "open_store"]

#: what ``storage_options`` takes: the typed options of the URL's store, or a dict of them (an fsspec store takes
#: a dict of its filesystem's keyword arguments)
StorageOptions = LocalOptions | S3Options | Mapping[str, Any]


def open_store(url: str | os.PathLike[str] | Store, storage_options: StorageOptions | None = None) -> Store:
    """Return the store for ``url``; a Store instance is returned as is (it was made with its options)."""
    if isinstance(url, Store):
        if storage_options:
            raise InvalidArgumentError(f"storage_options are for a URL; the store {url.url} was given already made: "
                                       "pass its options when making it")
        return url
    text = os.fspath(url)
    scheme, sep, rest = text.partition("://")
    if not sep or scheme == "file":
        return LocalStore.from_options(rest if sep else text, _typed(storage_options, LocalOptions, text))
    if scheme == "s3":
        from .s3 import S3Store

        options = _typed(storage_options, S3Options, text)
        return S3Store(text, options if isinstance(options, S3Options) else S3Options.from_dict(options))
    if scheme.startswith("fsspec+") or (scheme not in ("file", "memory") and _fsspec_knows(scheme)):
        from .fsspec_store import FsspecStore

        return FsspecStore.from_url(text, _typed(storage_options, Mapping, text))
    if storage_options:
        raise InvalidArgumentError(f"storage_options are not used by {scheme}:// stores; remove them")
    if scheme == "memory":
        return MemoryStore(rest)
    raise InvalidArgumentError(
        f"unsupported vault URL scheme {scheme!r} in {text!r}: use a local path, file://, memory://, s3://, "
        "or a protocol fsspec knows (pip install 'ckptvault[fsspec]')"
    )


def _typed(options: StorageOptions | None, wanted: type, url: str) -> Any:
    """``options`` if they are ``wanted`` or a dict (None: an empty dict); typed options of another store are an
    InvalidArgumentError saying which options ``url`` takes."""
    if options is None or isinstance(options, (wanted, Mapping)):
        return {} if options is None else options
    takes = "a dict of fsspec filesystem arguments" if wanted is Mapping else f"{wanted.__name__} or a dict"
    raise InvalidArgumentError(f"storage_options {type(options).__name__} are not for {url}: it takes {takes}")


def _fsspec_knows(scheme: str) -> bool:
    """True if fsspec is installed and has (or names) a filesystem for ``scheme``."""
    try:
        from fsspec.registry import known_implementations, registry
    except ImportError:
        return False
    return scheme in registry or scheme in known_implementations
