"""The vault's worker pool (``_parallel.py``): its threads are running before the first task, a batch of tasks
starts only once all of it is submitted, the first failure in input order is the one raised, and a closed vault's
idle pool is handed to the next vault."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ckptvault import _parallel
from ckptvault._codecs.planes import scratch
from ckptvault._parallel import PRESTARTED, map_all, release_pool, started_pool, take_pool
from ckptvault._vault import Vault


def _threads(prefix: str) -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith(prefix))


@pytest.mark.parametrize("workers", [1, 3, PRESTARTED + 4])
def test_a_started_pool_has_its_threads_running_before_any_task(workers: int) -> None:
    prefix = f"ckv-test-started-{workers}"
    pool = started_pool(workers, prefix)
    try:
        assert _threads(prefix) == min(workers, PRESTARTED)
        assert map_all(pool, lambda x: x * 2, range(50)) == [x * 2 for x in range(50)]
        assert _threads(prefix) <= workers
    finally:
        pool.shutdown(wait=True)
    assert _threads(prefix) == 0


def test_no_task_of_a_batch_starts_before_the_whole_batch_is_submitted() -> None:
    """A task holding the GIL would delay the submits after it; so none starts until the last item is taken."""
    taken = threading.Event()

    def items() -> Iterator[int]:
        try:
            for i in range(32):
                time.sleep(0.002)  # lets the workers run between submits, as a task's own GIL releases do
                yield i
        finally:
            taken.set()

    def work(x: int) -> bool:
        return taken.is_set()

    pool = started_pool(4, "ckv-test-gate")
    try:
        assert all(map_all(pool, work, items()))
    finally:
        pool.shutdown(wait=True)


def test_the_earliest_failure_in_input_order_is_raised_and_nothing_is_left_running() -> None:
    running = []

    def work(x: int) -> int:
        running.append(x)
        if x in (5, 9):
            raise ValueError(f"item {x}")
        return x

    pool = started_pool(3, "ckv-test-fail")
    try:
        with pytest.raises(ValueError, match="item 5"):
            map_all(pool, work, range(40))
        assert map_all(pool, lambda x: x, range(3)) == [0, 1, 2]  # the pool still works
    finally:
        pool.shutdown(wait=True)


@pytest.fixture
def no_spare_pools() -> Iterator[None]:
    """The test starts and ends with no spare pool kept (other tests' vaults leave theirs)."""
    def drop() -> None:
        while _parallel._spare:
            _parallel._spare.pop().shutdown(wait=True)

    drop()
    yield
    drop()


def _scratch_address(_item: object) -> tuple[int, int]:
    """(thread, address of its 1 MiB scratch buffer) as a task sees them."""
    return threading.get_ident(), scratch(1 << 20, "ckv-test").ctypes.data


def test_a_closed_vault_hands_its_idle_pool_to_the_next_vault(tmp_path: Path, no_spare_pools: None) -> None:
    """The next vault runs on the same threads, which find their buffers where they left them: fresh memory
    would be page-faulted in again."""
    def on_every_thread(pool: ThreadPoolExecutor) -> set[tuple[int, int]]:
        """_scratch_address on each of the pool's 3 threads: the tasks meet at a barrier, as on a busy machine one
        thread could run all three before the others start."""
        met = threading.Barrier(3)

        def task(item: int) -> tuple[int, int]:
            met.wait(timeout=60)
            return _scratch_address(item)

        return set(map_all(pool, task, range(3)))

    first = Vault(tmp_path / "a", workers=3)
    seen = on_every_thread(first.pool)
    first.close()
    assert len(_parallel._spare) == 1 and len({t for t, _ in seen}) == 3

    second = Vault(tmp_path / "b", workers=3)
    try:
        again = on_every_thread(second.pool)
        assert {t for t, _ in again} == {t for t, _ in seen}
        assert again <= seen  # the same buffer in the same thread
        assert _parallel._spare == []  # taken, not shared
    finally:
        second.close()


def test_pools_are_kept_per_worker_count_and_at_most_spare_pools(tmp_path: Path, no_spare_pools: None) -> None:
    vaults = [Vault(tmp_path / str(i), workers=2) for i in range(_parallel.SPARE_POOLS + 1)]
    pools = [v.pool for v in vaults]
    for vault in vaults:
        vault.close()
    assert _parallel._spare == pools[: _parallel.SPARE_POOLS]  # the last one was shut down
    assert pools[-1]._shutdown  # type: ignore[attr-defined]

    other = Vault(tmp_path / "other", workers=5)
    try:
        assert other.pool not in pools  # another worker count gets a pool of its own
        assert other.pool._max_workers == 5  # type: ignore[attr-defined]
    finally:
        other.close()


def test_a_pool_with_a_task_unfinished_is_shut_down_not_kept(no_spare_pools: None) -> None:
    """Closing waits for the task, as it always did, and keeps nothing that another vault could find busy."""
    pool = take_pool(2, "ckv-test-busy")
    release = threading.Event()
    future = pool.submit(release.wait)
    threading.Timer(0.2, release.set).start()
    assert not pool.idle()
    release_pool(pool)
    assert future.done() and _parallel._spare == []


def test_a_pool_counts_failed_and_cancelled_tasks_as_finished(no_spare_pools: None) -> None:
    pool = started_pool(1, "ckv-test-count")
    try:
        gate = threading.Event()
        blocker = pool.submit(gate.wait)
        queued = pool.submit(lambda: 1)
        assert queued.cancel() and not pool.idle()
        gate.set()
        blocker.result()
        with pytest.raises(ValueError):
            pool.submit(int, "not a number").result()
        assert pool.idle()
    finally:
        pool.shutdown(wait=True)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_take_the_parents_spare_pool(tmp_path: Path, no_spare_pools: None) -> None:
    """The spare pool's threads did not fork: a child that took it would wait forever for its tasks."""
    parent = Vault(tmp_path / "parent", workers=2)
    parent.pool  # noqa: B018 - starts it
    parent.close()
    assert len(_parallel._spare) == 1
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if a vault's tasks run
        code = 1
        try:
            vault = Vault(tmp_path / "child", workers=2)
            code = 0 if map_all(vault.pool, lambda x: x + 1, range(4)) == [1, 2, 3, 4] else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
