"""Asynchronous saves run by a saver process (``AsyncOptions(saver="process" | "idle-process")``): real processes,
a real model and optimizer, real signals."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptvault import AsyncOptions, CheckpointManager, DeltaOptions, LossySafety, Retention
from ckptvault._delta.policy import DeltaPolicy
from ckptvault._save.process_child import ChildConfig
from ckptvault._save.process_saver import ProcessSaver
from ckptvault.errors import InvalidArgumentError, LossyCodecError, SaveError
from ckptvault.stores import open_store
from helpers.one_rank_job import made_in_a_job
from helpers.recording_policy import RecordingKeepLast

pytestmark = pytest.mark.skipif(os.name != "posix", reason="a saver process needs a POSIX system")

PROCESS = AsyncOptions(saver="process")


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return value


def _same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        assert a == b


class _Training:
    """A real model and AdamW optimizer; ``step()`` trains one step and returns the live state."""

    def __init__(self, width: int = 64) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.ReLU(), torch.nn.Linear(width, 4))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.1)
        self.steps = 0

    def step(self) -> dict[str, Any]:
        loss = self.model(torch.randn(16, 32)).pow(2).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.steps += 1
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(), "step": self.steps}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is gone for our purposes
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_predicted_saves_in_a_saver_process_restore_bit_exact_while_training_goes_on(tmp_path: Path) -> None:
    training, saved = _Training(), {}
    with CheckpointManager(tmp_path / "v", async_options=PROCESS, delta=DeltaOptions(predict=True, max_chain=3)) as mgr:
        pid = mgr._saver.pid
        assert pid is not None and pid != os.getpid() and _alive(pid)
        for _ in range(7):
            state = training.step()
            handle = mgr.save(training.steps, state)
            assert handle.staged.done()
            saved[training.steps] = _clone(state)  # the live state moves on below while the save runs
        handle.wait()
        for step, state in saved.items():
            _same(mgr.restore(step), state)
        chains = {step: len(mgr.manifest(step).get("chain", [])) for step in saved}
    assert chains == {1: 0, 2: 1, 3: 2, 4: 3, 5: 0, 6: 1, 7: 2}  # predicted in the saver process, capped at 3
    assert not _alive(pid)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux's idle scheduling class")
@pytest.mark.parametrize(("saver", "policy"), [("process", "SCHED_OTHER"), ("idle-process", "SCHED_IDLE")])
def test_an_idle_saver_process_runs_in_the_idle_class(tmp_path: Path, saver: str, policy: str) -> None:
    with CheckpointManager(tmp_path / "v", async_options=AsyncOptions(saver=saver)) as mgr:
        mgr.save(1, _Training().step()).wait()
        pid = mgr._saver.pid
        assert pid is not None
        assert os.sched_getscheduler(pid) == getattr(os, policy)
        threads = os.listdir(f"/proc/{pid}/task")
        assert len(threads) > 1 and {os.sched_getscheduler(int(t)) for t in threads} == {getattr(os, policy)}


def test_progress_logs_and_warnings_of_the_saver_process_arrive_in_the_training_process(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    seen: list[tuple[int, int]] = []
    state = {"w": torch.randn(3_000_000), "tiny": torch.full((1000,), 1e-9)}  # fp16 flushes "tiny": a fallback warning
    with CheckpointManager(tmp_path / "v", async_options=PROCESS, codec_rules={"tiny": "fp16"}) as mgr:
        with caplog.at_level(logging.INFO, logger="ckptvault"):
            handle = mgr.save(1, state, progress=lambda n, total: seen.append((n, total)))
            with pytest.warns(RuntimeWarning, match=r"fp16 on 'tiny' is unsafe: .* fell back to bf16"):
                info = handle.wait()
    assert info is not None and len(seen) >= 3
    assert sum(n for n, _ in seen) == seen[0][1] == 4 * 3_000_000 + 2 * 1000  # as chunked: "tiny" in bf16
    assert {total for _, total in seen} == {seen[0][1]} and info.logical_bytes == 4 * 3_001_000
    committed = [r for r in caplog.records if r.getMessage().startswith("committed step 1 to ")]
    assert len(committed) == 1 and committed[0].processName.startswith("ckptvault-saver-")


def test_a_save_that_fails_in_the_saver_process_raises_its_typed_error_and_commits_nothing(tmp_path: Path) -> None:
    training = _Training()
    with CheckpointManager(tmp_path / "v", async_options=PROCESS, codec_rules={"tiny": "fp16"},
                           lossy_safety=LossySafety(on_unsafe="fail")) as mgr:
        mgr.save(1, {**training.step(), "tiny": torch.ones(100)}).wait()  # fp16 is safe here
        handle = mgr.save(2, {**training.step(), "tiny": torch.full((100,), 1e-9)})
        with pytest.raises(LossyCodecError, match=r"fp16 on 'tiny' is unsafe: .*flushed to zero"):
            handle.wait()
        assert mgr.steps() == [1]
        state = training.step()
        mgr.save(3, state).wait()  # the same saver process goes on
        assert mgr.steps() == [1, 3]
        _same(mgr.restore(3), _clone(state))


def test_a_saver_process_killed_mid_save_fails_that_save_and_the_next_save_starts_another(tmp_path: Path) -> None:
    """SIGKILL of the saver process after its first chunk: nothing of that step is listed (DESIGN M1)."""
    training = _Training()
    big = {"data": torch.randn(12 * 1024 * 1024 // 4 * 3)}  # 36 MiB: nine chunks, so the first progress is early

    with CheckpointManager(tmp_path / "v", async_options=PROCESS) as mgr:
        first = training.step()
        mgr.save(1, first).wait()
        first = _clone(first)
        pid = mgr._saver.pid
        assert pid is not None

        def kill_at_first_chunk(n: int) -> None:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)

        handle = mgr.save(2, big, progress=kill_at_first_chunk)
        with pytest.raises(SaveError, match=rf"the saver process \(pid {pid}\) exited with status -9 while saving step "
                                            r"2; that step was not reported committed, .* The next save starts a new"):
            handle.wait()
        assert mgr.steps() == [1]
        state = training.step()
        mgr.save(3, state).wait()
        assert mgr._saver.pid not in (None, pid)
        assert mgr.steps() == [1, 3]
        _same(mgr.restore(1), first)
        _same(mgr.restore(3), _clone(state))
        assert mgr.verify().ok


def test_a_saver_process_that_died_between_saves_is_replaced_by_the_next_save(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "v", async_options=PROCESS) as mgr:
        pid = mgr._saver.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        state = _Training().step()
        mgr.save(1, state).wait()
        assert mgr._saver.pid != pid
        _same(mgr.restore(1), _clone(state))


KILL_TRAINER = textwrap.dedent("""
    import os, signal, sys, torch
    from ckptvault import AsyncOptions, CheckpointManager
    mgr = CheckpointManager(sys.argv[1], async_options=AsyncOptions(saver="process"))
    mgr.save(1, {"w": torch.zeros(10)}).wait()
    print(mgr._saver.pid, flush=True)
    torch.manual_seed(1)
    mgr.save(2, {"w": torch.randn(16 * 1024 * 1024)})  # 64 MiB: not written yet below
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_training_process_killed_after_save_returned_still_gets_that_checkpoint_committed(tmp_path: Path) -> None:
    """SIGKILL of the training process while its save is in flight: the saver process commits it whole and exits
    (DESIGN M1)."""
    vault = tmp_path / "v"
    run = subprocess.run([sys.executable, "-c", KILL_TRAINER, str(vault)], capture_output=True, text=True, timeout=120)
    assert run.returncode == -signal.SIGKILL, run.stderr
    pid = int(run.stdout.split()[0])
    deadline = time.monotonic() + 60
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), "the saver process outlived the training process"
    with CheckpointManager(vault) as mgr:
        assert mgr.steps() == [1, 2]
        torch.manual_seed(1)
        _same(mgr.restore(2), {"w": torch.randn(16 * 1024 * 1024)})
        assert mgr.verify().ok


