"""Which zstd search suits which byte plane: the acceleration of level 1, by the plane's share of zero bytes.

    .venv/bin/python bench/accel_zstd.py [--workloads W1,W2,W4] [--accelerations 32,256,4096,131072]

For W1 (the GPT), W2 (the MiniLM fine-tuning run) and W4 (sparse embeddings with Adagrad) of
``workloads_incremental.py``: the planes a keyframe stores (float32 byte k of the +10 state) and those a delta
stores (byte k of the +1 and +10 states XORed with the keyframe's). Each plane is compressed in 1 MiB pieces on one
thread, unaccelerated (level 1, hash_log 7), at each acceleration with Huffman-coded literals (as ``_codecs/zstd.py``
compresses), and as the vault does (``Zstd.encode_sampled`` after the sample ``BytePlanes`` takes). Rows group the
tensors by their plane's share of zero bytes. Prints stored fraction and ns per input byte.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads_incremental as wi  # noqa: E402
from ckptvault._codecs.planes import BytePlanes  # noqa: E402
from ckptvault._codecs.zstd import LEVEL1_HASH_LOG, Zstd  # noqa: E402
from ckptvault._codecs.zstd import _AcceleratedLevel1 as Accelerated  # noqa: E402
from workloads import tensor_leaves  # noqa: E402

PIECE = 1 << 20
BINS = ((0.0, 0.5), (0.5, 0.8), (0.8, 0.9), (0.9, 0.95), (0.95, 0.99), (0.99, 1.01))


def float_leaves(state: object) -> list[tuple[str, torch.Tensor]]:
    return [(p, t) for p, t in tensor_leaves(state) if t.dtype == torch.float32 and t.numel() >= PIECE // 4]


def planes(states: wi.States, later: int | None, k: int) -> list[tuple[str, np.ndarray]]:
    """Byte ``k`` of every float32 tensor of the +10 state (``later`` None), or of ``states[later]`` XOR the keyframe."""
    out = []
    for (path, base), (_p, t) in zip(float_leaves(states[0]), float_leaves(states[later or 10])):
        words = t.reshape(-1).numpy().view(np.uint32)
        if later is not None:
            words = words ^ base.reshape(-1).numpy().view(np.uint32)
        out.append((path, ((words >> (8 * k)) & 255).astype(np.uint8)))
    return out


def accelerated(level: int) -> Callable[[np.ndarray], bytes]:
    ctx = Accelerated()
    ctx._lib.ZSTD_CCtx_setParameter(ctx._cctx, ctx._lib.ZSTD_c_targetLength, level)
    return ctx.compress


def measure(plane: np.ndarray, compress: Callable[[np.ndarray], bytes], reps: int = 3) -> tuple[float, float]:
    """(stored fraction, ns per byte; best of ``reps``) of compressing ``plane`` in 1 MiB pieces."""
    best, stored = float("inf"), 0
    for _ in range(reps):
        start = time.perf_counter()
        stored = sum(len(compress(plane[s : s + PIECE])) for s in range(0, plane.size, PIECE))
        best = min(best, time.perf_counter() - start)
    return stored / plane.size, best / plane.size * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="W1,W2,W4")
    parser.add_argument("--accelerations", default="32,256,4096,131072")
    args = parser.parse_args()
    plain = zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters.from_level(
        1, hash_log=LEVEL1_HASH_LOG, write_content_size=1))
    stage = BytePlanes(1, Zstd(1))
    methods: dict[str, Callable[[np.ndarray], bytes]] = {"unaccelerated": plain.compress}
    methods |= {f"acc {a}": accelerated(int(a)) for a in args.accelerations.split(",")}
    methods["vault"] = lambda piece: stage.inner.encode_sampled(memoryview(piece), stage.sample_ratio(memoryview(piece)))
    print("| workload | plane | zero bytes | share of bytes | " + " | ".join(methods) + " |")
    print("|---|---|---|---:|" + "---:|" * len(methods))
    for name in args.workloads.split(","):
        states = {"W1": lambda: wi.w1_states("full"), "W2": wi.w2_states, "W4": lambda: wi.w4_states("full")}[name]()
        for later, what in ((None, "keyframe"), (1, "XOR +1"), (10, "XOR +10")):
            for k in (3, 2, 1):
                rows = []
                for _path, plane in planes(states, later, k):
                    zeros = 1 - np.count_nonzero(plane) / plane.size
                    rows.append((zeros, plane))
                total = sum(p.size for _z, p in rows)
                for lo, hi in BINS:
                    chosen = [p for z, p in rows if lo <= z < hi]
                    if not chosen:
                        continue
                    joined = np.concatenate(chosen)
                    cells = [measure(joined, fn) for fn in methods.values()]
                    print(f"| {name} | {what} byte {k} | {lo:.2f}-{min(hi, 1):.2f} | {joined.size / total:.2f} | "
                          + " | ".join(f"{r:.3f} at {ns:.2f}" for r, ns in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
