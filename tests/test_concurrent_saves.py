"""Two real processes saving into one local vault at the same time do not disturb each other.

Each round, both processes save a different step; half of each state is identical in both (so they race
to create the same chunks with create-if-absent) and half is private. Both also race to create the vault
itself. Afterwards every step restores exactly and ``verify`` passes. A second test has both processes
save the SAME step: exactly one commits, the other gets StepExistsError, and the winner's data is intact.

This file is also the worker's entry point: ``python tests/test_concurrent_saves.py VAULT WORKER ROUNDS GO_FILE``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

import ckptvault
from conftest import assert_same_state

ROUNDS = 4
CHUNK_SIZE = 64 << 10


def make_state(round_: int, worker: int) -> dict[str, Any]:
    """Deterministic state: ``shared`` equal in both workers of a round, ``own`` private to one."""
    shared = torch.Generator().manual_seed(1000 + round_)
    own = torch.Generator().manual_seed(worker * 7919 + round_)
    return {
        "shared": {"w": torch.randn(256, 1024, generator=shared), "b": torch.randn(100, generator=shared)},
        "own": {"w": torch.randn(128, 512, generator=own), "small": [torch.randn(5, generator=own) for _ in range(20)]},
        "meta": {"round": round_, "worker": worker},
    }


def step_of(round_: int, worker: int) -> int:
    return round_ * 10 + worker


def worker_main(url: str, worker: int, rounds: int, go_file: str, same_step: bool) -> None:
    """Wait for the go signal, then save every round as fast as possible; print a JSON result line."""
    states = [make_state(r, worker) for r in range(rounds)]
    while not os.path.exists(go_file):
        time.sleep(0.001)
    outcome: dict[str, Any] = {"committed": [], "exists": []}
    with ckptvault.CheckpointManager(url, chunk_size=CHUNK_SIZE, workers=2) as mgr:
        for round_, state in enumerate(states):
            step = step_of(round_, 0 if same_step else worker)
            try:
                mgr.save(step, state).wait()
                outcome["committed"].append(step)
            except ckptvault.errors.StepExistsError:
                outcome["exists"].append(step)
    print(json.dumps(outcome))


def _run_workers(url: str, tmp_path: Path, same_step: bool) -> list[dict[str, Any]]:
    go = tmp_path / "go"
    cmd = [sys.executable, __file__, url, "{worker}", str(ROUNDS), str(go), "same" if same_step else "different"]
    procs = [subprocess.Popen([c.format(worker=w) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for w in (1, 2)]
    time.sleep(0.5)  # let both import torch and build their states
    go.touch()
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_two_processes_save_different_steps(tmp_path: Path) -> None:
    """Both processes create the chunks they share create-if-absent: every step of each commits and restores (DESIGN C1)."""
    url = str(tmp_path / "vault")
    results = _run_workers(url, tmp_path, same_step=False)
    expected_steps = sorted(step_of(r, w) for r in range(ROUNDS) for w in (1, 2))
    assert sorted(results[0]["committed"] + results[1]["committed"]) == expected_steps
    with ckptvault.CheckpointManager(url) as mgr:
        assert mgr.steps() == expected_steps
        for round_ in range(ROUNDS):
            for worker in (1, 2):
                assert_same_state(make_state(round_, worker), mgr.restore(step_of(round_, worker)))
            shared = [mgr.manifest(step_of(round_, w))["chunks"] for w in (1, 2)]
            assert {c["id"] for c in shared[0]} & {c["id"] for c in shared[1]}  # the rounds really shared chunks
        report = mgr.verify()
        assert report.ok, report.problems
        assert report.checked == expected_steps
    assert not list((Path(url) / "tmp").glob("*")), "temporary files were left behind"


def test_two_processes_save_the_same_step(tmp_path: Path) -> None:
    """A manifest is created create-if-absent: exactly one process commits each step, the other is told it exists (DESIGN M2)."""
    url = str(tmp_path / "vault")
    results = _run_workers(url, tmp_path, same_step=True)
    for round_ in range(ROUNDS):
        step = step_of(round_, 0)
        winners = [w for w, r in zip((1, 2), results) if step in r["committed"]]
        losers = [w for w, r in zip((1, 2), results) if step in r["exists"]]
        assert len(winners) == 1 and len(losers) == 1, (step, results)
        with ckptvault.CheckpointManager(url) as mgr:
            assert_same_state(make_state(round_, winners[0]), mgr.restore(step))
    with ckptvault.CheckpointManager(url) as mgr:
        assert mgr.verify().ok


if __name__ == "__main__":
    worker_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5] == "same")
