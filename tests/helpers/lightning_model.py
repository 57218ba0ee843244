"""A tiny Lightning training job for tests/test_integration_lightning.py: a few linear layers, AdamW, a step LR
schedule, seeded random data; Trainer factories with and without the vault plugin; bit-exact tree comparison."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

BATCHES_PER_EPOCH = 4


class _Tiny:
    """Three linear layers; logs ``train_loss`` every step; AdamW with a StepLR stepped per optimizer step."""

    hparams: Any
    log: Any

    def _build(self, width: int) -> None:
        self.net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.GELU(), torch.nn.Linear(width, width),
                                       torch.nn.GELU(), torch.nn.Linear(width, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.net.parameters(), lr=self.hparams["lr"], weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class TinyModule(_Tiny, pl.LightningModule):
    def __init__(self, width: int = 16, lr: float = 1e-2, **extra_hparams: Any) -> None:
        super().__init__()
        self.save_hyperparameters()
        self._build(width)


def standalone_tiny_module() -> Any:
    """The same module for the standalone ``pytorch_lightning`` package (an optional install)."""
    import pytorch_lightning

    class StandaloneTinyModule(_Tiny, pytorch_lightning.LightningModule):
        def __init__(self, width: int = 16, lr: float = 1e-2) -> None:
            super().__init__()
            self.save_hyperparameters()
            self._build(width)

    return StandaloneTinyModule()


def loader(batch: int = 8) -> torch.utils.data.DataLoader[Any]:
    """BATCHES_PER_EPOCH batches of seeded random data, in a fixed order."""
    gen = torch.Generator().manual_seed(1234)
    n = batch * BATCHES_PER_EPOCH
    data = torch.utils.data.TensorDataset(torch.randn(n, 8, generator=gen), torch.randn(n, 1, generator=gen))
    return torch.utils.data.DataLoader(data, batch_size=batch, shuffle=False)


def model(seed: int = 0, **hparams: Any) -> TinyModule:
    pl.seed_everything(seed, verbose=False)
    return TinyModule(**hparams)


def trainer(dirpath: str | os.PathLike[str], max_steps: int, plugins: list[Any] | None = None,
            **checkpoint: Any) -> pl.Trainer:
    """A CPU Trainer without logger, progress bar or model summary, with one ModelCheckpoint(dirpath, **checkpoint)."""
    return pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, plugins=plugins or [],
                      callbacks=[ModelCheckpoint(dirpath=dirpath, **checkpoint)], logger=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(dirpath),
                      num_sanity_val_steps=0, deterministic=True)


def fit(tr: pl.Trainer, module: pl.LightningModule, ckpt_path: str | None = None) -> None:
    with warnings.catch_warnings():  # Lightning's advice on num_workers and logging intervals
        warnings.filterwarnings("ignore", message=".*(num_workers|log_every_n_steps|does not have many workers).*")
        tr.fit(module, loader(), ckpt_path=ckpt_path)


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Key paths where ``a`` and ``b`` differ: tensors by dtype, shape and torch.equal; containers by type and keys;
    everything else by ``==`` and type."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [path]
    if type(a) is not type(b):
        return [f"{path} ({type(a).__name__} vs {type(b).__name__})"]
    if isinstance(a, dict):
        if list(a) != list(b):
            return [f"{path} (keys {list(a)} vs {list(b)})"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}.{k}" if path else str(k))]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{path} (length {len(a)} vs {len(b)})"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}.{i}")]
    return [] if a == b else [f"{path} ({a!r} vs {b!r})"]


def ckpt_files(dirpath: str | os.PathLike[str]) -> list[str]:
    return sorted(p.name for p in Path(dirpath).glob("*.ckpt"))
