"""Preemption-safe saves: a termination signal right after an asynchronous save() still commits that save.

Subprocess tests send a real signal to tests/helpers/preempt_saver.py while its step 2 is in flight (its
store makes background chunk writes slow, so step 2 needs about a second after save() returned):

* without the opt-in, SIGTERM kills the process at once (status -SIGTERM to Popen, 143 in a shell) and the
  vault keeps only step 1: the documented behaviour;
* with ``handle_preemption()``, step 2 is committed, the earlier handler ran (chaining) and the exit status is 143;
* with ``handle_preemption(SIGUSR1, poll=True)``, the loop's final checkpoint is committed too and the status is 138.

In-process tests check the handler's bookkeeping: a signal inside a save is acted on when the save returns,
close() restores the previous handler, SIG_IGN stays ignored, and installing is refused off the main thread.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptvault import CheckpointManager
from ckptvault._save.preemption import Preempted
from ckptvault.errors import InvalidArgumentError
from conftest import assert_same_state

HELPERS = Path(__file__).parent / "helpers"
sys.path.insert(0, str(HELPERS))
from preempt_saver import make_state  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="POSIX signals")


def run_and_signal(vault: Path, mode: str, signum: int, *extra: str) -> tuple[int, list[str]]:
    """Start the saver, send ``signum`` as soon as its step 2 save() returned; its exit status and stdout lines."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HELPERS), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(HELPERS / "preempt_saver.py"), str(vault), mode, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            lines.append(line.strip())
            if line.startswith("returned"):
                proc.send_signal(signum)
                break
        rest, err = proc.communicate(timeout=60)
    except BaseException:
        proc.kill()
        raise
    lines += rest.split()
    assert "returned" in lines, f"the saver never got to step 2: {lines}\n{err}"
    return proc.returncode, [line for line in lines if line]


def fresh_steps(vault: Path) -> list[int]:
    with CheckpointManager(str(vault)) as mgr:
        return mgr.steps()


def assert_restores(vault: Path, steps: list[int]) -> None:
    with CheckpointManager(str(vault)) as mgr:
        for step in steps:
            assert_same_state(mgr.restore(step), make_state(step))
        report = mgr.verify()
        assert report.ok, report


def test_sigterm_without_opt_in_loses_the_save_in_flight(tmp_path: Path) -> None:
    """The documented default: SIGTERM ends the process at once; the in-flight step 2 is not committed."""
    status, lines = run_and_signal(tmp_path / "v", "none", signal.SIGTERM)
    assert status == -signal.SIGTERM, (status, lines)
    assert fresh_steps(tmp_path / "v") == [1]


def test_sigterm_with_opt_in_commits_the_save_in_flight(tmp_path: Path) -> None:
    """handle_preemption(): the in-flight step commits bit-exactly, the earlier handler runs, exit status 143."""
    marker = tmp_path / "earlier-handler-ran"
    status, lines = run_and_signal(tmp_path / "v", "exit", signal.SIGTERM, "--chain", str(marker))
    assert status == 128 + signal.SIGTERM, (status, lines)
    assert "loop ended" not in lines and "closed" not in lines, lines  # it exited at the signal, not later
    assert marker.exists(), "the previously installed handler was not called"
    assert fresh_steps(tmp_path / "v") == [1, 2]
    assert_restores(tmp_path / "v", [1, 2])


def test_polled_preemption_takes_a_final_checkpoint(tmp_path: Path) -> None:
    """handle_preemption(SIGUSR1, poll=True): step 2 and the loop's final checkpoint commit; exit status 138."""
    status, lines = run_and_signal(tmp_path / "v", "poll", signal.SIGUSR1, "--signal", "USR1")
    assert status == 128 + signal.SIGUSR1, (status, lines)
    finals = [int(lines[i + 1]) for i, w in enumerate(lines) if w == "final"]
    assert len(finals) == 1 and finals[0] >= 3, lines
    assert "closed" not in lines, lines  # close() (the end of the with block) exited
    assert fresh_steps(tmp_path / "v") == [1, 2, finals[0]]
    assert_restores(tmp_path / "v", [2, finals[0]])


