"""Distributed-checkpoint benchmark (docs/benchmarks/distributed.md): ckptvault's DCP storage plugin
(``ckptvault.distributed.VaultWriter`` / ``VaultReader``) against torch.distributed.checkpoint's own
``FileSystemWriter`` / ``FileSystemReader``, on W1 sharded with FSDP2 over gloo on CPU.

    .venv/bin/python bench/bench_distributed.py --worlds 2,4 --runs 3 --size full
    .venv/bin/python bench/bench_distributed.py --worlds 2,3 --runs 1 --size tiny     # smoke check, ~1.5 min

Every rank (``torch.multiprocessing`` spawn, one torch thread each) builds the W1 GPT of ``workloads.SIZES``
(seeded, so every rank builds the same model), shards every block and the root with ``fully_shard``, and trains it
with AdamW at W1's learning rate on ``--batch`` x ``--seq`` tokens per rank (``--warm-steps`` real steps first,
so the Adam moments are not zero). The state saved is ``{"model", "optim"}`` of ``get_state_dict`` plus the step.
Per world size and run:

1. a training step, then the keyframe: ``dcp.save`` with ``VaultWriter`` into a new vault (step 1) and with
   ``FileSystemWriter`` (``sync_files=True``) into a new directory; wall time from a barrier to ``dcp.save``'s
   return, the slowest rank's; stored bytes (the vault's ``stored_bytes`` of the step, the directory's size);
2. a training step, then "one step later": step 2 into the same vault through the same writer (``checkpoint_id``;
   ``added_bytes``: what the step added, a delta where VaultWriter stores them) and a second full DCP directory;
3. a training step, then ``dcp.async_save`` with each writer: the vault's into one vault for all runs through one
   writer per rank (it keeps its staging buffers from one save to the next; its first async save, a keyframe with
   cold staging, is a warm-up reported apart), DCP's into a new directory: the time ``async_save`` blocks, and the
   time until its future is done (the slowest rank's of each).

Each phase starts with a tiny save and load with each writer and reader (the process's one-time costs: imports,
thread pools), reported apart. The pair of each measurement runs in the order vault-DCP on even runs, DCP-vault on
odd ones. The last run's steps 1 and 2 are then loaded at another world size (saved at 2: loaded at 4, and so on,
cyclic over ``--worlds``): ``dcp.load`` with ``VaultReader`` against ``FileSystemReader`` into the state dict of a
freshly built FSDP2 model and optimizer, each checkpoint's files first dropped from the page cache with
``POSIX_FADV_DONTNEED`` (no root needed; the fraction of pages still cached is reported), times again the slowest
rank's. The first load of each checkpoint is checked bit for bit against the other reader's.
Medians over ``--runs``. On a 2-core machine the ranks share the cores (the processes are not pinned).
Scratch: ``bench/out/distributed/`` (up to about 12 GB for W1 full at world sizes 2 and 4; deleted as the runs go).
Results: stdout (markdown) and ``--out`` (default ``bench/out/distributed-results.md``) with a ``.json`` beside it.
"""

from __future__ import annotations

import argparse
import inspect
import json
import mmap
import os
import re
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads must not spin against the ranks measured
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import ckptvault  # noqa: E402
from ckptvault import CheckpointManager  # noqa: E402
from ckptvault.demo.data import stdlib_bytes  # noqa: E402
from ckptvault.demo.model import GPT  # noqa: E402
from ckptvault.distributed import VaultReader, VaultWriter  # noqa: E402
from common import machine  # noqa: E402
from workloads import OUT_DIR, SIZES, W1_LR, train_step  # noqa: E402

