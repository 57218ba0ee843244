"""Where ckptvault's save and restore spend their time, stage by stage, on the W1 state.

    .venv/bin/python bench/profile_core.py --size full

Runs every stage of the save pipeline (hash, shuffle, zstd, object framing,
write, fsync, link + directory fsync) and of the restore pipeline (cold read,
parse, zstd decode, unshuffle, hash check, copy into a preallocated tensor)
chunk by chunk on ONE thread, using the library's own functions, and prints
seconds per stage for the whole state and its throughput. It also measures a
few alternatives the numbers suggest (blosc2, byte-plane selective zstd,
threaded blake3, one big file vs one file per chunk), so a proposal comes
with a figure. For the real multi-threaded pipeline, run the manager under
py-spy instead (see bench/README.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads must not spin against the pool threads measured
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ckptvault._codecs import DEFAULT_CODEC, chain_for, decode_chain, encode_chain  # noqa: E402
from ckptvault._codecs.shuffle import Shuffle  # noqa: E402
from ckptvault._format.chunk_object import ChunkHeader, chunk_id, encode_object, parse_object  # noqa: E402
from ckptvault._save.chunking import LeafSpec, plan_chunks  # noqa: E402
from ckptvault._save.snapshot import take_snapshot  # noqa: E402
from ckptvault._vault import DEFAULT_CHUNK_SIZE  # noqa: E402
from ckptvault.rules import CodecRules  # noqa: E402
from common import drop_caches, fresh_dir  # noqa: E402
from workloads import OUT_DIR, SIZES, w1_state  # noqa: E402


class Stages:
    """Accumulated seconds per named stage."""

    def __init__(self) -> None:
        self.secs: dict[str, float] = defaultdict(float)
        self.bytes: dict[str, int] = defaultdict(int)

    def run(self, name: str, nbytes: int, fn: Any, *args: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args)
        self.secs[name] += time.perf_counter() - t0
        self.bytes[name] += nbytes
        return out

    def table(self, title: str, total: int) -> str:
        lines = [f"\n{title}", "| stage | s for the state | GB/s (of raw bytes) |", "|---|---:|---:|"]
        for name, secs in self.secs.items():
            lines.append(f"| {name} | {secs:.3f} | {self.bytes[name] / secs / 1e9 if secs else float('inf'):.2f} |")
        lines.append(f"| **sum** | {sum(self.secs.values()):.3f} | {total / sum(self.secs.values()) / 1e9:.2f} |")
        return "\n".join(lines)


def chunk_views(state: Any, chunk_size: int) -> list[tuple[memoryview, int]]:
    """The raw bytes of every chunk of the state as the save pipeline plans them, with element size."""
    snap = take_snapshot(state, CodecRules(None, "zstd"))
    specs = [LeafSpec(r.nbytes, r.itemsize, r.codec) for r in snap.records]
    plans, _ = plan_chunks(specs, chunk_size, chunk_size // 4)
    out = []
    for plan in plans:
        parts = [snap.views[s.leaf][s.start : s.start + s.length] for s in plan.sources]
        out.append((parts[0] if len(parts) == 1 else memoryview(b"".join(parts)), plan.itemsize))
    return out


def write_file(path: Path, data: Any, sync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data).cast("B")
        while view:
            view = view[os.write(fd, view):]
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def fsync_path(path: Path, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def profile_save(chunks: list[tuple[memoryview, int]], work: Path) -> tuple[Stages, list[tuple[str, int]]]:
    """Each save stage over all chunks, one thread, objects written like LocalStore does."""
    st, written = Stages(), []
    tmp, final = fresh_dir(work / "tmp"), fresh_dir(work / "chunks")
    tmp.mkdir()
    final.mkdir()
    drop_caches()
    for i, (raw, itemsize) in enumerate(chunks):
        n = len(raw)
        cid = st.run("hash (blake3, 1 thread)", n, chunk_id, raw)
        codec, payload = st.run(f"encode ({DEFAULT_CODEC} chain)", n, encode_chain, raw, chain_for(DEFAULT_CODEC, itemsize))
        obj = st.run("frame object (b''.join)", n, encode_object, ChunkHeader(codec=codec, raw=n), payload)
        part = tmp / f"{i}.part"
        st.run("write to page cache", n, write_file, part, obj, False)
        st.run("fsync file", n, fsync_path, part)
        st.run("link + unlink tmp", n, lambda p=part, c=cid: (os.link(p, final / c), p.unlink()))
        st.run("fsync directory", n, fsync_path, final, os.O_RDONLY | os.O_DIRECTORY)
        written.append((cid, itemsize))
    return st, written


def profile_restore(written: list[tuple[str, int]], chunks: list[tuple[memoryview, int]], work: Path) -> Stages:
    """Each restore stage over the objects written by :func:`profile_save`, cold cache, one thread."""
    st = Stages()
    dest = [np.empty(len(raw), dtype=np.uint8) for raw, _ in chunks]
    for d in dest:
        d.fill(0)  # a preallocated, already-faulted target
    drop_caches()
    for (cid, _), d in zip(written, dest):
        n = d.nbytes
        data = st.run("read file (cold)", n, (work / "chunks" / cid).read_bytes)
        header, payload = st.run("parse header", n, parse_object, cid, data)
        raw = st.run(f"decode ({DEFAULT_CODEC} chain)", n, decode_chain, payload, header.codec, n)
        st.run("hash check (blake3)", n, chunk_id, raw)
        st.run("copy into target", n, np.copyto, d, np.frombuffer(raw, dtype=np.uint8))
    return st


def alternatives(chunks: list[tuple[memoryview, int]], work: Path) -> list[str]:
    """Throughput and ratio of options the stage table suggests, on a sample of the chunks."""
    import blake3
    import blosc2
    import zstandard

    sample = [c for c in chunks if c[1] == 4][:: max(1, len(chunks) // 48)]
    total = sum(len(r) for r, _ in sample)
    rows = []

    def bench(name: str, fn: Any) -> None:
        t0 = time.perf_counter()
        out = sum(fn(r) for r, _ in sample)
        secs = time.perf_counter() - t0
        ratio = f"{out / total:.3f}" if out else "-"
        rows.append(f"| {name} | {total / secs / 1e9:.2f} | {ratio} |")

    shuffle, z1, chain = Shuffle(4), zstandard.ZstdCompressor(level=1), chain_for(DEFAULT_CODEC, 4)
    bench(f"library default chain ({DEFAULT_CODEC})", lambda r: len(encode_chain(r, chain)[1]))
    bench("numpy shuffle + zstd-1 on the whole chunk", lambda r: len(z1.compress(shuffle.encode(r))))
    bench("blosc2 shuffle + zstd-1, 1 thread", lambda r: len(blosc2.compress2(r, typesize=4, clevel=1,
          codec=blosc2.Codec.ZSTD, filters=[blosc2.Filter.SHUFFLE], nthreads=1)))
    bench("blosc2 shuffle + zstd-1, 2 threads", lambda r: len(blosc2.compress2(r, typesize=4, clevel=1,
          codec=blosc2.Codec.ZSTD, filters=[blosc2.Filter.SHUFFLE], nthreads=2)))
    bench("blosc2 shuffle + lz4, 1 thread", lambda r: len(blosc2.compress2(r, typesize=4, clevel=1,
          codec=blosc2.Codec.LZ4, filters=[blosc2.Filter.SHUFFLE], nthreads=1)))
    bench("numpy shuffle, zstd-1 on the top byte plane only, rest raw", lambda r: _planes_zstd(shuffle, z1, r, 1))
    bench("blake3, 1 thread", lambda r: (blake3.blake3(r).digest(), 0)[1])
    bench("blake3, max_threads=2", lambda r: (blake3.blake3(r, max_threads=2).digest(), 0)[1])
    if _xxh3() is not None:
        bench("xxh3-128", _xxh3())
    rows += _one_file_vs_many(chunks, work)
    return ["\n| alternative (fp32 chunk sample) | GB/s | stored/raw |", "|---|---:|---:|", *rows]


def _planes_zstd(shuffle: Shuffle, z: Any, raw: memoryview, planes: int) -> int:
    """Stored size when only the ``planes`` most significant byte planes are compressed."""
    shuffled = np.frombuffer(shuffle.encode(raw), dtype=np.uint8)
    plane = len(shuffled) // 4
    cut = (4 - planes) * plane
    return cut + len(z.compress(shuffled[cut:]))


def _xxh3() -> Any:
    try:
        import xxhash
    except ImportError:
        return None
    return lambda r: (xxhash.xxh3_128(r).digest(), 0)[1]


def _one_file_vs_many(chunks: list[tuple[memoryview, int]], work: Path) -> list[str]:
    """Raw bytes to disk with fsync: one big file vs one file + fsync + dir fsync per chunk."""
    total = sum(len(r) for r, _ in chunks)
    rows = []
    d = fresh_dir(work / "onefile")
    d.mkdir()
    drop_caches()
    t0 = time.perf_counter()
    fd = os.open(d / "all", os.O_WRONLY | os.O_CREAT, 0o644)
    for raw, _ in chunks:
        view = raw
        while view:
            view = view[os.write(fd, view):]
    os.fsync(fd)
    os.close(fd)
    rows.append(f"| raw write, one file, one fsync | {total / (time.perf_counter() - t0) / 1e9:.2f} | 1.000 |")
    d = fresh_dir(work / "manyfiles")
    d.mkdir()
    drop_caches()
    t0 = time.perf_counter()
    for i, (raw, _) in enumerate(chunks):
        write_file(d / str(i), raw, True)
        fsync_path(d, os.O_RDONLY | os.O_DIRECTORY)
    rows.append(f"| raw write, file + fsync + dir fsync per chunk | {total / (time.perf_counter() - t0) / 1e9:.2f} | 1.000 |")
    d = fresh_dir(work / "manyfiles2")
    d.mkdir()
    drop_caches()
    t0 = time.perf_counter()
    for i, (raw, _) in enumerate(chunks):
        write_file(d / str(i), raw, False)
    for i in range(len(chunks)):
        fsync_path(d / str(i))
    fsync_path(d, os.O_RDONLY | os.O_DIRECTORY)
    secs = time.perf_counter() - t0
    rows.append(f"| raw write, file per chunk, fsyncs batched at the end | {total / secs / 1e9:.2f} | 1.000 |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE)
    parser.add_argument("--work", type=Path, default=OUT_DIR / "profile")
    args = parser.parse_args(argv)
    state = w1_state(args.size)
    chunks = chunk_views(state, args.chunk_size)
    total = sum(len(r) for r, _ in chunks)
    print(f"{len(chunks)} chunks, {total / 1e9:.3f} GB, chunk size {args.chunk_size >> 20} MiB")
    save, written = profile_save(chunks, args.work)
    print(save.table("save stages, 1 thread", total))
    restore = profile_restore(written, chunks, args.work)
    print(restore.table("restore stages, 1 thread, cold cache", total))
    print("\n".join(alternatives(chunks, args.work)))
    fresh_dir(args.work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
