"""Asynchronous-saving benchmark (docs/benchmarks/async.md): what an asynchronous save costs the training loop.

    .venv/bin/python bench/bench_async.py --size full --runs 3

The W1 model (``workloads.py``) is rebuilt from its cached state as a live GPT + AdamW, so
checkpoints are taken of a state that real training steps change in place. One process measures:

A. Per run, after one training step: the time ``save()`` blocks the caller (ckptvault async,
   staging buffer warm) against copying the state into preallocated buffers (np.copyto: one thread,
   plain memcpy; torch ``copy_``: its own threading) and against the blocked time of
   ``torch.distributed.checkpoint.async_save``; the time until durable of that ckptvault save (an
   incremental checkpoint) and of a keyframe into an empty vault, against a synchronous DCP save of
   the same state, and the same incremental save with ``direct_io="auto"`` (chunks written with O_DIRECT
   on ext4/XFS), with ``cache_keyframe=False`` (the keyframe read back and checked for every delta), and
   of a manager with ``keyframe_every=1`` (every save a keyframe, staging warm: what a loop's keyframes cost);
   the default and the keyframe manager again with ``drop_behind=False`` (chunks left in the page cache).
   The first ckptvault save (cold staging, keyframe) is a warm-up, reported apart.
B. A training loop checkpointing every ``--every`` steps: steps/second without checkpoints and with
   ckptvault async, ckptvault sync, torch.save and DCP async_save (each loop ends durable).
C. Peak RSS during a save relative to the state, one fresh subprocess per method (VmHWM, reset
   after loading the state).

DCP runs under a single-process gloo group. Medians over ``--runs``; variants rotate in B.
Part A keeps every output until it ends, about 10 GB per run of W1: ``--runs 5`` needs about 60 GB free
(a full disk fails the run with StorageFullError).
Results: stdout (markdown) and ``bench/out/async-results.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads must not spin against the threads measured
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import peers  # noqa: E402
from ckptvault import CheckpointManager  # noqa: E402
from ckptvault.demo.data import stdlib_bytes  # noqa: E402
from ckptvault.demo.model import GPT  # noqa: E402
from common import fresh_dir, machine  # noqa: E402
from workloads import OUT_DIR, SIZES, W1_LR, state_nbytes, tensor_leaves, train_step, w1_state, zeroed_copy  # noqa: E402

WORK = OUT_DIR / "async"
#: storage_options of the variants that keep their chunks in the page cache (drop-behind off)
KEEP_CACHED = {"drop_behind": False}
VARIANTS = ("no checkpoint", "ckptvault async", "ckptvault async, codec lz4", "ckptvault sync", "torch.save",
            "DCP async_save")


class Trainer:
    """The W1 GPT + AdamW resumed from the cached W1 state; ``step()`` is one real training step."""

    def __init__(self, size: str, batch_size: int, seq_len: int) -> None:
        cached = w1_state(size)
        self.model = GPT(SIZES[size])
        self.model.load_state_dict(cached["model"])
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=W1_LR)
        self.opt.load_state_dict(cached["optimizer"])
        self.n = cached["step"]
        del cached
        self.data, self.gen = stdlib_bytes(), torch.Generator().manual_seed(1)
        self.batch_size, self.seq_len = batch_size, seq_len

    def step(self) -> None:
        train_step(self.model, self.opt, self.data, self.batch_size, self.seq_len, self.gen)
        self.n += 1

    def state(self) -> dict[str, Any]:
        """The live state: the model's and optimizer's own tensors."""
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(), "step": self.n}


def dcp_async(state: Any, dest: Path) -> Future:
    """torch.distributed.checkpoint.async_save with its defaults (thread executor, default stager)."""
    import torch.distributed.checkpoint as dcp

    return dcp.async_save(state, storage_writer=dcp.FileSystemWriter(str(dest), sync_files=True))


def init_gloo(scratch: Path) -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{scratch / 'pg-store'}", rank=0, world_size=1)


# -- A: blocked and durable times --------------------------------------------------------------------
class Copier:
    """Preallocated (already faulted) buffers the state is copied into, two ways."""

    def __init__(self, state: Any) -> None:
        self.pairs = list(zip((t for _, t in tensor_leaves(zeroed_copy(state))), (t for _, t in tensor_leaves(state))))

    def memcpy(self) -> float:
        t0 = time.perf_counter()
        for dst, src in self.pairs:
            np.copyto(dst.numpy(), src.detach().numpy())
        return time.perf_counter() - t0

    def torch_copy(self) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            for dst, src in self.pairs:
                dst.copy_(src)
        return time.perf_counter() - t0


def timed_async(save: Any) -> tuple[float, float, float]:
    """(seconds the call blocked, seconds until durable, CPU seconds of the process) of an async save."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    pending = save()
    blocked = time.perf_counter() - t0
    pending.result() if isinstance(pending, Future) else pending.wait()
    return blocked, time.perf_counter() - t0, time.process_time() - cpu0


