"""Running one function over many items on a thread pool, all-or-nothing."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import TypeVar

T = TypeVar("T")


def map_all(pool: ThreadPoolExecutor, fn: Callable[..., T], *iterables: Iterable[object]) -> list[T]:
    """``[fn(*args) for args in zip(*iterables)]`` on ``pool``, results in order.

    On the first failure, tasks not yet started are cancelled and running ones
    are waited for before the error is raised, so when this returns or raises
    no task of it is still running (a failed save leaves no writer behind).
    The error raised is that of the earliest item, in input order, that failed,
    so the same input fails the same way whatever the thread timing.
    """
    futures: list[Future[T]] = [pool.submit(fn, *args) for args in zip(*iterables, strict=True)]
    _done, pending = wait(futures, return_when=FIRST_EXCEPTION)
    if any(f.done() and not f.cancelled() and f.exception() is not None for f in futures):
        for future in pending:
            future.cancel()
        wait(futures)
        failed = next(f for f in futures if not f.cancelled() and f.exception() is not None)
        raise failed.exception()  # type: ignore[misc]
    return [f.result() for f in futures]
