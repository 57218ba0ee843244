"""How fast and how well does zstd compress one byte plane of W1's state, in float32 and in fp16?

    .venv/bin/python bench/plane_zstd.py [--size full] [--group exp_avg]

Takes every float32 tensor of one group of W1's +10 state (``workloads_incremental.py``; the groups of
``bench_fidelity.py``), and compresses in 1 MiB pieces, on one thread: the float32 sign-and-exponent byte,
float32's second byte, the top and low byte of the same values cast to fp16, and the two high bytes of the +1
state XORed with the keyframe's (what a delta one step apart compresses). Each with the vault's zstd as it stores
(each piece sampled as ``_codecs/planes.py`` samples a plane, then stored raw or compressed as the sample says:
searched at level 1 with hash_log 7 and acceleration, searched without acceleration where it is mostly runs, or as
Huffman-coded literals only: ``_codecs/zstd.py``), with each of those three alone, and with a sweep of other settings. Prints the
stored fraction and ns per input byte (the vault's time includes its sampling).
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
from ckptvault._codecs.planes import BytePlanes  # noqa: E402
from ckptvault._codecs.zstd import ACCELERATED, LEVEL1_HASH_LOG, LITERALS_ONLY, Zstd, _compressor  # noqa: E402
from workloads import SIZES  # noqa: E402

PIECE = 1 << 20
Params = zstandard.ZstdCompressionParameters
SETTINGS: dict[str, Params | str] = {
    "vault (as stored)": "sampled",
    "level 1, hash_log 7, accelerated": "search",
    "literals only": "literals",
    "level 1, hash_log 7, unaccelerated": "runs",
    "level 1, hash_log 12": Params.from_level(1, hash_log=12),
    "level 1, hash_log 7, min_match 6": Params.from_level(1, hash_log=LEVEL1_HASH_LOG, min_match=6),
    "level 1, hash_log 7, window_log 14": Params.from_level(1, hash_log=LEVEL1_HASH_LOG, window_log=14),
    "level 2": Params.from_level(2),
    "level -1": Params.from_level(-1),
    "level -3": Params.from_level(-3),
}


def compress(plane: bytes, params: Params | str) -> tuple[float, float]:
    """(stored / raw, ns per byte), best time of 2. ``params``: zstd parameters, or how the vault's level 1
    compresses (``sampled``: as a plane of a chunk is stored; else a search of ``codecs.zstd._compressor``)."""
    if params == "sampled":
        planes = BytePlanes(1, Zstd(1))

        def compress(piece: bytes) -> bytes | memoryview:
            packed = planes.compress_if_pays(memoryview(piece))
            return piece if packed is None else packed  # stored raw where compressing does not pay
    elif isinstance(params, str):
        compress = _compressor(1, params).compress
    else:
        compress = zstandard.ZstdCompressor(compression_params=params).compress
    pieces = [plane[s : s + PIECE] for s in range(0, len(plane), PIECE)]
    best, stored = float("inf"), 0
    for _ in range(2):
        start = time.perf_counter()
        stored = sum(len(compress(p)) for p in pieces)
        best = min(best, time.perf_counter() - start)
    return stored / len(plane), best / len(plane) * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--group", choices=("weights", "exp_avg", "exp_avg_sq"), default="exp_avg")
    args = parser.parse_args()
    states = wi.w1_states(args.size)
    tensors = bench_fidelity.groups_of(states[10])[args.group]
    values = torch.cat([t.reshape(-1) for _path, t in tensors])
    xor = np.bitwise_xor(*(torch.cat([t.reshape(-1) for _path, t in bench_fidelity.groups_of(states[gap])[args.group]])
                           .view(torch.int32).numpy().view(np.uint32) for gap in (0, 1)))
    fp32 = values.view(torch.int32).numpy().view(np.uint32)
    fp16 = values.to(torch.float16).view(torch.int16).numpy().view(np.uint16)
    planes = {
        "float32 sign-and-exponent byte": (fp32 >> 24).astype(np.uint8).tobytes(),
        "float32 second byte": ((fp32 >> 16) & 0xFF).astype(np.uint8).tobytes(),
        "fp16 top byte (sign, exponent, 2 mantissa bits)": (fp16 >> 8).astype(np.uint8).tobytes(),
        "fp16 low byte": (fp16 & 0xFF).astype(np.uint8).tobytes(),
        "float32 sign-and-exponent byte, +1 XOR keyframe": (xor >> 24).astype(np.uint8).tobytes(),
        "float32 second byte, +1 XOR keyframe": ((xor >> 16) & 0xFF).astype(np.uint8).tobytes(),
    }
    print(f"W1 {args.size} {args.group}: {values.numel()} values; stored fraction, ns per byte, one thread"
          f"{'' if ACCELERATED else ' (zstandard[cffi] missing: the vault compresses without acceleration)'}"
          f"{'' if LITERALS_ONLY or not ACCELERATED else ' (no ZSTD_compressSequences: no literals-only mode)'}")
    for name, plane in planes.items():
        print(name)
        for label, params in SETTINGS.items():
            ratio, ns = compress(plane, params)
            print(f"  {label:38s} {ratio:.3f}  {ns:5.2f}")


if __name__ == "__main__":
    main()
