"""How ckptvault talks back to its caller: warnings attributed to the caller's line, and ``progress=`` callbacks.

**Warnings.** User-facing warnings that point at the caller's line, not into ckptvault.

:func:`warn_at_caller` issues a warning attributed to the first frame of the current stack outside this package
(the user's ``mgr.save(...)`` line), however deep inside ckptvault it is called. A thread with no such frame (a
save's worker threads, which encode chunks for synchronous saves too) has nobody to point at: the warning is kept
in a queue instead, and :func:`reissue_deferred` issues it again from the next user-facing call on a caller's
thread (``save``, ``wait``, ``close``, ``SaveHandle.wait``), pointing at that line. The queue is per process, so
with several managers a warning may surface at another manager's call. Imports nothing of the package.

**Progress.** ``progress=`` callbacks: called with each increment of bytes processed, and with the operation's total
where they take it.

``progress(n)`` is called once per chunk (saved, read or checked) with its size in bytes, from worker threads. A
callable that accepts a keyword ``total`` (a parameter of that name, or ``**kwargs``) is called as
``progress(n, total=T)`` instead, where ``T``, the same on every call of one operation, is the sum of all its
increments: the bytes the operation will process, known before its first chunk (for a progress bar:
``bar.total = total; bar.update(n)``). Whether it takes ``total`` is found once per callable (by
``inspect.signature``) and cached.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

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
    for message, category in take_deferred():
        warn_at_caller(message, category)


def take_deferred() -> list[tuple[str, type[Warning]]]:
    """Remove and return the deferred warnings (a saver process sends them to the training process this way)."""
    with _lock:
        pending = _deferred[:]
        _deferred.clear()
    return pending


def defer(pending: list[tuple[str, type[Warning]]]) -> None:
    """Queue ``pending`` (message, category) warnings for the next :func:`reissue_deferred`."""
    with _lock:
        _deferred.extend(pending)


#: what the pipelines call: the increment only (a metered callback adds the total)
Progress = Callable[[int], None]

_TAKES_TOTAL: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def takes_total(progress: Callable[..., Any]) -> bool:
    """Whether ``progress`` accepts a keyword ``total`` (cached per callable where it can be weakly referenced)."""
    try:
        return _TAKES_TOTAL[progress]
    except (KeyError, TypeError):
        pass
    try:
        params = inspect.signature(progress).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: called as before
        found = False
    else:
        found = any(p.kind is p.VAR_KEYWORD or (p.name == "total" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))
                    for p in params)
    try:
        _TAKES_TOTAL[progress] = found
    except TypeError:  # not weakly referenceable: found again next time
        pass
    return found


def metered(progress: Callable[..., Any] | None, total: int) -> Progress | None:
    """``progress`` as the pipelines call it (``f(n)``): given ``total=total`` on each call if it takes it."""
    if progress is None or not takes_total(progress):
        return progress
    return lambda n: progress(n, total=total)
