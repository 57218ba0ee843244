"""Keeping the store reading ahead of a restore that reads chunk objects in a known order.

A restore's threads alternate between reading a chunk object and decoding it; on a machine whose cores the
decoding keeps busy, a thread that then reads waits on the disk while no core works for it. A
:class:`ReadAhead` hints (``Store.prefetch``) the objects of the tasks ahead of the furthest task started, from
a thread of its own (a hint may block while the device's queue is full), so their bytes are on their way while
the tasks before them decode. It reads nothing itself and never raises: a lost hint only costs the wait it
would have saved.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from .._format.chunk_object import chunk_key
from ..stores.base import Store

log = logging.getLogger(__name__)

#: raw bytes of the chunk objects hinted ahead of the furthest task started
WINDOW_BYTES = 256 << 20
#: restores of fewer tasks than this get no read-ahead: the vault's threads start them all at once
MIN_TASKS = 16


class ReadAhead:
    """Hints ``store`` the chunk objects of a sequence of tasks in order, at most ``window`` raw bytes ahead.

    ``tasks[i]`` lists the (chunk id, raw bytes) that task ``i`` reads. Use as :func:`read_ahead` does: call
    :meth:`started` with a task's position as it starts (any thread), and :meth:`stop` once the tasks are done
    or failed."""

    def __init__(self, store: Store, tasks: list[list[tuple[str, int]]], window: int = WINDOW_BYTES) -> None:
        self._store = store
        self._tasks = tasks
        self._window = window
        self._changed = threading.Condition()
        self._started = 0  # tasks started (the furthest position + 1)
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="ckptvault-read-ahead", daemon=True)
        self._thread.start()

    def started(self, position: int) -> None:
        with self._changed:
            if position + 1 > self._started:
                self._started = position + 1
                self._changed.notify()

    def stop(self) -> None:
        """End the hints (those in flight finish) and wait for the thread."""
        with self._changed:
            self._stopped = True
            self._changed.notify()
        self._thread.join()

    def _run(self) -> None:
        seen: set[str] = set()
        sizes = [sum(raw for _cid, raw in task) for task in self._tasks]
        for position, task in enumerate(self._tasks):
            with self._changed:
                ahead = sum(sizes[self._started : position])  # raw bytes hinted for tasks not yet started
                while not self._stopped and ahead >= self._window:
                    self._changed.wait()
                    ahead = sum(sizes[self._started : position])
                if self._stopped:
                    return
            keys = [chunk_key(cid) for cid, _raw in task if cid not in seen]
            seen.update(cid for cid, _raw in task)
            try:
                self._store.prefetch(keys)
            except Exception as exc:  # noqa: BLE001 - a hint: the reads that follow report what is wrong
                log.debug("read-ahead stopped: %s: %s", type(exc).__name__, exc)
                return


class _NoReadAhead:
    def started(self, position: int) -> None:
        pass


@contextmanager
def read_ahead(store: Store, tasks: list[list[tuple[str, int]]]) -> Iterator[ReadAhead | _NoReadAhead]:
    """A :class:`ReadAhead` over ``tasks``, stopped when the block ends, however it ends; none (no thread) for
    fewer than :data:`MIN_TASKS` tasks, which the vault's threads start at once, or a store that takes no hints."""
    if len(tasks) < MIN_TASKS or type(store).prefetch is Store.prefetch:
        yield _NoReadAhead()
        return
    ahead = ReadAhead(store, tasks)
    try:
        yield ahead
    finally:
        ahead.stop()
