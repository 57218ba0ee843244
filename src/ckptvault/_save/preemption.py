"""Preemption: a termination signal (SIGTERM, or SLURM's ``--signal``) that finishes the save in flight.

Without it, a SIGTERM kills the process at once (exit status 143, no Python code runs), so an asynchronous
save that ``save()`` had handed to the background thread is lost; normal exits, exceptions and ``sys.exit``
wait for it (the exit flush of ``_save/pipeline.py``).

:meth:`CheckpointManager.handle_preemption` installs a handler (main thread only) that does the minimum a
signal handler may do: it records the signal, calls a previously installed Python handler (chaining), and then

* by default raises :class:`Preempted`, a ``SystemExit`` with code 128 + signum, in the main thread. The
  stack unwinds as for ``sys.exit`` (``finally`` blocks, ``with CheckpointManager(...)`` closes), the save
  in flight is committed by ``close()`` or by the exit flush, and the interpreter exits with status 143 for
  SIGTERM. The same is torchelastic's design. If the signal arrives while the main thread is inside this
  manager's ``save``, ``wait`` or ``close``, the exception is raised when that call returns, so the saver's
  own state and locks are never interrupted half-way;
* with ``poll=True`` only sets :attr:`CheckpointManager.preempted`: the training loop, at its next step
  boundary, takes a final checkpoint (a consistent state, not one torn mid-step) and leaves the manager's
  ``with`` block (or calls ``close()``), which finishes every save and then exits with 128 + signum. This is
  PyTorch Lightning's design.

A previous handler that is ``SIG_IGN`` keeps the signal ignored: the flag is set, nothing exits. ``close()``
puts the previous handler back (if ours is still the installed one).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from ..errors import InvalidArgumentError

log = logging.getLogger(__name__)

Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class Preempted(SystemExit):
    """Raised in the main thread for a handled termination signal: a ``SystemExit`` whose ``code`` is 128 + signum
    (143 for SIGTERM), so an uncaught one ends the process with the conventional status, after the save in flight
    is committed. ``signum`` is the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum

    def __str__(self) -> str:
        return f"preempted by {_name(self.signum)}: exiting with status {128 + self.signum} once saves are committed"


def _name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def signal_numbers(signals: int | Iterable[int]) -> tuple[int, ...]:
    """The signals to handle, checked: each an int (or ``signal.Signals``) that a Python handler may catch."""
    items = [signals] if isinstance(signals, int) else list(signals) if isinstance(signals, Iterable) else [signals]
    out: list[int] = []
    uncatchable = {getattr(signal, n) for n in ("SIGKILL", "SIGSTOP") if hasattr(signal, n)}
    for s in items:
        if isinstance(s, bool) or not isinstance(s, int):
            raise InvalidArgumentError(f"signals must be signal numbers such as signal.SIGTERM, got {s!r}")
        if s in uncatchable or s not in signal.valid_signals():
            raise InvalidArgumentError(f"{_name(s)} cannot be handled: choose e.g. signal.SIGTERM or signal.SIGUSR1")
        if int(s) not in out:
            out.append(int(s))
    if not out:
        raise InvalidArgumentError("signals is empty: name at least one, e.g. signal.SIGTERM")
    return tuple(out)


class PreemptionHandler:
    """The installed handler of one manager: which signal arrived, and what to do at the next safe point."""

    def __init__(self, signals: tuple[int, ...], poll: bool) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise InvalidArgumentError("handle_preemption() must be called from the main thread: Python runs signal "
                               "handlers only there")
        self.signals, self.poll = signals, poll
        self.signum: int | None = None  # the first handled signal
        self._depth = 0  # main-thread calls into the manager's save/wait/close now running
        self._deferred = False  # a Preempted to raise when the outermost of those returns
        self._raised = False
        self._pid = os.getpid()
        self.installed = True
        self._previous: dict[int, Handler] = {}  # kept after uninstall: a handler that replaced ours may chain to ours
        try:
            for s in signals:
                self._previous[s] = signal.signal(s, self._handle)
        except BaseException:
            self.uninstall()
            raise

    # -- the handler: main thread, between bytecodes; no locks, no waiting, no I/O ----------------------
    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._pid:  # a forked child (a DataLoader worker): not ours; die as if never installed
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.signum is None:
            self.signum = signum
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)  # chain; if it raises, its exception unwinds instead (the exit flush still runs)
        elif previous == signal.SIG_IGN:
            return
        if self.poll or self._raised or self._deferred:
            return
        if self._depth:
            self._deferred = True
            return
        self._raised = True
        raise Preempted(signum)

    # -- safe points ---------------------------------------------------------------------------------
    @contextmanager
    def critical(self) -> Iterator[None]:
        """Around the manager's save/wait/close: a signal inside is acted on when the outermost one returns."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0 and self._deferred and not self._raised and self.signum is not None:
                self._deferred, self._raised = False, True
                raise Preempted(self.signum)  # also in place of the call's own error: the process is to end

    def exit_status_due(self) -> int | None:
        """At close (saves committed): the signal to exit for, if the process is to exit now (poll mode)."""
        if self.signum is None or self._raised or not (self.poll or self._deferred):
            return None
        if self._previous.get(self.signum) == signal.SIG_IGN:
            return None
        self._raised = True
        return self.signum

    def uninstall(self) -> None:
        """Put back the previous handlers, where ours is still the installed one (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("close() outside the main thread cannot restore the handlers of %s; they stay installed",
                        ", ".join(map(_name, self._previous)))
            return
        if not self.installed:
            return
        for s, previous in self._previous.items():
            if signal.getsignal(s) == self._handle:
                signal.signal(s, previous if previous is not None else signal.SIG_DFL)
            else:
                log.info("the handler of %s was replaced after handle_preemption(); leaving the new one", _name(s))
        self.installed = False


@contextmanager
def critical(handler: PreemptionHandler | None) -> Iterator[None]:
    """``handler.critical()``, or nothing when no handler is installed."""
    if handler is None:
        yield
    else:
        with handler.critical():
            yield
