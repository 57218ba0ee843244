"""Codec presets: named rule sets a user picks in one word, and ``ckptvault presets`` that lists them.

Each preset is applied to a real model + AdamW state saved twice (a keyframe, then a checkpoint against it),
and the codec every tensor got is checked against what the preset promises.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptvault import CheckpointManager
from ckptvault.errors import InvalidArgumentError
from ckptvault.rules import PRESETS, CodecRules, preset_rules
from conftest import assert_same_state

NAMES = ["lossless", "moments-compact", "moments-bf16", "fp16", "bf16", "residual"]

#: preset -> (weights, exp_avg, exp_avg_sq) codecs in the second checkpoint, as "LOSSY+LOSSLESS" or "LOSSLESS"
EXPECTED = {
    "lossless": ("zstd", "zstd", "zstd"),
    "moments-compact": ("zstd", "int8-block+zstd", "bf16+zstd"),
    "moments-bf16": ("zstd", "bf16+zstd", "bf16+zstd"),
    "fp16": ("fp16+lz4", "int8-block+lz4", "bf16+lz4"),
    "bf16": ("bf16+zstd", "bf16+zstd", "bf16+zstd"),
    "residual": ("residual-int8+zstd", "int8-block+zstd", "bf16+zstd"),
}


@pytest.fixture(scope="module")
def states() -> list[dict[str, Any]]:
    """Two training states of an MLP with AdamW, two steps apart (moments with no block that int8 flushes)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for step in range(4):
        opt.zero_grad(set_to_none=True)
        model(torch.randn(64, 256)).pow(2).mean().backward()
        opt.step()
        if step % 2:
            out.append(copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}))
    return out


def codecs(mgr: CheckpointManager, step: int) -> dict[str, str]:
    return {t.path: t.codec.replace(":256", "") for t in mgr.info(step).tensors}


def test_the_documented_presets_exist_and_parse() -> None:
    assert list(PRESETS) == NAMES
    for name in NAMES:
        assert PRESETS[name]["summary"], name
        CodecRules(preset_rules(name), "zstd")  # every codec name is valid
    assert preset_rules("lossless") == {}
    rules = preset_rules("moments-compact")
    rules["*"] = "bf16"  # a copy: changing it changes no preset
    assert preset_rules("moments-compact")["*"] == "lossless"


@pytest.mark.parametrize("name", NAMES)
def test_each_preset_stores_what_it_promises(states: list[dict[str, Any]], tmp_path: Path, name: str) -> None:
    with CheckpointManager(tmp_path / "v", codec_rules=name, chunk_size=64 << 10) as mgr:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no tensor of this state needs a fallback
            for step, state in enumerate(states):
                mgr.save(step, state)
            mgr.wait()
        got = codecs(mgr, 1)
        restored = [mgr.restore(0), mgr.restore(1)]
    weights, exp_avg, exp_avg_sq = EXPECTED[name]
    for path, codec in got.items():
        expected = (exp_avg_sq if path.endswith("exp_avg_sq") else exp_avg if path.endswith("exp_avg")
                    else weights if path.startswith("model.") else "zstd")
        assert codec == expected, (name, path)
    if name == "residual":  # the keyframe holds the weights exactly
        assert_same_state(states[0]["model"], restored[0]["model"])
    if name in ("lossless", "moments-compact", "moments-bf16", "residual"):
        for step in (0, 1):
            assert_same_state(states[step]["optimizer"]["state"][0]["step"], restored[step]["optimizer"]["state"][0]["step"])
    if name == "lossless":
        assert_same_state(states[1], restored[1])
    if name.startswith("moments"):
        assert_same_state(states[1]["model"], restored[1]["model"])


def test_moments_compact_is_smaller_than_lossless(states: list[dict[str, Any]], tmp_path: Path) -> None:
    sizes = {}
    for name in ("lossless", "moments-compact"):
        with CheckpointManager(tmp_path / name, codec_rules=name, incremental=False) as mgr:
            sizes[name] = mgr.save(1, states[1]).wait().stored_bytes
    assert sizes["moments-compact"] < 0.7 * sizes["lossless"]


def test_unknown_preset_lists_the_presets(tmp_path: Path) -> None:
    listing = r"unknown preset 'moments'; presets are lossless, moments-compact, moments-bf16, fp16, bf16, residual"
    with pytest.raises(InvalidArgumentError, match=listing):
        CheckpointManager(tmp_path / "v", codec_rules="moments")
    with pytest.raises(InvalidArgumentError, match=listing):
        preset_rules("moments")
    assert not (tmp_path / "v").exists()


# -- ckptvault presets -----------------------------------------------------------------------------------------
def cli(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptvault", *map(str, args)], capture_output=True, text=True, timeout=120)


def test_cli_lists_every_preset_with_summary_and_rules() -> None:
    text = cli("presets")
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    for name in NAMES:
        assert any(line.split()[:1] == [name] and PRESETS[name]["summary"] in line for line in lines), name
        assert f"{name}: {PRESETS[name]['summary']}" in lines
    fp16 = lines[lines.index(f"fp16: {PRESETS['fp16']['summary']}") + 1:]
    assert fp16[0].split() == ["PATTERN", "CODEC"] and fp16[3].split() == ["model.*", "fp16+lz4"]


def test_cli_one_preset_as_json_and_an_unknown_name() -> None:
    one = json.loads(cli("presets", "residual", "--json").stdout)
    assert one == {"presets": [{"name": "residual", "summary": PRESETS["residual"]["summary"],
                                "rules": [{"pattern": p, "codec": c} for p, c in PRESETS["residual"]["rules"].items()]}]}
    assert one["presets"][0]["rules"][2] == {"pattern": "model.*", "codec": "residual-int8:256"}
    bad = cli("presets", "nope")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip() == ("error: unknown preset 'nope'; presets are lossless, moments-compact, moments-bf16, "
                                  "fp16, bf16, residual (see `ckptvault presets`)")
