"""Asynchronous saving: save() returns once the state is staged in host memory.

What must hold:

* no torn snapshots: training may change every tensor in place as soon as ``save`` returns, and the
  committed checkpoint still holds the values from before;
* both moments are exposed (``handle.staged`` then ``handle.committed``); ``mgr.wait()``, ``close()``
  and interpreter exit flush the save in flight, and exit reports a failure in the log;
* host memory is bounded: one reusable staging buffer (grown only when a state needs more room),
  a cap above which a save runs synchronously, at most one save in flight (``on_busy``);
* a background error surfaces as its typed error on the next save, wait or close, exactly once, and
  the failed step never commits;
* ``async_save=False`` returns committed, and both paths write the same manifest.

Background saves are made slow deterministically with :class:`GatedStore` (a LocalStore whose
background calls wait for an event) and failed with :class:`QuotaStore` (a LocalStore whose chunk
writes hit ENOSPC past a quota); see tests/helpers/async_stores.py.
"""

from __future__ import annotations

import copy
import logging
import multiprocessing
import os
import subprocess
import sys
import threading
import time
import warnings
from concurrent import futures
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import ckptvault
from ckptvault import CheckpointInfo, CheckpointManager
from ckptvault._codecs.planes import load_kernels_in_background, wait_for_kernel_loading
from ckptvault.errors import InvalidArgumentError, SaveError, StepExistsError, StorageFullError
from conftest import assert_same_state
from helpers.async_stores import GatedStore, QuotaStore

HELPERS = Path(__file__).parent / "helpers"
CHUNK = 64 << 10
SETTLE = 0.3  # seconds a blocked call is given to (wrongly) finish before we check that it has not


# -- a real training state ---------------------------------------------------------------------------
class Training:
    """An MLP with AdamW in which every parameter gets a gradient, so one step changes every tensor."""

    def __init__(self, seed: int = 0, width: int = 64) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(32, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                                   nn.Linear(width, 8))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.01)
        self.gen = torch.Generator().manual_seed(seed + 1)

    def backward(self) -> None:
        """Compute gradients for the next step (so that ``step()`` right after a save is only the update)."""
        x = torch.randn(16, 32, generator=self.gen)
        self.opt.zero_grad()
        self.model(x).square().mean().backward()

    def train(self, steps: int = 1) -> None:
        for _ in range(steps):
            self.backward()
            self.opt.step()

    def state(self, step: int) -> dict[str, Any]:
        """The live state: the model's and optimizer's own tensors (an optimizer step changes them in place)."""
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(), "step": step}


