"""Exact resume: training restored from a checkpoint in a fresh process continues bit-identically.

A small GPT (dropout on, so the torch RNG matters) trains with AdamW and OneCycleLR on batches whose
windows come from numpy's global RNG, a torch.Generator and Python's ``random`` (loss weighting). The
test runs N steps uninterrupted; separately it trains k steps, saves model, optimizer, scheduler, every
RNG state and the step, then a NEW PYTHON PROCESS restores the checkpoint, trains on to N and saves the
result. Weights and optimizer state must equal the uninterrupted run bit for bit (``torch.equal``).

This file is also the subprocess's entry point: ``python tests/test_resume.py VAULT STEP TOTAL MODE``.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ckptvault
from ckptvault.demo.data import stdlib_bytes
from ckptvault.demo.model import GPT, GPTConfig

TOTAL_STEPS = 12
SAVE_AT = 5
CONFIG = GPTConfig(seq_len=32, d_model=32, n_layer=2, n_head=2, dropout=0.1)


class Trainer:
    """Model, optimizer, scheduler and every RNG a training loop draws from."""

    def __init__(self, seed: int = 1234) -> None:
        torch.set_num_threads(1)  # the same kernels in both processes
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        self.data = stdlib_bytes(limit=256 << 10)
        self.model = GPT(CONFIG)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3, weight_decay=0.1)
        self.sched = torch.optim.lr_scheduler.OneCycleLR(self.opt, max_lr=3e-3, total_steps=TOTAL_STEPS)
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.step = 0

    def train_step(self) -> None:
        self.model.train()
        starts = np.random.randint(0, len(self.data) - CONFIG.seq_len - 1, size=4)
        offsets = torch.randint(0, 3, (4,), generator=self.gen)
        idx = torch.stack([self.data[s + o : s + o + CONFIG.seq_len] for s, o in zip(starts.tolist(), offsets.tolist())])
        tgt = torch.stack([self.data[s + o + 1 : s + o + CONFIG.seq_len + 1] for s, o in zip(starts.tolist(), offsets.tolist())])
        loss = self.model.loss(idx, tgt) * (1.0 + 0.1 * random.random())
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.sched.step()
        self.step += 1

    def train_to(self, total: int) -> None:
        while self.step < total:
            self.train_step()

    def state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(), "optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
                    "data": self.gen.get_state()},
            "step": self.step,
        }

    def load(self, state: dict[str, Any], into_model: bool = False) -> None:
        if not into_model:
            self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"]["torch"])
        np.random.set_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])
        self.gen.set_state(state["rng"]["data"])
        self.step = state["step"]


def resume_main(url: str, step: int, total: int, mode: str) -> None:
    """Subprocess body: restore ``step`` from ``url``, train to ``total``, save it as step ``total``."""
    trainer = Trainer(seed=999)  # a different init: everything must come from the checkpoint
    with ckptvault.CheckpointManager(url) as mgr:
        if mode == "into":
            mgr.restore(step, into=trainer.model.state_dict())
            trainer.load(mgr.restore(step, keys=["optimizer", "scheduler", "rng", "step"]), into_model=True)
        else:
            trainer.load(mgr.restore(step))
        assert trainer.step == step, trainer.step
        trainer.train_to(total)
        mgr.save(total, trainer.state()).wait()


def _assert_bit_identical(expected: dict[str, Any], actual: dict[str, Any]) -> None:
    for key, tensor in expected["model"].items():
        assert torch.equal(actual["model"][key], tensor), f"model.{key} differs"
    for pid, slots in expected["optimizer"]["state"].items():
        for name, value in slots.items():
            assert torch.equal(actual["optimizer"]["state"][pid][name], value), f"optimizer.state.{pid}.{name} differs"
    assert actual["scheduler"] == expected["scheduler"]
    assert actual["step"] == expected["step"]


@pytest.fixture(scope="module")
def uninterrupted() -> dict[str, Any]:
    trainer = Trainer()
    trainer.train_to(TOTAL_STEPS)
    return trainer.state()


@pytest.mark.parametrize("mode", ["load_state_dict", "into"])
def test_resume_in_fresh_process_is_bit_identical(tmp_path: Path, uninterrupted: dict[str, Any], mode: str) -> None:
    url = str(tmp_path / "vault")
    trainer = Trainer()
    trainer.train_to(SAVE_AT)
    with ckptvault.CheckpointManager(url) as mgr:
        mgr.save(SAVE_AT, trainer.state(), metrics={"step": SAVE_AT}).wait()
    env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, __file__, url, str(SAVE_AT), str(TOTAL_STEPS), mode], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with ckptvault.CheckpointManager(url) as mgr:
        assert mgr.steps() == [SAVE_AT, TOTAL_STEPS]
        resumed = mgr.restore(TOTAL_STEPS)
    _assert_bit_identical(uninterrupted, resumed)
    moved = [k for k, v in resumed["model"].items() if not torch.equal(v, trainer.state()["model"][k])]
    assert moved, "training after the resume changed nothing: the test would not notice a broken resume"


def test_resume_without_rng_state_diverges(uninterrupted: dict[str, Any]) -> None:
    """Control: the comparison above is sensitive; forgetting one RNG state breaks bit-identity."""
    trainer = Trainer()
    trainer.train_to(SAVE_AT)
    state = trainer.state()
    resumed = Trainer(seed=999)
    resumed.load(state)
    torch.manual_seed(0)  # dropout masks now differ from the uninterrupted run
    resumed.train_to(TOTAL_STEPS)
    differing = [k for k, v in resumed.state()["model"].items() if not torch.equal(v, uninterrupted["model"][k])]
    assert differing


if __name__ == "__main__":
    resume_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