def timed_sync(save: Any) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the process) of a synchronous save."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    save()
    return time.perf_counter() - t0, time.process_time() - cpu0


def part_a(trainer: Trainer, runs: int, rows: dict[str, list[float]]) -> None:
    """Each run takes one training step, then saves that state with every variant and the peers, in an order
    rotated from run to run: on this VM the first save after a training step is the slowest (the step frees
    and re-faults memory), and a fixed order would hand that cost to the same variant every time."""
    copier = Copier(trainer.state())
    with CheckpointManager(fresh_dir(WORK / "a-ckv-async")) as mgr, \
            CheckpointManager(fresh_dir(WORK / "a-ckv-none"), codec="none") as raw, \
            CheckpointManager(fresh_dir(WORK / "a-ckv-uncached"), cache_keyframe=False) as uncached, \
            CheckpointManager(fresh_dir(WORK / "a-ckv-direct"), storage_options={"direct_io": "auto"}) as direct, \
            CheckpointManager(fresh_dir(WORK / "a-ckv-keyframes"), keyframe_every=1) as keyframes, \
            CheckpointManager(fresh_dir(WORK / "a-ckv-kept"), storage_options=KEEP_CACHED) as kept, \
            CheckpointManager(fresh_dir(WORK / "a-ckv-keyframes-kept"), keyframe_every=1,
                              storage_options=KEEP_CACHED) as keyframes_kept:
        variants = {"": mgr, ", codec none": raw, ", no keyframe cache": uncached, ", direct I/O": direct,
                    ", page cache kept": kept, ", every save a keyframe": keyframes,
                    ", every save a keyframe, page cache kept": keyframes_kept}
        for run in range(runs + 1):
            trainer.step()
            state = trainer.state()
            if run == 0:  # warm-up: allocates and faults the staging buffers, writes the first keyframes
                blocked, durable, _cpu = timed_async(partial(mgr.save, trainer.n, state))
                add(rows, "ckptvault async, first save (cold staging, keyframe): blocked", blocked)
                add(rows, "ckptvault async, first save (cold staging, keyframe): until durable", durable)
                for other in (raw, uncached, direct, kept, keyframes, keyframes_kept):
                    other.save(trainer.n, state).wait()
                continue
            jobs = [partial(_time_variant, name, m, trainer.n, state, rows) for name, m in variants.items()]
            jobs.append(partial(measure_peers, state, trainer.n, copier, rows))
            shift = (run - 1) % len(jobs)
            for job in jobs[shift:] + jobs[:shift]:
                job()
            print(f"  A run {run}: load {os.getloadavg()[0]:.1f}", flush=True)
    for name in ("a-ckv-async", "a-ckv-none", "a-ckv-uncached", "a-ckv-direct", "a-ckv-kept", "a-ckv-keyframes",
                 "a-ckv-keyframes-kept", "a-peers"):
        shutil.rmtree(WORK / name, ignore_errors=True)


