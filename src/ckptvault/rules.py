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

import difflib
from collections.abc import Iterable, Mapping, Sequence
from fnmatch import fnmatchcase
from typing import TypedDict

from ._codecs import validate_codec_name
from ._codecs.lossy import parse_codec
from ._feedback import warn_at_caller
from .errors import InvalidArgumentError, UnmatchedRuleWarning


def path_matches(path: str, pattern: str) -> bool:
    """True if ``path`` matches ``pattern`` or lies under the subtree it names."""
    return fnmatchcase(path, pattern) or path.startswith(pattern + ".")


def any_match(path: str, patterns: Iterable[str]) -> bool:
    return any(path_matches(path, p) for p in patterns)


class CodecRules:
    """An ordered list of (pattern, codec) with a default.

    ``check_unmatched=True`` (the manager's first save): :meth:`warn_unmatched` warns about patterns that match no
    tensor of the state being saved.
    """

    def __init__(self, rules: Mapping[str, str] | Iterable[tuple[str, str]] | None, default: str, *,
                 check_unmatched: bool = False) -> None:
        items = list(rules.items()) if isinstance(rules, Mapping) else list(rules or [])
        self.default = validate_codec_name(default)
        self.check_unmatched = check_unmatched
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

    def warn_unmatched(self, arrays: Sequence[tuple[str, str]]) -> list[str]:
        """With ``check_unmatched``: warn (:class:`~ckptvault.errors.UnmatchedRuleWarning`, once, at the caller's
        ``save()`` line) about every pattern except the catch-all ``*`` that matches none of ``arrays`` (the key path
        and dtype of each array the state holds, as :meth:`codec_for` gets them), with close existing key paths.
        Nothing for a state without arrays. Returns the unmatched patterns (as written, with any ``@DTYPE``)."""
        if not self.check_unmatched or not arrays:
            return []
        unmatched = [(p, d) for p, d, _ in self.rules if p != "*"
                     and not any((d is None or d == dtype) and path_matches(path, p) for path, dtype in arrays)]
        if not unmatched:
            return []
        candidates = _pattern_candidates([path for path, _ in arrays])
        parts = []
        for pattern, dtype in unmatched:
            dtypes = sorted({d for p, d in arrays if path_matches(p, pattern)}) if dtype else []
            close = difflib.get_close_matches(pattern, candidates, n=2, cutoff=0.6)
            if dtypes:
                hint = f"its key paths hold {', '.join(dtypes)}, not {dtype}"
            else:
                hint = f"did you mean {' or '.join(map(repr, close))}?" if close else "no key path is close to it"
            parts.append(f"{pattern + '@' + dtype if dtype else pattern!r} ({hint})")
        examples = ", ".join(repr(path) for path, _ in arrays[:3]) + (", ..." if len(arrays) > 3 else "")
        several = len(parts) > 1
        warn_at_caller(
            f"codec_rules pattern{'s' if several else ''} {'; '.join(parts)} matched no tensor of the first saved "
            f"state, so {'they change' if several else 'it changes'} nothing. The state's key paths look like "
            f"{examples} (`ckptvault show URL` lists them): fix or remove the pattern. To make this an error: "
            "warnings.filterwarnings('error', category=ckptvault.errors.UnmatchedRuleWarning)", UnmatchedRuleWarning)
        return [f"{p}@{d}" if d else p for p, d in unmatched]


#: the most candidate patterns a "did you mean" suggestion is drawn from (similarity is quadratic in their length)
MAX_CANDIDATES = 5000


def _pattern_candidates(paths: Sequence[str]) -> list[str]:
    """Patterns a rule may have meant for these key paths: each path, each of its subtrees (``model.*``,
    ``model.0.*``), and its last name under any prefix (``*exp_avg``)."""
    found: dict[str, None] = {}
    for path in paths:
        parts = path.split(".")
        for i in range(1, len(parts)):
            found[".".join(parts[:i]) + ".*"] = None
        found["*" + parts[-1]] = None
        found[path] = None
        if len(found) >= MAX_CANDIDATES:
            break
    return list(found)


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
        "summary": "weights (model.*) in fp16, every lossy tensor then compressed with LZ4 (fast); Adam moments "
                   "compacted as in moments-compact (exp_avg_sq bf16, exp_avg block int8)",
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