def test_a_skipped_save_while_the_saver_process_is_busy(tmp_path: Path) -> None:
    options = AsyncOptions(saver="process", on_busy="skip")
    with CheckpointManager(tmp_path / "v", async_options=options) as mgr:
        mgr.save(1, {"w": torch.zeros(10)}).wait()
        first = mgr.save(2, {"w": torch.randn(16 * 1024 * 1024)})
        with pytest.warns(RuntimeWarning, match="skipping the save of step 3: step 2 is still being saved"):
            skipped = mgr.save(3, {"w": torch.ones(10)})
        assert skipped.skipped and skipped.wait() is None
        first.wait()
        assert mgr.steps() == [1, 2]


def test_saves_queue_in_their_own_buffers_while_the_saver_process_is_held_up(tmp_path: Path) -> None:
    """max_in_flight=3: three saves stage and return while the saver process is stopped, a fourth is skipped (or
    waits), and the three commit in order, each predicted from the one before."""
    training = _Training()
    options = AsyncOptions(saver="process", max_in_flight=3, on_busy="skip")
    with CheckpointManager(tmp_path / "v", async_options=options, delta=DeltaOptions(predict=True)) as mgr:
        mgr.save(1, training.step())
        mgr.wait()  # finished, not only committed: its buffer is free
        pid = mgr._saver.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            handles, saved = [], {}
            for _ in range(3):
                state = training.step()
                handles.append(mgr.save(training.steps, state))
                saved[training.steps] = _clone(state)
            assert [h.staged.done() and not h.done() for h in handles] == [True] * 3
            with pytest.warns(RuntimeWarning, match="skipping the save of step 5: steps 2, 3, 4 are still being saved"):
                assert mgr.save(5, training.step()).skipped
        finally:
            os.kill(pid, signal.SIGCONT)
        _same(mgr.restore(4), saved[4])  # waits for it
        assert [h.done() for h in handles] == [True] * 3
        for step, state in saved.items():
            _same(mgr.restore(step), state)
        assert [len(mgr.manifest(s).get("chain", [])) for s in mgr.steps()] == [0, 1, 2, 3]


