"""Retention and garbage-collection benchmark (docs/benchmarks/retention.md).

1. GC plan time on a vault of ``--checkpoints`` (default 1,000) checkpoints of
   a small training state (an MLP + AdamW trained one step per checkpoint, a
   frozen buffer shared by all): the time of :func:`ckptvault._maintenance.gc.plan_gc`
   (list chunks, read and verify every manifest, mark), median of ``--runs``,
   warm and (as root) cold page cache. Also the prune plan, and prune + gc
   execute after ``keep_last=10, keep_every=100``.
2. Stored bytes of a ``--steps``-step run of the demo GPT (``GPTConfig.small()``,
   AdamW, one checkpoint per step, incremental saves) with retention off vs
   ``Retention(keep_last=3, keep_every=25)`` (gc after each prune, grace 0).

Writes ``bench/out/gc-results.json`` and prints a Markdown summary.

    .venv/bin/python bench/bench_gc.py                      # ~3-6 min on 2 cores
    .venv/bin/python bench/bench_gc.py --checkpoints 200 --steps 20   # quick check
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ckptvault import CheckpointManager  # noqa: E402
from ckptvault._maintenance.gc import execute_gc, plan_gc  # noqa: E402
from ckptvault._maintenance.prune import execute_prune, plan_prune  # noqa: E402
from ckptvault._maintenance.retention import Retention  # noqa: E402
from ckptvault.demo.data import batch, stdlib_bytes  # noqa: E402
from ckptvault.demo.model import GPT, GPTConfig  # noqa: E402
from common import Timing, drop_caches, fresh_dir, machine, timed  # noqa: E402

OUT = Path(__file__).resolve().parent / "out" / "gc"
CHUNK = 64 << 10


def build_vault(root: Path, checkpoints: int) -> float:
    """Save ``checkpoints`` checkpoints of a small real training state; returns the build seconds."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 128))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    frozen = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB shared by every checkpoint
    start = time.perf_counter()
    with CheckpointManager(fresh_dir(root), chunk_size=CHUNK, async_save=False) as mgr:
        for step in range(checkpoints):
            loss = model(torch.randn(16, 128)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            mgr.save(step, {"model": model.state_dict(), "optimizer": opt.state_dict(), "frozen": frozen},
                     metrics={"loss": loss.item()})
    return time.perf_counter() - start


def vault_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def bench_plan(root: Path, runs: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with CheckpointManager(root) as mgr:
        for cold in (False, True):
            if cold and not drop_caches():
                out["cold"] = "not measured (dropping the page cache needs root)"
                continue
            timing = Timing()
            for _ in range(runs):
                plan = timed(lambda: plan_gc(mgr.vault, 3600.0), timing, cold)
            out["cold" if cold else "warm"] = {"median_s": timing.median, "runs_s": timing.wall}
        out["chunks"], out["live_chunks"], out["checkpoints"] = plan.chunks_total, len(plan.live), len(plan.manifests)
        timing = Timing()
        for _ in range(runs):
            timed(lambda: plan_prune(mgr.vault, Retention(keep_last=10, keep_every=100)), timing, False)
        out["prune_plan_warm_median_s"] = timing.median
    return out


def bench_execute(root: Path) -> dict[str, Any]:
    """Prune to keep_last=10 + keep_every=100, then gc with grace 0 (on a copy)."""
    work = OUT / "execute"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(root, work)
    before = vault_bytes(work)
    with CheckpointManager(work) as mgr:
        t0 = time.perf_counter()
        pruned = execute_prune(mgr.vault, plan_prune(mgr.vault, Retention(keep_last=10, keep_every=100)))
        t1 = time.perf_counter()
        plan = plan_gc(mgr.vault, 0.0)
        t2 = time.perf_counter()
        result = execute_gc(mgr.vault, plan)
        t3 = time.perf_counter()
        kept = len(mgr.steps())
    out = {"pruned": len(pruned.deleted), "kept": kept, "prune_s": t1 - t0, "gc_plan_s": t2 - t1, "gc_execute_s": t3 - t2,
           "chunks_deleted": len(result.deleted), "bytes_freed": result.bytes_freed, "vault_bytes_before": before,
           "vault_bytes_after": vault_bytes(work)}
    shutil.rmtree(work, ignore_errors=True)
    return out


def retention_run(root: Path, steps: int, retention: Retention | None) -> dict[str, Any]:
    """Train the demo GPT ``steps`` steps, saving each; return the vault's bytes and checkpoints."""
    cfg = GPTConfig.small()
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    data, gen = stdlib_bytes(), torch.Generator().manual_seed(0)
    start = time.perf_counter()
    with CheckpointManager(fresh_dir(root), retention=retention) as mgr:
        for step in range(steps):
            x, y = batch(data, 8, cfg.seq_len, gen)
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            mgr.save(step, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step},
                     metrics={"loss": loss.item()})
    with CheckpointManager(root) as mgr:  # the first one's close() waited for the last save and its retention
        kept = mgr.steps()
        logical = mgr.info(kept[-1]).logical_bytes
    return {"stored_bytes": vault_bytes(root), "checkpoints": len(kept), "logical_bytes_per_checkpoint": logical,
            "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoints", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rebuild", action="store_true", help="rebuild the cached 1,000-checkpoint vault")
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = OUT / f"vault-{args.checkpoints}"
    built = None
    if args.rebuild or not (root / "manifests").is_dir() or len(list((root / "manifests").iterdir())) != args.checkpoints:
        built = build_vault(root, args.checkpoints)
    results: dict[str, Any] = {"machine": machine(), "checkpoints": args.checkpoints, "build_s": built,
                               "vault_bytes": vault_bytes(root)}
    results["plan"] = bench_plan(root, args.runs)
    results["execute"] = bench_execute(root)
    off = retention_run(OUT / "run-off", args.steps, None)
    on = retention_run(OUT / "run-on", args.steps, Retention(keep_last=3, keep_every=25, gc_grace=0))
    results["retention_run"] = {"steps": args.steps, "model": "GPTConfig.small() + AdamW", "off": off, "on": on}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT.parent / "gc-results.json").write_text(json.dumps(results, indent=1))
    print(summary(results))


def summary(r: dict[str, Any]) -> str:
    p, e, run = r["plan"], r["execute"], r["retention_run"]
    cold = p["cold"]["median_s"] if isinstance(p["cold"], dict) else None
    mib = 2**20
    lines = [
        f"vault: {r['checkpoints']} checkpoints, {p['chunks']} chunks, {r['vault_bytes'] / mib:.1f} MiB"
        + (f" (built in {r['build_s']:.1f} s)" if r["build_s"] else ""),
        "",
        "| operation | seconds |",
        "|---|---|",
        f"| gc plan, warm cache (median of {len(p['warm']['runs_s'])}) | {p['warm']['median_s']:.3f} |",
        f"| gc plan, cold cache | {f'{cold:.3f}' if cold is not None else p['cold']} |",
        f"| prune plan (keep_last=10, keep_every=100), warm | {p['prune_plan_warm_median_s']:.3f} |",
        f"| prune execute ({e['pruned']} manifests deleted, {e['kept']} kept) | {e['prune_s']:.3f} |",
        f"| gc plan + execute after it ({e['chunks_deleted']} objects, {e['bytes_freed'] / mib:.1f} MiB freed) | "
        f"{e['gc_plan_s']:.3f} + {e['gc_execute_s']:.3f} |",
        "",
        f"retention run: {run['steps']} steps of {run['model']}, one checkpoint per step "
        f"({run['off']['logical_bytes_per_checkpoint'] / mib:.1f} MiB logical each)",
        "",
        "| retention | checkpoints kept | stored MiB |",
        "|---|---|---|",
        f"| off | {run['off']['checkpoints']} | {run['off']['stored_bytes'] / mib:.1f} |",
        f"| keep_last=3, keep_every=25 (+ gc) | {run['on']['checkpoints']} | {run['on']['stored_bytes'] / mib:.1f} |",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
