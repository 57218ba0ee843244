"""How saves and restores run: one function over many items on a thread pool, all-or-nothing, with Python's cycle
collector paused while they build their objects.

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
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import TypeVar

T = TypeVar("T")

#: threads a :func:`started_pool` starts before it is returned; any more start as tasks need them
PRESTARTED = 8


def started_pool(workers: int, name: str) -> ThreadPoolExecutor:
    """A pool of ``workers`` threads with its first :data:`PRESTARTED` already started, idle.

    A ``ThreadPoolExecutor`` starts a thread inside ``submit`` and waits until it runs, which needs the GIL: while
    the first task holds it, starting the next thread waits for it (up to the interpreter's switch interval, 5 ms,
    each time), so the second and third chunks of a small save or restore started well after the first. Threads
    started here, before any task, take the tasks as they are submitted.
    """
    pool = ThreadPoolExecutor(workers, thread_name_prefix=name)
    count = min(workers, PRESTARTED)
    gate = threading.Barrier(count + 1)  # each submit finds every started thread busy at the gate: a new one
    try:
        for _ in range(count):
            pool.submit(gate.wait)
        gate.wait()
    except BaseException:
        gate.abort()  # frees the threads already waiting (their BrokenBarrierError goes nowhere)
        pool.shutdown(wait=False)
        raise
    return pool


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