def _time_variant(name: str, mgr: CheckpointManager, step: int, state: Any, rows: dict[str, list[float]]) -> None:
    blocked, durable, cpu = timed_async(partial(mgr.save, step, state))
    if not name:
        add(rows, "ckptvault async: blocked", blocked)
    kind = "keyframe" if mgr.delta_policy.every == 1 else "incremental checkpoint"
    add(rows, f"ckptvault async{name} ({kind}): until durable", durable)
    add(rows, f"ckptvault async{name} ({kind}): CPU s", cpu)


def measure_peers(state: Any, step: int, copier: Copier, rows: dict[str, list[float]]) -> None:
    """The baselines, on the state the ckptvault save just took. Each writes into a new directory that stays
    until part A ends, as ckptvault's vaults do: on this VM, new page cache costs far more than page cache
    that a deleted file just freed, so deleting a peer's output after each save would favour the peer."""
    add(rows, "memcpy into preallocated buffers (np.copyto, 1 thread)", copier.memcpy())
    add(rows, "torch copy_ into preallocated buffers", copier.torch_copy())
    blocked, durable, _ = timed_async(lambda: dcp_async(state, fresh_dir(WORK / f"a-peers/dcp-async-{step}")))
    add(rows, "DCP async_save: blocked", blocked)
    add(rows, "DCP async_save: until durable", durable)
    syncs = {"DCP save (sync)": lambda: peers.dcp_save(state, fresh_dir(WORK / f"a-peers/dcp-{step}")),
             "torch.save (sync)": lambda: peers.torch_save(state, fresh_dir(WORK / f"a-peers/torch-{step}")),
             "ckptvault save (sync), keyframe into an empty vault":
                 lambda: peers.ckptvault_save(state, fresh_dir(WORK / f"a-peers/ckv-sync-{step}"), step=step),
             "ckptvault save (sync), keyframe into an empty vault, page cache kept":
                 lambda: peers.ckptvault_save(state, fresh_dir(WORK / f"a-peers/ckv-kept-{step}"), step=step,
                                              storage_options=KEEP_CACHED)}
    for name, save in syncs.items():
        wall, cpu = timed_sync(save)
        add(rows, name, wall)
        add(rows, f"{name}: CPU s", cpu)


def add(rows: dict[str, list[float]], name: str, value: float) -> None:
    rows.setdefault(name, []).append(value)


# -- B: the training loop ------------------------------------------------------------------------------
class LoopCheckpointer:
    """One way of checkpointing inside the loop; ``flush()`` makes everything durable."""

    def __init__(self, variant: str) -> None:
        self.variant = variant
        self.mgr = None
        if variant.startswith("ckptvault"):
            self.mgr = CheckpointManager(fresh_dir(WORK / f"b-{variant.replace(' ', '-').replace(',', '')}"),
                                         async_save="async" in variant, codec="lz4" if "lz4" in variant else None)
        self.pending: Future | None = None
        self.blocked: list[float] = []
        self.count = 0

    def checkpoint(self, state: Any, step: int) -> None:
        t0 = time.perf_counter()
        if self.mgr is not None:
            self.mgr.save(step, state)
        elif self.variant == "torch.save":
            peers.torch_save(state, fresh_dir(WORK / f"b-torch-{self.count % 2}"))
        elif self.variant == "DCP async_save":
            if self.pending is not None:
                self.pending.result()  # as DCP recommends: one save in flight
            self.pending = dcp_async(state, fresh_dir(WORK / f"b-dcp-{self.count % 2}"))
        self.blocked.append(time.perf_counter() - t0)
        self.count += 1

    def flush(self) -> None:
        if self.mgr is not None:
            self.mgr.wait()
        if self.pending is not None:
            self.pending.result()
            self.pending = None

    def close(self) -> None:
        self.flush()
        if self.mgr is not None:
            self.mgr.close()


