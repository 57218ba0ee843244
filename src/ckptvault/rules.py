"""Key-path rules: map tensor key paths to codec names, first match wins.

Patterns are shell-style (``fnmatch``): ``*`` matches across dots, so
``optimizer.*`` covers everything under ``optimizer``. A bare prefix such as
``model`` also matches every path under it (``model.fc.weight``). A pattern
may end in ``@DTYPE`` to match only tensors of that dtype
(``model.*@float32``). Codec names are lossless (``zstd``, ``lz4``, ``none``,
``fast``, ``zstd-N``, ``lossless``) or lossy (``bf16``, ``fp16``,
``int8-block[:B]``, ``residual-int8[:B]``, optionally ``+LOSSLESS``); see
``_codecs/lossy.py``.

Named rule sets (``PRESETS``) let a user pick rules in one word (``codec_rules="moments-compact"``; see
``ckptvault presets``). Their key paths follow ``{"model": model.state_dict(), "optimizer": opt.state_dict()}``
as in the README; the patterns also match states that put the optimizer elsewhere (``*exp_avg_sq`` matches any
Adam second moment).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from fnmatch import fnmatchcase
from typing import TypedDict

from ._codecs import validate_codec_name
from ._codecs.lossy import parse_codec
from .errors import InvalidArgumentError


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


class Preset(TypedDict):
    """One of :data:`PRESETS`: a one-line summary and its rules (pattern -> codec name)."""

    summary: str
    rules: dict[str, str]


PRESETS: dict[str, Preset] = {
    "lossless": {
        "summary": "every tensor bit-exact (the default)",
        "rules": {},
    },
    "moments-compact": {
        "summary": "weights exact; Adam's exp_avg_sq in bf16 and exp_avg in block int8",
        "rules": {"*exp_avg_sq": "bf16", "*exp_avg": "int8-block:256", "*": "lossless"},
    },
    "moments-bf16": {
        "summary": "weights exact; both Adam moments in bf16",
        "rules": {"*exp_avg_sq": "bf16", "*exp_avg": "bf16", "*": "lossless"},
    },
    "fp16": {
        "summary": "the seed workflow: fp16 weights with LZ4; moments as in moments-compact",
        "rules": {"*exp_avg_sq": "bf16+lz4", "*exp_avg": "int8-block:256+lz4", "model.*": "fp16+lz4",
                  "*": "lossless"},
    },
    "bf16": {
        "summary": "bf16 weights and moments",
        "rules": {"*exp_avg_sq": "bf16", "*exp_avg": "bf16", "model.*": "bf16", "*": "lossless"},
    },
    "residual": {
        "summary": "weights as int8 residuals against the exact keyframe; moments as in moments-compact",
        "rules": {"*exp_avg_sq": "bf16", "*exp_avg": "int8-block:256", "model.*": "residual-int8:256",
                  "*": "lossless"},
    },
}


def preset_rules(name: str) -> dict[str, str]:
    """The rules of preset ``name``; InvalidArgumentError lists the presets for an unknown name."""
    try:
        return dict(PRESETS[name]["rules"])
    except KeyError:
        raise InvalidArgumentError(f"unknown preset {name!r}; presets are {', '.join(PRESETS)} "
                                   "(see `ckptvault presets`)") from None
