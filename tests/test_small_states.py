"""Small states pay no fixed costs they do not use: no numba and no torch.distributed.checkpoint for lossless
saves and restores, the byte-plane kernels loaded only once a process has split or joined enough bytes, and a
lossy save still loading (and using) the lossy kernels.

Each test runs in a fresh interpreter, where ``sys.modules`` shows what a process imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ckptvault._codecs import planes


def run_fresh(script: str) -> dict:
    """Run ``script`` in a new interpreter; the JSON object its last output line prints."""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


#: modules ckptvault needs only for lossy codecs, DCP, S3, fsspec or the CLI (torch itself imports tqdm)
HEAVY = ("numba", "llvmlite", "torch.distributed.checkpoint", "boto3", "botocore", "fsspec", "tqdm", "click")
#: the start of each script: which of HEAVY the process imports beyond what ``import torch`` imports
PRELUDE = f"""
import json, sys
import torch
before = set(sys.modules)
def heavy():
    return sorted(m for m in {HEAVY!r} if m in sys.modules and m not in before)
"""


def test_importing_ckptvault_imports_nothing_heavy() -> None:
    found = run_fresh(PRELUDE + """
import ckptvault
print(json.dumps(heavy()))
""")
    assert found == []


@pytest.mark.parametrize("async_save", [False, True])
def test_lossless_save_and_restore_import_neither_numba_nor_dcp(tmp_path: Path, async_save: bool) -> None:
    """A lossless save (default codec: byte planes + zstd, so planes are split and joined) and its restore, by a
    manager and by the one-liners, in one fresh process: every value comes back, and neither numba nor
    torch.distributed.checkpoint was imported."""
    out = run_fresh(PRELUDE + f"""
import ckptvault
state = {{"w": torch.randn(300_000), "h": torch.randn(70_000).bfloat16(), "d": torch.randn(9_000).double(),
          "i": torch.arange(5_000), "step": 3}}
with ckptvault.CheckpointManager({str(tmp_path / "a")!r}, async_save={async_save}) as mgr:
    mgr.save(3, state).wait()
    back = mgr.restore(3)
ckptvault.save(state, {str(tmp_path / "b")!r}, step=4)
again = ckptvault.load({str(tmp_path / "b")!r})
same = all(torch.equal(r[k], state[k]) for r in (back, again) for k in ("w", "h", "d", "i"))
print(json.dumps({{"same": same, "steps": [back["step"], again["step"]],
                   "heavy": heavy()}}))
""")
    assert out == {"same": True, "steps": [3, 3], "heavy": []}


def test_the_plane_kernels_load_once_a_process_has_split_enough_bytes(tmp_path: Path) -> None:
    """Past ``planes.LOAD_AFTER`` bytes through the numpy loops, the kernels load in the background; splits use
    them once loaded, and what is stored and restored is the same either way."""
    out = run_fresh(f"""
import json, sys
import torch
import ckptvault
from ckptvault._codecs import planes
planes.LOAD_AFTER = 1 << 20
state = {{"w": torch.randn(600_000)}}  # 2.4 MB: past the threshold within the first save
with ckptvault.CheckpointManager({str(tmp_path / "v")!r}, async_save=False) as mgr:
    mgr.save(1, state)
    planes.wait_for_kernel_loading()
    loaded = planes._kernels is not None and planes._kernels is not False
    original = state["w"].clone()
    state["w"] += 1
    mgr.save(2, state)
    back = [mgr.restore(step)["w"] for step in (1, 2)]
print(json.dumps({{"loaded": loaded, "numba": "numba" in sys.modules,
                   "same": torch.equal(back[1], state["w"]) and torch.equal(back[0], original)}}))
""")
    assert out["loaded"] and out["numba"] and out["same"], out


def test_a_lossy_save_loads_the_lossy_kernels_and_then_the_plane_kernels(tmp_path: Path) -> None:
    """A lossy rule imports numba (the fused lossy kernels); the byte-plane kernels then load at once, as numba
    is there already. The restored values are the bfloat16 rounding of the saved ones."""
    out = run_fresh(f"""
import json, sys
import torch
import ckptvault
from ckptvault._codecs import planes
torch.manual_seed(0)
state = {{"optimizer": {{"m": torch.randn(200_000)}}, "model": {{"w": torch.randn(50_000)}}}}
with ckptvault.CheckpointManager({str(tmp_path / "v")!r}, async_save=False, codec_rules={{"optimizer.*": "bf16"}}) as mgr:
    mgr.save(1, state)
    planes.wait_for_kernel_loading()
    back = mgr.restore(1)
print(json.dumps({{
    "lossy_kernels": "ckptvault._codecs.lossy_kernels" in sys.modules,
    "plane_kernels": planes._kernels is not None and planes._kernels is not False,
    "rounded": torch.equal(back["optimizer"]["m"], state["optimizer"]["m"].bfloat16().float()),
    "exact": torch.equal(back["model"]["w"], state["model"]["w"])}}))
""")
    assert out == {"lossy_kernels": True, "plane_kernels": True, "rounded": True, "exact": True}


@pytest.mark.parametrize("typesize", [2, 4, 8])
def test_numpy_loops_match_the_kernels_across_blocks(typesize: int) -> None:
    """The numpy split and join work block by block (``NUMPY_BLOCK`` elements); over several blocks and a
    partial last one they give the planes the kernels give, and join them back to the same bytes."""
    count = 2 * planes.NUMPY_BLOCK + 123
    raw = np.random.default_rng(typesize).integers(0, 256, typesize * count + 1, dtype=np.uint8).tobytes()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(planes, "_kernels", False)
        numpy_planes, tail = planes.split_planes(raw, typesize)
        numpy_planes = numpy_planes.copy()
        joined = planes.assemble(list(numpy_planes), tail, np.empty(len(raw), np.uint8)).tobytes()
    expected = np.frombuffer(raw, np.uint8)[: typesize * count].reshape(-1, typesize).T
    np.testing.assert_array_equal(numpy_planes, expected)
    assert joined == raw
    assert planes._plane_kernels() is not None
    kernel_planes, _ = planes.split_planes(raw, typesize)
    np.testing.assert_array_equal(kernel_planes, numpy_planes)
