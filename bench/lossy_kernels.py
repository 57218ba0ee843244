"""What do the fused lossy kernels cost per value, next to torch's plain cast into a reused buffer?

    .venv/bin/python bench/lossy_kernels.py [--values 4194304] [--reps 5]

One thread, float32 normal random data (scale 0.02, like weights); best of ``--reps`` per kernel, after one
call that compiles or loads it. Each kernel writes what is stored and returns the error sums
(``ckptvault._codecs.lossy_kernels``); the torch row is only the cast, without any measurement. Prints ns per value.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch

from ckptvault._codecs import lossy_kernels


def best_ns_per_value(call: Callable[[], object], values: int, reps: int) -> float:
    call()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best / values * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=1 << 22)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    n, block = args.values, 256
    x = (torch.randn(n, generator=torch.Generator().manual_seed(0)) * 0.02).numpy()
    base = x * np.float32(0.999)
    bits, half = x.view(np.uint32), np.empty(n, np.uint16)
    q, scale = np.empty(n, np.int8), np.empty(-(-n // block), np.float32)
    cast_into = torch.empty(n, dtype=torch.float16)
    rows = {
        "bf16 (cast + measure)": lambda: lossy_kernels.cast_bf16(bits, half),
        "fp16 (cast + measure)": lambda: lossy_kernels.cast_fp16(bits, half),
        f"int8-block:{block} (quantise + measure)": lambda: lossy_kernels.quantise_int8(x, block, q, scale),
        f"residual-int8:{block} (quantise + measure)": lambda: lossy_kernels.quantise_int8_residual(x, base, block, q,
                                                                                                   scale),
        "torch fp16 copy_ into a reused buffer (cast only)": lambda: cast_into.copy_(torch.from_numpy(x)),
    }
    print(f"{n} float32 values, 1 thread, best of {args.reps}")
    for name, call in rows.items():
        print(f"{name:52s} {best_ns_per_value(call, n, args.reps):6.3f} ns/value")


if __name__ == "__main__":
    main()