WORK = OUT_DIR / "distributed"
#: (row of ours, row of the peer, target ratio): what the page checks
TARGETS = [
    ("keyframe: stored bytes", "keyframe: DCP bytes", 0.85),
    ("one step later: added bytes", "one step later: DCP bytes", 0.65),
    ("keyframe: save s", "keyframe: DCP save s", 1.0),
    ("one step later: save s", "one step later: DCP save s", None),
    ("async: blocked s", "async: DCP blocked s", 0.5),
    ("async: until done s", "async: DCP until done s", None),
    ("async: added bytes", "async: DCP bytes", None),
    ("async, first save (cold staging, keyframe): blocked s", "async, first save (cold staging, keyframe): DCP blocked s",
     None),
    ("async, first save (cold staging, keyframe): until done s",
     "async, first save (cold staging, keyframe): DCP until done s", None),
]
RESTORE_TARGET = 1.2
#: parts of the state whose stored bytes are reported apart (by key path)
GROUPS = ("model", "exp_avg", "exp_avg_sq", "other")


# -- in every rank ---------------------------------------------------------------------------------------------
class Trainer:
    """The W1 GPT + AdamW sharded with FSDP2 over every rank; ``step()`` is one real (data-parallel) step."""

    def __init__(self, size: str, mesh: Any, seed: int, batch_size: int, seq_len: int) -> None:
        torch.manual_seed(seed)
        self.model = GPT(SIZES[size])
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=W1_LR)
        self.data, self.gen = stdlib_bytes(), torch.Generator().manual_seed(seed * 1000 + dist.get_rank())
        self.batch_size, self.seq_len = batch_size, min(seq_len, SIZES[size].seq_len)
        self.n = 0

    def step(self) -> None:
        train_step(self.model, self.opt, self.data, self.batch_size, self.seq_len, self.gen)
        self.n += 1

    def state(self) -> dict[str, Any]:
        """The sharded state DCP saves (a collective)."""
        model, optim = get_state_dict(self.model, self.opt)
        return {"model": model, "optim": optim, "step": self.n}


def slowest(*values: float) -> list[float]:
    """Every rank's ``values``, the maximum over ranks of each (a collective)."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def total(value: float) -> float:
    """The sum of every rank's ``value`` (a collective)."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.item()


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """(seconds from a barrier to ``fn``'s return, the slowest rank's; CPU seconds of every rank's process, all their
    threads, summed)."""
    dist.barrier()
    t0, cpu0 = time.perf_counter(), time.process_time()
    fn()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return slowest(wall)[0], total(cpu)


def timed_async(fn: Callable[[], Any]) -> tuple[float, float, float]:
    """(seconds ``fn`` blocked, seconds until the future it returned was done), the slowest rank's of each, and the
    CPU seconds until done of every rank summed. Nothing else collective runs while the save's thread works: the
    main thread waits for it first."""
    dist.barrier()
    t0, cpu0 = time.perf_counter(), time.process_time()
    pending = fn()
    blocked = time.perf_counter() - t0
    (pending.upload_completion if hasattr(pending, "upload_completion") else pending).result()
    done, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return slowest(blocked, done)[0], slowest(blocked, done)[1], total(cpu)


def on_rank0(fn: Callable[[], Any]) -> Any:
    """``fn()`` on rank 0 only, every rank waiting for it."""
    out = fn() if dist.get_rank() == 0 else None
    dist.barrier()
    return out


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (their sizes, as ls shows them)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def vault_info(url: Path, step: int) -> dict[str, int]:
    """The sizes of a committed step, read by one rank: a manager that does not take part in the job."""
    options: dict[str, Any] = {"async_save": False}
    if hasattr(ckptvault, "DistributedOptions"):  # else a manager made in a process group joins it: a collective
        options["distributed"] = ckptvault.DistributedOptions(enabled=False)
    with CheckpointManager(url, **options) as mgr:
        info = mgr.info(step)
    out = {"stored": info.stored_bytes, "added": info.added_bytes, "logical": info.logical_bytes,
           "files": tree_bytes(url)}
    for tensor in info.tensors:  # stored bytes by part of the state, to see where a delta's bytes go
        group = next(g for g in GROUPS if g == "other" or g in tensor.path.split(".")[:3] + tensor.path.split(".")[-1:])
        out[f"stored {group}"] = out.get(f"stored {group}", 0) + tensor.stored_bytes
        out[f"logical {group}"] = out.get(f"logical {group}", 0) + tensor.nbytes
    return out


