"""User-facing warnings that point at the caller's line, not into ckptvault.

:func:`warn_at_caller` issues a warning attributed to the first frame of the current stack outside this package
(the user's ``mgr.save(...)`` line), however deep inside ckptvault it is called. A thread with no such frame (a
save's worker threads, which encode chunks for synchronous saves too) has nobody to point at: the warning is kept
in a queue instead, and :func:`reissue_deferred` issues it again from the next user-facing call on a caller's
thread (``save``, ``wait``, ``close``, ``SaveHandle.wait``), pointing at that line. The queue is per process, so
with several managers a warning may surface at another manager's call. Imports nothing of the package.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_deferred: list[tuple[str, type[Warning]]] = []
_lock = threading.Lock()


def _caller_level() -> int | None:
    """The ``stacklevel`` that ``warnings.warn`` in :func:`warn_at_caller` needs to name the first frame outside
    this package, or None if the whole stack is inside it (a worker thread)."""
    frame = sys._getframe(2)  # warn_at_caller's caller
    level = 2
    while frame is not None:
        if not os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
            module = str(frame.f_globals.get("__name__", ""))
            return None if module == "threading" or module.startswith("concurrent.futures") else level
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return None


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn, attributed to the user's code that called into ckptvault; deferred on a thread without user code."""
    level = _caller_level()
    if level is None:
        with _lock:
            _deferred.append((message, category))
        return
    warnings.warn(message, category, stacklevel=level)


def reissue_deferred() -> None:
    """Issue the warnings background threads deferred, attributed to the current caller (call it from user-facing
    methods only: on a thread without user code they are deferred again)."""
    with _lock:
        pending = _deferred[:]
        _deferred.clear()
    for message, category in pending:
        warn_at_caller(message, category)
