"""Key-path rules: map tensor key paths to codec names, first match wins.

Patterns are shell-style (``fnmatch``): ``*`` matches across dots, so
``optimizer.*`` covers everything under ``optimizer``. A bare prefix such as
``model`` also matches every path under it (``model.fc.weight``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from fnmatch import fnmatchcase

from .codecs import validate_codec_name


def path_matches(path: str, pattern: str) -> bool:
    """True if ``path`` matches ``pattern`` or lies under the subtree it names."""
    return fnmatchcase(path, pattern) or path.startswith(pattern + ".")


def any_match(path: str, patterns: Iterable[str]) -> bool:
    return any(path_matches(path, p) for p in patterns)


class CodecRules:
    """An ordered list of (pattern, codec) with a default."""

    def __init__(self, rules: Mapping[str, str] | Iterable[tuple[str, str]] | None, default: str) -> None:
        items = list(rules.items()) if isinstance(rules, Mapping) else list(rules or [])
        self.rules = [(pattern, validate_codec_name(codec)) for pattern, codec in items]
        self.default = validate_codec_name(default)

    def codec_for(self, path: str) -> str:
        for pattern, codec in self.rules:
            if path_matches(path, pattern):
                return codec
        return self.default