def pair(run: int, jobs: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Run both jobs, the vault's first on even runs; their results by name."""
    names = list(jobs) if run % 2 == 0 else list(jobs)[::-1]
    return {name: jobs[name]() for name in names}


def remove(*paths: Path) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def vault_save(state: Any, writer: VaultWriter, step: int) -> None:
    dcp.save(state, storage_writer=writer, checkpoint_id=step)


def dcp_save(state: Any, folder: Path) -> None:
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder), sync_files=True))


def vault_async(state: Any, writer: VaultWriter, step: int) -> Any:
    return dcp.async_save(state, storage_writer=writer, checkpoint_id=step)


def dcp_async(state: Any, folder: Path) -> Any:
    return dcp.async_save(state, storage_writer=dcp.FileSystemWriter(str(folder), sync_files=True))


def warm_up(work: Path, rows: dict[str, list[float]]) -> None:
    """One tiny save with each writer and its load: the process's one-time costs (imports, thread pools), timed
    apart from the measurements."""
    state = {"warm": torch.arange(4096, dtype=torch.float32) + dist.get_rank()}
    on_rank0(partial(remove, work / "warm-vault", work / "warm-dcp"))
    on_rank0(partial(work.mkdir, parents=True, exist_ok=True))
    for name, save, load in (
            ("ckptvault", partial(vault_save, state, VaultWriter(work / "warm-vault", 1), 1),
             partial(dcp.load, state, storage_reader=VaultReader(work / "warm-vault", 1))),
            ("DCP", partial(dcp_save, state, work / "warm-dcp"),
             partial(dcp.load, state, storage_reader=dcp.FileSystemReader(str(work / "warm-dcp"))))):
        rows.setdefault(f"warm-up: first {name} save s (16 KB state)", []).append(timed(save)[0])
        rows.setdefault(f"warm-up: first {name} load s (16 KB state)", []).append(timed(load)[0])
    on_rank0(partial(remove, work / "warm-vault", work / "warm-dcp"))


def save_phase(job: dict[str, Any], mesh: Any) -> None:
    """Keyframe and one-step-later saves into a new vault per run (one VaultWriter per rank and vault, as a training
    loop keeps it); async saves into one vault for all runs (the writer keeps its staging buffers from one save to the
    next: its first async save, a keyframe with cold staging, is a warm-up reported apart)."""
    runs, work = job["runs"], Path(job["work"])
    on_rank0(partial(work.mkdir, parents=True, exist_ok=True))
    trainer = Trainer(job["size"], mesh, 0, job["batch"], job["seq"])
    for _ in range(job["warm_steps"]):
        trainer.step()
    rows: dict[str, list[float]] = {}
    notes: dict[str, Any] = {}
    warm_up(work, rows)

    def add(name: str, value: float) -> None:
        rows.setdefault(name, []).append(value)

    def train() -> dict[str, Any]:
        t0 = time.perf_counter()
        trainer.step()
        add("training step s", slowest(time.perf_counter() - t0)[0])
        return trainer.state()

    def async_pair(run: int, step: int, folder: Path, prefix: str) -> None:
        state = train()
        times = pair(run, {"vault": partial(timed_async, partial(vault_async, state, async_writer, step)),
                           "dcp": partial(timed_async, partial(dcp_async, state, folder))})
        add(f"{prefix}: blocked s", times["vault"][0])
        add(f"{prefix}: until done s", times["vault"][1])
        add(f"{prefix}: DCP blocked s", times["dcp"][0])
        add(f"{prefix}: DCP until done s", times["dcp"][1])
        add(f"{prefix}: CPU s (all ranks)", times["vault"][2])
        add(f"{prefix}: DCP CPU s (all ranks)", times["dcp"][2])
        if dist.get_rank() == 0:
            add(f"{prefix}: added bytes", vault_info(async_vault, step)["added"])
            add(f"{prefix}: DCP bytes", tree_bytes(folder))
        on_rank0(partial(remove, folder))

    async_vault = work / "vault-async"
    on_rank0(partial(remove, async_vault))
    async_writer = VaultWriter(async_vault, 1)
    async_pair(0, 1, work / "dcp-async-first", "async, first save (cold staging, keyframe)")
    for run in range(runs):
        vault, dirs = work / f"vault-{run}", [work / f"dcp-{run}-{k}" for k in (1, 2)]
        on_rank0(partial(remove, vault, *dirs))
        writer = VaultWriter(vault, 1)
        for k, (label, step) in enumerate((("keyframe", 1), ("one step later", 2))):
            state = train()
            times = pair(run, {"vault": partial(timed, partial(vault_save, state, writer, step)),
                               "dcp": partial(timed, partial(dcp_save, state, dirs[k]))})
            del state
            add(f"{label}: save s", times["vault"][0])
            add(f"{label}: DCP save s", times["dcp"][0])
            add(f"{label}: save CPU s (all ranks)", times["vault"][1])
            add(f"{label}: DCP save CPU s (all ranks)", times["dcp"][1])
            if dist.get_rank() == 0:
                info = vault_info(vault, step)
                add(f"{label}: stored bytes", info["stored"])
                add(f"{label}: added bytes", info["added"])
                add(f"{label}: vault files bytes", info["files"])
                add(f"{label}: DCP bytes", tree_bytes(dirs[k]))
                for group in GROUPS:
                    if f"stored {group}" in info:
                        add(f"{label}: stored bytes of {group} (of {info[f'logical {group}'] / 1e6:,.1f} MB)",
                            info[f"stored {group}"])
                notes["logical_bytes"] = info["logical"]
        writer.close()
        async_pair(run, run + 2, work / f"dcp-async-{run}", "async")
        if run < runs - 1:
            on_rank0(partial(remove, vault, *dirs))
        if dist.get_rank() == 0:
            print(f"  world {dist.get_world_size()} run {run}: keyframe {rows['keyframe: save s'][-1]:.2f} s vs DCP "
                  f"{rows['keyframe: DCP save s'][-1]:.2f} s, load {os.getloadavg()[0]:.1f}", flush=True)
    async_writer.close()
    on_rank0(partial(remove, async_vault))
    if dist.get_rank() == 0:
        keep = {"vault": str(work / f"vault-{runs - 1}"), "dcp": {str(k): str(work / f"dcp-{runs - 1}-{k}") for k in (1, 2)}}
        Path(job["result"]).write_text(json.dumps({"rows": rows, "notes": notes, "keep": keep}))


