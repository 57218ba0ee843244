"""``ckptvault diff`` and ``ckptvault._reports.diff.diff_steps``: per-tensor comparison of two checkpoints.

Library tests check the numbers on hand-made states whose differences are known exactly; CLI tests run
the real entry point (``python -m ckptvault``) in a fresh interpreter against vaults a real training run wrote.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from ckptvault import CheckpointManager
from ckptvault._format.chunk_object import chunk_key
from ckptvault._reports.diff import compare_bytes, diff_steps
from ckptvault.errors import StepNotFoundError

CHUNK = 64 << 10


def as_bytes(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.contiguous().reshape(-1).view(torch.uint8).numpy().copy()
    return np.ascontiguousarray(value.astype(value.dtype.newbyteorder("<"))).reshape(-1).view(np.uint8).copy()


def compare(a: Any, b: Any) -> tuple[int, float | int | None]:
    if isinstance(a, torch.Tensor):
        return compare_bytes(as_bytes(a), as_bytes(b), "torch", str(a.dtype).removeprefix("torch."))
    return compare_bytes(as_bytes(a), as_bytes(b), "numpy", a.dtype.str)


# -- the per-element comparison --------------------------------------------------------------------------


def test_floats_count_bit_changes_and_the_largest_difference() -> None:
    a = torch.tensor([1.0, 2.0, 0.0, float("nan"), float("inf"), 5.0])
    b = torch.tensor([1.0, 2.5, -0.0, float("nan"), float("inf"), 1.0])
    assert compare(a, b) == (3, 4.0)  # -0.0 differs in its bits; identical NaNs and infinities do not
    assert compare(a, a.clone()) == (0, 0)


def test_a_nan_that_appears_makes_the_difference_nan() -> None:
    changed, worst = compare(torch.tensor([1.0, 2.0]), torch.tensor([1.0, float("nan")]))
    assert changed == 1 and isinstance(worst, float) and math.isnan(worst)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn])
def test_every_float_dtype_is_compared_as_numbers(dtype: torch.dtype) -> None:
    a = torch.tensor([1.0, 2.0, 3.0, 4.0]).to(dtype)
    b = torch.tensor([1.0, 2.0, 3.0, 0.5]).to(dtype)
    assert compare(a, b) == (1, 3.5)


def test_complex_differences_are_moduli() -> None:
    a = torch.tensor([1 + 1j, 2 + 0j], dtype=torch.complex64)
    b = torch.tensor([1 + 1j, 5 + 4j], dtype=torch.complex64)
    assert compare(a, b) == (1, 5.0)


def test_integers_and_bools_are_exact_numbers() -> None:
    lo, hi = torch.iinfo(torch.int64).min, torch.iinfo(torch.int64).max
    changed, worst = compare(torch.tensor([lo, 0, 7]), torch.tensor([hi, 0, 7]))
    assert (changed, worst) == (1, 2**64 - 1)  # no float rounding, no overflow
    assert compare(torch.tensor([0, 2**64 - 1], dtype=torch.uint64), torch.tensor([0, 0], dtype=torch.uint64)) == (1, 2**64 - 1)
    assert compare(torch.tensor([True, False, True]), torch.tensor([False, False, True])) == (1, 1)
    assert compare(torch.tensor([-128, 5], dtype=torch.int8), torch.tensor([127, 5], dtype=torch.int8)) == (1, 255)


def test_numpy_arrays_of_any_byte_order() -> None:
    a = np.array([1.0, 2.0, 3.0], dtype=">f8")
    b = np.array([1.0, -2.0, 3.0], dtype=">f8")
    assert compare(a, b) == (1, 4.0)
    strings = np.array(["ab", "cd"]), np.array(["ab", "ce"])
    assert compare(*strings) == (1, None)  # counted, but not numbers


def test_large_arrays_are_compared_in_slices() -> None:
    a = torch.zeros(9_000_001)
    b = a.clone()
    b[[0, 4_194_304, 9_000_000]] = torch.tensor([1.0, -2.0, 0.25])
    assert compare(a, b) == (3, 2.0)


# -- diff_steps on real vaults ---------------------------------------------------------------------------


def test_diff_steps_reports_changes_sizes_and_key_set_changes(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    frozen = torch.randn(128, 256, generator=gen)  # 128 KiB: two chunks of its own
    w = torch.randn(64, 256, generator=gen)
    a = {"frozen": frozen, "w": w, "gone": torch.ones(3), "step": 1, "lr": 0.1}
    w2 = w.clone()
    w2[0, :10] += 0.5
    b = {"frozen": frozen.clone(), "w": w2, "new": torch.arange(5), "step": 2, "lr": 0.1,
         "shape": torch.zeros(2, 2)}
    a["shape"] = torch.zeros(4)
    with CheckpointManager(tmp_path / "v", chunk_size=CHUNK) as mgr:
        mgr.save(10, a)
        mgr.save(20, b).wait()
        d = diff_steps(mgr.vault, 10, 20)
        by_path = {t.path: t for t in d.tensors}
        assert list(by_path) == ["frozen", "w", "shape"]
        assert (by_path["frozen"].status, by_path["frozen"].changed, by_path["frozen"].added_bytes) == ("same", 0, 0)
        changed = by_path["w"]
        assert (changed.status, changed.changed, changed.numel) == ("changed", 10, 64 * 256)
        assert changed.max_abs_diff == pytest.approx(0.5, abs=1e-6)
        assert 0 < changed.added_bytes < 64 * 256 * 4 // 4  # a delta against step 10, far smaller than the tensor
        assert (by_path["shape"].status, by_path["shape"].max_abs_diff) == ("retyped", None)
        assert [o.path for o in d.only_a] == ["gone"] and [o.path for o in d.only_b] == ["new"]
        assert d.only_b[0].added_bytes > 0
        assert d.scalars == [{"path": "step", "status": "changed", "a": 1, "b": 2}]
        totals = d.totals
        assert totals["tensors_changed"] == 2 and totals["elements_changed"] == 10 + 4
        assert totals["added_bytes"] == mgr.manifest(20)["added_bytes"]
        shares = sum(t.added_bytes for t in d.tensors) + sum(o.added_bytes for o in d.only_b)
        assert abs(shares - totals["added_bytes"]) <= len(d.tensors) + len(d.only_b)  # rounding only
        only_w = diff_steps(mgr.vault, 10, 20, keys=["w"])
        assert [t.path for t in only_w.tensors] == ["w"] and not only_w.only_a and not only_w.scalars
        with pytest.raises(StepNotFoundError, match="step 30 has no committed checkpoint"):
            diff_steps(mgr.vault, 10, 30)


def test_diff_reads_no_chunk_of_arrays_stored_identically(tmp_path: Path) -> None:
    """Equal arrays are recognised from the manifests: deleting their chunks does not disturb the diff."""
    big = torch.randn(64 << 10)
    with CheckpointManager(tmp_path / "v", chunk_size=CHUNK) as mgr:
        mgr.save(1, {"big": big, "small": torch.zeros(1000)})
        mgr.save(2, {"big": big, "small": torch.ones(1000)}).wait()
        big_chunks = {c["id"] for c in mgr.manifest(2)["chunks"] if c["raw"] == CHUNK}
    assert len(big_chunks) == 4
    for cid in big_chunks:
        (tmp_path / "v" / chunk_key(cid)).unlink()
    with CheckpointManager(tmp_path / "v") as mgr:
        d = diff_steps(mgr.vault, 1, 2)
    assert [(t.path, t.status, t.changed) for t in d.tensors] == [("big", "same", 0), ("small", "changed", 1000)]


# -- the command line -------------------------------------------------------------------------------------


def cli(*args: object) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TQDM_")}
    return subprocess.run([sys.executable, "-m", "ckptvault", *map(str, args)], capture_output=True, text=True,
                          timeout=120, env=env)


@pytest.fixture(scope="module")
def trained_vault(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A frozen first layer, a trained head with AdamW, and an extra tensor that appears at step 200."""
    root = tmp_path_factory.mktemp("diff") / "vault"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.Tanh(), nn.Linear(256, 16))
    for p in model[0].parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    with CheckpointManager(root, chunk_size=CHUNK) as mgr:
        for step in (100, 200):
            model(torch.randn(8, 128)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
            if step == 200:
                state["ema"] = torch.zeros(64, 256)
            mgr.save(step, state)
    return root


def test_cli_diff_text(trained_vault: Path) -> None:
    out = cli("diff", trained_vault, 100, 200)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"diff of step 100 -> step 200 in {trained_vault} (step 200: deltas against keyframe 100)"
    rows = {line.split()[0]: line.split() for line in lines if line.startswith(("model.", "optimizer."))}
    assert rows["model.0.weight"][3:6] == ["0", "0", "0"]  # frozen: unchanged, nothing added
    assert rows["model.2.weight"][3] == "100%" and rows["model.2.weight"][4] != "0"
    assert "only in step 200:" in out.stdout and "ema" in out.stdout.split("only in step 200:")[1]
    assert "step: 100 -> 200" in out.stdout
    assert any(line.startswith("tensors") and "differ; 0 only in 100, 1 only in 200" in line for line in lines)
    changed_only = cli("diff", trained_vault, 100, 200, "--changed-only")
    assert "model.0.weight" not in changed_only.stdout and "model.2.weight" in changed_only.stdout


def test_cli_diff_json_matches_the_manifests(trained_vault: Path) -> None:
    out = cli("diff", trained_vault, 100, 200, "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    with CheckpointManager(trained_vault) as mgr:
        m200 = mgr.manifest(200)
    assert (doc["step_a"], doc["step_b"], doc["keyframe_step_b"]) == (100, 200, 100)
    assert doc["totals"]["added_bytes"] == m200["added_bytes"]
    tensors = {t["path"]: t for t in doc["tensors"]}
    assert tensors["model.0.weight"]["status"] == "same" and tensors["model.0.weight"]["added_bytes"] == 0
    head = tensors["model.2.weight"]
    assert head["status"] == "changed" and head["changed"] == head["numel"] == 16 * 256
    assert 0 < head["max_abs_diff"] < 1e-3  # one AdamW step at lr 1e-4 moves each weight by about lr
    assert [o["path"] for o in doc["only_b"]] == ["ema"] and doc["only_a"] == []
    assert doc["scalars"] == [{"path": "step", "status": "changed", "a": 100, "b": 200}]
    keyed = json.loads(cli("diff", trained_vault, 100, 200, "--json", "-k", "optimizer").stdout)
    assert keyed["tensors"] and all(t["path"].startswith("optimizer.") for t in keyed["tensors"])


def test_cli_diff_errors(trained_vault: Path, tmp_path: Path) -> None:
    missing = cli("diff", trained_vault, 100, 300)
    assert missing.returncode == 2
    assert missing.stderr.startswith("error: step 300 has no committed checkpoint")
    assert "committed steps: 100, 200" in missing.stderr
    novault = cli("diff", tmp_path / "nothing", 1, 2)
    assert novault.returncode == 2 and "no ckptvault vault" in novault.stderr
    assert cli("diff", trained_vault, 100).returncode == 2  # B is required


def test_cli_diff_reports_a_damaged_chunk(trained_vault: Path, tmp_path: Path) -> None:
    import shutil

    root = Path(shutil.copytree(trained_vault, tmp_path / "vault"))
    with CheckpointManager(root) as mgr:
        m = mgr.manifest(200)
    head = next(t for t in m["tensors"] if t["path"] == "model.2.weight")
    cid = m["chunks"][head["pieces"][0][0]]["id"]
    path = root / chunk_key(cid)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    out = cli("diff", root, 100, 200)
    assert out.returncode == 1
    assert out.stderr.startswith(f"error: chunk {cid} is corrupt (needed by step 200")
