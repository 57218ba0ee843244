"""GC next to real processes: a saver with retention on while another process prunes and collects,
and SIGKILL of a running gc at random moments."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ckptvault import CheckpointManager
from ckptvault._maintenance.gc import collect
from ckptvault._maintenance.retention import KeepEvery, KeepLast
from ckptvault._vault import Vault
from conftest import assert_same_state
from test_gc import age, orphans

HELPERS = Path(__file__).parent / "helpers"
sys.path.insert(0, str(HELPERS))
from statedigest import state_digest  # noqa: E402

SECONDS = 12
GRACE = 2.0


def _parse(log: Path) -> list[list[str]]:
    return [line.split() for line in log.read_text().splitlines() if line.strip()]


# -- saver + collector ------------------------------------------------------------------------------
@pytest.mark.parametrize("seconds", [SECONDS, pytest.param(120, marks=pytest.mark.slow)])
def test_prune_and_gc_in_a_loop_next_to_a_saving_process(tmp_path: Path, seconds: int) -> None:
    """Prune and gc in a loop next to a saving process: every committed checkpoint kept restores bit-exactly (DESIGN G1, G5)."""
    vault, saver_log, collector_log = tmp_path / "vault", tmp_path / "saver.log", tmp_path / "collector.log"
    saver = subprocess.Popen([sys.executable, str(HELPERS / "gc_saver.py"), str(vault), str(saver_log), str(seconds)])
    collector = subprocess.Popen([sys.executable, str(HELPERS / "gc_collector.py"), str(vault), str(collector_log),
                                  str(seconds), str(GRACE)])
    try:
        assert saver.wait(timeout=seconds + 120) == 0, saver_log.read_text()[-3000:]
        assert collector.wait(timeout=seconds + 120) == 0, collector_log.read_text()[-3000:]
    finally:
        for proc in (saver, collector):
            if proc.poll() is None:
                proc.kill()
    saved = _parse(saver_log)
    collected = _parse(collector_log)
    committed = {int(w[1]): w[2] for w in saved if w[0] == "committed"}
    pinned = [int(w[1]) for w in collected if w[0] == "pinned"]
    chunks_collected = sum(int(w[1]) for w in collected if w[0] == "gc")
    assert len(committed) >= 10, f"the saver committed only {len(committed)} checkpoints"
    assert chunks_collected > 0, "the collector never deleted a chunk: the test did not exercise gc"
    assert len(pinned) == 1

    with CheckpointManager(vault) as mgr:
        steps = mgr.steps()
        latest = max(committed)
        assert pinned[0] in steps and latest in steps
        assert set(sorted(committed)[-3:]) <= set(steps)
        assert {s for s in committed if s % 5 == 0} <= set(steps)
        assert set(steps) <= set(committed)
        plan, _ = mgr.prune([KeepLast(3), KeepEvery(5)], dry_run=True)
        assert plan.drop == [], f"the policy would still drop {plan.drop}"
        for step in steps:
            assert state_digest(mgr.restore(step)) == committed[step], f"step {step} does not restore bit-exactly"
        report = mgr.verify()
        assert report.ok, report.problems
        _, result = mgr.gc(0)
    assert result is not None
    assert orphans(vault) == set()
    assert not any((vault / "tmp").iterdir())


# -- SIGKILL of a running gc ------------------------------------------------------------------------
class GCServer:
    """``gc_killee.py serve``: imports ckptvault once and forks one gc per trial."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(HELPERS / "gc_killee.py"), "serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        assert self._reply() == "serving"

    def _reply(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"gc server exited with {self.proc.wait()}"
        return line.strip()

    def ask(self, *words: object) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(" ".join(map(str, words)) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        try:
            self.ask("quit")
        except (AssertionError, BrokenPipeError):
            pass
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def garbage_vault(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict[str, torch.Tensor]], set[str]]:
    """Step 1 is a delta checkpoint whose keyframe (step 0) is deleted, and so is step 2 (with 24 MiB of junk):
    hundreds of garbage chunks, and live delta bases that no manifest lists as chunks of their own."""
    root = tmp_path_factory.mktemp("gckill") / "vault"
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(1 << 18, generator=g), torch.randn(1 << 17, generator=g)
    states = {0: {"a": a, "b": b}, 1: {"a": a + 1e-3, "b": b},
              2: {"a": a + 2e-3, "b": b, "junk": torch.randn(3 << 20, generator=g)}, 3: {"a": a + 3e-3, "b": b}}
    with CheckpointManager(root, chunk_size=64 << 10, async_save=False) as mgr:
        for step, state in states.items():
            mgr.save(step, state)
        assert any(c.get("base") for c in mgr.manifest(1)["chunks"])
        mgr.delete(0)
        mgr.delete(2)
    age(root, 7200)
    garbage = orphans(root)
    assert len(garbage) > 150
    return root, {s: states[s] for s in (1, 3)}, garbage


@pytest.mark.parametrize("trials", [12, pytest.param(150, marks=pytest.mark.slow)])
def test_sigkill_of_gc_at_random_moments_leaves_a_consistent_vault(
        garbage_vault: tuple[Path, dict[int, dict[str, torch.Tensor]], set[str]], tmp_path: Path, trials: int) -> None:
    """SIGKILL of gc at stratified random moments leaves every checkpoint intact; the next gc finishes the job (DESIGN G4)."""
    template, states, garbage = garbage_vault
    server = GCServer()
    rng = random.Random(2024 + trials)
    try:
        calibration = Path(shutil.copytree(template, tmp_path / "calibration"))
        started = time.monotonic()
        assert server.ask("wait", server.ask("run", calibration, 60)) == "exit 0"
        full = time.monotonic() - started
        assert orphans(calibration) == set()
        outcomes = []
        for trial in range(trials):
            vault = Path(shutil.copytree(template, tmp_path / f"trial{trial}"))
            delay = full * 1.1 * (trial + rng.random()) / trials  # stratified: early, middle and late kills
            pid = int(server.ask("run", vault, 60))
            time.sleep(delay)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            status = server.ask("wait", pid)
            assert status in ("signal 9", "exit 0"), status
            left = orphans(vault)
            assert left <= garbage
            outcomes.append((status, len(left)))
            _check_intact(vault, states, f"trial {trial} after kill at {delay:.3f}s ({status})")
            v = Vault(vault)
            try:
                collect(v, 60)  # the next gc finishes the job
            finally:
                v.close()
            assert orphans(vault) == set(), f"trial {trial}: the next gc left orphans"
            _check_intact(vault, states, f"trial {trial} after the next gc", restore=False)
            shutil.rmtree(vault)
    finally:
        server.close()
    killed_mid_sweep = [n for status, n in outcomes if status == "signal 9" and 0 < n < len(garbage)]
    assert len(killed_mid_sweep) >= 2, f"too few kills landed mid-sweep (gc took {full:.3f}s): {outcomes}"


def _check_intact(vault: Path, states: dict[int, dict[str, torch.Tensor]], ctx: str, restore: bool = True) -> None:
    with CheckpointManager(vault) as mgr:
        assert mgr.steps() == sorted(states), ctx
        for step, state in states.items() if restore else ():
            assert_same_state(state, mgr.restore(step))
        report = mgr.verify()
        assert report.ok, (ctx, report.problems)


def test_a_save_whose_temporary_files_gc_swept_fails_as_a_retryable_save_error(tmp_path: Path) -> None:
    """gc at grace 0 next to a save: it may sweep the save's unlinked temporary chunk files, and the save must then
    fail as G5 promises (SaveError, nothing committed), not with a storage error naming a chunk."""
    import threading

    from ckptvault.errors import SaveError

    url = str(tmp_path / "v")
    gate = threading.Event()
    with CheckpointManager(url, chunk_size=65536, workers=1) as saver, \
            CheckpointManager(url, async_save=False) as other:
        other.save(0, {"x": torch.zeros(4)})
        handle = saver.save(1, {"w": torch.randn(100_000)}, progress=lambda n: gate.wait(10))  # holds after a chunk
        deadline = time.monotonic() + 10
        while not os.listdir(Path(url) / "tmp") and time.monotonic() < deadline:  # the first chunk's temp file
            time.sleep(0.01)
        swept = [g.key for g in other.gc(0)[1].deleted if g.kind == "temp"]
        gate.set()
        with pytest.raises(SaveError, match=r"was removed before the batch could link it .*nothing was committed: "
                                             r"save again"):
            handle.wait()
        assert swept and other.steps() == [0]
        saver.save(1, {"w": torch.ones(3)}).wait()  # the retry commits
        assert other.steps() == [0, 1]