def part_b(trainer: Trainer, runs: int, every: int, ckpts: int, rows: dict[str, list[float]]) -> None:
    checkpointers = {v: LoopCheckpointer(v) for v in VARIANTS}
    steps = every * (ckpts + 1)  # the last checkpoint's background work overlaps `every` training steps
    try:
        for run in range(runs):
            for variant in VARIANTS[run % len(VARIANTS):] + VARIANTS[: run % len(VARIANTS)]:
                ckpt = checkpointers[variant]
                t0 = time.perf_counter()
                for i in range(1, steps + 1):
                    trainer.step()
                    if variant != "no checkpoint" and i % every == 0 and i < steps:
                        ckpt.checkpoint(trainer.state(), trainer.n)
                ckpt.flush()
                add(rows, f"loop, {variant}: steps/s", steps / (time.perf_counter() - t0))
                print(f"  B run {run} {variant}: {rows[f'loop, {variant}: steps/s'][-1]:.3f} steps/s, "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)
        for variant, ckpt in checkpointers.items():
            if ckpt.blocked:
                rows[f"loop, {variant}: blocked per checkpoint"] = ckpt.blocked
    finally:
        for ckpt in checkpointers.values():
            ckpt.close()
        for path in WORK.glob("b-*"):
            shutil.rmtree(path, ignore_errors=True)


# -- C: peak RSS, one subprocess per method ---------------------------------------------------------------
RSS_METHODS = ("ckptvault async", "ckptvault sync", "torch.save", "DCP save (sync)", "DCP async_save")


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def rss_child(method: str, size: str, dest: Path) -> None:
    """Load the state, reset the peak, save once (twice for ckptvault async: the 2nd reuses staging); print JSON."""
    state = w1_state(size)
    init_gloo(dest)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base = rss_kib("VmRSS")
    if method == "ckptvault async":
        with CheckpointManager(dest / "vault") as mgr:
            mgr.save(1, state).wait()
            state["model"][next(iter(state["model"]))].add_(1.0)
            mgr.save(2, state).wait()
    elif method == "ckptvault sync":
        peers.ckptvault_save(state, dest / "vault")
    elif method == "torch.save":
        peers.torch_save(state, dest / "torch")
    elif method == "DCP save (sync)":
        peers.dcp_save(state, dest / "dcp")
    else:
        dcp_async(state, dest / "dcp").result()
    print(json.dumps({"base_kib": base, "peak_kib": rss_kib("VmHWM"), "state_bytes": state_nbytes(state)}))
    dist.destroy_process_group()


def part_c(size: str, rows: dict[str, list[float]]) -> None:
    for method in RSS_METHODS:
        with tempfile.TemporaryDirectory(dir=WORK) as scratch:
            done = subprocess.run([sys.executable, __file__, "--rss-child", method, "--size", size, "--scratch", scratch],
                                  capture_output=True, text=True, check=True)
        out = json.loads(done.stdout.strip().splitlines()[-1])
        add(rows, f"peak RSS growth during save / state: {method}",
            (out["peak_kib"] - out["base_kib"]) * 1024 / out["state_bytes"])
        print(f"  C {method}: {rows[f'peak RSS growth during save / state: {method}'][-1]:.2f} x state", flush=True)


# -- report ------------------------------------------------------------------------------------------------
# (ours, peer, target ratio): ours / peer of the medians
TARGETS = [
    ("ckptvault async: blocked", "memcpy into preallocated buffers (np.copyto, 1 thread)", 1.5),
    ("ckptvault async: blocked", "torch copy_ into preallocated buffers", 1.5),
    ("ckptvault async: blocked", "DCP async_save: blocked", 0.7),
    ("ckptvault async (incremental checkpoint): until durable", "DCP save (sync)", 0.8),
    ("ckptvault save (sync), keyframe into an empty vault", "DCP save (sync)", 0.8),
    ("ckptvault async, codec none (incremental checkpoint): until durable", "DCP save (sync)", 0.8),
    ("ckptvault async, no keyframe cache (incremental checkpoint): until durable", "DCP save (sync)", 0.8),
    ("ckptvault async, direct I/O (incremental checkpoint): until durable", "DCP save (sync)", 0.8),
    ("ckptvault async, every save a keyframe (keyframe): until durable", "DCP save (sync)", 0.8),
    ("ckptvault async, page cache kept (incremental checkpoint): until durable", "DCP save (sync)", 0.8),
    ("ckptvault async, every save a keyframe, page cache kept (keyframe): until durable", "DCP save (sync)", 0.8),
    ("ckptvault save (sync), keyframe into an empty vault, page cache kept", "DCP save (sync)", 0.8),
]


