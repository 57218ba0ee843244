"""Crash-test saver: trains a small real model with AdamW and saves a checkpoint after every step.

Every save is bracketed by two log lines, each written with one ``os.write`` on an
``O_APPEND`` descriptor and fsynced before the program goes on::

    ready PID
    begin STEP DIGEST MONOTONIC_TIME       (before mgr.save)
    committed STEP DIGEST MONOTONIC_TIME   (after .wait() returned)

In ``overlap`` mode (the asynchronous path as training uses it) a third line comes between
them, and the next training step runs while the save is in flight::

    returned STEP DIGEST MONOTONIC_TIME    (mgr.save returned: staged; the background writes)
    ... one optimizer step changes every tensor of the saved state in place ...
    committed STEP DIGEST MONOTONIC_TIME   (after .wait() returned)

``DIGEST`` is :func:`state_digest` of the exact state handed to the save. A test
kills the process with SIGKILL at any moment and then checks the vault against
the log: every committed step must restore to its digest, and the one step that
was begun but not logged as committed may be present (complete) or absent.

Two ways to run it:

* ``python tests/helpers/saver.py run VAULT LOG [--start S] [--count N] [--overwrite STEP] [--trial T] [--overlap]``
  saves in this process (use it to reproduce a trial by hand);
* ``python tests/helpers/saver.py serve`` imports torch once and then forks one saver
  per ``run VAULT LOG START COUNT OVERWRITE TRIAL CHUNK_SIZE [MODE]`` line read on stdin (MODE
  ``wait``, the default, or ``overlap``), answering
  with the child's pid; ``wait PID`` reaps it and answers ``signal N`` or ``exit N``.
  Forking keeps each trial fast (no 2 s torch import per kill).

The state is deterministic: iteration ``k`` of every trial trains the same model to the
same weights (so later trials dedup against chunks that killed trials left behind),
while a per-trial ``noise`` array makes every save write some new chunks too.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from typing import Any

import numpy as np
import torch

torch.set_num_threads(1)  # before any op: no OpenMP pool, so forking after the first op stays safe

from statedigest import state_digest  # noqa: E402  (this script's folder is sys.path[0])

from ckptvault import CheckpointManager  # noqa: E402
from ckptvault.demo.model import GPT, GPTConfig  # noqa: E402

CONFIG = GPTConfig(seq_len=64, d_model=96, n_layer=3, n_head=4)
NOISE_ELEMENTS = 1 << 18  # 1 MiB of float32 that differs per trial and step
FROZEN_ELEMENTS = 1 << 18  # 1 MiB that never changes: dedups within and across saves
DEFAULT_CHUNK_SIZE = 256 << 10


# -- the training state ----------------------------------------------------------------------------
class Trainer:
    """A small GPT with AdamW, trained one deterministic step per checkpoint."""

    def __init__(self) -> None:
        torch.manual_seed(1234)
        np.random.seed(1234)
        self.model = GPT(CONFIG)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4)
        self.data = torch.randint(0, 256, (1 << 16,), generator=torch.Generator().manual_seed(5))
        self.batches = torch.Generator().manual_seed(6)
        self.frozen = torch.randn(FROZEN_ELEMENTS, generator=torch.Generator().manual_seed(7))

    def train_step(self) -> float:
        starts = torch.randint(0, len(self.data) - CONFIG.seq_len - 1, (2,), generator=self.batches).tolist()
        x = torch.stack([self.data[s : s + CONFIG.seq_len] for s in starts])
        y = torch.stack([self.data[s + 1 : s + CONFIG.seq_len + 1] for s in starts])
        loss = self.model.loss(x, y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return float(loss.detach())

    def state(self, step: int, trial: int, iteration: int, loss: float) -> dict[str, Any]:
        noise = np.random.default_rng([trial, iteration]).standard_normal(NOISE_ELEMENTS, dtype=np.float32)
        return {
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "step": step,
            "loss": loss,
            "frozen": self.frozen,
            "noise": noise,
            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "tag": (trial, iteration)},
        }


# -- the save loop ---------------------------------------------------------------------------------
class Log:
    """Append-only line log; every line is one write, fsynced before returning."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def line(self, *words: object) -> None:
        os.write(self.fd, (" ".join(map(str, words)) + "\n").encode())
        os.fsync(self.fd)


def save_loop(trainer: Trainer, vault: str, log_path: str, start: int, count: int, overwrite: int,
              trial: int, chunk_size: int, overlap: bool = False) -> None:
    """Train and save ``count`` checkpoints: steps start, start+1, ... or, with overwrite >= 0, always that step.

    With ``overlap`` the next training step runs (changing the saved tensors in place) while the save is in flight.
    """
    log = Log(log_path)
    log.line("ready", os.getpid())
    with CheckpointManager(vault, chunk_size=chunk_size) as mgr:
        loss = trainer.train_step()
        for iteration in range(count):
            step = overwrite if overwrite >= 0 else start + iteration
            state = trainer.state(step, trial, iteration, loss)
            digest = state_digest(state)
            log.line("begin", step, digest, f"{time.monotonic():.6f}")
            handle = mgr.save(step, state, metrics={"loss": loss}, overwrite=overwrite >= 0)
            if overlap:
                log.line("returned", step, digest, f"{time.monotonic():.6f}")
                loss = trainer.train_step()
            handle.wait()
            log.line("committed", step, digest, f"{time.monotonic():.6f}")
            if not overlap:
                loss = trainer.train_step()
    log.line("done")


def serve() -> None:
    """Fork one saver per ``run`` command; see the module docstring for the protocol."""
    trainer = Trainer()
    trainer.train_step()  # warm up torch in the server, so forked children start at once
    trainer = Trainer()
    print("serving", flush=True)
    for raw in sys.stdin:
        words = raw.split()
        if not words:
            continue
        if words[0] == "run":
            pid = os.fork()
            if pid == 0:
                _child(trainer, words[1:])
            print(pid, flush=True)
        elif words[0] == "wait":
            _, status = os.waitpid(int(words[1]), 0)
            sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
            print(f"signal {sig}" if sig else f"exit {os.WEXITSTATUS(status)}", flush=True)
        elif words[0] == "quit":
            return


def _child(trainer: Trainer, args: list[str]) -> None:
    vault, log_path = args[0], args[1]
    start, count, overwrite, trial, chunk_size = map(int, args[2:7])
    overlap = args[7:8] == ["overlap"]
    code = 0
    try:
        sys.stdin.close()
        save_loop(trainer, vault, log_path, start, count, overwrite, trial, chunk_size, overlap)
    except BaseException:
        code = 1
        with open(log_path, "a") as f:
            f.write("error " + traceback.format_exc().replace("\n", " | ") + "\n")
    finally:
        os._exit(code)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="save in this process")
    run.add_argument("vault")
    run.add_argument("log")
    run.add_argument("--start", type=int, default=0)
    run.add_argument("--count", type=int, default=1000)
    run.add_argument("--overwrite", type=int, default=-1, help="save every iteration to this step, overwrite=True")
    run.add_argument("--trial", type=int, default=0)
    run.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE)
    run.add_argument("--overlap", action="store_true", help="train the next step while each save is in flight")
    sub.add_parser("serve", help="fork a saver per command read on stdin")
    args = parser.parse_args(argv)
    if args.cmd == "serve":
        serve()
    else:
        save_loop(Trainer(), args.vault, args.log, args.start, args.count, args.overwrite, args.trial, args.chunk_size,
                  args.overlap)


if __name__ == "__main__":
    main()
