"""How fast and how well does zstd compress one byte plane of W1's Adam moments, in float32 and in fp16?

    .venv/bin/python bench/plane_zstd.py [--size full] [--group exp_avg]

Takes every float32 tensor of one group of W1's +10 state (``workloads_incremental.py``; the groups of
``bench_fidelity.py``), and compresses in 1 MiB pieces, on one thread: the float32 sign-and-exponent byte,
float32's second byte, and the top and low byte of the same values cast to fp16, each with the vault's zstd
(level 1, hash_log 7) and a sweep of other settings. Prints the stored fraction and ns per input byte.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_fidelity  # noqa: E402
import workloads_incremental as wi  # noqa: E402
from ckptvault.codecs.zstd import LEVEL1_HASH_LOG  # noqa: E402
from workloads import SIZES  # noqa: E402

PIECE = 1 << 20
Params = zstandard.ZstdCompressionParameters
SETTINGS = {
    "vault (level 1, hash_log 7)": Params.from_level(1, hash_log=LEVEL1_HASH_LOG),
    "level 1, hash_log 12": Params.from_level(1, hash_log=12),
    "level 1, hash_log 7, min_match 6": Params.from_level(1, hash_log=LEVEL1_HASH_LOG, min_match=6),
    "level 1, hash_log 7, window_log 14": Params.from_level(1, hash_log=LEVEL1_HASH_LOG, window_log=14),
    "level 2": Params.from_level(2),
    "level -1": Params.from_level(-1),
    "level -3": Params.from_level(-3),
}


def compress(plane: bytes, params: zstandard.ZstdCompressionParameters) -> tuple[float, float]:
    """(stored / raw, ns per byte), best time of 2."""
    compressor = zstandard.ZstdCompressor(compression_params=params)
    pieces = [plane[s : s + PIECE] for s in range(0, len(plane), PIECE)]
    best, stored = float("inf"), 0
    for _ in range(2):
        start = time.perf_counter()
        stored = sum(len(compressor.compress(p)) for p in pieces)
        best = min(best, time.perf_counter() - start)
    return stored / len(plane), best / len(plane) * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--group", choices=("weights", "exp_avg", "exp_avg_sq"), default="exp_avg")
    args = parser.parse_args()
    tensors = bench_fidelity.groups_of(wi.w1_states(args.size)[10])[args.group]
    values = torch.cat([t.reshape(-1) for _path, t in tensors])
    fp32 = values.view(torch.int32).numpy().view(np.uint32)
    fp16 = values.to(torch.float16).view(torch.int16).numpy().view(np.uint16)
    planes = {
        "float32 sign-and-exponent byte": (fp32 >> 24).astype(np.uint8).tobytes(),
        "float32 second byte": ((fp32 >> 16) & 0xFF).astype(np.uint8).tobytes(),
        "fp16 top byte (sign, exponent, 2 mantissa bits)": (fp16 >> 8).astype(np.uint8).tobytes(),
        "fp16 low byte": (fp16 & 0xFF).astype(np.uint8).tobytes(),
    }
    print(f"W1 {args.size} {args.group}: {values.numel()} values; stored fraction, ns per byte, one thread")
    for name, plane in planes.items():
        print(name)
        for label, params in SETTINGS.items():
            ratio, ns = compress(plane, params)
            print(f"  {label:38s} {ratio:.3f}  {ns:5.2f}")


if __name__ == "__main__":
    main()