def tensors_of(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in tensors_of(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in tensors_of(v)]
    return []


def frozen(state: Any) -> Any:
    """A deep copy that training cannot change."""
    return copy.deepcopy(state)


def manager(store: Any, **kwargs: Any) -> CheckpointManager:
    return CheckpointManager(store, **{"chunk_size": CHUNK, **kwargs})


def restored(url: Any, step: int) -> Any:
    with CheckpointManager(url) as mgr:
        return mgr.restore(step)


def open_gate_later(store: GatedStore, delay: float) -> threading.Timer:
    timer = threading.Timer(delay, store.gate.set)
    timer.start()
    return timer


# -- no torn snapshots ---------------------------------------------------------------------------------
def test_optimizer_step_right_after_save_does_not_reach_the_checkpoint(tmp_path: Path) -> None:
    training = Training()
    training.train(2)  # Adam moments exist
    store = GatedStore(tmp_path / "vault")
    with manager(store) as mgr:
        training.backward()
        state = training.state(3)
        before = frozen(state)
        handle = mgr.save(3, state)
        assert store.blocked.wait(10), "the background save never reached the store"
        training.opt.step()  # in place, while the save is in flight and has read nothing yet
        unchanged = [i for i, (a, b) in enumerate(zip(tensors_of(before), tensors_of(state))) if torch.equal(a, b)]
        assert not unchanged, f"the optimizer step left tensors {unchanged} unchanged: the test would prove nothing"
        assert not handle.done()
        store.gate.set()
        info = handle.wait()
    assert info is not None and info.step == 3
    assert_same_state(before, restored(tmp_path / "vault", 3))


def test_many_saves_while_training_each_holds_its_own_step(tmp_path: Path) -> None:
    """Ungated: a training loop that saves every step and never waits; every checkpoint is its step's state."""
    training = Training(seed=1)
    expected = {}
    with manager(tmp_path / "vault") as mgr:
        for step in range(6):
            training.backward()
            state = training.state(step)
            expected[step] = frozen(state)
            mgr.save(step, state)
            training.opt.step()
        mgr.wait()
        assert mgr.steps() == list(range(6))
        for step, want in expected.items():
            assert_same_state(want, mgr.restore(step))


# -- staged, then committed --------------------------------------------------------------------------
def test_staged_completes_before_committed(tmp_path: Path) -> None:
    store = GatedStore(tmp_path / "vault")
    state = Training().state(1)
    with manager(store) as mgr:
        handle = mgr.save(1, state)
        assert handle.staged.done() and handle.staged.result() is None
        assert store.blocked.wait(10)
        assert not handle.committed.done() and not handle.done()
        assert repr(handle) == "<SaveHandle step=1 staged>"
        assert mgr.steps() == []
        with pytest.raises(futures.TimeoutError):  # the builtin only from Python 3.11
            handle.wait(timeout=0.05)
        store.gate.set()
        info = handle.committed.result(timeout=30)
        assert isinstance(info, CheckpointInfo) and info.step == 1
        assert handle.wait() is info and repr(handle) == "<SaveHandle step=1 committed>"
        assert mgr.steps() == [1]


def test_synchronous_save_returns_committed_and_stages_nothing(tmp_path: Path) -> None:
    training = Training()
    with manager(tmp_path / "vault", async_save=False) as mgr:
        state = training.state(1)
        handle = mgr.save(1, state)
        assert handle.staged.done() and handle.committed.done()
        assert handle.committed.result().step == 1
        assert mgr.steps() == [1]
        assert mgr._saver._staging.capacity == 0, "a synchronous save must not allocate staging memory"
        assert_same_state(state, mgr.restore(1))


def test_wait_waits_for_the_save_in_flight(tmp_path: Path) -> None:
    store = GatedStore(tmp_path / "vault")
    with manager(store) as mgr:
        handle = mgr.save(1, Training().state(1))
        waiter = threading.Thread(target=mgr.wait)
        waiter.start()
        waiter.join(SETTLE)
        assert waiter.is_alive() and not handle.done(), "mgr.wait() returned while the save was in flight"
        store.gate.set()
        waiter.join(30)
        assert not waiter.is_alive() and handle.done() and mgr.steps() == [1]


def test_wait_after_several_saves_leaves_all_committed(tmp_path: Path) -> None:
    training = Training()
    with manager(tmp_path / "vault") as mgr:
        handles = []
        for step in range(4):
            training.train()
            handles.append(mgr.save(step, frozen(training.state(step))))
        mgr.wait()
        assert all(h.done() for h in handles) and mgr.steps() == [0, 1, 2, 3]


def test_close_flushes_the_save_in_flight(tmp_path: Path) -> None:
    store = GatedStore(tmp_path / "vault")
    state = Training().state(7)
    mgr = manager(store)
    handle = mgr.save(7, state)
    assert store.blocked.wait(10) and not handle.done()
    open_gate_later(store, SETTLE)
    started = time.monotonic()
    mgr.close()
    assert time.monotonic() - started >= SETTLE * 0.9, "close() returned before the save in flight could finish"
    assert handle.done() and handle.wait().step == 7
    assert_same_state(state, restored(tmp_path / "vault", 7))


def test_reading_the_step_in_flight_waits_for_it(tmp_path: Path) -> None:
    store = GatedStore(tmp_path / "vault")
    state = Training().state(5)
    with manager(store) as mgr:
        mgr.save(5, state)
        with pytest.raises(StepExistsError, match="step 5 is already committed"):
            mgr.save(5, state)  # the same step while it is in flight
        open_gate_later(store, SETTLE)
        assert_same_state(state, mgr.restore(5))
        assert mgr.info(5).step == 5


# -- interpreter exit ----------------------------------------------------------------------------------
EXIT_SCRIPT = """
import logging, sys, threading, torch
sys.path.insert(0, {helpers!r})
from async_stores import GatedStore, QuotaStore
from ckptvault import CheckpointManager
torch.manual_seed(0)
state = {{"w": torch.randn(300_000), "b": torch.arange(1000)}}
torch.save(state, {expected!r})
store = GatedStore({vault!r}) if {gated} else QuotaStore({vault!r}, quota=0)
mgr = CheckpointManager(store, chunk_size=64 << 10)
handle = mgr.save(1, state)
if {gated}:
    store.blocked.wait(30)
    timer = threading.Timer(0.3, store.gate.set)
    timer.daemon = True
    timer.start()
print("returned staged=%s committed=%s" % (handle.staged.done(), handle.committed.done()), flush=True)
state["w"].zero_()  # training goes on: the checkpoint must not see this
# no wait(), no close(): the interpreter exits with the save in flight
"""


def run_exit_script(tmp_path: Path, gated: bool) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "exit_script.py"
    script.write_text(EXIT_SCRIPT.format(helpers=str(HELPERS), vault=str(tmp_path / "vault"),
                                         expected=str(tmp_path / "expected.pt"), gated=gated))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)


