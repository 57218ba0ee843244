"""What a checkpoint of a GPU-resident training state costs the training loop (needs a CUDA device).

    python bench/bench_cuda.py --layers 8 --width 4096 --runs 3

The state is an MLP of ``--layers`` square ``--width`` linear layers with AdamW, all on the GPU
(8 x 4096: 134M parameters, 1.6 GB with both moments). Between saves one AdamW step with a random
gradient changes every value, as training does. Per run, one process measures, each into a fresh
directory under ``--dir``:

* the time ``save()`` blocks the caller and the time until durable, for ckptvault's asynchronous save
  (a new manager: its first save allocates the pinned staging buffer; then a second save, an incremental
  one after a training step, with the buffer reused), its synchronous save, ``torch.save`` (the state
  copied to host memory by torch, then written), and DCP's ``save`` and ``async_save`` (a single-process
  gloo group);
* restoring into the live GPU state: ckptvault ``restore(into=...)``, ``torch.load`` + copy, DCP ``load``;
  and, to tell reading from copying to the GPU, ckptvault's restore into new CPU tensors and then into those.

Every save is durable when timed as such (fsync). Reads come from the page cache (the runs do not drop it).
Medians over ``--runs``. Prints a markdown table. Results: docs/benchmarks/gpu.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from ckptvault import CheckpointManager  # noqa: E402
from common import fresh_dir, machine  # noqa: E402
from peers import dcp_load, dcp_save, fsync_dir, torch_save  # noqa: E402


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class GpuState:
    def __init__(self, layers: int, width: int, device: str) -> None:
        torch.manual_seed(0)
        self.device = device
        self.model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.step()

    def step(self) -> None:
        """One AdamW step with a random gradient: every weight and moment changes in place."""
        for p in self.model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        self.opt.step()
        synchronize()

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}

    def nbytes(self) -> int:
        leaves = [*self.model.state_dict().values()]
        leaves += [t for s in self.opt.state_dict()["state"].values() for t in s.values()]
        return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def clock(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def ckptvault_async(gpu: GpuState, dest: Path) -> dict[str, float]:
    out = {}
    with CheckpointManager(dest) as mgr:
        for label, step in (("first", 1), ("second", 2)):
            if step == 2:
                gpu.step()
            t0 = time.perf_counter()
            handle = mgr.save(step, gpu.state())
            out[f"ckptvault async, {label} save: blocked"] = time.perf_counter() - t0
            handle.wait()
            out[f"ckptvault async, {label} save: until durable"] = time.perf_counter() - t0
    return out


def ckptvault_sync(gpu: GpuState, dest: Path) -> dict[str, float]:
    with CheckpointManager(dest, async_save=False) as mgr:
        seconds, _ = clock(lambda: mgr.save(1, gpu.state()))
    return {"ckptvault sync save": seconds}


def dcp_async(gpu: GpuState, dest: Path) -> dict[str, float]:
    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    future = dcp.async_save(gpu.state(), storage_writer=dcp.FileSystemWriter(str(dest), sync_files=True))
    blocked = time.perf_counter() - t0
    future.result()
    fsync_dir(dest)
    return {"DCP async_save: blocked": blocked, "DCP async_save: until durable": time.perf_counter() - t0}


def restores(gpu: GpuState, vault: Path, torch_dir: Path, dcp_dir: Path) -> dict[str, float]:
    state = gpu.state()
    out = {}
    with CheckpointManager(vault) as mgr:
        out["restore: ckptvault into GPU state"], _ = clock(lambda: (mgr.restore(1, into=state), synchronize()))
        out["restore: ckptvault, new CPU tensors (no GPU copy)"], host = clock(lambda: mgr.restore(1))
        out["restore: ckptvault into those CPU tensors"], _ = clock(lambda: mgr.restore(1, into=host))

    def torch_load() -> None:
        loaded = torch.load(torch_dir / "state.pt", weights_only=True, map_location=gpu.device)
        gpu.model.load_state_dict(loaded["model"])
        gpu.opt.load_state_dict(loaded["optimizer"])
        synchronize()

    out["restore: torch.load (to GPU) + load_state_dict"], _ = clock(torch_load)
    out["restore: DCP load into GPU state"], _ = clock(lambda: (dcp_load(dcp_dir, state), synchronize()))
    return out


def one_run(gpu: GpuState, base: Path) -> dict[str, float]:
    measured = ckptvault_async(gpu, base / "vault-async")
    measured |= ckptvault_sync(gpu, base / "vault-sync")
    gpu.step()
    measured["torch.save"], _ = clock(lambda: torch_save(gpu.state(), base / "torch"))
    measured["DCP save"], _ = clock(lambda: dcp_save(gpu.state(), base / "dcp"))
    measured |= dcp_async(gpu, base / "dcp-async")
    # restore what the synchronous vault, torch.save and DCP hold (each one full state)
    return measured | restores(gpu, base / "vault-sync", base / "torch", base / "dcp")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--device", default="cuda", help="cpu: try the script out on a machine without a GPU")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "ckptvault-bench-cuda")
    args = parser.parse_args()
    import torch.distributed as dist

    scratch = fresh_dir(args.dir)
    scratch.mkdir(parents=True)
    dist.init_process_group("gloo", init_method=f"file://{scratch / 'pg-store'}", rank=0, world_size=1)
    gpu = GpuState(args.layers, args.width, args.device)
    name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(f"machine: {machine()}; device: {name}; state {gpu.nbytes() / 1e9:.2f} GB", flush=True)
    results: dict[str, list[float]] = {}
    for run in range(args.runs):
        measured = one_run(gpu, fresh_dir(scratch / f"run{run}"))
        for name, seconds in measured.items():
            results.setdefault(name, []).append(seconds)
        print(f"run {run}: " + ", ".join(f"{k} {v:.3f}" for k, v in measured.items()), flush=True)
    print("\n| operation | median s | runs |\n|---|---:|---|")
    for name, values in results.items():
        print(f"| {name} | {statistics.median(values):.3f} | {', '.join(f'{v:.3f}' for v in values)} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
