"""The saver process's side of ``AsyncOptions(saver="process")``: it runs the saves the training process stages.

The training process starts it (``_save/process_saver.py``) as ``python -c`` calling :func:`main` with one end of a
socket pair. Messages, each a pickled tuple (both ends are this package; nothing read from storage is unpickled):

* training -> saver: ``("open", ChildConfig)`` first; ``("staging", slot, nbytes)`` followed by the descriptor of
  the shared staging buffer of that slot (``multiprocessing.reduction.send_handle``) whenever that buffer is new;
  ``("save", slot, SaveRequest, wants_progress, tree, records, allow_pickle, log_level)`` for a state staged there; ``("stop",)``.
* saver -> training: ``("ready", runs_retention)`` or ``("broken", error)`` once after ``open``; per save ``("progress", n,
  total)`` and ``("log", record)`` any number of times, then ``("committed", CheckpointInfo)`` or ``("failed",
  error)`` preceded by ``("warnings", warnings)``, then ``("finished", error_after_commit, warnings)``.

The saver runs one save at a time, in its main thread, with the pipeline of a synchronous :class:`Saver` (its
delta bases, predictions and keyframe cache live here), and after each commit the manager's retention, between
that save and the next one: ``runs_retention`` tells the training process it need not run it (False where the
manager has none, or its policies did not unpickle here, such as a class defined in the training script).
It ignores SIGINT and SIGTERM: the training process decides when it stops, and when that process is gone (end of
file on the socket) it finishes the save it holds and exits.
"""

from __future__ import annotations

import gc
import logging
import mmap
import os
import pickle
import signal
import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle
from typing import Any

import numpy as np

from .._codecs.lossy import LossySafety
from .._codecs.planes import kernels_ready, load_kernels_in_background, wait_for_kernel_loading
from .._delta.kernels import wait_for_fused_loading
from .._delta.policy import DeltaPolicy
from .._delta.predict import predictor_for
from .._feedback import take_deferred
from .._maintenance.prune import GcPacer, apply_retention
from .._maintenance.retention import Retention
from .._vault import Vault
from ..errors import SaveError
from ..handle import SaveHandle
from .pipeline import Saver, SaveRequest
from .snapshot import ArrayRecord, Snapshot
from .staging import aligned_offsets


@dataclass(frozen=True)
class ChildConfig:
    """What the saver process needs to open the vault and save as the training process's manager would."""

    url: str
    storage_options: Any
    workers: int | None
    delta_policy: DeltaPolicy
    predict: bool | Mapping[str, str]
    safety: LossySafety
    cache_keyframe: bool
    log_level: int  # the training process's level for the ``ckptvault`` loggers (each save sends it again)
    retention: bytes | None = None  # the manager's Retention, pickled (None: none, or its policies do not pickle)
    exclusive: bool = False  # the manager's exclusive=: retention frees what its prune released at once (DESIGN G6)


