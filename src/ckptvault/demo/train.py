"""The demo's training job: the small GPT, AdamW and a warmup-cosine LR schedule over stdlib bytes.

:class:`Trainer` owns everything a resume needs and exposes it as one nested
state (:meth:`Trainer.state`): model, optimizer, scheduler, step and every RNG
the job draws from (torch's global RNG, numpy's, Python's and the generator
that picks training windows). :meth:`Trainer.load_state` puts such a state
back, after which training continues exactly as if it had never stopped.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from .data import batch, stdlib_bytes
from .model import GPT, GPTConfig


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of the demo job (recorded in every checkpoint's metadata)."""

    batch_size: int = 16
    lr: float = 2e-3
    weight_decay: float = 0.1
    warmup: int = 50
    horizon: int = 3000
    seed: int = 0
    data_bytes: int = 4 << 20


class WarmupCosine:
    """LR multiplier: linear warmup, then cosine decay to ``floor`` at ``horizon``, flat after.

    A callable object rather than a function, so ``LambdaLR.state_dict()``
    records its settings in the checkpoint.
    """

    def __init__(self, warmup: int, horizon: int, floor: float = 0.1) -> None:
        self.warmup, self.horizon, self.floor = warmup, horizon, floor

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.horizon - self.warmup))
        return self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * progress))


def seed_everything(seed: int) -> None:
    """Seed torch's, numpy's and Python's global RNGs."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


class Trainer:
    """One training run of the demo model. Not thread-safe."""

    def __init__(self, cfg: TrainConfig | None = None, model_cfg: GPTConfig | None = None) -> None:
        self.cfg = cfg or TrainConfig()
        self.model_cfg = model_cfg or GPTConfig.small()
        seed_everything(self.cfg.seed)
        self.data = stdlib_bytes(self.cfg.data_bytes)
        self.model = GPT(self.model_cfg)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.lr, betas=(0.9, 0.95),
                                           weight_decay=self.cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, WarmupCosine(self.cfg.warmup, self.cfg.horizon))
        self.generator = torch.Generator().manual_seed(self.cfg.seed)
        self.step = 0

    def train_step(self) -> float:
        """One optimizer step; returns its loss. Advances :attr:`step` by one."""
        self.model.train()
        x, y = batch(self.data, self.cfg.batch_size, self.model_cfg.seq_len, self.generator)
        loss = self.model.loss(x, y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        return float(loss.detach())

    def state(self) -> dict[str, Any]:
        """Everything a bit-exact resume needs. Tensors are the live ones (no copy): save before the next step."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "rng": {
                "torch": torch.get_rng_state(),
                "numpy": np.random.get_state(),
                "python": random.getstate(),
                "data": self.generator.get_state(),
            },
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Put a state made by :meth:`state` back (the trainer must have been built with the same configs)."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        rng = state["rng"]
        torch.set_rng_state(rng["torch"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])
        self.generator.set_state(rng["data"])

    def metadata(self) -> dict[str, Any]:
        """JSON-ready description of the run, stored with each checkpoint."""
        return {"job": "ckptvault-demo", "model": asdict(self.model_cfg), "train": asdict(self.cfg),
                "torch": torch.__version__}
