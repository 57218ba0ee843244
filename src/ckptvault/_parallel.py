"""Running one function over many items on a thread pool, all-or-nothing."""

from __future__ import annotations

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
