"""Lightning's default checkpointing (TorchCheckpointIO: torch.save to local disk) against VaultCheckpointIO.

One Lightning ``Trainer.fit`` per run: an MLP of ``--layers`` x ``--width`` linear layers (~26M parameters at the
defaults) trained with AdamW on seeded random data, every layer (``scratch``) or only the last layer and the head
(``finetune``, the others frozen as a pretrained backbone), ``ModelCheckpoint(every_n_train_steps=--every,
save_top_k=-1)`` for ``--checkpoints`` checkpoints. Measured per run: the seconds the training loop waits inside
``save_checkpoint`` (for the vault: staging copy, bookkeeping, pointer file; its writes run in the background),
the plugin's ``teardown`` (the vault waits there for its last save), the whole ``fit`` wall time, and the bytes
on disk after the run (checkpoint files; vault plus pointer files). Per workload, runs alternate torch / vault,
``--runs`` times, plus one run without checkpoints; the table gives medians.

    .venv/bin/python bench/bench_lightning.py --runs 3          # ~20 min on 2 cores
    .venv/bin/python bench/bench_lightning.py --runs 1 --width 512 --checkpoints 3   # smoke check, seconds

Raw results: bench/out/lightning.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads must not spin against the save threads

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import TorchCheckpointIO  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckptvault.integrations.lightning import VaultCheckpointIO  # noqa: E402
from common import fresh_dir, machine  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
#: workload -> how many of the layers are frozen
WORKLOADS = {"scratch": lambda layers: 0, "finetune": lambda layers: layers - 1}
METRICS = ("fit_s", "wait_median_s", "wait_total_s", "teardown_s", "bytes")


class MLP(pl.LightningModule):
    """``layers`` linear layers of ``width`` and a head; the first ``frozen`` layers do not train (a pretrained
    backbone being fine-tuned)."""

    def __init__(self, width: int, layers: int, lr: float, frozen: int) -> None:
        super().__init__()
        self.lr = lr
        blocks: list[torch.nn.Module] = []
        for i in range(layers):
            linear = torch.nn.Linear(width, width)
            linear.requires_grad_(i >= frozen)
            blocks += [linear, torch.nn.GELU()]
        self.net = torch.nn.Sequential(*blocks, torch.nn.Linear(width, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr, weight_decay=0.01)


class _Timed:
    """Times each ``save_checkpoint`` (what the training loop waits) and ``teardown`` of the plugin it is mixed into."""

    waits: list[float]
    teardown_s: float

    def _start_timing(self) -> None:
        self.waits, self.teardown_s = [], 0.0

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        t0 = time.perf_counter()
        super().save_checkpoint(checkpoint, path, storage_options)  # type: ignore[misc]
        self.waits.append(time.perf_counter() - t0)

    def teardown(self) -> None:
        t0 = time.perf_counter()
        super().teardown()  # type: ignore[misc]
        self.teardown_s += time.perf_counter() - t0


class TimedTorchIO(_Timed, TorchCheckpointIO):
    """Lightning's default plugin, timed."""

    def __init__(self) -> None:
        self._start_timing()


class TimedVaultIO(_Timed, VaultCheckpointIO):
    """The vault plugin, timed."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self._start_timing()


def tree_bytes(*paths: Path) -> int:
    return sum(f.stat().st_size for p in paths if p.exists() for f in p.rglob("*") if f.is_file())


def one_run(kind: str, workload: str, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    ckpts, vault = fresh_dir(scratch / "ckpts"), fresh_dir(scratch / "vault")
    io: TimedTorchIO | TimedVaultIO | None = {"torch": TimedTorchIO, "vault": lambda: TimedVaultIO(str(vault)),
                                              "none": lambda: None}[kind]()
    pl.seed_everything(0, verbose=False)
    model = MLP(args.width, args.layers, args.lr, frozen=WORKLOADS[workload](args.layers))
    gen = torch.Generator().manual_seed(1)
    steps = args.every * args.checkpoints
    data = torch.utils.data.TensorDataset(torch.randn(args.batch * steps, args.width, generator=gen),
                                          torch.randn(args.batch * steps, 1, generator=gen))
    callbacks = [] if io is None else [ModelCheckpoint(dirpath=ckpts, every_n_train_steps=args.every, save_top_k=-1)]
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, plugins=[io] if io else [], logger=False,
                         callbacks=callbacks, enable_checkpointing=io is not None, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(scratch))
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t0 = time.perf_counter()
        trainer.fit(model, loader)
        fit_s = time.perf_counter() - t0
    waits = io.waits if io is not None else []
    result = {"kind": kind, "workload": workload, "fit_s": fit_s, "checkpoints": len(waits), "waits_s": waits,
              "wait_median_s": statistics.median(waits) if waits else 0.0, "wait_total_s": sum(waits),
              "teardown_s": getattr(io, "teardown_s", 0.0), "bytes": tree_bytes(ckpts, vault)}
    if isinstance(io, TimedVaultIO):
        result["steps"] = io.manager.steps()
        io.teardown()
    print(f"{workload:8} {kind:5} fit {fit_s:6.1f} s  checkpoints {len(waits):2}  wait/ckpt {result['wait_median_s']:.3f} s  "
          f"teardown {result['teardown_s']:.2f} s  stored {result['bytes'] / 2**20:8.1f} MiB", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--width", type=int, default=2560)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--every", type=int, default=10, help="optimizer steps between checkpoints")
    parser.add_argument("--checkpoints", type=int, default=10)
    parser.add_argument("--workloads", default="scratch,finetune",
                        help="scratch: every layer trains; finetune: all but the last layer and the head frozen")
    args = parser.parse_args()
    scratch = OUT / "lightning"
    params = args.layers * (args.width * args.width + args.width) + args.width + 1
    print(f"MLP {args.layers} x {args.width}: {params / 1e6:.1f}M parameters, {args.checkpoints} checkpoints every "
          f"{args.every} steps, {args.runs} runs (the run without checkpoints: once)", flush=True)
    runs = []
    for workload in args.workloads.split(","):
        for i in range(args.runs):
            for kind in ("torch", "vault", "none") if i == 0 else ("torch", "vault"):
                runs.append(one_run(kind, workload, args, scratch))
    summary = {w: {k: {m: statistics.median(r[m] for r in runs if r["kind"] == k and r["workload"] == w)
                       for m in METRICS} for k in ("torch", "vault", "none")} for w in args.workloads.split(",")}
    for workload, by_kind in summary.items():
        torch_, vault = by_kind["torch"], by_kind["vault"]
        print(f"{workload}: vault / torch: bytes {vault['bytes'] / torch_['bytes']:.3f}x, wait per checkpoint "
              f"{vault['wait_median_s'] / torch_['wait_median_s']:.3f}x, fit {vault['fit_s'] / torch_['fit_s']:.3f}x")
    OUT.mkdir(exist_ok=True)
    record = {"args": vars(args), "parameters": params, "machine": machine(), "runs": runs, "summary": summary}
    (OUT / "lightning.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