def test_interpreter_exit_commits_the_save_in_flight(tmp_path: Path) -> None:
    done = run_exit_script(tmp_path, gated=True)
    assert done.returncode == 0, done.stderr
    assert "returned staged=True committed=False" in done.stdout, done.stdout + done.stderr
    assert "failed" not in done.stderr, done.stderr
    with CheckpointManager(tmp_path / "vault") as mgr:
        assert mgr.steps() == [1]
        assert mgr.verify().ok
        assert_same_state(torch.load(tmp_path / "expected.pt"), mgr.restore(1))


def test_interpreter_exit_reports_a_failed_save_in_the_log(tmp_path: Path) -> None:
    done = run_exit_script(tmp_path, gated=False)
    assert "returned staged=True" in done.stdout, done.stdout + done.stderr
    assert "save of step 1 failed, nothing committed: no space left while writing" in done.stderr, done.stderr
    assert "a checkpoint save failed before exit: no space left while writing" in done.stderr, done.stderr
    with CheckpointManager(tmp_path / "vault") as mgr:
        assert mgr.steps() == []


def _exit_at_once() -> None:
    """A forked child that does nothing and exits (as a DataLoader worker does at the end of an epoch)."""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_does_not_wait_for_the_parents_save_at_exit(tmp_path: Path) -> None:
    """multiprocessing children run the threading exit hooks; the parent's save in flight is not theirs to flush."""
    store = GatedStore(tmp_path / "vault")
    with manager(store) as mgr:
        handle = mgr.save(1, Training().state(1))
        assert store.blocked.wait(10)
        child = multiprocessing.get_context("fork").Process(target=_exit_at_once)
        child.start()
        child.join(30)
        hung = child.is_alive()
        if hung:
            child.kill()
            child.join()
        assert not hung and child.exitcode == 0, f"the forked child hung at exit (exit code {child.exitcode})"
        assert not handle.done()
        store.gate.set()
        assert handle.wait().step == 1


