"""What a save costs as a vault grows: retention applied after every save, and the lookup of the step before a save
in a vault of many checkpoints (docs/benchmarks/retention.md, "Retention after every save").

    .venv/bin/python bench/retention_per_save.py --steps 3000 --manifests 10000

- **retention**: a synchronous manager with ``Retention(keep_last=3, keep_every=25)`` (the default grace period)
  saves a 64 KiB float32 array, one element changed per step, ``--steps`` times; printed: the median time of a save
  in windows of 100 steps across the run, and the checkpoints kept at the end;
- **many manifests**: a vault of one checkpoint whose manifest is hard-linked under ``--manifests`` step names (what
  listing the vault sees, without writing them all), then 30 saves of a 256 KiB array by a new manager; printed:
  the median time of the last 25.

Compare codes by running it through ``PYTHONPATH=<other src>``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from ckptvault import CheckpointManager, Retention

ROOT = Path(__file__).resolve().parent.parent


def retention_run(work: Path, steps: int) -> None:
    state = {"w": torch.randn(1 << 14)}
    times = []
    with CheckpointManager(work / "retention", async_save=False,
                           retention=Retention(keep_last=3, keep_every=25)) as mgr:
        for step in range(steps):
            state["w"][step % 1000] += 1
            start = time.perf_counter()
            mgr.save(step, state)
            times.append(time.perf_counter() - start)
        kept = len(mgr.steps())
    windows = [lo for lo in (100, steps // 3, 2 * steps // 3, steps - 100) if lo + 100 <= steps]
    cells = ", ".join(f"steps {lo}-{lo + 99}: {statistics.median(times[lo:lo + 100]) * 1e3:.1f} ms" for lo in windows)
    print(f"retention after every save (keep_last=3, keep_every=25), median save: {cells}; {kept} kept at the end")


def many_manifests(work: Path, manifests: int) -> None:
    state = {"w": torch.randn(1 << 16)}
    url = work / "many"
    with CheckpointManager(url, async_save=False) as mgr:
        mgr.save(0, state)
    first = url / "manifests" / f"{0:020d}.json"
    for step in range(1, manifests):
        os.link(first, url / "manifests" / f"{step:020d}.json")
    times = []
    with CheckpointManager(url, async_save=False) as mgr:
        for step in range(manifests, manifests + 30):
            state["w"][step % 1000] += 1
            start = time.perf_counter()
            mgr.save(step, state)
            times.append(time.perf_counter() - start)
    print(f"a vault of {manifests} checkpoints, median save of the last 25: {statistics.median(times[5:]) * 1e3:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000, help="saves of the retention run (default 3000)")
    parser.add_argument("--manifests", type=int, default=10000, help="checkpoints of the large vault (default 10000)")
    args = parser.parse_args()
    (ROOT / "bench" / "out").mkdir(parents=True, exist_ok=True)
    code = os.environ.get("PYTHONPATH") or "this checkout"
    print(f"code: {code}; python {sys.version.split()[0]}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory(dir=ROOT / "bench" / "out") as tmp:
        retention_run(Path(tmp), args.steps)
        many_manifests(Path(tmp), args.manifests)


if __name__ == "__main__":
    main()
