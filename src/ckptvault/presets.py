"""Named rule sets a user picks in one word (``codec_rules="moments-compact"``); see ``ckptvault presets``.

Key paths follow ``{"model": model.state_dict(), "optimizer": opt.state_dict()}``
as in the README; the patterns also match states that put the optimizer
elsewhere (``*exp_avg_sq`` matches any Adam second moment).
"""

from __future__ import annotations

from .errors import InvalidArgumentError

PRESETS: dict[str, dict[str, object]] = {
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
        return dict(PRESETS[name]["rules"])  # type: ignore[arg-type]
    except KeyError:
        raise InvalidArgumentError(f"unknown preset {name!r}; presets are {', '.join(PRESETS)} "
                                   "(see `ckptvault presets`)") from None
