"""``ckptvault presets``: the named codec rule sets (``CheckpointManager(codec_rules="NAME")``)."""

from __future__ import annotations

from typing import Any

import click

from ..rules import PRESETS, preset_rules
from .common import emit_json, json_option
from .render import table

EPILOG = """\b
Codec names in rules:
  lossless            the vault's lossless codec (zstd unless the vault says otherwise)
  bf16, fp16          round float32/float64 tensors to 16 bits; restore casts back
  int8-block[:B]      int8 with one float32 scale per block of B elements (default 256)
  residual-int8[:B]   int8-block of the difference from the keyframe's exact copy
  LOSSY+LOSSLESS      e.g. fp16+lz4: the lossless codec for the stored bytes

A lossy result that flushes more than max_flushed (5%) of the non-zero values
to zero, overflows or makes NaNs falls back (fp16/int8 -> bf16 -> lossless)
with a warning; CheckpointManager(on_unsafe="fail") raises instead, "keep"
keeps it. `ckptvault show` prints each tensor's codec and measured error.
"""


@click.command("presets", short_help="List the named codec presets and their rules.", epilog=EPILOG)
@click.argument("name", required=False)
@json_option
def presets(name: str | None, as_json: bool) -> None:
    """List the codec presets (or show preset NAME): a one-line summary and the rules.

    Pick one with CheckpointManager(url, codec_rules="NAME"). Rules map key
    path patterns (shell-style; PATTERN@DTYPE matches that dtype only) to
    codecs; the first matching rule wins, unmatched tensors use the vault's
    lossless codec. Key paths are those of {"model": model.state_dict(),
    "optimizer": optimizer.state_dict()}.

    \b
    JSON: {"presets": [{"name", "summary", "rules": [{"pattern", "codec"}]}]}
    """
    names = [name] if name is not None else list(PRESETS)
    entries = [_entry(n) for n in names]  # an unknown NAME: InvalidArgumentError listing the presets (exit 2)
    if as_json:
        emit_json({"presets": entries})
        return
    if name is None:
        click.echo(table(("PRESET", "SUMMARY"), [(e["name"], e["summary"]) for e in entries]))
        click.echo()
    for entry in entries:
        click.echo(f"{entry['name']}: {entry['summary']}")
        rows = [(f"  {r['pattern']}", r["codec"]) for r in entry["rules"]] or [("  *", "lossless")]
        click.echo(table(("  PATTERN", "CODEC"), rows))
        click.echo()


def _entry(name: str) -> dict[str, Any]:
    rules = preset_rules(name)
    return {"name": name, "summary": PRESETS[name]["summary"],
            "rules": [{"pattern": p, "codec": c} for p, c in rules.items()]}
