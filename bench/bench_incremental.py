"""Incremental benchmark (docs/benchmarks/incremental.md): checkpoints by dedup + XOR deltas on four training workloads.

    .venv/bin/python bench/bench_incremental.py --size full --runs 3        # all four workloads, full size
    .venv/bin/python bench/bench_incremental.py --size tiny --runs 1 --warmup 2 --workloads W1,W4   # smoke

For each workload (``workloads_incremental.py``) the state is taken after ``--warmup`` training steps (the
keyframe), one step later and ten steps later. Each run, for each gap (1 and 10 steps): a fresh vault,
a synchronous save of the keyframe state, then of the later state (a delta checkpoint against it); then
the keyframe and the delta checkpoint are restored into one preallocated target and checked bit for bit.
torch.save of every state gives the reference size (and time). The page cache is dropped before every
timed operation unless ``--warm``. Medians over ``--runs``. Results: stdout (markdown) and
``bench/out/incremental-results.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import peers  # noqa: E402
import workloads_incremental as wi  # noqa: E402
from ckptvault import CheckpointManager  # noqa: E402
from common import Timing, drop_caches, fresh_dir, machine, timed  # noqa: E402
from workloads import OUT_DIR, SIZES, assert_same_tensors, state_nbytes, tensor_leaves, zeroed_copy  # noqa: E402

log = logging.getLogger("bench_incremental")

# (workload, gap) -> the stored-bytes target as a fraction of torch.save; W3/W4 targets depend on the state
FIXED_TARGETS = {("W1", 1): 0.72, ("W1", 10): 0.80, ("W2", 1): 0.36, ("W2", 10): 0.42}
RESTORE_TARGET = 1.5


def load_states(name: str, size: str, warmup: int) -> tuple[wi.States, dict[str, Any]]:
    """The sampled states of workload ``name`` and facts the targets need."""
    if name == "W1":
        return wi.w1_states(size, warmup), {"config": vars(SIZES[size])}
    if name == "W2":
        return wi.w2_states(warmup), {}
    if name == "W3":
        states = wi.w3_states(warmup)
        names = wi.w3_trainable_names()
        return states, {"trainable_bytes": {g: wi.trainable_bytes(states[g], names) for g in states}}
    states = wi.w4_states(size, warmup)
    rows = wi.W4_ROWS[size]
    changed = {g: wi.w4_changed_rows(states[0], states[g]) for g in wi.GAPS}
    return states, {"rows": rows, "changed_rows": changed, "table_bytes": wi.w4_table_bytes(states[0])}


def target_for(name: str, gap: int, facts: dict[str, Any], torch_bytes: int) -> tuple[float, str]:
    """(the target's limit on delta bytes / torch.save bytes, how it was derived)."""
    if (name, gap) in FIXED_TARGETS:
        return FIXED_TARGETS[(name, gap)], "fixed"
    if name == "W3":
        trainable = facts["trainable_bytes"][gap]
        return trainable / torch_bytes + 0.01, f"(adapters + head + their AdamW state {trainable / 1e6:.2f} MB) / torch.save + 1%"
    rows, changed = facts["rows"], facts["changed_rows"][gap]
    touched = facts["table_bytes"] * changed / rows
    return touched / torch_bytes + 0.02, (f"{changed} of {rows} rows changed since the keyframe ({100 * changed / rows:.1f}%): "
                                          f"their weights + Adagrad sums {touched / 1e6:.1f} MB / torch.save + 2%")


def vault_save(mgr: CheckpointManager, step: int, state: Any) -> dict[str, Any]:
    mgr.save(step, state).wait()
    return mgr.manifest(step)


def restore_checked(vault: Path, step: int, state: Any, target: Any, timing: Timing, cold: bool) -> None:
    """Restore ``step`` into ``target`` (zeroed first, outside the timing) and check it bit for bit."""
    for _, tensor in tensor_leaves(target):
        tensor.zero_()

    def restore() -> None:
        with CheckpointManager(vault) as mgr:
            mgr.restore(step, into=target)

    timed(restore, timing, cold)
    assert_same_tensors(state, target)


def run_once(name: str, states: wi.States, target: Any, work: Path, cold: bool, times: dict[str, Timing],
             sizes: dict[str, Any]) -> None:
    """One round for one workload: torch.save of each state, then per gap a keyframe + delta vault."""
    for offset, state in states.items():
        dest = fresh_dir(work / "torch")
        timed(lambda state=state, dest=dest: peers.torch_save(state, dest), times[f"torch.save {offset}"], cold)
        sizes[f"torch.save {offset}"] = (dest / "state.pt").stat().st_size
    timed(lambda: peers.torch_load_copy(work / "torch", target), times["torch.load + copy"], cold)
    assert_same_tensors(states[wi.GAPS[-1]], target)
    for gap in wi.GAPS:
        vault = fresh_dir(work / f"vault-{gap}")
        with CheckpointManager(vault, async_save=False) as mgr:
            key = timed(lambda mgr=mgr: vault_save(mgr, 0, states[0]), times[f"save keyframe ({gap})"], cold)
            delta = timed(lambda mgr=mgr, gap=gap: vault_save(mgr, gap, states[gap]), times[f"save delta {gap}"], cold)
        assert key["keyframe_step"] == 0 and delta["keyframe_step"] == 0, "the later save must be a delta checkpoint"
        sizes[f"keyframe added ({gap})"] = key["added_bytes"]
        sizes[f"delta {gap} added"] = delta["added_bytes"]
        sizes[f"delta {gap} chunks"] = [sum(bool(c.get("base")) for c in delta["chunks"]),
                                        sum(c["new"] and not c.get("base") for c in delta["chunks"]),
                                        sum(not c["new"] for c in delta["chunks"])]
        restore_checked(vault, 0, states[0], target, times[f"restore keyframe ({gap})"], cold)
        restore_checked(vault, gap, states[gap], target, times[f"restore delta {gap}"], cold)
        log.info("%s gap %d: keyframe %.1f MB in %.2f s, delta %.1f MB in %.2f s; restores %.2f / %.2f s", name, gap,
                 key["added_bytes"] / 1e6, times[f"save keyframe ({gap})"].wall[-1], delta["added_bytes"] / 1e6,
                 times[f"save delta {gap}"].wall[-1], times[f"restore keyframe ({gap})"].wall[-1],
                 times[f"restore delta {gap}"].wall[-1])
        shutil.rmtree(vault)
    shutil.rmtree(work / "torch", ignore_errors=True)


def measure(name: str, size: str, warmup: int, runs: int, work: Path, cold: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    states, facts = load_states(name, size, warmup)
    prepared = time.perf_counter() - t0
    target = zeroed_copy(states[0])
    times: dict[str, Timing] = defaultdict(Timing)
    sizes: dict[str, Any] = {}
    for run in range(runs):
        log.info("%s run %d of %d (load %.1f)", name, run + 1, runs, os.getloadavg()[0])
        run_once(name, states, target, work, cold, times, sizes)
    rows = []
    for gap in wi.GAPS:
        torch_bytes = sizes[f"torch.save {gap}"]
        limit, how = target_for(name, gap, facts, torch_bytes)
        ratio = sizes[f"delta {gap} added"] / torch_bytes
        restore_ratio = times[f"restore delta {gap}"].median / times[f"restore keyframe ({gap})"].median
        rows.append({
            "gap": gap, "torch_save_bytes": torch_bytes, "keyframe_added": sizes[f"keyframe added ({gap})"],
            "keyframe_ratio": sizes[f"keyframe added ({gap})"] / sizes["torch.save 0"],
            "delta_added": sizes[f"delta {gap} added"], "delta_ratio": ratio, "target": limit, "target_basis": how,
            "bytes_met": ratio <= limit, "chunks_delta_full_reused": sizes[f"delta {gap} chunks"],
            "save_keyframe_s": times[f"save keyframe ({gap})"].median, "save_delta_s": times[f"save delta {gap}"].median,
            "torch_save_s": times[f"torch.save {gap}"].median,
            "restore_keyframe_s": times[f"restore keyframe ({gap})"].median,
            "restore_delta_s": times[f"restore delta {gap}"].median, "restore_ratio": restore_ratio,
            "restore_met": restore_ratio <= RESTORE_TARGET,
            "restore_cpu_keyframe_s": times[f"restore keyframe ({gap})"].cpu_median,
            "restore_cpu_delta_s": times[f"restore delta {gap}"].cpu_median,
        })
    return {"workload": name, "state_bytes": state_nbytes(states[0]), "prepare_s": prepared, "facts": _jsonable(facts),
            "rows": rows, "torch_load_copy_s": times["torch.load + copy"].median,
            "times": {k: {"wall": t.wall, "cpu": t.cpu} for k, t in times.items()}, "sizes": sizes}


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


def report(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "| workload | gap | torch.save MB | keyframe / torch.save | delta / torch.save | target | bytes | "
        "save s: torch / keyframe / delta | restore s: keyframe / delta (ratio) | restore <= 1.5x | restore CPU s (ratio) |",
        "|---|---:|---:|---:|---:|---:|---|---|---|---|---|",
    ]
    for r in results:
        for row in r["rows"]:
            verdict = "met" if row["bytes_met"] else f"missed by {(row['delta_ratio'] / row['target'] - 1) * 100:.1f}%"
            lines.append(
                f"| {r['workload']} | {row['gap']} | {row['torch_save_bytes'] / 1e6:.1f} | {row['keyframe_ratio']:.3f} "
                f"| {row['delta_ratio']:.4f} | <= {row['target']:.3f} | {verdict} "
                f"| {row['torch_save_s']:.2f} / {row['save_keyframe_s']:.2f} / {row['save_delta_s']:.2f} "
                f"| {row['restore_keyframe_s']:.2f} / {row['restore_delta_s']:.2f} ({row['restore_ratio']:.2f}x) "
                f"| {'met' if row['restore_met'] else 'missed'} "
                f"| {row['restore_cpu_keyframe_s']:.2f} / {row['restore_cpu_delta_s']:.2f} "
                f"({row['restore_cpu_delta_s'] / row['restore_cpu_keyframe_s']:.2f}x) |")
    lines += ["", "| workload | gap | delta chunks / full chunks written / reused | target basis |", "|---|---:|---|---|"]
    for r in results:
        for row in r["rows"]:
            d, f, u = row["chunks_delta_full_reused"]
            lines.append(f"| {r['workload']} | {row['gap']} | {d} / {f} / {u} | {row['target_basis']} |")
    lines += ["", f"runs: {meta['runs']}, cold cache: {meta['cold_cache']}, load average before/after: "
                  f"{meta['load_before'][0]:.1f} / {meta['load_after'][0]:.1f}, torch threads {meta['machine']['torch_threads']}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full",
                        help="W1 model and W4 table size (full: 85M GPT, 2M-row table; W2/W3 are always MiniLM)")
    parser.add_argument("--workloads", default="W1,W2,W3,W4", help="comma-separated subset of W1,W2,W3,W4")
    parser.add_argument("--runs", type=int, default=3, help="rounds; medians are reported (default 3)")
    parser.add_argument("--warmup", type=int, default=wi.WARMUP, help="training steps before the keyframe")
    parser.add_argument("--warm", action="store_true", help="do not drop the page cache before each operation")
    parser.add_argument("--work", type=Path, default=OUT_DIR / "incremental", help="scratch directory")
    parser.add_argument("--from-json", type=Path, help="only print the markdown of an earlier run's results JSON")
    args = parser.parse_args(argv)
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        print(report(saved["results"], saved["meta"]))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cold = not args.warm and drop_caches()
    if not args.warm and not cold:
        log.warning("cannot drop the page cache (not root?): everything is measured warm")
    meta = {"size": args.size, "runs": args.runs, "warmup": args.warmup, "cold_cache": cold, "machine": machine(),
            "load_before": os.getloadavg(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join([".venv/bin/python", "bench/bench_incremental.py", *(argv or sys.argv[1:])])}
    results = []
    for name in args.workloads.split(","):
        results.append(measure(name.strip().upper(), args.size, args.warmup, args.runs, args.work, cold))
        _free()
    meta["load_after"] = os.getloadavg()
    text = report(results, meta)
    print(text)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.size == "full" else f"-{args.size}"
    (OUT_DIR / f"incremental-results{suffix}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (OUT_DIR / f"incremental-results{suffix}.md").write_text(text + "\n")
    return 0


def _free() -> None:
    import gc

    gc.collect()

if __name__ == "__main__":
    sys.exit(main())
