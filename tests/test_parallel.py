"""The vault's worker pool (``_parallel.py``): its threads are running before the first task, a batch of tasks
starts only once all of it is submitted, and the first failure in input order is the one raised."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from ckptvault._parallel import PRESTARTED, map_all, started_pool


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
