"""What writing into freshly allocated memory costs here, by how long the memory lay free before.

    .venv/bin/python bench/fresh_memory.py --gib 1 --pauses 0,0.5,2,8 --runs 3

An asynchronous save copies the state into a staging buffer; the first save of a manager allocates it, so every
page of it is faulted in once. Each run allocates ``--gib`` GiB (numpy, 4 KiB pages), fills it with a copy, and
frees it, after sleeping each ``--pauses`` seconds. With ``--populate`` it also times the same after
``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+), which faults the whole range in one call.

On a VM whose balloon device reports free pages to the host (virtio-balloon free page reporting), memory that lay
free for a moment is handed back, and touching it again costs far more than memory freed just before: the pause
is what shows it. Prints wall and system CPU seconds per GiB.
"""

from __future__ import annotations

import argparse
import mmap
import resource
import statistics
import time

import numpy as np

MADV_POPULATE_WRITE = 23


def system_seconds() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime


def fill_fresh(source: np.ndarray, populate: bool) -> tuple[float, float]:
    """(wall, system CPU) seconds to allocate ``source.nbytes`` bytes and copy ``source`` into them."""
    sys0, wall0 = system_seconds(), time.perf_counter()
    if populate:
        region = mmap.mmap(-1, source.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(MADV_POPULATE_WRITE)
        target = np.frombuffer(region, np.uint8)
    else:
        region, target = None, np.empty(source.nbytes, np.uint8)
    target[:] = source
    out = time.perf_counter() - wall0, system_seconds() - sys0
    del target
    if region is not None:
        region.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--pauses", default="0,0.5,2,8", help="seconds the memory lies free before each fill")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--populate", action="store_true", help="also time fills after MADV_POPULATE_WRITE")
    args = parser.parse_args()
    source = np.ones(int(args.gib * (1 << 30)), np.uint8)
    fill_fresh(source, False)  # the first allocation of the process is not one of the cases
    kinds = [False, True] if args.populate else [False]
    results: dict[tuple[float, bool], list[tuple[float, float]]] = {}
    for _ in range(args.runs):
        for pause in (float(p) for p in args.pauses.split(",")):
            for populate in kinds:
                time.sleep(pause)
                results.setdefault((pause, populate), []).append(fill_fresh(source, populate))
    print(f"Filling {args.gib:g} GiB of fresh memory, medians of {args.runs} (s per GiB)\n")
    print("| free before | faulting | wall | system CPU |\n|---:|---|---:|---:|")
    for (pause, populate), rows in results.items():
        wall, system = (statistics.median(r[i] for r in rows) / args.gib for i in range(2))
        print(f"| {pause:g} s | {'MADV_POPULATE_WRITE' if populate else 'on touch'} | {wall:.2f} | {system:.2f} |")


if __name__ == "__main__":
    main()
