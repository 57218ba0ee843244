"""Asynchronous saves run by a saver process of their own (``AsyncOptions(saver="process" | "idle-process")``).

Training shares one interpreter lock with a background thread, so a save's Python work slows every step however
low its priority; a separate process shares nothing but memory bandwidth, and in Linux's idle class it runs only
on CPU time training leaves unused.

Order of calls for one save, as for the thread :class:`~ckptvault._save.pipeline.Saver`: ``submit`` (caller's
thread: raise an unreported error, wait for or skip a save in flight, copy the state into a free shared staging
buffer and send the save to the saver process, ``_save/process_child.py``, before returning) -> the background
thread follows the saver process's messages about it, reports its commit on the handle, and ends when the saver
process has finished it. The manager's retention runs in the saver process after the commit, before its next save,
off the training process's interpreter lock; only where its policies do not pickle into that process (a
``keep_if`` lambda, a policy class of the training script) does the after-commit hook run it here instead.
Once ``save()`` has returned, the saver process holds the save: it commits it even if the training process dies
next.
Up to ``AsyncOptions.max_in_flight`` saves may be in flight, each in a staging buffer of its own; the saver process
runs them one after another in the order they were made, so a save's predictions see the save before it.

Failure: a save that fails in the saver process fails its handle with the same typed error; if the saver process
dies, its save in flight fails with :class:`SaveError` and the next save starts a new saver process. Either way
nothing of a failed save is committed by the training process, and every earlier commit stays.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
import warnings
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle
from typing import Any

from .._feedback import defer, takes_total
from .._parallel import pause_collector, resume_collector
from ..errors import InvalidArgumentError, SaveError
from ..handle import SaveHandle
from ..options import AsyncOptions
from ..rules import CodecRules
from .inflight import InFlight, typed_error
from .pipeline import SaveRequest, forget_live, register_live
from .process_child import ChildConfig
from .snapshot import Snapshot, take_snapshot
from .staging import SharedStaging

log = logging.getLogger(__name__)

#: the package's parent folder: the saver process imports this very copy of ckptvault
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: how long close() waits for a stopped saver process before it kills it
STOP_TIMEOUT = 60.0


class _Child:
    """One saver process and the socket to it."""

    def __init__(self, config: ChildConfig, idle: bool) -> None:
        ours, theirs = socket.socketpair()
        prelude = "import os; os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0)); " if idle else ""
        code = (f"{prelude}import sys; sys.path.insert(0, {_PACKAGE_ROOT!r}); "
                f"from ckptvault._save.process_child import main; main({theirs.fileno()})")
        with ours, theirs:
            self.process = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()],
                                            stdin=subprocess.DEVNULL)
            self.conn = Connection(ours.detach())
        self.conn.send(("open", config))
        self.broken: BaseException | None = None  # the error it answered "open" with, if any
        self.runs_retention = False  # it answered "open" saying it applies the retention after its commits
        self.staging_generations: dict[int, int] = {}  # slot -> generation of the staging buffer mapped there
        log.debug("started saver process %d", self.process.pid)

    def alive(self) -> bool:
        return self.process.poll() is None

    def gone(self, step: int) -> SaveError:
        """The error of a save in flight when this process died."""
        status = self.process.wait()
        return SaveError(f"the saver process (pid {self.process.pid}) exited with status {status} while saving step "
                         f"{step}; that step was not reported committed, and every checkpoint committed before it is "
                         "kept. The next save starts a new saver process")

    def stop(self) -> None:
        """Ask the process to exit once its save is done, and wait for it (kill it after STOP_TIMEOUT)."""
        try:
            self.conn.send(("stop",))
        except OSError:
            pass  # already gone
        try:
            self.process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            log.warning("saver process %d did not stop within %.0f s; killing it", self.process.pid, STOP_TIMEOUT)
            self.process.kill()
            self.process.wait()
        self.conn.close()


@dataclass
class _Queued:
    """A save handed to the background thread: its handle, its task there, and the staging buffer it holds."""

    handle: SaveHandle
    task: Future[None]
    slot: int


class ProcessSaver(InFlight):
    """Runs asynchronous saves into one vault in a saver process (module docstring)."""

    def __init__(self, config: ChildConfig, async_options: AsyncOptions,
                 after_commit: Callable[[int], None] | None = None, exclusive_retention: bool = False) -> None:
        super().__init__("ckptvault-save", after_commit)
        self.exclusive_retention = exclusive_retention  # the after-commit hook frees chunks at once (DESIGN G6)
        check_process_saver(async_options.saver, config.url)
        self.config, self.idle = config, async_options.saver == "idle-process"
        self.on_busy, self.max_staging_bytes = async_options.on_busy, async_options.max_staging_bytes
        try:
            pickle.dumps(config)
        except Exception as exc:  # noqa: BLE001 - any failure to pickle means: these settings cannot be sent
            raise InvalidArgumentError(f"AsyncOptions(saver={async_options.saver!r}) sends the manager's settings to "
                                       f"the saver process, and they do not pickle ({type(exc).__name__}: {exc}): "
                                       "give storage_options as plain values") from None
        self._slots = [SharedStaging() for _ in range(async_options.max_in_flight)]  # memory only once used
        self._queue: deque[_Queued] = deque()  # saves not yet finished, oldest first; run in this order
        self._child: _Child | None = _Child(config, self.idle)  # starts now: its imports overlap the caller's set-up
        register_live(self)

    @property
    def pid(self) -> int | None:
        """The pid of the saver process started last (None once closed)."""
        return self._child.process.pid if self._child is not None else None

    @property
    def inflight_step(self) -> int | None:
        """The newest save not yet committed, or None."""
        steps = self._unfinished()
        return steps[-1] if steps else None

    def in_flight(self, step: int) -> bool:
        return step in self._unfinished()

    def _unfinished(self) -> list[int]:
        return [queued.handle.step for queued in list(self._queue) if not queued.handle.done()]

    def submit(self, request: SaveRequest, state: Any, rules: CodecRules, allow_pickle: bool) -> SaveHandle:
        """Stage ``state`` into a free shared buffer and queue its save for the saver process. With every buffer
        held, first wait for the oldest save to finish; or, with ``on_busy="skip"`` and none of them committed yet,
        skip this one (a committed save is only running its after-commit step: it is waited for)."""
        self.raise_pending()
        slot = self._free_slot()
        if slot is None and self.on_busy == "skip" and not any(queued.handle.done() for queued in self._queue):
            busy = self._unfinished()
            what = f"step {busy[0]} is" if len(busy) == 1 else f"steps {', '.join(map(str, busy))} are"
            warnings.warn(f"skipping the save of step {request.step}: {what} still being saved",
                          RuntimeWarning, stacklevel=3)
            return SaveHandle.skipped_save(request.step)
        while slot is None:
            self._queue[0].task.result()  # never raises: errors are kept with keep_error
            self.raise_pending()
            slot = self._free_slot()
        pause_collector()
        try:
            snapshot = take_snapshot(state, rules, allow_pickle, self._slots[slot], self.max_staging_bytes)
            if not snapshot.staged:
                raise InvalidArgumentError(
                    f"step {request.step} needs more staging memory than max_staging_bytes={self.max_staging_bytes}, "
                    "and a saver process can only save a staged state: raise max_staging_bytes, or use "
                    "AsyncOptions(saver='thread'), which saves such a state synchronously")
            handle = SaveHandle(request.step)
            child = self._send(request, snapshot, slot)  # now: the saver process holds it, whatever happens here
            handle.staged.set_result(None)
            task = self.submit_task(self._complete, handle, request, child)
            self._queue.append(_Queued(handle, task, slot))
        finally:
            resume_collector()
        return handle

    def _free_slot(self) -> int | None:
        """A staging buffer no unfinished save holds (forgetting finished saves), or None; always None while a
        save is unfinished where an exclusive retention runs in this process (DESIGN G6: it frees chunks at once,
        so no save of this manager may be in flight meanwhile)."""
        while self._queue and self._queue[0].task.done():
            self._queue.popleft()  # saves finish in the order they were queued
        if self._queue and self.exclusive_retention and not (self._child is not None and self._child.runs_retention):
            return None
        held = {queued.slot for queued in self._queue}
        return next((slot for slot in range(len(self._slots)) if slot not in held), None)

    def wait_inflight(self) -> None:
        """Wait until every queued save has finished (committed or failed, and what runs after it)."""
        while self._queue:
            self._queue[0].task.result()
            self._queue.popleft()

    def _complete(self, handle: SaveHandle, request: SaveRequest, child: _Child) -> None:
        """The background thread's part of one save, sent to ``child`` (never raises: the outcome goes to the
        handle)."""
        try:
            self._follow(child, handle, request)
        except BaseException as caught:  # noqa: BLE001 - handed to the caller, not swallowed
            if isinstance(caught, (EOFError, OSError)):
                caught = child.gone(request.step)
            exc = typed_error(caught, f"the save of step {request.step} failed, nothing committed")
            log.error("%s", exc)
            if not handle.done():
                self.keep_error(exc, handle)
                handle.committed.set_exception(exc)
            else:
                self.keep_error(exc, None)

    def _live_child(self) -> _Child:
        """The saver process, started anew if it died or could not open the vault."""
        child = self._child
        if child is None or child.broken is not None or not child.alive():
            if child is not None:
                log.warning("saver process %d exited (status %s); starting a new one", child.process.pid,
                            child.process.poll())
            child = self._child = _Child(self.config, self.idle)
        return child

    def _send(self, request: SaveRequest, snapshot: Snapshot, slot: int) -> _Child:
        """Send the staged save to the saver process (the staging buffer's descriptor first, where that process has
        not mapped it yet); returns the process it went to. The save is queued there behind any others."""
        child = self._live_child()
        staging = self._slots[slot]
        try:
            if child.staging_generations.get(slot) != staging.generation:
                child.conn.send(("staging", slot, staging.capacity))
                assert staging.fd is not None  # the snapshot just filled the buffer
                send_handle(child.conn, staging.fd, child.process.pid)
                child.staging_generations[slot] = staging.generation
            wants_progress = request.progress is not None
            child.conn.send(("save", slot, replace(request, progress=None), wants_progress, snapshot.tree,
                             snapshot.records, snapshot.allow_pickle,
                             logging.getLogger("ckptvault").getEffectiveLevel()))
        except OSError:
            pass  # it died: the task following this save reports it (end of file), and the next save starts another
        return child

    def _follow(self, child: _Child, handle: SaveHandle, request: SaveRequest) -> None:
        """Act on the saver process's messages about this save until it has finished."""
        progress: Callable[..., None] | None = request.progress
        with_total = progress is not None and takes_total(progress)
        while True:
            if child.broken is not None:  # it could not open the vault: every save sent to it fails so
                raise child.broken
            message = child.conn.recv()
            kind = message[0]
            if kind == "progress" and progress is not None:
                progress(message[1], total=message[2]) if with_total else progress(message[1])
            elif kind == "log":
                record = logging.makeLogRecord(message[1])
                logger = logging.getLogger(record.name)
                if logger.isEnabledFor(record.levelno):
                    logger.handle(record)
            elif kind == "ready":
                child.runs_retention = message[1]
            elif kind == "broken":
                child.broken = message[1]
            elif kind == "warnings":
                defer(message[1])
            elif kind == "committed":
                handle.committed.set_result(message[1])
                if not child.runs_retention:
                    self.run_after_commit(request.step)
            elif kind == "failed":
                self.keep_error(message[1], handle)
                handle.committed.set_exception(message[1])
            elif kind == "finished":
                if message[1] is not None:
                    self.keep_error(message[1], None)
                defer(message[2])
                return

    def close(self) -> None:
        """Flush: wait for the save in flight, stop the saver process and the background thread, raise any
        unreported error."""
        try:
            self.wait()
        finally:
            self.stop_thread()
            forget_live(self)
            if self._child is not None:
                self._child.stop()
                self._child = None
            for staging in self._slots:
                staging.close()


def pickled_retention(retention: Any) -> bytes | None:
    """``retention`` pickled for the saver process, or None where there is none or it does not pickle (a
    ``keep_if`` lambda): the training process then runs it after each commit."""
    if retention is None:
        return None
    try:
        return pickle.dumps(retention)
    except Exception as exc:  # noqa: BLE001 - any failure to pickle: run it here
        log.debug("the retention runs in the training process, it does not pickle: %s: %s", type(exc).__name__, exc)
        return None


def check_process_saver(saver: str, url: str) -> None:
    """InvalidArgumentError where a saver process cannot run: no POSIX descriptor passing, no idle class, or a
    vault it could not open as the same vault."""
    if os.name != "posix":
        raise InvalidArgumentError(f"AsyncOptions(saver={saver!r}) needs a POSIX system; use saver='thread'")
    if saver == "idle-process" and not hasattr(os, "SCHED_IDLE"):
        raise InvalidArgumentError("AsyncOptions(saver='idle-process') needs Linux's SCHED_IDLE; use saver='process'")
    if url.startswith("memory://"):
        raise InvalidArgumentError(f"AsyncOptions(saver={saver!r}) cannot save into {url}: a saver process would "
                                   "open a memory store of its own; use a local path or an object-store URL")
