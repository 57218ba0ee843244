"""Concurrency-test saver: trains a small real model and saves a checkpoint per step, retention on.

    python tests/helpers/gc_saver.py VAULT LOG SECONDS

Saves steps 0, 1, 2, ... for SECONDS seconds with ``CheckpointManager(retention=policy())``
(prune after every commit, no gc: ``gc_collector.py`` collects in another process).
Each line of LOG is written with one ``os.write`` on an ``O_APPEND`` descriptor::

    committed STEP DIGEST    after the save of STEP is durable (DIGEST: statedigest of the saved state)
    failed STEP MESSAGE      a save that a concurrent gc made fail cleanly (it is retried with the same state)
    done COUNT
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import torch

torch.set_num_threads(1)

from statedigest import state_digest  # noqa: E402  (this script's folder is sys.path[0])

from ckptvault import CheckpointManager  # noqa: E402
from ckptvault._maintenance.retention import Retention  # noqa: E402
from ckptvault.errors import SaveError  # noqa: E402

CHUNK_SIZE = 64 << 10


def policy(gc: bool = False) -> Retention:
    """The retention both processes of the test apply."""
    return Retention(keep_last=3, keep_every=5, gc=gc)


class Log:
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def line(self, *words: object) -> None:
        os.write(self.fd, (" ".join(map(str, words)) + "\n").encode())


def main(vault: str, log_path: str, seconds: float) -> None:
    log = Log(log_path)
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    frozen = torch.arange(1 << 16, dtype=torch.float32)  # 256 KiB that every checkpoint shares
    deadline = time.monotonic() + seconds
    step = 0
    with CheckpointManager(vault, chunk_size=CHUNK_SIZE, keyframe_every=4, retention=policy()) as mgr:
        while time.monotonic() < deadline:
            loss = model(torch.randn(32, 64)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "frozen": frozen, "step": step}
            digest = state_digest(state)
            for _attempt in range(5):
                try:
                    mgr.save(step, state, metrics={"loss": loss.item()})
                    mgr.wait()
                    break
                except SaveError as exc:
                    log.line("failed", step, " ".join(str(exc).split()))
            else:
                raise RuntimeError(f"step {step} failed 5 times")
            log.line("committed", step, digest)
            step += 1
    log.line("done", step)


if __name__ == "__main__":
    try:
        main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
    except BaseException:
        with open(sys.argv[2], "a") as f:
            f.write("error " + traceback.format_exc().replace("\n", " | ") + "\n")
        raise
