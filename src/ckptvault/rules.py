"""Key-path rules: map tensor key paths to codec names, first match wins.

Patterns are shell-style (``fnmatch``): ``*`` matches across dots, so
``optimizer.*`` covers everything under ``optimizer``. A bare prefix such as
``model`` also matches every path under it (``model.fc.weight``). A pattern
may end in ``@DTYPE`` to match only tensors of that dtype
(``model.*@float32``). Codec names are lossless (``zstd``, ``lz4``, ``none``,
``fast``, ``zstd-N``, ``lossless``) or lossy (``bf16``, ``fp16``,
``int8-block[:B]``, ``residual-int8[:B]``, optionally ``+LOSSLESS``); see
``lossy.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from fnmatch import fnmatchcase

from .codecs import validate_codec_name
from .lossy import parse_codec


def path_matches(path: str, pattern: str) -> bool:
    """True if ``path`` matches ``pattern`` or lies under the subtree it names."""
    return fnmatchcase(path, pattern) or path.startswith(pattern + ".")


def any_match(path: str, patterns: Iterable[str]) -> bool:
    return any(path_matches(path, p) for p in patterns)


class CodecRules:
    """An ordered list of (pattern, codec) with a default."""

    def __init__(self, rules: Mapping[str, str] | Iterable[tuple[str, str]] | None, default: str) -> None:
        items = list(rules.items()) if isinstance(rules, Mapping) else list(rules or [])
        self.default = validate_codec_name(default)
        self.rules = []
        for pattern, codec in items:
            parse_codec(codec, self.default)  # raises InvalidArgumentError for unknown names
            path_pattern, _, dtype = pattern.partition("@")
            self.rules.append((path_pattern, dtype or None, codec))

    def codec_for(self, path: str, dtype: str | None = None) -> str:
        """The codec of the first rule matching ``path`` (and ``dtype``), else the default."""
        for pattern, rule_dtype, codec in self.rules:
            if (rule_dtype is None or rule_dtype == dtype) and path_matches(path, pattern):
                return codec
        return self.default
