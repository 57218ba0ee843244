"""How ckptvault's sync save and restore respond to its two knobs: worker threads and chunk size.

    .venv/bin/python bench/sweep_core.py --size full --runs 3 --workers 2,4,8 --chunk-mib 4,16

For every (workers, chunk size) pair: a fresh-vault sync save with codec
``none`` and with the default codec, then a cold restore into a preallocated
state; medians over ``--runs``, configurations interleaved within each run so
that load on a shared machine hits them alike.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import sys
from collections import defaultdict
from functools import partial
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ckptvault import CheckpointManager  # noqa: E402
from common import Timing, fresh_dir, timed  # noqa: E402
from workloads import OUT_DIR, SIZES, assert_same_tensors, tensor_leaves, w1_state, zeroed_copy  # noqa: E402


def save(state: object, dest: Path, codec: str | None, workers: int, chunk: int) -> None:
    with CheckpointManager(dest, codec=codec, workers=workers, chunk_size=chunk, async_save=False) as mgr:
        mgr.save(1, state).wait()


def restore(dest: Path, target: object, workers: int) -> None:
    with CheckpointManager(dest, workers=workers) as mgr:
        mgr.restore(1, into=target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workers", default="2,4,8")
    parser.add_argument("--chunk-mib", default="4,16")
    args = parser.parse_args(argv)
    state = w1_state(args.size)
    target = zeroed_copy(state)
    configs = list(itertools.product([int(w) for w in args.workers.split(",")],
                                     [int(c) << 20 for c in args.chunk_mib.split(",")]))
    times: dict[tuple[str, int, int], Timing] = defaultdict(Timing)
    work = OUT_DIR / "sweep"
    for run in range(args.runs):
        for workers, chunk in configs[run % len(configs):] + configs[: run % len(configs)]:
            dest = work / f"{workers}-{chunk}"
            for codec in ("none", None):
                fresh_dir(dest)
                timed(partial(save, state, dest, codec, workers, chunk), times[(codec or "default", workers, chunk)], True)
            timed(partial(restore, dest, target, workers), times[("restore default", workers, chunk)], True)
            assert_same_tensors(state, target)
            for _, tensor in tensor_leaves(target):
                tensor.zero_()
            shutil.rmtree(work, ignore_errors=True)
    print("| workers | chunk MiB | save, codec none s | save, default s | restore into, default s |")
    print("|---:|---:|---:|---:|---:|")
    for workers, chunk in configs:
        cells = [f"{times[(what, workers, chunk)].median:.2f}" for what in ("none", "default", "restore default")]
        print(f"| {workers} | {chunk >> 20} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
