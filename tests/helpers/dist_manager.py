"""The rank processes of tests/test_distributed_manager.py: CheckpointManager in a torch.distributed job.

A small FSDP2 model (tests/helpers/dcp_worker.py's Net, gloo on CPU) trained with AdamW on batches drawn from
torch's global generator, seeded differently on every rank: a resume that gave every rank one rank's RNG state (the
pitfall of DCP, which keeps one copy of every plain tensor) would train on other batches and not match. Each
function runs on every rank and leaves what it saw under ``out`` for the test process to check (rank 0: full state
dicts as ``.pt``; every rank: a JSON report).
"""

from __future__ import annotations

import copy
import json
import os
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import ckptvault
from ckptvault.errors import KeyMismatchError, RankFailedError, StepExistsError, StorageFullError, UnsharedVaultError
from helpers.dcp_worker import FULL, Net, _init, _sharded, run_rank


def _train(net: Net, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        loss = net(torch.randn(8, 128)).square().mean()  # torch's global generator: per-rank state
        loss.backward()
        opt.step()
        opt.zero_grad()


def _state(net: Net, opt: torch.optim.Optimizer, step: int, loader: int) -> dict[str, Any]:
    model, optim = get_state_dict(net, opt)
    return {"model": model, "optim": optim, "step": step, "rng": ckptvault.rng_state(), "loader": {"position": loader}}


def _full(net: Net, opt: torch.optim.Optimizer) -> dict[str, Any]:
    model, optim = get_state_dict(net, opt, options=FULL)  # a collective; at one rank, views of the live tensors
    return copy.deepcopy({"model": model, "optim": optim})


def _manager(url: str, async_save: bool, **options: Any) -> ckptvault.CheckpointManager:
    return ckptvault.CheckpointManager(url, async_save=async_save, chunk_size=64 << 10,
                                       distributed=ckptvault.DistributedOptions(**options))


def train_and_save(rank: int, world: int, store: str, url: str, out: str, async_save: bool) -> None:
    """Train 2 steps, save step 2; train 1, save step 3; train 2 more (the uninterrupted run: rank 0 writes
    ``expected_3.pt`` and ``final.pt``)."""
    mesh = _init(rank, world, store)
    net, opt = _sharded(0, mesh)  # seeds torch's generator with 0 on every rank, to build the same model
    torch.manual_seed(100 + rank)
    folder = Path(out)
    report: dict[str, Any] = {}
    with _manager(url, async_save, per_rank=("loader",)) as mgr:
        report["distributed"] = mgr.distributed
        _train(net, opt, 2)
        handle = mgr.save(2, _state(net, opt, 2, loader=10 * rank), metrics={"loss": 1.0})
        _train(net, opt, 1)
        mgr.save(3, _state(net, opt, 3, loader=10 * rank + 1))
        expected = _full(net, opt)
        mgr.wait()
        report["info_2"] = handle.wait().step if handle.wait() is not None else None
        report["steps"] = mgr.steps()
        cache = mgr._collective._keyframe_cache  # keyframe 2's chunks of this rank, kept for step 3's deltas
        report["cached_bytes"] = 0 if cache is None else cache.nbytes
        try:
            mgr.save(3, _state(net, opt, 3, loader=0))
            mgr.wait()
        except StepExistsError as exc:
            report["exists"] = str(exc)
        _train(net, opt, 2)
        final = _full(net, opt)
    if rank == 0:
        torch.save(expected, folder / "expected_3.pt")
        torch.save(final, folder / "final.pt")
    (folder / f"save_rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


def save_once(rank: int, world: int, store: str, url: str, out: str) -> None:
    """Train 1 step, save it as step 3 (rank 0 writes the full state as ``expected_3.pt``)."""
    mesh = _init(rank, world, store)
    net, opt = _sharded(0, mesh)
    torch.manual_seed(100 + rank)
    _train(net, opt, 1)
    with _manager(url, False, per_rank=("loader",)) as mgr:
        mgr.save(3, _state(net, opt, 3, loader=10 * rank + 1))
        expected = _full(net, opt)
    if rank == 0:
        torch.save(expected, Path(out) / "expected_3.pt")
    dist.barrier()
    dist.destroy_process_group()


def resume(rank: int, world: int, store: str, url: str, out: str, train: int) -> None:
    """A fresh model and optimizer restored from step 3 at this world size: rank 0 writes the restored full state
    (``restored_w<world>.pt``) and, after ``train`` more steps, ``resumed_w<world>.pt``; every rank reports its
    per-rank values."""
    mesh = _init(rank, world, store)
    net, opt = _sharded(1, mesh)
    torch.manual_seed(999)  # replaced by the restored RNG state
    _train(net, opt, 1)  # an optimizer with state, so that the restore replaces rather than creates it
    folder = Path(out)
    with _manager(url, False) as mgr:
        strict_error = None
        try:  # a per-rank value the save holds none of for ranks >= its world size: all ranks stop, none hangs
            mgr.restore(3, into={"loader": {"position": -1}})
        except (KeyMismatchError, RankFailedError) as exc:
            strict_error = f"{type(exc).__name__}: {exc}"
        model, optim = get_state_dict(net, opt)
        state = {"model": model, "optim": optim, "step": -1}
        mgr.restore(3, into=state)
        set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        extra = mgr.restore(3, keys=["rng", "loader"], strict=False)  # ranks the save did not have get none
        if "rng" in extra:
            ckptvault.set_rng_state(extra["rng"])
        restored = _full(net, opt)
        _train(net, opt, train)
        resumed = _full(net, opt)
    report = {"step": state["step"], "loader": extra.get("loader"), "strict_error": strict_error}
    if rank == 0:
        torch.save(restored, folder / f"restored_w{world}.pt")
        torch.save(resumed, folder / f"resumed_w{world}.pt")
    (folder / f"resume_w{world}_rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


def fail_during_write(rank: int, world: int, store: str, url: str, out: str, how: str, timeout: float) -> None:
    """Save step 5, in which rank 1 fails while writing its chunks: ``how="raise"`` (its store raises),
    ``"kill"`` (SIGKILL of its own process) or ``"hang"`` (it sleeps past the timeout, then exits). The survivors
    report the error they got and how long it took."""
    import time

    mesh = _init(rank, world, store)
    net, opt = _sharded(0, mesh)
    torch.manual_seed(100 + rank)
    _train(net, opt, 1)
    mgr = _manager(url, False, timeout=timeout)
    if rank == 1:
        _fail_chunk_writes(mgr, how)
    report: dict[str, Any] = {}
    start = time.monotonic()
    try:
        mgr.save(5, _state(net, opt, 5, loader=0))
        report["error"] = None
    except RankFailedError as exc:
        report.update(error=type(exc).__name__, text=str(exc), failures={str(k): v for k, v in exc.failures.items()})
    report["seconds"] = time.monotonic() - start
    report["steps"] = mgr.steps()
    Path(out, f"fail_{how}_rank{rank}.json").write_text(json.dumps(report))
    os._exit(0)  # the job's groups are broken now; nothing else to tear down cleanly


def _fail_chunk_writes(mgr: ckptvault.CheckpointManager, how: str) -> None:
    """Rank 1's chunk writes (after the shared-vault probe, which uses plain puts) raise ENOSPC, or kill it."""

    def failing_batch() -> Any:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "hang":  # alive (its heartbeat goes on) but stuck far past the others' timeout
            import time

            time.sleep(8)
            os._exit(3)
        raise StorageFullError("No space left on device (injected on rank 1)")

    mgr.vault.store.write_batch = failing_batch  # type: ignore[method-assign]


def unshared(rank: int, world: int, store: str, base: str, out: str) -> None:
    """Every rank names a vault directory of its own (as a node-local path would): the first save is refused on
    every rank before anything is written."""
    _init(rank, world, store)
    url = str(Path(base) / f"node{rank}")
    report: dict[str, Any] = {}
    with _manager(url, False) as mgr:
        try:
            mgr.save(1, {"w": torch.ones(4) * rank})
        except UnsharedVaultError as exc:
            report = {"error": str(exc), "ranks": {str(k): v for k, v in exc.ranks.items()}}
    dist.barrier()  # rank 0 deletes its probe after the gather: list only once every rank is past it
    report["files"] = sorted(str(p.relative_to(base)) for p in Path(base).rglob("*") if p.is_file())
    Path(out, f"unshared_rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


def spawn_independent(fn: Any, world: int, args: tuple[Any, ...], tmp: Path, timeout: float = 120) -> list[int | None]:
    """Run ``fn(rank, world, store, *args)`` on ``world`` processes and wait for each on its own (unlike
    ``mp.spawn``, a rank that dies does not stop the others); returns the exit codes, killing what is left after
    ``timeout`` seconds (its code: None)."""
    import multiprocessing
    import time

    context = multiprocessing.get_context("spawn")
    store = tmp / f"store-{fn.__name__}-{world}-{os.getpid()}-{time.monotonic_ns()}"
    processes = [context.Process(target=run_rank, args=(rank, fn, world, str(store), *args)) for rank in range(world)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout
    codes: list[int | None] = []
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()
            codes.append(None)
        else:
            codes.append(process.exitcode)
    return codes


def plugin_async(rank: int, world: int, store: str, url: str, out: str) -> None:
    """``dcp.async_save`` with one VaultWriter (DCP's AsyncStager) for steps 1 and 2: training changes the model as
    soon as each call returns, yet each step holds the state at its call (rank 0 writes ``async_<step>.pt``); every
    rank reports whether its staging buffers were reused by the second save."""
    import torch.distributed.checkpoint as dcp

    from ckptvault.distributed import VaultWriter

    mesh = _init(rank, world, store)
    net, opt = _sharded(0, mesh)
    torch.manual_seed(100 + rank)
    _train(net, opt, 1)
    writer = VaultWriter(url, 1, chunk_size=64 << 10)
    group = dist.new_group(backend="gloo")  # the save's collectives run beside training's: a group of their own
    pointers = []
    for step in (1, 2):
        expected = _full(net, opt)
        model, optim = get_state_dict(net, opt)
        future = dcp.async_save({"model": model, "optim": optim}, storage_writer=writer, checkpoint_id=step,
                                process_group=group)
        pointers.append(sorted(buffer.data_ptr() for buffer in writer._staging._buffers.values()))
        _train(net, opt, 1)  # changes the live parameters while the save is in flight
        future.result()
        if rank == 0:
            torch.save(expected, Path(out) / f"async_{step}.pt")
    report = {"reused": pointers[0] == pointers[1], "buffers": len(pointers[0])}
    Path(out, f"async_rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


def lonely(rank: int, world: int, store: str, url: str, out: str) -> None:
    """Only rank 0 makes a manager (the rank-0-only saving of many DDP scripts): it fails after the timeout naming
    rank 1, instead of hanging; with ``enabled=False`` rank 0 saves alone."""
    _init(rank, world, store)
    report: dict[str, Any] = {}
    if rank == 0:
        try:
            _manager(url, False, timeout=2.0)
        except RankFailedError as exc:
            report = {"text": str(exc), "failures": {str(k): v for k, v in exc.failures.items()}}
        with _manager(url, False, enabled=False) as mgr:
            mgr.save(1, {"w": torch.ones(3)})
            report["alone"] = [mgr.distributed, mgr.steps()]
    Path(out, f"lonely_rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


def retention_fails(rank: int, world: int, store: str, url: str, out: str) -> None:
    """Retention (rank 0 runs it after each commit) fails with an unexpected error: what each rank's ``wait`` raises
    after an asynchronous save, and what the vault holds after."""
    import ckptvault.manager

    def broken(vault: object, retention: object, step: int, exclusive: bool = False, pacer: object = None) -> None:
        raise RuntimeError("retention bug")

    ckptvault.manager.apply_retention = broken  # type: ignore[assignment]
    mesh = _init(rank, world, store)
    net, opt = _sharded(0, mesh)
    report: dict[str, Any] = {"error": None}
    with ckptvault.CheckpointManager(url, chunk_size=64 << 10, retention=ckptvault.KeepLast(1)) as mgr:
        mgr.save(1, _state(net, opt, 1, loader=rank))
        try:
            mgr.wait()
        except Exception as exc:  # noqa: BLE001 - reported for the test process to check
            report = {"error": type(exc).__name__, "text": str(exc), "cause": type(exc.__cause__).__name__}
        report["steps"] = mgr.steps()
    Path(out, f"retention_rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


LOSSY_RULES = {"optim.state.*.exp_avg_sq": "bf16", "optim.state.*.exp_avg": "int8-block:64",
               "model.inner.weight": "residual-int8"}


def lossy_save(rank: int, world: int, store: str, url: str, out: str) -> None:
    """Steps 1 (the keyframe) and 2 saved with lossy rules on sharded tensors; rank 0 writes the exact full states
    (``lossy_<step>.pt``)."""
    mesh = _init(rank, world, store)
    net, opt = _sharded(0, mesh)
    torch.manual_seed(100 + rank)
    with ckptvault.CheckpointManager(url, async_save=False, chunk_size=64 << 10, codec_rules=LOSSY_RULES) as mgr:
        for step in (1, 2):
            _train(net, opt, 1)
            exact = _full(net, opt)
            mgr.save(step, _state(net, opt, step, loader=0))
            if rank == 0:
                torch.save(exact, Path(out) / f"lossy_{step}.pt")
    dist.barrier()
    dist.destroy_process_group()


def lossy_load(rank: int, world: int, store: str, url: str, out: str) -> None:
    """Step 2 restored at this world size into a fresh FSDP2 model; rank 0 writes the full state it got."""
    mesh = _init(rank, world, store)
    net, opt = _sharded(1, mesh)
    _train(net, opt, 1)
    with _manager(url, False) as mgr:
        model, optim = get_state_dict(net, opt)
        state = {"model": model, "optim": optim}
        mgr.restore(2, into=state)
        set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        loaded = _full(net, opt)
    if rank == 0:
        torch.save(loaded, Path(out) / f"lossy_loaded_w{world}.pt")
    dist.barrier()
    dist.destroy_process_group()


def lossy_split(rank: int, world: int, store: str, url: str, out: str) -> None:
    """An array whose rank-0 shard int8 would flush (one large value per block of tiny ones) and whose rank-1 shard
    it would not: the ranks agree to store both shards exactly."""
    from torch.distributed.tensor import DTensor, Shard

    mesh = _init(rank, world, store)
    local = torch.full((4, 64), 1e-3)
    if rank == 0:
        local[:, 0] = 1e3
    x = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    y = DTensor.from_local(torch.linspace(-1, 1, 256).reshape(4, 64) + rank, mesh, [Shard(0)], run_check=False)
    with ckptvault.CheckpointManager(url, async_save=False, codec_rules={"x": "int8-block:64", "y": "int8-block:64"}) as mgr:
        mgr.save(1, {"x": x, "y": y})
    dist.barrier()
    dist.destroy_process_group()
