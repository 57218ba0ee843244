"""Python's cycle collector, paused while a restore builds its objects.

A restore allocates thousands of acyclic objects (the parsed manifest, its records, the restored tree): garbage the
collector cannot find, but enough allocations to start a full collection whenever one is due, and one is due right
after ``import torch`` (it leaves some 170k objects to examine, 0.1-0.5 s). ``pause()`` disables automatic
collection for the span of a restore, so that debt stays with the process instead of landing inside the restore;
the next allocations after it pay it as they would have without ckptvault. ``gc.collect()`` still works meanwhile.
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_depth = 0  # restores in progress, in any thread
_reenable = False  # whether the first of them found the collector enabled


def pause() -> None:
    """Automatic collection off until every ``pause()`` has had its ``resume()``, in any thread.

    Call ``resume()`` exactly once after each ``pause()``, in a ``finally``. Plain calls rather than a context
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


def resume() -> None:
    """End one ``pause()``."""
    global _depth
    _lock.acquire()
    try:
        _depth -= 1
        if _depth == 0 and _reenable:
            gc.enable()
    finally:
        _lock.release()
