"""At most one save in flight, on a background thread of its own, and the error nobody was told about yet.

Shared by the single-process :class:`~ckptvault._save.pipeline.Saver` and a distributed manager's collective saves.
Call order: :meth:`InFlight.start` (one task at a time: callers first :meth:`InFlight.wait_inflight`), then the task
reports its outcome on its handle and, for a failure, with :meth:`InFlight.keep_error`; :meth:`raise_pending` raises
that error once unless the handle's ``wait()`` already did; :meth:`stop_thread` at close.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..errors import SaveError, VaultError
from ..handle import SaveHandle

log = logging.getLogger(__name__)


class InFlight:
    """The save in flight (its handle and task), its thread, and the error of a failed save kept for the caller."""

    def __init__(self, thread_name: str, after_commit: Callable[[int], None] | None = None) -> None:
        self._thread_name = thread_name
        self.after_commit = after_commit  # run after each commit (retention): run_after_commit
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: SaveHandle | None = None
        self._task: Future[None] | None = None
        self._error: BaseException | None = None
        self._error_handle: SaveHandle | None = None  # the failed save's handle: its wait() reports the error
        self._lock = threading.Lock()

    @property
    def inflight_step(self) -> int | None:
        handle = self._inflight
        return handle.step if handle is not None and not handle.done() else None

    def in_flight(self, step: int) -> bool:
        """Whether the save of ``step`` is in flight (not yet committed)."""
        return self.inflight_step == step

    def start(self, handle: SaveHandle, task: Callable[..., None], *args: Any) -> None:
        """Run ``task(*args)`` (which never raises) on the background thread as the save of ``handle``."""
        self._inflight = handle
        self._task = self.submit_task(task, *args)

    def submit_task(self, task: Callable[..., None], *args: Any) -> Future[None]:
        """Queue ``task(*args)`` on the background thread (started on first use); tasks run in order."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix=self._thread_name)
        return self._executor.submit(task, *args)

    def wait_inflight(self) -> None:
        """Wait for the whole background task (the commit and what runs after it)."""
        task = self._task
        if task is not None:
            task.result()  # the task never raises; its errors are kept with keep_error
            self._task = None
        self._inflight = None

    def run_after_commit(self, step: int) -> None:
        """Run the after-commit hook (retention) of committed ``step``; its failure is logged and kept with
        :meth:`keep_error` for the next save, wait or close, as the commit stands."""
        if self.after_commit is None:
            return
        try:
            self.after_commit(step)
        except BaseException as exc:  # noqa: BLE001 - kept for the next save, wait or close
            log.error("after-commit step (retention) of step %d failed: %s", step, exc)
            self.keep_error(typed_error(exc, f"step {step} was committed, but the retention that runs after it failed"),
                            None)

    def keep_error(self, error: BaseException, handle: SaveHandle | None) -> None:
        """Keep ``error`` for :meth:`raise_pending`; ``handle``: the failed save's (None: an error after a commit)."""
        with self._lock:
            self._error, self._error_handle = error, handle

    def raise_pending(self) -> None:
        """Raise (once) the error of a background save nobody has been told about."""
        with self._lock:
            error, handle, self._error, self._error_handle = self._error, self._error_handle, None, None
        if error is not None and not (handle is not None and handle.reported):  # wait() already raised it
            raise error

    def wait(self) -> None:
        """Wait for the save in flight; raise its error (or an earlier unreported one)."""
        self.wait_inflight()
        self.raise_pending()

    def stop_thread(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def typed_error(exc: BaseException, what: str) -> BaseException:
    """``exc`` if it is one of ckptvault's errors (or not an Exception: KeyboardInterrupt, SystemExit), else a
    :class:`SaveError` "``what``: Type: message" with ``exc`` as its cause: an unexpected failure (a store's own
    exception, a codec bug, MemoryError) still reaches the caller as a typed error."""
    if isinstance(exc, VaultError) or not isinstance(exc, Exception):
        return exc
    wrapped = SaveError(f"{what}: {type(exc).__name__}: {exc}")
    wrapped.__cause__ = exc
    return wrapped