# -- in-process: the handler's bookkeeping ----------------------------------------------------------------------
def small_state() -> dict[str, Any]:
    return {"w": torch.arange(1 << 16, dtype=torch.float32)}


def test_a_signal_inside_a_save_is_acted_on_when_the_save_returns(tmp_path: Path) -> None:
    """The handler never interrupts a save: the signal arrives mid-save, the save commits, then Preempted."""
    before = signal.getsignal(signal.SIGUSR1)
    mgr = CheckpointManager(str(tmp_path / "v"), async_save=False, chunk_size=64 << 10)
    sent: list[bool] = []

    def progress(_: int) -> None:
        if not sent:
            sent.append(True)
            signal.raise_signal(signal.SIGUSR1)
            time.sleep(0.05)  # the main thread is inside save(): the Python handler runs there now or soon

    try:
        mgr.handle_preemption(signal.SIGUSR1)
        with pytest.raises(Preempted) as caught:
            mgr.save(1, small_state(), progress=progress)
        assert caught.value.code == 128 + signal.SIGUSR1
        assert sent and mgr.preempted
        assert mgr.steps() == [1], "the save was interrupted instead of finishing first"
    finally:
        mgr.close()
    assert signal.getsignal(signal.SIGUSR1) == before, "close() did not restore the previous handler"
    assert_same_state(CheckpointManager(str(tmp_path / "v")).restore(1), small_state())


def test_poll_mode_only_sets_the_flag_and_close_exits(tmp_path: Path) -> None:
    mgr = CheckpointManager(str(tmp_path / "v"))
    mgr.handle_preemption([signal.SIGUSR1, signal.SIGUSR2], poll=True)
    assert not mgr.preempted
    signal.raise_signal(signal.SIGUSR2)  # returns: no exception in poll mode
    assert mgr.preempted
    mgr.save(5, small_state())
    with pytest.raises(Preempted) as caught:
        mgr.close()
    assert caught.value.code == 128 + signal.SIGUSR2
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL and signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
    assert fresh_steps(tmp_path / "v") == [5]


def test_an_ignored_signal_stays_ignored(tmp_path: Path) -> None:
    previous = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        mgr = CheckpointManager(str(tmp_path / "v"))
        mgr.handle_preemption(signal.SIGUSR1)
        assert signal.getsignal(signal.SIGUSR1) != signal.SIG_IGN
        signal.raise_signal(signal.SIGUSR1)  # no Preempted: the signal was ignored before
        assert mgr.preempted
        mgr.close()  # no Preempted either
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_installing_is_checked(tmp_path: Path) -> None:
    with CheckpointManager(str(tmp_path / "v")) as mgr:
        with pytest.raises(InvalidArgumentError):
            mgr.handle_preemption(signal.SIGKILL)
        with pytest.raises(InvalidArgumentError):
            mgr.handle_preemption([])
        errors: list[BaseException] = []

        def off_main() -> None:
            try:
                mgr.handle_preemption(signal.SIGUSR1)
            except BaseException as exc:  # noqa: BLE001 - checked below
                errors.append(exc)

        t = threading.Thread(target=off_main)
        t.start()
        t.join()
        assert len(errors) == 1 and isinstance(errors[0], InvalidArgumentError), errors
        assert "must be called from the main thread" in str(errors[0])
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
        mgr.handle_preemption(signal.SIGUSR1)
        with pytest.raises(InvalidArgumentError, match=r"handle_preemption\(\) was already called on this manager"):
            mgr.handle_preemption(signal.SIGUSR1)
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def test_a_forked_child_dies_of_the_signal_as_before(tmp_path: Path) -> None:
    """A forked child (a DataLoader worker) inherits the handler; there it behaves as the default action."""
    with CheckpointManager(str(tmp_path / "v")) as mgr:
        mgr.handle_preemption(signal.SIGUSR1)
        pid = os.fork()
        if pid == 0:
            try:
                os.kill(os.getpid(), signal.SIGUSR1)
                time.sleep(5)
            finally:
                os._exit(3)
        _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGUSR1, status