def test_a_full_queue_makes_the_next_save_wait_for_the_oldest(tmp_path: Path) -> None:
    options = AsyncOptions(saver="process", max_in_flight=2)
    with CheckpointManager(tmp_path / "v", async_options=options) as mgr:
        mgr.save(1, {"w": torch.zeros(10)})
        mgr.wait()
        pid = mgr._saver.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        first, second = mgr.save(2, {"w": torch.ones(10)}), mgr.save(3, {"w": torch.full((10,), 3.0)})
        assert not first.done() and not second.done()
        timer = threading.Timer(0.5, os.kill, (pid, signal.SIGCONT))
        timer.start()
        started = time.monotonic()
        third = mgr.save(4, {"w": torch.full((10,), 4.0)})  # both buffers taken: waits until step 2 is finished
        assert time.monotonic() - started >= 0.4 and first.done()
        third.wait()
        timer.join()
        assert mgr.steps() == [1, 2, 3, 4]
        _same(mgr.restore(3), {"w": torch.full((10,), 3.0)})


def test_retention_and_a_growing_staging_buffer_with_a_saver_process(tmp_path: Path) -> None:
    states = [{"w": torch.full((n,), float(n))} for n in (10, 1000, 300_000, 20)]
    with CheckpointManager(tmp_path / "v", async_options=PROCESS, retention=Retention(keep_last=2)) as mgr:
        for step, state in enumerate(states, 1):
            mgr.save(step, state)
        mgr.wait()
        assert mgr.steps() == [3, 4]
        _same(mgr.restore(3), states[2])
        _same(mgr.restore(4), states[3])


