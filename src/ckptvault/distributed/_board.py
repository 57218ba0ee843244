"""Which ranks of a job are alive: heartbeats in the job's own key-value store.

When a rank dies during a collective save, the survivors' collective fails (gloo notices a closed connection at
once; a hung rank shows only at the timeout), but the error rarely says which rank it was. Every rank of a
distributed CheckpointManager therefore bumps a counter of its own in the store of torch.distributed's default
group (a TCPStore or FileStore every rank already reaches) every ``interval`` seconds, from a daemon thread. After a
failed collective, :meth:`HeartbeatBoard.silent` reads every counter twice, ``interval`` x ``SILENT_BEATS`` apart:
a rank whose counter did not move, and which did not report the failure itself, has stopped (killed, hung, or its
machine gone). If the store itself is unreachable, rank 0 (whose process hosts it in a TCPStore) is named.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch.distributed as dist

log = logging.getLogger(__name__)

#: beats a rank may miss before it counts as stopped
SILENT_BEATS = 3
STOPPED = "stopped responding (killed, hung, or its machine lost) before the save was committed"


def _default_store() -> Any:
    """The key-value store of torch.distributed's default group (private in torch, stable since 1.x)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


class HeartbeatBoard:
    """Heartbeats of every rank under ``prefix`` in the default group's store. ``start`` once, ``stop`` at close."""

    def __init__(self, prefix: str, rank: int, world: int, interval: float = 1.0) -> None:
        self.rank, self.world, self.interval = rank, world, interval
        self.store = dist.PrefixStore(prefix, _default_store())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.store.set(f"beat/{self.rank}", "0")
        self._thread = threading.Thread(target=self._beat, name="ckptvault-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        count = 0
        while not self._stop.wait(self.interval):
            count += 1
            try:
                self.store.set(f"beat/{self.rank}", str(count))
            except Exception as exc:  # noqa: BLE001 - the store went away (rank 0 died): stop beating
                log.debug("heartbeat stopped: %s", exc)
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval * 2)
            self._thread = None

    def silent(self) -> dict[int, str]:
        """The ranks (other than this one) whose heartbeat stopped, each with why; waits ``SILENT_BEATS`` beats.
        A rank that saw the failure itself says so first (``survived/<rank>``): it is not named, even if it has
        exited since."""
        try:
            self.store.set(f"survived/{self.rank}", "1")
            before = self._counts()
            time.sleep(self.interval * SILENT_BEATS)
            after = self._counts()
            survivors = {rank for rank in range(self.world) if self.store.check([f"survived/{rank}"])}
        except Exception as exc:  # noqa: BLE001 - the store is gone: its host is rank 0's process
            return {0: f"unreachable: the job's key-value store, which rank 0 hosts, fails ({type(exc).__name__}: "
                       f"{exc}); rank 0 was probably killed"}
        return {rank: STOPPED for rank in range(self.world)
                if rank not in survivors and (after.get(rank) is None or after.get(rank) == before.get(rank))}

    def _counts(self) -> dict[int, str | None]:
        keys = [f"beat/{rank}" for rank in range(self.world)]
        return {rank: (self.store.get(key).decode() if self.store.check([key]) else None)
                for rank, key in enumerate(keys)}


#: seconds a rank waits for the others to make their manager before it says what it waits for
JOIN_WARNING_S = 10.0
_MADE = [0]  # managers this process made in a job: ranks make theirs in the same order, so the n-th ones meet


def join(rank: int, world: int, timeout: float) -> int:
    """Wait until every rank has made its n-th distributed CheckpointManager (n: this process's count), so that a
    manager made on one rank only fails with a clear error instead of hanging in the collectives that follow.
    Returns n. RankFailedError naming the ranks that never came, after ``timeout`` seconds (a warning after
    ``JOIN_WARNING_S``)."""
    from ..errors import RankFailedError

    _MADE[0] += 1
    number = _MADE[0]
    store = dist.PrefixStore(f"ckptvault/join/{number}/", _default_store())
    store.set(str(rank), "1")
    keys = [str(r) for r in range(world)]
    start, warned = time.monotonic(), False
    while not store.check(keys):
        waited = time.monotonic() - start
        missing = [r for r in range(world) if not store.check([str(r)])]
        if waited > timeout:
            why = ("never made its CheckpointManager: in a torch.distributed job every rank makes one (a collective); "
                   "to save from one rank alone, pass distributed=DistributedOptions(enabled=False)")
            raise RankFailedError("making the CheckpointManager", dict.fromkeys(missing, why))
        if waited > JOIN_WARNING_S and not warned:
            log.warning("rank %d waits for ranks %s to make their CheckpointManager (every rank makes one; to save "
                        "from one rank alone, pass distributed=DistributedOptions(enabled=False))", rank, missing)
            warned = True
        time.sleep(0.05)
    return number