def report(rows: dict[str, list[float]], info: dict[str, Any]) -> str:
    med = {name: statistics.median(values) for name, values in rows.items()}
    lines = [f"W1 {info['size']}: {info['state_bytes'] / 1e9:.3f} GB; load average {info['load_before'][0]:.1f} before, "
             f"{info['load_after'][0]:.1f} after; {info['machine']['cpus']} CPUs; code {info['machine']['code']}", "",
             "| measurement | median | min-max | n |", "|---|---:|---:|---:|"]
    for name, values in rows.items():
        unit = "" if "/" in name or name.endswith(" s") else " s"
        lines.append(f"| {name} | {med[name]:.3f}{unit} | {min(values):.3f}-{max(values):.3f} | {len(values)} |")
    lines += ["", "| ours | peer | ratio | target | result |", "|---|---|---:|---:|---|"]
    for ours, peer, target in TARGETS:
        if ours in med and peer in med:
            ratio = med[ours] / med[peer]
            result = "met" if ratio <= target else f"missed ({ratio / target - 1:.0%} over)"
            lines.append(f"| {ours} | {peer} | {ratio:.2f}x | <= {target}x | {result} |")
    base = med.get("loop, no checkpoint: steps/s")
    if base:
        lines += ["", f"Loop: {info['every']} steps between checkpoints, {info['ckpts']} checkpoints per loop of "
                  f"{info['every'] * (info['ckpts'] + 1)} steps (batch {info['batch']} x {info['seq']} tokens), ends durable.",
                  "", "| variant | steps/s | vs no checkpoint | blocked per checkpoint (median s) |", "|---|---:|---:|---:|"]
        for variant in VARIANTS:
            sps = med.get(f"loop, {variant}: steps/s")
            blocked = med.get(f"loop, {variant}: blocked per checkpoint")
            if sps:
                lines.append(f"| {variant} | {sps:.3f} | {sps / base:.2f} | {'-' if blocked is None else f'{blocked:.3f}'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=list(SIZES), default="full")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--every", type=int, default=10, help="training steps between checkpoints in the loop")
    parser.add_argument("--ckpts", type=int, default=2, help="checkpoints per loop")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--parts", default="abc")
    parser.add_argument("--rss-child", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss_child:
        rss_child(args.rss_child, args.size, Path(args.scratch))
        return
    WORK.mkdir(parents=True, exist_ok=True)
    init_gloo(Path(tempfile.mkdtemp(dir=WORK)))
    rows: dict[str, list[float]] = {}
    trainer = Trainer(args.size, args.batch, args.seq)
    nbytes = state_nbytes(trainer.state())
    info = {"machine": machine(), "size": args.size, "state_bytes": nbytes, "runs": args.runs, "every": args.every,
            "ckpts": args.ckpts, "batch": args.batch, "seq": args.seq, "load_before": os.getloadavg()}
    print(f"W1 {args.size}: {nbytes / 1e9:.3f} GB of state; load {info['load_before']}", flush=True)
    if "a" in args.parts:
        part_a(trainer, args.runs, rows)
    if "b" in args.parts:
        part_b(trainer, args.runs, args.every, args.ckpts, rows)
    if "c" in args.parts:
        part_c(args.size, rows)
    info["load_after"] = os.getloadavg()
    text = report(rows, info)
    print(text)
    (OUT_DIR / "async-results.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    (OUT_DIR / "async-results.md").write_text(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
