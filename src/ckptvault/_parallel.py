"""How saves and restores run: one function over many items on a thread pool, all-or-nothing, with Python's cycle
collector paused while they build their objects.

A vault owns a pool while it is open (:func:`take_pool`); when it closes, an idle pool is kept for the next vault
(:func:`release_pool`). Its threads keep their reusable buffers (byte planes, compression output, read buffers):
new threads would allocate them again, and fresh memory is slow to fault in (docs/benchmarks/small.md).

Saves and restores allocate thousands of acyclic objects (the snapshot's skeleton and records, manifests, the
restored tree) that live until the operation ends: garbage the collector cannot find, but enough allocations to
start collections inside the operation, and a full one whenever one is due (one is due right after ``import
torch``: some 170k objects to examine, 0.1-0.5 s). A collection that runs while they are alive also promotes them
to older generations, which brings the next full collection closer. :func:`pause_collector` disables automatic
collection for the span of one operation, so its temporaries die before the collector sees them and a debt stays
with the process; the next allocations after it pay that debt as they would have without ckptvault.
``gc.collect()`` still works meanwhile. A save in the background pauses collection for the whole process while it
runs.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

T = TypeVar("T")

#: threads a :func:`started_pool` starts before it is returned; any more start as tasks need them
PRESTARTED = 8
#: idle pools of closed vaults kept for the next vaults (:func:`release_pool`)
SPARE_POOLS = 2


class WorkerPool(ThreadPoolExecutor):
    """A ``ThreadPoolExecutor`` that counts its unfinished tasks, so that a closed vault can hand it on if idle."""

    def __init__(self, workers: int, name: str) -> None:
        super().__init__(workers, thread_name_prefix=name)
        self.workers, self.name = workers, name
        self._unfinished = 0
        self._count_lock = threading.Lock()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        with self._count_lock:
            self._unfinished += 1
        try:
            future = super().submit(fn, *args, **kwargs)
        except BaseException:
            self._task_done(None)
            raise
        future.add_done_callback(self._task_done)  # also on cancel; at once if it is done already
        return future

    def _task_done(self, _future: object) -> None:
        with self._count_lock:
            self._unfinished -= 1

    def idle(self) -> bool:
        """Whether every task submitted so far has finished (or was cancelled)."""
        with self._count_lock:
            return self._unfinished == 0


def started_pool(workers: int, name: str) -> WorkerPool:
    """A pool of ``workers`` threads with its first :data:`PRESTARTED` already started, idle.

    A ``ThreadPoolExecutor`` starts a thread inside ``submit`` and waits until it runs, which needs the GIL: while
    the first task holds it, starting the next thread waits for it (up to the interpreter's switch interval, 5 ms,
    each time), so the second and third chunks of a small save or restore started well after the first. Threads
    started here, before any task, take the tasks as they are submitted.
    """
    pool = WorkerPool(workers, name)
    count = min(workers, PRESTARTED)
    gate = threading.Barrier(count + 1)  # each submit finds every started thread busy at the gate: a new one
    try:
        for _ in range(count):
            ThreadPoolExecutor.submit(pool, gate.wait)  # not counted: a pool is idle once these few lines are done
        gate.wait()
    except BaseException:
        gate.abort()  # frees the threads already waiting (their BrokenBarrierError goes nowhere)
        pool.shutdown(wait=False)
        raise
    return pool


_spare: list[WorkerPool] = []  # idle pools of closed vaults, newest last
_spare_lock = threading.Lock()


def take_pool(workers: int, name: str) -> WorkerPool:
    """A pool for a vault: the spare pool of a closed vault with the same ``workers`` and ``name`` if there is
    one (its threads keep their reused buffers, which fresh threads would page-fault in again), else a new
    :func:`started_pool`. Give it back with :func:`release_pool`."""
    with _spare_lock:
        for i in range(len(_spare) - 1, -1, -1):
            if _spare[i].workers == workers and _spare[i].name == name:
                return _spare.pop(i)
    return started_pool(workers, name)


def release_pool(pool: WorkerPool) -> None:
    """Done with ``pool`` (a vault closes): keep it for :func:`take_pool` if no task of it is unfinished and fewer
    than :data:`SPARE_POOLS` are kept, else shut it down, waiting for its tasks. A kept pool's threads stay idle
    with the buffers they reuse (up to a few chunks' worth each) until a later vault takes it or the
    interpreter exits, which stops them as it stops every idle pool's."""
    with _spare_lock:
        if pool.idle() and len(_spare) < SPARE_POOLS:
            _spare.append(pool)
            return
    pool.shutdown(wait=True)


def _forget_spare_pools() -> None:
    """In a forked child the spare pools' threads did not fork: a task submitted there would never run."""
    _spare.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_spare_pools)


def map_all(pool: ThreadPoolExecutor, fn: Callable[..., T], *iterables: Iterable[object]) -> list[T]:
    """``[fn(*args) for args in zip(*iterables)]`` on ``pool``, results in order.

    On the first failure, tasks not yet started are cancelled and running ones
    are waited for before the error is raised, so when this returns or raises
    no task of it is still running (a failed save leaves no writer behind).
    The error raised is that of the earliest item, in input order, that failed,
    so the same input fails the same way whatever the thread timing.
    """
    # Tasks wait until all are submitted: a task running Python code holds the GIL that the next submit needs,
    # up to the interpreter's switch interval (5 ms) each time, so the next chunks started late.
    submitted = threading.Event()

    def gated(*args: object) -> T:
        submitted.wait()
        return fn(*args)

    try:
        futures: list[Future[T]] = [pool.submit(gated, *args) for args in zip(*iterables, strict=True)]
    finally:
        submitted.set()
    _done, pending = wait(futures, return_when=FIRST_EXCEPTION)
    if any(f.done() and not f.cancelled() and f.exception() is not None for f in futures):
        for future in pending:
            future.cancel()
        wait(futures)
        failed = next(f for f in futures if not f.cancelled() and f.exception() is not None)
        raise failed.exception()  # type: ignore[misc]
    return [f.result() for f in futures]


_lock = threading.Lock()
_depth = 0  # saves and restores in progress, in any thread
_reenable = False  # whether the first of them found the collector enabled


def pause_collector() -> None:
    """Automatic collection off until every ``pause_collector()`` has had its ``resume_collector()``, in any thread.

    Call ``resume_collector()`` exactly once after each ``pause_collector()``, in a ``finally``. Plain calls rather than a context
    manager: creating one allocates, and the allocation just before the pause is the one that would pay the debt.
    Pauses nest and overlap across threads: the collector is re-enabled when the last one resumes, and only if it was
    enabled when the first one paused (a process that disabled it keeps it disabled).
    """
    global _depth, _reenable
    _lock.acquire()  # not ``with``: its bound __enter__ would be an allocation
    try:
        if _depth == 0:
            _reenable = gc.isenabled()
            gc.disable()
        _depth += 1
    finally:
        _lock.release()


def resume_collector(run_due: bool = False) -> None:
    """End one ``pause_collector()``. ``run_due``: if this ends the last pause, run now, in this thread, the collection the
    interpreter would start at its next allocation (if one is due), so that back-to-back pauses cannot hold
    collection off indefinitely (a save in the background ends this way)."""
    global _depth
    _lock.acquire()
    try:
        _depth -= 1
        enabled = _depth == 0 and _reenable
        if enabled:
            gc.enable()
    finally:
        _lock.release()
    if enabled and run_due:
        _allocation: set[None] = set()  # a tracked allocation with no free list: the interpreter starts a due collection here
