"""``progress=`` callbacks (src/ckptvault/_progress.py): byte increments, and the operation's total for a callable
that takes a ``total`` keyword; the same on every call, the sum of the increments, known from the first call."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ckptvault
from ckptvault._feedback import takes_total

CHUNK = 64 << 10


class Recorder:
    """A progress callback that records (increment, total) pairs; thread-safe (called from worker threads)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int | None]] = []
        self._lock = threading.Lock()

    def __call__(self, n: int, *, total: int | None = None) -> None:
        with self._lock:
            self.calls.append((n, total))

    def total(self) -> int:
        totals = {t for _, t in self.calls}
        assert len(totals) == 1, f"the total changed between calls: {sorted(totals, key=str)}"
        (only,) = totals
        assert only is not None, "called without a total"
        assert sum(n for n, _ in self.calls) == only, "the increments do not add up to the total"
        return only


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128))
    return {"model": model.state_dict(), "extra": {"big": torch.randn(100_000), "arr": np.arange(10, dtype=np.int64)},
            "step": 3}


def test_save_restore_and_verify_report_a_total_equal_to_the_logical_bytes(tmp_path: Path) -> None:
    with ckptvault.CheckpointManager(tmp_path / "v", chunk_size=CHUNK) as mgr:
        saving = Recorder()
        mgr.save(1, _state(), progress=saving).wait()
        logical = mgr.info(1).logical_bytes
        assert len(saving.calls) > 3  # several chunks, so the sum test means something
        assert saving.total() == logical

        restoring = Recorder()
        mgr.restore(1, progress=restoring)
        assert restoring.total() == logical

        verifying = Recorder()
        assert mgr.verify(1, progress=verifying).ok
        assert verifying.total() == logical

        again = Recorder()  # an unchanged state: every chunk is deduplicated, and still counted
        mgr.save(2, _state(), progress=again).wait()
        assert mgr.info(2).added_bytes == 0 < again.total() == logical
        everything = Recorder()
        mgr.verify(progress=everything)  # steps 1 and 2 share every chunk: each is checked once
        assert everything.total() == logical


def test_restore_into_reports_the_bytes_of_the_chunks_it_reads(tmp_path: Path) -> None:
    state = _state()
    with ckptvault.CheckpointManager(tmp_path / "v", chunk_size=CHUNK) as mgr:
        mgr.save(1, state).wait()
        model_bytes = sum(t.numel() * t.element_size() for t in state["model"].values())
        partial = Recorder()
        target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
        mgr.restore(1, into=target, progress=partial)
        assert model_bytes <= partial.total() < mgr.info(1).logical_bytes  # the big tensor is not read
        assert torch.equal(target["model"]["0.weight"], state["model"]["0.weight"])

        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128))
        live = Recorder()  # live objects and plain values: several reads, one total
        report = mgr.restore(1, into={"model": model, "extra": None, "step": 0}, progress=live)
        assert report["step"] == 3 and torch.equal(model[0].weight, state["model"]["0.weight"])
        assert live.total() == mgr.info(1).logical_bytes


def test_a_callable_without_total_is_called_with_the_increment_only(memory_url: str) -> None:
    seen: list[int] = []
    with ckptvault.CheckpointManager(memory_url) as mgr:
        mgr.save(1, {"w": torch.ones(1000)}, progress=seen.append).wait()  # a builtin method: no total
        mgr.restore(1, progress=lambda n: seen.append(n))
        assert seen == [4000, 4000]


@pytest.mark.parametrize(("function", "expected"), [
    (lambda n: None, False),
    (lambda n, total: None, True),
    (lambda n, *, total=None: None, True),
    (lambda n, **kwargs: None, True),
    (lambda n, totals=None: None, False),
    (print, False),
])
def test_which_callables_take_a_total(function: Any, expected: bool) -> None:
    assert takes_total(function) is expected
    assert takes_total(function) is expected  # cached