# -- bounded host memory --------------------------------------------------------------------------------
def test_staging_buffer_is_reused_and_grows_only_when_needed(tmp_path: Path) -> None:
    training = Training(width=64)
    with manager(tmp_path / "vault") as mgr:
        staging = mgr._saver._staging
        pointers = []
        for step in range(3):
            training.train()
            mgr.save(step, training.state(step))
            pointers.append((id(staging._buffer), staging._buffer.data_ptr(), staging.capacity))
        assert len(set(pointers)) == 1, f"the staging buffer changed between saves of one state: {pointers}"
        small_capacity = pointers[0][2]
        state_bytes = sum(t.numel() * t.element_size() for t in tensors_of(training.state(0)))
        assert state_bytes <= small_capacity < state_bytes + 64 * len(tensors_of(training.state(0))) + 64

        big = {"big": torch.randn(small_capacity // 4 + 50_000)}
        mgr.save(10, big)
        assert staging.capacity >= big["big"].nbytes > small_capacity
        grown = (id(staging._buffer), staging._buffer.data_ptr(), staging.capacity)
        mgr.save(11, training.state(11))  # smaller again: the big buffer is kept, not reallocated
        assert (id(staging._buffer), staging._buffer.data_ptr(), staging.capacity) == grown
        mgr.wait()
        assert_same_state(big, mgr.restore(10))


def test_a_cpu_only_state_is_staged_in_ordinary_memory_where_cuda_is_available(tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Pinning is for device-to-host copies: a state without CUDA tensors neither initialises CUDA nor page-locks
    memory. (On this CPU-only machine, asking torch for pinned memory raises, so any attempt to pin fails here;
    tests/test_cuda.py checks that a state with CUDA tensors gets a pinned buffer.)"""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    training = Training(width=64)
    with manager(tmp_path / "vault") as mgr:
        training.train()
        expected = copy.deepcopy(training.state(1))
        mgr.save(1, training.state(1))
        assert mgr._saver._staging.capacity > 0 and not mgr._saver._staging.pinned
        assert not mgr._saver._staging._buffer.is_pinned()
        mgr.wait()
        assert_same_state(expected, mgr.restore(1))


def test_state_over_max_staging_bytes_is_saved_synchronously_with_a_warning(tmp_path: Path,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    store = QuotaStore(tmp_path / "vault", quota=None)
    state = {"w": torch.randn(100_000), "v": torch.randn(50_000)}  # 600 KB
    with manager(store, max_staging_bytes=256 << 10) as mgr:
        with caplog.at_level(logging.WARNING, logger="ckptvault"):
            handle = mgr.save(1, state)
        assert handle.committed.done(), "a save over the staging cap must return committed"
        assert mgr._saver._staging.capacity == 0
        message = "step 1 needs more staging memory than max_staging_bytes=262144; saving synchronously"
        assert any(r.levelno == logging.WARNING and r.getMessage() == message for r in caplog.records), caplog.text
        assert_same_state(state, mgr.restore(1))

        small = {"s": torch.randn(1000)}
        caplog.clear()
        handle = mgr.save(2, small)  # under the cap: asynchronous again, no warning
        assert 0 < mgr._saver._staging.capacity <= 256 << 10
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        handle.wait()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """Samples this process's resident set every millisecond while active."""

    def __init__(self) -> None:
        self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.001)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs /proc to read the resident set size")
@pytest.mark.parametrize(("cache_keyframe", "bound"), [(False, 1.5), (None, 2.0)])
def test_peak_host_memory_over_ten_saves_is_bounded(tmp_path: Path, cache_keyframe: bool | None, bound: float) -> None:
    """One staging copy of the state, plus per-worker encode buffers of a few chunks (so workers and chunk size
    are pinned); by default also the keyframe cache, half of a float32 state."""
    tensors = [torch.randn(6_250_000) for _ in range(4)]  # 4 x 25 MB
    state = {"model": {f"t{i}": t for i, t in enumerate(tensors)}}
    state_bytes = sum(t.nbytes for t in tensors)
    with manager(tmp_path / "vault", chunk_size=1 << 20, workers=2, cache_keyframe=cache_keyframe) as mgr:
        mgr.save(0, {"warm": torch.zeros(10)}).wait()  # thread pools and codecs started before measuring
        load_kernels_in_background()  # and the byte-plane kernels (numba, ~100 MB), which these saves would load
        wait_for_kernel_loading()
        base = rss_bytes()
        after = []
        with PeakRss() as peak:
            for step in range(1, 11):
                tensors[step % 4].add_(1.0)  # 25 MB of new chunks per save; the rest dedups
                mgr.save(step, state)
                after.append(rss_bytes() - base)
            mgr.wait()
        growth = peak.peak - base
        cache = mgr._saver._keyframe_cache
        assert (cache is None) if cache_keyframe is False else (cache is not None and cache.nbytes == state_bytes // 2)
    assert growth < bound * state_bytes, f"peak RSS grew by {growth / state_bytes:.2f} x the state"
    settled = 1 if cache_keyframe is False else 3  # step 2 is the state's first keyframe: it fills the cache
    assert after[-1] - after[settled] < 0.25 * state_bytes, f"RSS kept growing from save to save: {after}"


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs /proc to read the resident set size")
def test_the_one_shot_save_function_neither_stages_nor_caches(tmp_path: Path) -> None:
    """``ckptvault.save`` waits for the commit anyway: a staging copy (1x) or keyframe cache (0.5x) would be waste."""
    tensors = [torch.randn(6_250_000) for _ in range(4)]  # 4 x 25 MB
    state = {"model": {f"t{i}": t for i, t in enumerate(tensors)}}
    state_bytes = sum(t.nbytes for t in tensors)
    ckptvault.save({"warm": torch.zeros(10)}, tmp_path / "vault", 0, chunk_size=1 << 20, workers=2)
    base = rss_bytes()
    with PeakRss() as peak:
        ckptvault.save(state, tmp_path / "vault", 1, chunk_size=1 << 20, workers=2)
    growth = peak.peak - base
    assert growth < 0.5 * state_bytes, f"peak RSS grew by {growth / state_bytes:.2f} x the state"
    assert_same_state(state, restored(tmp_path / "vault", 1))


# -- on_busy ---------------------------------------------------------------------------------------------
def test_on_busy_skip_skips_with_a_warning_while_a_save_is_in_flight(tmp_path: Path) -> None:
    store = GatedStore(tmp_path / "vault")
    training = Training()
    with manager(store, on_busy="skip") as mgr:
        first = mgr.save(1, frozen(training.state(1)))
        assert store.blocked.wait(10)
        with pytest.warns(RuntimeWarning, match=r"skipping the save of step 2: step 1 is still being saved"):
            skipped = mgr.save(2, training.state(2))
        assert skipped.skipped and skipped.done() and skipped.wait() is None
        assert repr(skipped) == "<SaveHandle step=2 skipped>"
        store.gate.set()
        first.wait()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing in flight now: no warning, no skip
            third = mgr.save(3, training.state(3))
        assert not third.skipped
        mgr.wait()
        assert mgr.steps() == [1, 3]


def test_on_busy_wait_blocks_the_next_save_until_the_first_commits(tmp_path: Path) -> None:
    store = GatedStore(tmp_path / "vault")
    training = Training()
    with manager(store, on_busy="wait") as mgr:
        first = mgr.save(1, training.state(1))
        assert store.blocked.wait(10)
        second: list[Any] = []
        saver = threading.Thread(target=lambda: second.append(mgr.save(2, training.state(2))))
        saver.start()
        saver.join(SETTLE)
        assert saver.is_alive() and not second, "the second save did not wait for the first"
        assert not first.done()
        store.gate.set()
        saver.join(30)
        assert first.done() and second and not second[0].skipped
        mgr.wait()
        assert mgr.steps() == [1, 2]


def test_on_busy_must_be_wait_or_skip(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=r"on_busy must be one of \('wait', 'skip'\), got 'queue'"):
        CheckpointManager(tmp_path / "vault", on_busy="queue")


# -- errors of background saves --------------------------------------------------------------------------
class BrokenStore(QuotaStore):
    """A store whose chunk writes fail with an exception that is not one of ckptvault's (a third-party backend's
    own error, say)."""

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        if key.startswith("chunks/"):
            raise RuntimeError("controller on fire")
        return super().put_if_absent(key, data)


@pytest.mark.parametrize("async_save", [True, False])
def test_an_unexpected_error_reaches_the_caller_as_a_save_error(tmp_path: Path, async_save: bool) -> None:
    store = BrokenStore(tmp_path / "vault", quota=None)
    mgr = manager(store, async_save=async_save)
    with pytest.raises(SaveError, match=r"^the save of step 2 failed, nothing committed: RuntimeError: controller on fire$") \
            as caught:
        mgr.save(2, frozen(Training().state(2))).wait()
    assert isinstance(caught.value.__cause__, RuntimeError)
    mgr.close()  # reported once: closing does not raise it again
    assert CheckpointManager(tmp_path / "vault").steps() == []


def full_vault(tmp_path: Path) -> tuple[QuotaStore, dict[str, Any]]:
    """A vault with step 1 committed whose chunk quota is now spent; and the state of step 1."""
    store = QuotaStore(tmp_path / "vault", quota=None)
    state = frozen(Training().state(1))
    with manager(store) as mgr:
        mgr.save(1, state).wait()
    store.quota = store.used  # the disk is now full
    return store, state


def assert_storage_full(exc: BaseException) -> None:
    assert type(exc) is StorageFullError, repr(exc)
    message = str(exc)
    assert message.startswith("no space left while writing") and "/chunks/" in message, message
    assert "Committed checkpoints are intact" in message and "save again" in message, message


@pytest.mark.parametrize("surfaces_on", ["save", "wait", "close", "handle"])
def test_background_error_surfaces_once_and_the_step_never_commits(tmp_path: Path, surfaces_on: str) -> None:
    store, state1 = full_vault(tmp_path)
    training = Training(seed=3)
    state2 = frozen(training.state(2))
    mgr = manager(store)
    handle = mgr.save(2, state2)  # returns: the failure happens in the background
    assert handle.staged.done()
    with pytest.raises(StorageFullError) as caught:
        if surfaces_on == "save":
            handle.committed.exception(timeout=30)  # let it fail first, then the next save raises it
            mgr.save(3, training.state(3))
        elif surfaces_on == "wait":
            mgr.wait()
        elif surfaces_on == "close":
            mgr.close()
        else:
            handle.wait()
    assert_storage_full(caught.value)
    assert handle.done() and handle.committed.exception() is caught.value
    assert repr(handle) == "<SaveHandle step=2 failed>"
    assert store.refused >= 1
    # exactly once: none of these raise it again
    mgr.wait()
    store.quota = None  # space freed
    if surfaces_on != "close":
        mgr.save(4, training.state(4)).wait()
        mgr.close()
    mgr.close()
    with CheckpointManager(tmp_path / "vault") as check:
        assert 2 not in check.steps() and 3 not in check.steps()
        assert not (tmp_path / "vault" / "manifests" / f"{2:020d}.json").exists()
        assert_same_state(state1, check.restore(1))
        assert check.verify().ok


def test_synchronous_save_raises_the_error_itself_and_only_once(tmp_path: Path) -> None:
    store, _ = full_vault(tmp_path)
    with manager(store, async_save=False) as mgr:
        with pytest.raises(StorageFullError) as caught:
            mgr.save(2, Training(seed=4).state(2))
        assert_storage_full(caught.value)
        mgr.wait()  # already reported
        assert mgr.steps() == [1]


# -- one pipeline ----------------------------------------------------------------------------------------
def mixed_state() -> dict[str, Any]:
    """Leaves that take every staging path: contiguous, strided, conjugated, numpy, odd dtypes, empty, tied."""
    torch.manual_seed(5)
    shared = torch.randn(40, 30)
    complex_values = torch.randn(20, dtype=torch.complex64)
    return {
        "model": {"emb": shared, "head": shared, "w": torch.randn(300, 200), "bias": torch.zeros(200)},
        "strided": torch.randn(64, 64).t(), "sliced": torch.arange(1000, dtype=torch.int64)[::3],
        "conj": complex_values.conj(), "neg": torch.randn(16)._neg_view(),
        "bf16": torch.randn(500).to(torch.bfloat16), "int8": torch.randint(-100, 100, (999,), dtype=torch.int8),
        "mask": torch.rand(77) > 0.5, "empty": torch.empty(0, 3), "scalar": torch.tensor(2.5),
        "numpy": np.arange(1234, dtype=np.float64), "big_endian": np.arange(50, dtype=">i4"),
        "small": [torch.full((3,), float(i)) for i in range(40)], "meta": {"lr": 0.1, "name": "run"},
    }


def _overwrite(value: Any) -> None:
    """Write other values into every array of a state, in place (through the views it holds)."""
    if isinstance(value, torch.Tensor):
        if value.numel():
            target = value._neg_view() if value.is_neg() else value.conj() if value.is_conj() else value
            target.copy_(torch.full_like(target, 7))
    elif isinstance(value, np.ndarray):
        value[...] = 7
    elif isinstance(value, dict):
        for child in value.values():
            _overwrite(child)
    elif isinstance(value, list):
        for child in value:
            _overwrite(child)


def test_a_staged_save_keeps_the_values_of_save_time_whatever_the_state_does_next(tmp_path: Path) -> None:
    """Every staging path (views with an offset, odd strides, conj and neg bits, tensors over the parallel-copy
    size) copies the bytes of save() time: the state overwritten while the save is held is not what is stored."""
    base = torch.arange(4000, dtype=torch.float32)
    state = {**mixed_state(), "offset": base[7:1007], "odd_stride": base[::2][:1],
             "large": torch.randn(600_000), "u8": torch.arange(255, dtype=torch.uint8)}
    expected = copy.deepcopy(state)
    store = GatedStore(tmp_path / "vault")
    with manager(store) as mgr:
        handle = mgr.save(1, state)
        try:
            assert handle.staged.done() and store.blocked.wait(10)
            _overwrite(state)
            assert state["large"][0].item() == 7 and state["offset"][0].item() == 7
        finally:
            store.gate.set()
        handle.wait(timeout=60)
    assert_same_state(expected, restored(tmp_path / "vault", 1))


def test_async_and_sync_saves_write_identical_manifests(tmp_path: Path) -> None:
    state = mixed_state()
    manifests = {}
    for mode in ("async", "sync"):
        url = tmp_path / mode
        with manager(url, async_save=mode == "async") as mgr:
            mgr.save(1, state).wait()
            manifests[mode] = {k: v for k, v in mgr.manifest(1).items() if k != "time"}
            assert_same_state(state, mgr.restore(1))
    assert manifests["async"] == manifests["sync"]
    assert sorted(p.name for p in (tmp_path / "async" / "chunks").rglob("*") if p.is_file()) == \
        sorted(p.name for p in (tmp_path / "sync" / "chunks").rglob("*") if p.is_file())
