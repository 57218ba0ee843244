"""Python's cycle collector, paused while a save or a restore builds its objects.

Saves and restores allocate thousands of acyclic objects (the snapshot's skeleton and records, manifests, the
restored tree) that live until the operation ends: garbage the collector cannot find, but enough allocations to
start collections inside the operation, and a full one whenever one is due (one is due right after ``import
torch``: some 170k objects to examine, 0.1-0.5 s). A collection that runs while they are alive also promotes them
to older generations, which brings the next full collection closer. ``pause()`` disables automatic collection for
the span of one operation, so its temporaries die before the collector sees them and a debt stays with the process;
the next allocations after it pay that debt as they would have without ckptvault. ``gc.collect()`` still works
meanwhile. A save in the background pauses collection for the whole process while it runs.
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_depth = 0  # saves and restores in progress, in any thread
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


def resume(run_due: bool = False) -> None:
    """End one ``pause()``. ``run_due``: if this ends the last pause, run now, in this thread, the collection the
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