def local_tensors(state: Any) -> Iterator[torch.Tensor]:
    """This rank's part of every tensor of ``state``."""
    if isinstance(state, DTensor):
        yield state.to_local()
    elif isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from local_tensors(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from local_tensors(value)


def load_phase(job: dict[str, Any], mesh: Any) -> None:
    keep = job["keep"]
    rows: dict[str, list[float]] = {}
    warm_up(Path(keep["vault"]).parent / f"warm-load-{dist.get_world_size()}", rows)
    trainer = Trainer(job["size"], mesh, 1, job["batch"], job["seq"])  # another seed: other values than saved
    state = trainer.state()  # get_state_dict creates the optimizer's (zero) moments, so DCP loads into them
    notes: dict[str, Any] = {"cached_after_drop": [], "identical": []}
    for run in range(job["runs"]):
        for label, step in (("keyframe", 1), ("one step later", 2)):
            folder = Path(keep["dcp"][str(step)])
            loads = {"vault": (Path(keep["vault"]), lambda st=step: dcp.load(state, storage_reader=VaultReader(
                         keep["vault"], st))),
                     "dcp": (folder, lambda f=folder: dcp.load(state, storage_reader=dcp.FileSystemReader(str(f))))}
            order = list(loads) if run % 2 == 0 else list(loads)[::-1]
            first: list[torch.Tensor] | None = None
            for name in order:
                path, load = loads[name]
                cached = on_rank0(lambda p=path: drop_from_cache(p))
                if cached is not None:
                    notes["cached_after_drop"].append(cached)
                seconds, cpu = timed(load)
                rows.setdefault(f"{label}: {'DCP ' if name == 'dcp' else ''}load s", []).append(seconds)
                rows.setdefault(f"{label}: {'DCP ' if name == 'dcp' else ''}load CPU s (all ranks)", []).append(cpu)
                if run == 0:  # check each checkpoint once: the second reader's values against the first's
                    if first is None:
                        first = [t.clone() for t in local_tensors(state)]
                        with torch.no_grad():
                            for t in local_tensors(state):
                                t.zero_()
                    else:
                        same = all(torch.equal(a, b) for a, b in zip(first, local_tensors(state), strict=True))
                        notes["identical"].append(bool(slowest(0.0 if same else 1.0)[0] == 0.0))
        if dist.get_rank() == 0:
            print(f"  loaded at world {dist.get_world_size()} run {run}: keyframe {rows['keyframe: load s'][-1]:.2f} s "
                  f"vs DCP {rows['keyframe: DCP load s'][-1]:.2f} s", flush=True)
    if dist.get_rank() == 0:
        Path(job["result"]).write_text(json.dumps({"rows": rows, "notes": notes}))


def drop_from_cache(path: Path) -> float:
    """Drop every file under ``path`` from the page cache (POSIX_FADV_DONTNEED on clean pages: no root needed);
    the fraction of their pages still cached afterwards (mincore)."""
    total = cached = 0
    for file in (p for p in path.rglob("*") if p.is_file() and p.stat().st_size):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            pages, resident = _resident_pages(fd, os.fstat(fd).st_size)
            total, cached = total + pages, cached + resident
        finally:
            os.close(fd)
    return cached / total if total else 0.0


def _resident_pages(fd: int, size: int) -> tuple[int, int]:
    """(pages, pages in the page cache) of the open file ``fd``: mincore(2) on a mapping never touched."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        return pages, pages  # unknown: counted as cached
    try:
        vec = ctypes.create_string_buffer(pages)
        if libc.mincore(addr, size, vec) != 0:
            return pages, pages
        return pages, sum(byte & 1 for byte in vec.raw)
    finally:
        libc.munmap(addr, size)


def rank_main(rank: int, world: int, store: str, job: dict[str, Any]) -> None:
    torch.set_num_threads(1)  # several ranks share 2 cores
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        (save_phase if job["phase"] == "save" else load_phase)(job, mesh)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # gloo's worker thread may still be destroying the last barrier's work while the interpreter finalizes, which
    # aborts the process (std::terminate); the results are written, so end at once
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# -- the driver ------------------------------------------------------------------------------------------------
def spawn(world: int, job: dict[str, Any], timeout: float) -> dict[str, Any]:
    """``rank_main`` on ``world`` spawned processes; rank 0's results."""
    import torch.multiprocessing as mp

    store = WORK / f"pg-{job['phase']}-{world}-{time.monotonic_ns()}"
    result = WORK / f"result-{job['phase']}-{world}.json"
    result.unlink(missing_ok=True)
    job = {**job, "result": str(result)}
    context = mp.spawn(rank_main, args=(world, str(store), job), nprocs=world, join=False)
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{job['phase']} on {world} ranks did not finish in {timeout} s")
    store.unlink(missing_ok=True)
    return json.loads(result.read_text())


def verdict(ratio: float, target: float | None) -> str:
    if target is None:
        return ""
    return "met" if ratio <= target else f"missed ({ratio / target - 1:.1%} over)"


def fmt(name: str, value: float) -> str:
    if "bytes" in name:
        return f"{value / 1e6:,.1f} MB"
    return f"{value:.3f} s" if re.search(r" s( |$)", name) else f"{value:.2f}"


def report(results: dict[str, Any], info: dict[str, Any]) -> str:
    lines = [f"W1 {info['size']} sharded with FSDP2 (gloo, CPU): {info['logical_bytes'] / 1e9:.3f} GB of state; "
             f"{info['machine']['cpus']} CPUs shared by all ranks; medians of {info['runs']} runs; "
             f"VaultWriter incremental keyword: {info['incremental_keyword']}; code {info['machine']['code']}; "
             f"load average {info['load_before'][0]:.1f} before, {info['load_after'][0]:.1f} after", ""]
    lines += ["| world | measurement | ckptvault | DCP FileSystem | ratio | target | result |",
              "|---:|---|---:|---:|---:|---:|---|"]
    for world, res in results["save"].items():
        med = {k: statistics.median(v) for k, v in res["rows"].items()}
        for ours, peer, target in TARGETS:
            ratio = med[ours] / med[peer]
            if ours not in med or peer not in med:
                continue
            lines.append(f"| {world} | {ours} "
                         f"| {fmt(ours, med[ours])} | {fmt(peer, med[peer])} | {ratio:.3f}x "
                         f"| {'-' if target is None else f'<= {target}x'} | {verdict(ratio, target)} |")
    lines += ["", "| saved at | loaded at | checkpoint | VaultReader | FileSystemReader | ratio | target | result |",
              "|---:|---:|---|---:|---:|---:|---:|---|"]
    for world, res in results["load"].items():
        med = {k: statistics.median(v) for k, v in res["rows"].items()}
        for label in ("keyframe", "one step later"):
            ratio = med[f"{label}: load s"] / med[f"{label}: DCP load s"]
            lines.append(f"| {res['saved_at']} | {world} | {label} | {med[f'{label}: load s']:.3f} s "
                         f"| {med[f'{label}: DCP load s']:.3f} s | {ratio:.3f}x | <= {RESTORE_TARGET}x "
                         f"| {verdict(ratio, RESTORE_TARGET)} |")
    lines += ["", "All runs (min-max):", "", "| world | phase | measurement | median | min-max | n |",
              "|---:|---|---|---:|---:|---:|"]
    for phase in ("save", "load"):
        for world, res in results[phase].items():
            for name, values in res["rows"].items():
                lines.append(f"| {world} | {phase} | {name} | {fmt(name, statistics.median(values))} "
                             f"| {fmt(name, min(values))}-{fmt(name, max(values))} | {len(values)} |")
    cached = [c for res in results["load"].values() for c in res["notes"]["cached_after_drop"]]
    identical = [i for res in results["load"].values() for i in res["notes"]["identical"]]
    lines += ["", f"Page cache before each load: at most {max(cached, default=0):.1%} of the checkpoint's pages cached "
              f"after POSIX_FADV_DONTNEED. VaultReader and FileSystemReader loaded identical values: {all(identical)} "
              f"({len(identical)} checks)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", default="2,4", help="world sizes, comma-separated")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--size", choices=list(SIZES), default="full")
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank per training step")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--warm-steps", type=int, default=2, help="training steps before the first measurement")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one world size's phase may take")
    parser.add_argument("--out", type=Path, default=OUT_DIR / "distributed-results.md")
    args = parser.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    WORK.mkdir(parents=True, exist_ok=True)
    job = {"size": args.size, "runs": args.runs, "batch": args.batch, "seq": args.seq, "warm_steps": args.warm_steps}
    info: dict[str, Any] = {"machine": machine(), "load_before": os.getloadavg(), **job, "worlds": worlds,
                            "incremental_keyword": "incremental" in inspect.signature(VaultWriter).parameters}
    results: dict[str, Any] = {"save": {}, "load": {}}
    try:
        for world in worlds:
            t0 = time.perf_counter()
            results["save"][world] = spawn(world, {**job, "phase": "save", "work": str(WORK / f"w{world}")}, args.timeout)
            print(f"world {world}: saves in {time.perf_counter() - t0:.0f} s", flush=True)
        for i, world in enumerate(worlds):
            source = worlds[i - 1] if len(worlds) > 1 else world  # saved at the previous world size (cyclic)
            t0 = time.perf_counter()
            loaded = spawn(world, {**job, "phase": "load", "keep": results["save"][source]["keep"]}, args.timeout)
            results["load"][world] = {**loaded, "saved_at": source}
            print(f"world {world}: loads of world {source}'s checkpoints in {time.perf_counter() - t0:.0f} s", flush=True)
    finally:
        for world in worlds:
            shutil.rmtree(WORK / f"w{world}", ignore_errors=True)
    info["load_after"] = os.getloadavg()
    info["logical_bytes"] = next(iter(results["save"].values()))["notes"]["logical_bytes"]
    text = report(results, info)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps({"info": info, "results": results}, indent=1))


if __name__ == "__main__":
    main()
