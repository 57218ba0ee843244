"""The README's "Distributed training" recipe, run as written with torchrun (FSDP2 on gloo, 2 ranks on CPU).

A run stopped after 10 steps and resumed to 20 ends bit-identical to an uninterrupted run of 20 (the model, the
optimizer and each rank's RNG state came back); resumed again at 1 rank, it reshards and goes on. The code block is
the one after the ``<!-- torchrun-recipe`` comment in README.md, written to a file and run with
``python -m torch.distributed.run`` with ``VAULT`` and ``STEPS`` in its environment.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptvault
from conftest import assert_same_state

README = Path(__file__).resolve().parent.parent / "README.md"


def recipe() -> str:
    found = re.search(r"<!-- torchrun-recipe[^\n]*-->\n```python\n(.*?)\n```\n", README.read_text(), re.S)
    assert found, "README.md has no code block marked <!-- torchrun-recipe -->"
    return found.group(1)


def _torchrun(script: Path, vault: Path, steps: int, ranks: int) -> None:
    env = dict(os.environ, VAULT=str(vault), STEPS=str(steps), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(script)]
    done = subprocess.run(command, cwd=script.parent, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("recipe") / "train.py"
    path.write_text(recipe())
    return path


def _state(vault: Path, step: int) -> dict[str, object]:
    with ckptvault.CheckpointManager(vault) as mgr:
        state: dict[str, object] = mgr.restore(step)
    return state


def test_a_stopped_run_resumed_with_torchrun_matches_an_uninterrupted_one_and_reshards(script: Path) -> None:
    whole, resumed = script.parent / "whole", script.parent / "resumed"
    _torchrun(script, whole, 20, 2)
    _torchrun(script, resumed, 10, 2)
    with ckptvault.CheckpointManager(resumed) as mgr:
        assert mgr.steps() == [4, 9]
    _torchrun(script, resumed, 20, 2)
    with ckptvault.CheckpointManager(resumed) as mgr:
        kept = mgr.steps()  # KeepLast(3), applied once by rank 0 (it keeps step 4 too while it is a kept delta's keyframe)
        assert kept[-3:] == [9, 14, 19] and kept[:-3] in ([], [4])
    expected, actual = _state(whole, 19), _state(resumed, 19)
    for state in (expected, actual):  # numpy's and Python's generators are never seeded or drawn from: left out
        del state["rng"]["numpy"], state["rng"]["python"]  # type: ignore[attr-defined]
    assert_same_state(expected, actual)  # torch's RNG states of both ranks too, each its own
    rngs = actual["rng"]["torch"]["__per_rank__"]  # type: ignore[index]
    assert not torch.equal(rngs["0"], rngs["1"])

    _torchrun(script, resumed, 25, 1)  # the same vault resumed at 1 rank: resharded, rank 0's RNG state
    before, after = _state(resumed, 19), _state(resumed, 24)
    assert after["step"] == 24
    model_before, model_after = before["model"], after["model"]  # type: ignore[index]
    assert {k: v.shape for k, v in model_before.items()} == {k: v.shape for k, v in model_after.items()}
    assert any(not torch.equal(model_before[k], model_after[k]) for k in model_before)