def _retention_run(tmp_path: Path, policy: Any) -> set[int]:
    """Six saves of a changing state with ``policy``; the pids of the saver processes."""
    pids = set()
    with CheckpointManager(tmp_path / "v", async_options=PROCESS, retention=policy) as mgr:
        for step in range(1, 7):
            mgr.save(step, {"w": torch.full((1000,), float(step))})
            pids.add(mgr._saver.pid)
        mgr.wait()
    return pids


def test_retention_runs_in_the_saver_process_where_its_policies_unpickle(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # the saver process can import helpers/
    log = tmp_path / "applied-by"
    saver_pids = _retention_run(tmp_path, RecordingKeepLast(2, str(log)))
    appliers = log.read_text().split()
    assert len(appliers) == 6 and set(map(int, appliers)) == saver_pids != {os.getpid()}
    with CheckpointManager(tmp_path / "v") as again:
        assert again.steps() == [1, 5, 6]  # 1: the keyframe of 5 and 6
        _same(again.restore(5), {"w": torch.full((1000,), 5.0)})


def test_every_built_in_policy_travels_to_the_saver_process() -> None:
    from ckptvault._save.process_child import _retention
    from ckptvault._save.process_saver import pickled_retention

    retention = Retention(keep_last=1, keep_every=2, keep_best=1, metric="loss", mode="max", keep_daily=3,
                          keep_weekly=4, gc=False, gc_grace=5)
    there = _retention(pickled_retention(retention))
    assert there is not None and repr(there) == repr(retention) and (there.gc, there.gc_grace) == (False, 5.0)
    assert pickled_retention(Retention(keep_if=lambda info: True)) is None and pickled_retention(None) is None


def test_retention_the_saver_process_cannot_unpickle_runs_in_the_training_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONPATH", raising=False)  # the policy's module is not importable in the saver process
    log = tmp_path / "applied-by"
    _retention_run(tmp_path, [RecordingKeepLast(2, str(log))])
    assert log.read_text().split() == [str(os.getpid())] * 6
    with CheckpointManager(tmp_path / "v") as again:
        assert again.steps() == [1, 5, 6]


def test_an_exclusive_retention_in_the_training_process_lets_no_save_overlap_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """(DESIGN G6) it frees released chunks at once, so each save waits for the one before and its retention."""
    monkeypatch.delenv("PYTHONPATH", raising=False)
    log = tmp_path / "applied-by"
    options = AsyncOptions(saver="process", max_in_flight=4)
    with CheckpointManager(tmp_path / "v", async_options=options, exclusive=True,
                           retention=RecordingKeepLast(1, str(log))) as mgr:
        for step in range(1, 6):
            mgr.save(step, {"w": torch.full((1000,), float(step))})
            applied = len(log.read_text().split()) if log.exists() else 0
            assert applied == step - 1, f"save {step} began while an earlier save or its retention ran"
            time.sleep(0.2)  # time enough for a save in flight to have started, had this one not waited
        mgr.wait()
        assert mgr.steps()[-1] == 5 and log.read_text().split() == [str(os.getpid())] * 5


def test_a_retention_that_fails_in_the_saver_process_is_raised_by_the_next_call(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    log = tmp_path / "applied-by"
    with CheckpointManager(tmp_path / "v", async_options=PROCESS,
                           retention=RecordingKeepLast(1, str(log), fail=True)) as mgr:
        assert mgr.save(1, {"w": torch.ones(3)}).wait() is not None  # committed: the retention runs after it
        with pytest.raises(SaveError, match=r"step 1 was committed, but the retention that runs after it failed: "
                                            r"ZeroDivisionError: no"):
            mgr.wait()
        assert mgr.steps() == [1] and log.read_text().split() == [str(mgr._saver.pid)]


def test_a_state_over_max_staging_bytes_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    options = AsyncOptions(saver="process", max_staging_bytes=1000)
    with CheckpointManager(tmp_path / "v", async_options=options) as mgr:
        mgr.save(1, {"w": torch.zeros(10)}).wait()
        chunks = sorted(open_store(str(tmp_path / "v")).list("chunks/"))
        with pytest.raises(InvalidArgumentError, match=r"step 2 needs more staging memory than max_staging_bytes=1000, "
                                                       r"and a saver process can only save a staged state"):
            mgr.save(2, {"w": torch.zeros(1000)})
        assert mgr.steps() == [1] and sorted(open_store(str(tmp_path / "v")).list("chunks/")) == chunks


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"async_save": False}, r"AsyncOptions\(saver='process'\) runs asynchronous saves; it needs async_save=True"),
    ({"url": "memory://somewhere"}, r"cannot save into memory://somewhere: a saver process would open a memory store"),
    ({"url": "store"}, r"needs the vault's URL, which the saver process opens itself, not a Store object: pass '/.*/v'"),
])
def test_settings_a_saver_process_cannot_serve_are_refused(tmp_path: Path, kwargs: dict[str, Any], match: str) -> None:
    url = kwargs.pop("url", tmp_path / "v")
    url = open_store(str(tmp_path / "v")) if url == "store" else url
    with pytest.raises(InvalidArgumentError, match=match):
        CheckpointManager(url, async_options=PROCESS, **kwargs)


