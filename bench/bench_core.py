"""Core benchmark (docs/benchmarks/core.md): ckptvault's save and restore against torch.save, safetensors and DCP.

    .venv/bin/python bench/bench_core.py --size full --runs 3

One process measures everything, so the ratios compare like with like. Each
run saves the W1 state (``workloads.py``) with every method into a fresh
directory (a fresh vault for each ckptvault save, else dedup would make it
free), then saves into the default vault twice more (the same state, and a
state with one layer changed), then restores every saved copy into one
preallocated target and checks it bit for bit. The page cache is dropped
before every timed operation (``--warm`` to keep it). Medians over ``--runs``;
the order of methods rotates between runs. Results go to stdout as markdown
and to ``bench/out/core-results.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads must not spin against the pool threads measured
sys.path.insert(0, str(Path(__file__).resolve().parent))

import peers  # noqa: E402
from common import Timing, drop_caches, fresh_dir, machine, timed  # noqa: E402
from workloads import OUT_DIR, SIZES, W1_STEPS, assert_same_tensors, perturb_one_layer, state_nbytes, w1_state, zeroed_copy  # noqa: E402

log = logging.getLogger("bench_core")

# name -> (directory slug, save function)
SAVES: dict[str, tuple[str, Callable[[Any, Path], None]]] = {
    "torch.save": ("torch", peers.torch_save),
    "safetensors.save_file": ("safetensors", peers.safetensors_save),
    "DCP save": ("dcp", peers.dcp_save),
    "ckptvault save, codec none": ("ckv-none", lambda s, d: peers.ckptvault_save(s, d, codec="none")),
    "ckptvault save, default": ("ckv-default", lambda s, d: peers.ckptvault_save(s, d)),  # sync; lossless default codec
}
# name -> (directory slug it reads, restore function filling the target in place)
RESTORES: dict[str, tuple[str, Callable[[Path, Any], None]]] = {
    "torch.load + copy": ("torch", peers.torch_load_copy),
    "safetensors load + copy": ("safetensors", peers.safetensors_load_copy),
    "DCP load (in place)": ("dcp", peers.dcp_load),
    "ckptvault restore into, default": ("ckv-default", peers.ckptvault_restore_into),
    "ckptvault restore into, codec none": ("ckv-none", peers.ckptvault_restore_into),
}

# (ours, peer, target ratio, what is compared)
TARGETS = [
    ("ckptvault save, codec none", "safetensors.save_file", 1.1, "time"),
    ("ckptvault save, default", "torch.save", 1.0, "time"),
    ("ckptvault save, default", "torch.save", 0.85, "bytes"),
    ("ckptvault restore into, default", "torch.load + copy", 1.0, "time"),
]


def rotated(names: list[str], run: int) -> list[str]:
    k = run % len(names)
    return names[k:] + names[:k]


def run_once(run: int, state: Any, changed: Any, target: Any, work: Path, cold: bool,
             times: dict[str, Timing], sizes: dict[str, int]) -> None:
    """One round: every save, the two re-saves, every restore (verified)."""
    dirs = {slug: work / slug for slug, _ in SAVES.values()}
    for name in rotated(list(SAVES), run):
        slug, save = SAVES[name]
        dest = fresh_dir(dirs[slug])
        timed(lambda save=save, dest=dest: save(state, dest), times[name], cold)
        sizes[name] = peers.disk_bytes(dest)
        log.info("run %d: %s %.2f s", run, name, times[name].wall[-1])
    vault = dirs["ckv-default"]
    before = peers.disk_bytes(vault)
    timed(lambda: peers.ckptvault_save(state, vault, step=2), times["ckptvault re-save, same state"], cold)
    sizes["ckptvault re-save, same state"] = peers.disk_bytes(vault) - before
    before = peers.disk_bytes(vault)
    timed(lambda: peers.ckptvault_save(changed, vault, step=3), times["ckptvault re-save, one layer changed"], cold)
    sizes["ckptvault re-save, one layer changed"] = peers.disk_bytes(vault) - before
    async_vault = fresh_dir(work / "ckv-async")
    (b1, d1), (b2, d2) = timed(lambda: peers.ckptvault_async_saves(state, async_vault), Timing(), cold)
    for name, secs in (("async save, fresh vault: blocks training", b1), ("async save, fresh vault: until durable", d1),
                       ("async re-save, same state: blocks training", b2), ("async re-save, same state: until durable", d2)):
        times[f"ckptvault {name}"].add(secs)
    shutil.rmtree(async_vault)
    for name in rotated(list(RESTORES), run):
        slug, restore = RESTORES[name]
        timed(lambda restore=restore, slug=slug: restore(dirs[slug], target), times[name], cold)
        assert_same_tensors(state, target)
        _zero(target)
        log.info("run %d: %s %.2f s", run, name, times[name].wall[-1])
    result = timed(lambda: peers.ckptvault_restore_new(vault), times["ckptvault restore, new tensors"], cold)
    assert_same_tensors(state, result)
    del result
    timed(lambda: torch_load_only(dirs["torch"]), times["torch.load (no copy)"], cold)
    for path in dirs.values():
        shutil.rmtree(path, ignore_errors=True)


def torch_load_only(dest: Path) -> None:
    import torch

    del_me = torch.load(dest / "state.pt", weights_only=True)
    del del_me


def _zero(target: Any) -> None:
    from workloads import tensor_leaves

    for _, tensor in tensor_leaves(target):
        tensor.zero_()


def report(times: dict[str, Timing], sizes: dict[str, int], meta: dict[str, Any]) -> str:
    """The results as markdown: timings, targets, sizes."""
    lines = ["| operation | median s | min-max s | CPU s (median) | GB/s |", "|---|---:|---:|---:|---:|"]
    logical = meta["state_bytes"]
    for name, t in times.items():
        cpu = "-" if t.cpu[0] != t.cpu[0] else f"{t.cpu_median:.2f}"
        lines.append(f"| {name} | {t.median:.2f} | {min(t.wall):.2f}-{max(t.wall):.2f} | {cpu} "
                     f"| {logical / t.median / 1e9:.2f} |")
    lines += ["", "| target | ours | peer | ratio of medians | median of per-run ratios | CPU-s ratio | target | result |",
              "|---|---:|---:|---:|---:|---:|---:|---|"]
    for ours, peer, limit, what in TARGETS:
        if what == "time":
            a, b = times[ours].median, times[peer].median
            paired = statistics.median(x / y for x, y in zip(times[ours].wall, times[peer].wall))
            cpu = times[ours].cpu_median / times[peer].cpu_median
            cells = f"{a:.2f} s | {b:.2f} s | {a / b:.2f}x | {paired:.2f}x | {cpu:.2f}x"
        else:
            a, b = sizes[ours], sizes[peer]
            cells = f"{a / 1e6:.0f} MB | {b / 1e6:.0f} MB | {a / b:.2f}x | - | -"
        ratio = a / b
        verdict = "met" if ratio <= limit else f"missed by {(ratio / limit - 1) * 100:.0f}%"
        lines.append(f"| {ours} {what} vs {peer} | {cells} | <= {limit}x | {verdict} |")
    lines += ["", "| stored | MB | / logical |", "|---|---:|---:|"]
    for name, size in sizes.items():
        lines.append(f"| {name} | {size / 1e6:.1f} | {size / logical:.3f} |")
    return "\n".join(lines)


def report_from_json(path: Path) -> str:
    """Re-render the markdown of a saved results file (after changing :func:`report`)."""
    data = json.loads(path.read_text())
    times = {name: Timing(t["wall"], t["cpu"]) for name, t in data["times"].items()}
    return report(times, data["sizes"], data["meta"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full", help="W1 model size (full = ~85M params)")
    parser.add_argument("--runs", type=int, default=3, help="rounds; medians are reported (default 3)")
    parser.add_argument("--steps", type=int, default=W1_STEPS, help="training steps before the state is taken")
    parser.add_argument("--warm", action="store_true", help="do not drop the page cache before each operation")
    parser.add_argument("--work", type=Path, default=OUT_DIR / "core", help="scratch directory (same disk as results)")
    parser.add_argument("--report", type=Path, help="only re-render the tables of a saved core-results.json")
    args = parser.parse_args(argv)
    if args.report:
        print(report_from_json(args.report))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    state = w1_state(args.size, args.steps)
    changed, target = perturb_one_layer(state), zeroed_copy(state)
    cold = not args.warm and drop_caches()
    if not args.warm and not cold:
        log.warning("cannot drop the page cache (not root?): restores are measured warm")
    meta = {"size": args.size, "runs": args.runs, "steps": args.steps, "cold_cache": cold,
            "state_bytes": state_nbytes(state), "machine": machine(), "load_before": os.getloadavg(),
            "command": " ".join([".venv/bin/python", "bench/bench_core.py", *(argv or sys.argv[1:])]),
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    times: dict[str, Timing] = defaultdict(Timing)
    sizes: dict[str, int] = {}
    for run in range(args.runs):
        run_once(run, state, changed, target, args.work, cold, times, sizes)
    meta["load_after"] = os.getloadavg()
    text = report(times, sizes, meta)
    print(text)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    raw = {name: {"wall": t.wall, "cpu": t.cpu} for name, t in times.items()}
    (OUT_DIR / "core-results.json").write_text(json.dumps({"meta": meta, "times": raw, "sizes": sizes}, indent=1))
    (OUT_DIR / "core-results.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
