"""The rank processes of tests/test_dcp.py: a small model sharded with FSDP2 (gloo on CPU), trained with AdamW,
saved into a vault with ckptvault.distributed.VaultWriter and loaded back with VaultReader at another world size.

Each function runs on every rank (``torch.multiprocessing`` spawn) and writes what it saw under ``out`` (rank 0:
the full state dicts as ``.pt`` files; every rank: a JSON report), for the test process to check.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ckptvault.distributed import VaultLoadPlanner, VaultReader, VaultWriter

CHUNK_SIZE = 64 << 10
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class Net(nn.Module):
    """A frozen layer large enough for chunks of its own (unchanged by training: deduplicated across steps) and
    two trained layers; 129 and 5 rows, sharded unevenly on 2 and 3 ranks."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.frozen = nn.Linear(128, 129, bias=False)
        self.frozen.weight.requires_grad_(False)
        self.inner = nn.Linear(129, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.inner(self.frozen(x))))


def values(step: int) -> dict[str, Any]:
    """Non-tensor values of the state: an int, a nested dict with a string, a float and a list."""
    return {"step": step, "run": {"name": "dcp-test", "lr": 1e-2, "tags": ["a", "b"]}}


def placeholder_values() -> dict[str, Any]:
    return {"step": -1, "run": {"name": "", "lr": 0.0, "tags": []}}


def _init(rank: int, world: int, store: str) -> Any:
    torch.set_num_threads(1)  # 2 or 3 ranks on a 2-core machine
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    return init_device_mesh("cpu", (world,))


def _sharded(seed: int, mesh: Any) -> tuple[Net, torch.optim.Optimizer]:
    net = Net(seed)
    fully_shard(net, mesh=mesh)
    return net, torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2)


def _train(net: Net, opt: torch.optim.Optimizer, rank: int, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed + rank)
    for _ in range(steps):
        loss = net(torch.randn(8, 128, generator=gen)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def _state(net: Net, opt: torch.optim.Optimizer, extra: dict[str, Any]) -> dict[str, Any]:
    model, optim = get_state_dict(net, opt)
    return {"model": model, "optim": optim, "extra": extra}


def _save_full(net: Net, opt: torch.optim.Optimizer, rank: int, path: Path, extra: dict[str, Any]) -> None:
    model, optim = get_state_dict(net, opt, options=FULL)  # a collective: every rank calls it
    if rank == 0:
        torch.save({"model": model, "optim": optim, "extra": extra}, path)


def _failure(exc: CheckpointException) -> dict[str, Any]:
    return {"text": str(exc), "types": {str(r): type(e).__name__ for r, (e, _) in exc.failures.items()}}


def save_run(rank: int, world: int, store: str, url: str, out: str) -> None:
    """Train 2 steps, save step 1; train 1 more, save step 2 and the same state again as step 3; then a save of
    committed step 1 (StepExistsError) and a save of step 4 in which rank 1 holds a value that needs pickle."""
    mesh = _init(rank, world, store)
    folder = Path(out)
    net, opt = _sharded(0, mesh)
    _train(net, opt, rank, 2, seed=10)
    _save_full(net, opt, rank, folder / "expected_1.pt", values(1))
    timings = {}
    start = time.perf_counter()
    dcp.save(_state(net, opt, values(1)), storage_writer=VaultWriter(url, 1, chunk_size=CHUNK_SIZE))
    timings["save_1"] = time.perf_counter() - start
    _train(net, opt, rank, 1, seed=20)
    _save_full(net, opt, rank, folder / "expected_2.pt", values(2))
    dcp.save(_state(net, opt, values(2)), storage_writer=VaultWriter(url, 2, metrics={"loss": 0.5}))
    dcp.save(_state(net, opt, values(2)), storage_writer=VaultWriter(url, 3))
    report: dict[str, Any] = {"timings": timings}
    try:
        dcp.save(_state(net, opt, values(2)), storage_writer=VaultWriter(url, 1))
    except CheckpointException as exc:
        report["exists"] = _failure(exc)
    state = _state(net, opt, values(4))
    if rank == 1:
        state["extra"]["rank1_only"] = object()  # only rank 1 plans it, so only rank 1 fails in write_data
    try:
        dcp.save(state, storage_writer=VaultWriter(url, 4))
    except CheckpointException as exc:
        report["fault"] = _failure(exc)
    (folder / f"save_rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


def load_run(rank: int, world: int, store: str, url: str, out: str, step: int, vault_planner: bool) -> None:
    """A fresh (differently initialised) model and optimizer at world size ``world``, loaded from ``step``, then
    gathered whole by rank 0 into ``loaded_w<world>.pt``."""
    mesh = _init(rank, world, store)
    net, opt = _sharded(1, mesh)
    state = _state(net, opt, placeholder_values())
    planner = VaultLoadPlanner() if vault_planner else None
    dcp.load(state, storage_reader=VaultReader(url, step), planner=planner)
    set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _save_full(net, opt, rank, Path(out) / f"loaded_w{world}.pt", state["extra"])
    dist.barrier()
    dist.destroy_process_group()


def run_rank(rank: int, fn: Any, *args: Any) -> None:
    """Run ``fn(rank, *args)``, then end the process at once (exit code 0) if it returned.

    A rank that finishes normally would go on to interpreter finalization while gloo's worker threads may still
    be destroying the last collective's work (a barrier holding earlier broadcasts' tensors): their Python
    references, released without the GIL a finalizing interpreter no longer hands out, abort the process
    ("terminate called without an active exception"). Everything a rank reports is written before it returns,
    so nothing is lost by skipping finalization; an exception still propagates (exit code 1, with its traceback).
    """
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn: Any, world: int, args: tuple[Any, ...], tmp: Path, timeout: float = 120) -> None:
    """Run ``fn(rank, world, store, *args)`` on ``world`` spawned processes (through ``run_rank``); fail
    (killing them) after ``timeout`` seconds."""
    import torch.multiprocessing as mp

    store = tmp / f"store-{fn.__name__}-{world}-{os.getpid()}-{time.monotonic_ns()}"
    context = mp.spawn(run_rank, args=(fn, world, str(store), *args), nprocs=world, join=False)
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{fn.__name__} on {world} ranks did not finish in {timeout} s")