def test_settings_that_do_not_pickle_are_refused_before_a_saver_process_starts(tmp_path: Path) -> None:
    config = ChildConfig(str(tmp_path / "v"), {"token": lambda: "secret"}, None, DeltaPolicy(), False, LossySafety(),
                         True, logging.WARNING)
    with pytest.raises(InvalidArgumentError, match=r"AsyncOptions\(saver='process'\) sends the manager's settings to "
                                                   r"the saver process, and they do not pickle \(.*\): give "
                                                   r"storage_options as plain values"):
        ProcessSaver(config, PROCESS)


def test_an_unknown_saver_or_queue_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match=r"saver must be one of \('thread', 'process', 'idle-process'\), "
                                                   r"got 'processes'"):
        AsyncOptions(saver="processes")
    with pytest.raises(InvalidArgumentError, match=r"max_in_flight=2 needs a saver process \(saver='process' or "
                                                   r"'idle-process'\): the thread saver runs one save at a time"):
        AsyncOptions(max_in_flight=2)
    with pytest.raises(InvalidArgumentError, match="max_in_flight must be at least 1, got 0"):
        AsyncOptions(saver="process", max_in_flight=0)


def test_a_distributed_manager_refuses_a_saver_process() -> None:
    assert made_in_a_job("async_options=ckptvault.AsyncOptions(saver='process')").startswith(
        "refused: AsyncOptions(saver='process') is for single-process saves")


def test_the_flat_spellings_fold_into_async_options(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "v", saver="process", max_in_flight=2) as mgr:
        assert isinstance(mgr._saver, ProcessSaver) and len(mgr._saver._slots) == 2
        mgr.save(1, {"w": torch.ones(3)}).wait()
        _same(mgr.restore(1), {"w": torch.ones(3)})


def test_a_retention_that_fails_after_a_commit_in_the_saver_process_is_raised_by_the_next_call(tmp_path: Path) -> None:
    def broken(info: Any) -> bool:
        raise ZeroDivisionError("no")

    with CheckpointManager(tmp_path / "v", async_options=PROCESS, retention=Retention(keep_last=1, keep_if=broken)) as mgr:
        assert mgr.save(1, {"w": torch.ones(3)}).wait() is not None  # committed: the retention runs after it
        with pytest.raises(SaveError, match=r"step 1 was committed, but the retention that runs after it failed: "
                                            r"ZeroDivisionError: no"):
            mgr.wait()
        assert mgr.steps() == [1]
