"""Preemption-test saver (tests/test_preemption.py): an asynchronous save in flight when a signal arrives.

``python tests/helpers/preempt_saver.py VAULT MODE [--signal NAME] [--chain MARKER]``

* MODE ``none``: no opt-in (the default behaviour); ``exit``: ``mgr.handle_preemption()``; ``poll``:
  ``mgr.handle_preemption(poll=True)``, and the loop saves a final checkpoint once ``mgr.preempted``.
* ``--signal``: the signal to handle (default ``TERM``); ``--chain MARKER``: install, before the manager's
  handler, a handler of our own that creates MARKER (the handler ``handle_preemption`` must chain to).

It commits step 1, then makes the store slow (every chunk write of a background thread sleeps
``SLOW_PUT`` seconds) and saves step 2 asynchronously: ``save()`` returns at once and the background
needs about a second, so a signal sent when ``returned`` is printed lands while step 2 is in flight.
Then it "trains" (sleeps in small steps) for at most 30 s. Lines on stdout: ``ready``, ``returned``,
``final STEP`` (poll mode, after the final save returned), ``loop ended`` (only if the loop ran out).
States are :func:`make_state` (deterministic per step), so the test rebuilds them to compare bit for bit.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any

import numpy as np
import torch

from ckptvault import CheckpointManager
from ckptvault.stores import LocalStore
from ckptvault.stores.base import WriteBatch

torch.set_num_threads(1)

CHUNK_SIZE = 256 << 10
ELEMENTS = 6 << 18  # 6 MiB of float32: 24 chunks
SLOW_PUT = 0.08  # seconds per background chunk write while slow (2 workers: ~1 s for step 2)


def make_state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(ELEMENTS, generator=g), "b": torch.arange(step, step + 16, dtype=torch.int64)},
            "noise": np.random.default_rng(step).standard_normal(1024).astype(np.float32), "step": step}


class SlowStore(LocalStore):
    """LocalStore whose chunk writes from threads other than the main one sleep while ``slow`` is set."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.slow = threading.Event()

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        if key.startswith("chunks/") and self.slow.is_set() and threading.current_thread() is not threading.main_thread():
            time.sleep(SLOW_PUT)
        return super().put_if_absent(key, data)

    def write_batch(self) -> WriteBatch:
        return WriteBatch(self)  # chunk writes through put_if_absent


def say(*words: object) -> None:
    print(*words, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("vault")
    parser.add_argument("mode", choices=["none", "exit", "poll"])
    parser.add_argument("--signal", default="TERM")
    parser.add_argument("--chain")
    args = parser.parse_args()
    signum = getattr(signal, f"SIG{args.signal}")
    if args.chain:
        def earlier(sig: int, frame: FrameType | None) -> None:
            os.close(os.open(args.chain, os.O_CREAT | os.O_WRONLY, 0o644))
        signal.signal(signum, earlier)
    store = SlowStore(args.vault)
    with CheckpointManager(store, chunk_size=CHUNK_SIZE, workers=2) as mgr:
        if args.mode != "none":
            mgr.handle_preemption(signum, poll=args.mode == "poll")
        mgr.save(1, make_state(1)).wait()
        store.slow.set()
        say("ready")
        mgr.save(2, make_state(2))
        say("returned")
        deadline = time.monotonic() + 30
        step = 3
        while time.monotonic() < deadline:
            time.sleep(0.005)  # a training step
            if mgr.preempted:
                mgr.save(step, make_state(step))
                say("final", step)
                break
            step += 1
        else:
            say("loop ended")
    say("closed")
    sys.exit(0)


if __name__ == "__main__":
    main()