class _Channel:
    """The socket to the training process; sends from any thread (progress and log records come from workers)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, message: tuple[Any, ...]) -> None:
        with self._lock:
            self.conn.send(message)


class _Forward(logging.Handler):
    """Sends the ``ckptvault`` loggers' records to the training process, formatted (their arguments need not
    pickle)."""

    def __init__(self, channel: _Channel) -> None:
        super().__init__()
        self.channel = channel

    def emit(self, record: logging.LogRecord) -> None:
        try:
            fields = dict(record.__dict__, msg=record.getMessage(), args=None, exc_info=None,
                          exc_text=self.formatter.formatException(record.exc_info) if record.exc_info else None)
            fields["processName"] = f"ckptvault-saver-{os.getpid()}"
            self.channel.send(("log", fields))
        except Exception:  # noqa: BLE001 - logging must never break a save
            self.handleError(record)

    formatter = logging.Formatter()


def portable(exc: BaseException) -> BaseException:
    """``exc`` if it pickles as itself (ckptvault's errors do), else a :class:`SaveError` naming it."""
    try:
        copy = pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any failure to pickle means: send a description instead
        copy = None
    if type(copy) is type(exc):
        return exc
    return SaveError(f"{type(exc).__name__}: {exc}")


def main(fd: int) -> None:
    """The saver process: serve the training process on socket ``fd`` until it stops us or is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(fd)
    channel = _Channel(conn)
    try:
        kind, config = conn.recv()
    except EOFError:  # the training process is gone before it sent anything
        return
    assert kind == "open", kind
    logger = logging.getLogger("ckptvault")
    logger.addHandler(_Forward(channel))
    logger.setLevel(config.log_level)
    logger.propagate = False
    try:
        vault = Vault(config.url, config.storage_options, config.workers)
        retention = _retention(config.retention)
        saver = Saver(vault, config.delta_policy, async_save=False, safety=config.safety,
                      cache_keyframe=config.cache_keyframe, predictor=predictor_for(config.predict),
                      after_commit=_retention_hook(vault, retention, config.exclusive))
    except BaseException as exc:  # noqa: BLE001 - reported to the training process, which raises it
        channel.send(("broken", portable(exc)))
        return
    channel.send(("ready", retention is not None))
    load_kernels_in_background()  # this process exists to save: numba's kernels pay from the first saves on
    try:
        _serve(conn, channel, saver)
    finally:
        saver.close()
        vault.close()
        wait_for_kernel_loading()  # no thread left importing numba while the interpreter exits
        wait_for_fused_loading()


def _retention(pickled: bytes | None) -> Retention | None:
    """The manager's retention, or None where it has none or it does not unpickle in this process."""
    if pickled is None:
        return None
    try:
        retention = pickle.loads(pickled)  # sent by the training process, never read from storage
    except Exception as exc:  # noqa: BLE001 - any failure: the training process runs the retention itself
        logging.getLogger(__name__).debug("the retention runs in the training process: %s: %s", type(exc).__name__,
                                          exc)
        return None
    return retention if isinstance(retention, Retention) else None


def _retention_hook(vault: Vault, retention: Retention | None, exclusive: bool) -> Callable[[int], None] | None:
    """What the saver runs after each commit here: the manager's retention, paced gc included."""
    if retention is None:
        return None
    pacer = GcPacer()

    def after_commit(step: int) -> None:
        apply_retention(vault, retention, step, exclusive=exclusive, pacer=pacer)

    return after_commit


def _freeze_once_loaded() -> bool:
    """Once the kernels are loaded, move every object this process holds into the cycle collector's permanent
    generation (``gc.freeze``): what imports and kernels made lives as long as the process, so the full collections
    that saves make due walk only the saves' own objects. Returns whether it froze."""
    if not kernels_ready():
        return False
    gc.collect()
    gc.freeze()
    return True


def _serve(conn: Connection, channel: _Channel, saver: Saver) -> None:
    staging: dict[int, np.ndarray] = {}  # slot -> that staging buffer's bytes
    frozen = False
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the training process is gone
            return
        if message[0] == "stop":
            return
        if message[0] == "staging":
            staging[message[1]] = _map(recv_handle(conn), message[2])
        elif message[0] == "save":
            frozen = frozen or _freeze_once_loaded()
            _save(channel, saver, staging[message[1]], *message[2:])


def _map(fd: int, nbytes: int) -> np.ndarray:
    try:
        return np.frombuffer(mmap.mmap(fd, nbytes), dtype=np.uint8)
    finally:
        os.close(fd)  # the mapping keeps the memory


def _save(channel: _Channel, saver: Saver, staging: np.ndarray, request: SaveRequest, wants_progress: bool,
          tree: Any, records: list[ArrayRecord], allow_pickle: bool, log_level: int) -> None:
    """Run one staged save; report its commit or failure, then what came after it."""
    logging.getLogger("ckptvault").setLevel(log_level)  # records below the training process's level are not sent
    offsets = aligned_offsets([r.nbytes for r in records])[0]
    views = [staging[o : o + r.nbytes].data if r.nbytes else memoryview(b"") for o, r in zip(offsets, records, strict=True)]
    snapshot = Snapshot(tree, records, views, allow_pickle, staged=True)
    if wants_progress:
        request.progress = lambda n, total=None: channel.send(("progress", n, total))
    handle = SaveHandle(request.step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle.committed.add_done_callback(lambda done: _report(channel, done, caught))
        saver._complete(handle, request, snapshot)  # as a staged save's background task runs it
    handle.reported = True  # its failure went out with "failed": only an error after the commit is left
    try:
        saver.raise_pending()
        after: BaseException | None = None
    except BaseException as exc:  # noqa: BLE001 - sent to the training process
        after = portable(exc)
    channel.send(("finished", after, _warnings(caught)))


def _report(channel: _Channel, done: Any, caught: list[warnings.WarningMessage]) -> None:
    """Send the warnings so far, then the save's outcome: a caller that waits for the commit sees both."""
    channel.send(("warnings", _warnings(caught)))
    error = done.exception()
    channel.send(("committed", done.result()) if error is None else ("failed", portable(error)))


def _warnings(caught: list[warnings.WarningMessage]) -> list[tuple[str, type[Warning]]]:
    """Remove and return the warnings issued so far, the recorded and the deferred ones (``_feedback.py``)."""
    found = [(str(w.message), w.category) for w in caught]
    del caught[:]
    return found + take_deferred()
