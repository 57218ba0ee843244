"""Where the CPU of a delta save goes: the stages of encoding W1's chunks against their keyframe, on one thread.

    .venv/bin/python bench/delta_costs.py [--size full] [--chunk-mib 4]

Takes the float32 tensors of W1 (``workloads_incremental.py``) at its keyframe and one step later, cuts them into
chunks as a save does (whole chunks only), and times on one thread: blake3 of each chunk, the byte-plane split,
a keyframe's encoding, a delta's encoding against the keyframe's planes, and the samples that choose between the
two for each plane. Then, per byte plane (0 = lowest mantissa byte, 3 = sign and exponent), what a delta stores
(the plane on its own or XORed, compressed or raw), its size, and the CPU it took. Prints seconds per GiB of state.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads_incremental as wi  # noqa: E402
from ckptvault._codecs.planes import BytePlanes, scratch, split_planes  # noqa: E402
from ckptvault._codecs.xplanes import PlaneDelta  # noqa: E402
from ckptvault._codecs.zstd import Zstd  # noqa: E402
from ckptvault._format.chunk_object import chunk_id  # noqa: E402
from workloads import SIZES, tensor_leaves  # noqa: E402

GIB = 1 << 30


def chunk_pairs(states: Any, chunk: int) -> list[tuple[memoryview, memoryview]]:
    """(chunk one step later, the keyframe's chunk) for every whole chunk of every float32 tensor."""
    keyframe, later = dict(tensor_leaves(states[0])), dict(tensor_leaves(states[1]))
    pairs = []
    for path, t in later.items():
        if t.dtype != torch.float32:
            continue
        new = t.contiguous().reshape(-1).view(torch.uint8).numpy()
        old = keyframe[path].contiguous().reshape(-1).view(torch.uint8).numpy()
        pairs += [(memoryview(new[s : s + chunk]), memoryview(old[s : s + chunk])) for s in range(0, new.size - chunk + 1, chunk)]
    return pairs


def timed(label: str, per_gib: float, work: Callable[[], object]) -> None:
    start = time.process_time()
    work()
    print(f"{label:44s} {(time.process_time() - start) * per_gib:6.3f} CPU s per GiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--chunk-mib", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    chunk = args.chunk_mib << 20
    pairs = chunk_pairs(wi.w1_states(args.size), chunk)
    per_gib = GIB / (len(pairs) * chunk)
    full, delta = BytePlanes(4, Zstd(1)), PlaneDelta(4, Zstd(1))
    bases = [np.array(split_planes(old, 4)[0]) for _new, old in pairs]
    print(f"W1 {args.size}: {len(pairs)} chunks of {args.chunk_mib} MiB ({len(pairs) * chunk / GIB:.2f} GiB), one thread")
    timed("blake3 (chunk ids)", per_gib, lambda: [chunk_id(new) for new, _old in pairs])
    timed("byte-plane split", per_gib, lambda: [split_planes(new, 4, scratch(chunk, "planes")) for new, _old in pairs])
    timed("keyframe encoding (planes + zstd)", per_gib, lambda: [b"".join(full.encode_parts(new)) for new, _old in pairs])
    timed("delta encoding against the keyframe", per_gib,
          lambda: [delta.encode_against(new, list(base)) for (new, _old), base in zip(pairs, bases)])

    def samples() -> None:
        for (new, _old), base in zip(pairs, bases):
            planes, _tail = split_planes(new, 4, scratch(chunk, "planes"))
            for k in range(4):
                delta.sample_ratio(memoryview(planes[k]))
                delta.sample_ratio(memoryview(planes[k]), xor_with=base[k])

    timed("split + both samples of every plane", per_gib, samples)
    per_plane: dict[tuple[int, str], list[float]] = collections.defaultdict(lambda: [0, 0, 0.0])
    for (new, _old), base in zip(pairs, bases):
        planes, _tail = split_planes(new, 4)
        for k in range(4):
            start = time.process_time()
            stored = delta._choose(memoryview(np.ascontiguousarray(planes[k])), base[k])
            row = per_plane[(k, ("XORed" if stored.xor else "own") + (", compressed" if stored.compressed else ", raw"))]
            row[0] += 1
            row[1] += len(memoryview(stored.data).cast("B"))
            row[2] += time.process_time() - start
    print("\nper plane: chunks, stored / plane size, CPU s per GiB of state")
    for (k, kind), (count, size, cpu) in sorted(per_plane.items()):
        print(f"  plane {k} {kind:18s} {int(count):5d}  {size / (count * chunk / 4):.3f}  {cpu * per_gib:.3f}")


if __name__ == "__main__":
    main()
