"""The README's "Resume a training run" recipe, run as written: killed with SIGKILL part-way, or stopped with SIGTERM
(it saves the step it is at and exits with 143), and run again, it ends bit-identical to an uninterrupted run
(weights, optimizer and scheduler states, the losses after the resume).

The code block is the one after the ``<!-- resume-recipe`` comment in README.md, written to a file and run as a
script in a subprocess with ``VAULT`` and ``STEPS`` in its environment.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptvault
from ckptvault._format.manifest import manifest_key
from conftest import assert_same_state

README = Path(__file__).resolve().parent.parent / "README.md"
STEPS = 200  # the recipe's default: 12.5 epochs of 16 batches, saved every 25 steps
KILL_AFTER = 50  # the first run is killed once this step is committed (it saves at 25, 50, ...)


def recipe() -> str:
    text = README.read_text()
    found = re.search(r"<!-- resume-recipe[^\n]*-->\n```python\n(.*?)\n```\n", text, re.S)
    assert found, "README.md has no code block marked <!-- resume-recipe -->"
    return found.group(1)


def _start(script: Path, vault: Path) -> subprocess.Popen[str]:
    env = dict(os.environ, VAULT=str(vault), STEPS=str(STEPS), OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    return subprocess.Popen([sys.executable, str(script)], cwd=script.parent, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _run(script: Path, vault: Path) -> list[str]:
    proc = _start(script, vault)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    return out.splitlines()


def _losses(lines: list[str]) -> dict[int, str]:
    return {int(m[1]): m[2] for line in lines if (m := re.fullmatch(r"step (\d+) loss (\S+)", line))}


def _final(vault: Path) -> dict[str, Any]:
    with ckptvault.CheckpointManager(vault) as mgr:
        assert mgr.latest_step() == STEPS
        state = mgr.restore(STEPS)
    return state


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, str]]:
    """The recipe run once to the end (shared by the tests that stop it): its vault and its losses."""
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    script = tmp_path / "train.py"
    script.write_text(recipe())
    full = _run(script, tmp_path / "vault")
    expected = _losses(full)
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert "resumed from step" not in "\n".join(full)
    return tmp_path / "vault", expected


def _resumes_identically(script: Path, vault: Path, stopped: int, full_vault: Path,
                         expected: dict[int, str]) -> dict[str, Any]:
    """Run the recipe again on ``vault`` (last committed: ``stopped``): it resumes there, its losses after the
    resume are the uninterrupted run's, and its final state is that run's bit for bit. Returns the final state."""
    second = _run(script, vault)
    assert second[0] == f"resumed from step {stopped}"
    resumed = _losses(second)
    assert sorted(resumed) == list(range(stopped + 1, STEPS + 1))
    assert resumed == {s: expected[s] for s in resumed}, "the losses after the resume differ"
    want, got = _final(full_vault), _final(vault)
    for key in ("model", "optimizer", "scheduler", "step"):
        assert_same_state(want[key], got[key])
    assert got["optimizer"]["state"][0]["step"].item() == STEPS
    return got


def test_the_readme_recipe_resumes_bit_identically_after_sigkill(tmp_path: Path,
                                                                 uninterrupted: tuple[Path, dict[int, str]]) -> None:
    script = tmp_path / "train.py"
    script.write_text(recipe())
    assert 'os.environ.get("VAULT", "./ckpts")' in script.read_text()  # the parameters are shown with defaults
    full_vault, expected = uninterrupted

    vault = tmp_path / "killed"
    proc = _start(script, vault)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip() == f"saved step {KILL_AFTER}":
            break
    deadline = time.monotonic() + 60
    while not (vault / manifest_key(KILL_AFTER)).exists():  # committed (the save runs in the background)
        assert time.monotonic() < deadline and proc.poll() is None, "the save was not committed"
        time.sleep(0.001)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it was killed: the test proves nothing"
    with ckptvault.CheckpointManager(vault) as mgr:
        committed = mgr.latest_step()
    assert committed is not None and KILL_AFTER <= committed < STEPS

    got = _resumes_identically(script, vault, committed, full_vault, expected)
    assert got["scheduler"]["last_epoch"] == STEPS


def test_the_readme_recipe_saves_the_step_it_is_at_on_sigterm_and_resumes_bit_identically(
        tmp_path: Path, uninterrupted: tuple[Path, dict[int, str]]) -> None:
    script = tmp_path / "train.py"
    script.write_text(recipe())
    assert "mgr.handle_preemption(poll=True)" in script.read_text()
    full_vault, expected = uninterrupted

    vault = tmp_path / "terminated"
    proc = _start(script, vault)
    assert proc.stdout is not None
    first = []
    for line in proc.stdout:
        first.append(line.strip())
        if first[-1] == f"saved step {KILL_AFTER}":
            break
    deadline = time.monotonic() + 60
    while not (vault / manifest_key(KILL_AFTER)).exists():  # committed (the save runs in the background)
        assert time.monotonic() < deadline and proc.poll() is None, "the save was not committed"
        time.sleep(0.001)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    first += out.splitlines()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    stopped = max(_losses(first))
    assert KILL_AFTER < stopped < STEPS, "the run did not stop part-way on SIGTERM"
    assert first[-1] == f"saved step {stopped}"  # the step it was at, saved last
    with ckptvault.CheckpointManager(vault) as mgr:
        assert mgr.latest_step() == stopped  # ... and committed before the exit

    _resumes_identically(script, vault, stopped, full_vault, expected)


def test_the_comparison_notices_a_resume_without_the_rng_state(tmp_path: Path,
                                                               uninterrupted: tuple[Path, dict[int, str]]) -> None:
    """Control: the same recipe with ``set_rng_state`` taken out resumes with other dropout masks and diverges.
    (Its uninterrupted run is the recipe's: the line taken out runs only on a resume.)"""
    code = recipe()
    assert code.count("set_rng_state(report[\"rng\"])") == 1
    script = tmp_path / "train.py"
    script.write_text(code.replace("set_rng_state(report[\"rng\"])", "torch.manual_seed(1)"))
    full_vault, expected = uninterrupted
    vault = tmp_path / "resumed"
    with ckptvault.CheckpointManager(full_vault) as src:  # a vault holding steps 25 and 50 only
        with ckptvault.CheckpointManager(vault) as dst:
            for step in (25, 50):
                dst.save(step, src.restore(step)).wait()
    resumed = _losses(_run(script, vault))
    assert min(resumed) == 51
    assert any(resumed[s] != expected[s] for s in resumed)
    got = _final(vault)
    assert not torch.equal(got["model"]["0.weight"], _final(full_vault)["model"]["0.weight"])
