"""Is the S3 store slower than boto3 at moving bytes? 64 conditional PUTs of 16 MiB vs one upload_file of 1 GiB.

    .venv/bin/python bench/s3_raw_puts.py [--reps 2]

Starts the same Ceph RGW as ``bench_s3.py`` (or uses ``--endpoint``). No hashing, no codec, no staging: only
``S3Store.put_if_absent`` from 16 threads (what a save's chunk writes do) against boto3's ``upload_file`` of
the same bytes from a local file (default TransferConfig). Prints seconds per rep.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_s3 import BUCKET, Gateway  # noqa: E402
from ckptvault.stores import open_store  # noqa: E402

OBJECTS, SIZE, THREADS = 64, 16 << 20, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--endpoint", default=None)
    args = parser.parse_args()
    gw = Gateway(args.endpoint)
    try:
        client = gw.bucket_client()
        noise = os.urandom(SIZE)
        blobs = [bytes([i]) + noise[1:] for i in range(OBJECTS)]
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "blob.bin"
            path.write_bytes(b"".join(blobs))
            for rep in range(args.reps):
                store = open_store(f"s3://{BUCKET}/raw-puts-{rep}", gw.options())
                with ThreadPoolExecutor(THREADS) as pool:
                    t0 = time.perf_counter()
                    list(pool.map(lambda kb, s=store: s.put_if_absent(f"chunks/{kb[0]}", kb[1]), enumerate(blobs)))
                    puts = time.perf_counter() - t0
                store.close()
                t0 = time.perf_counter()
                client.upload_file(str(path), BUCKET, f"raw-puts-file-{rep}")
                upload = time.perf_counter() - t0
                print(f"rep {rep + 1}: {OBJECTS} x {SIZE >> 20} MiB put_if_absent ({THREADS} threads) {puts:.2f} s; "
                      f"boto3 upload_file of the same {OBJECTS * SIZE >> 20} MiB {upload:.2f} s", flush=True)
    finally:
        gw.stop()


if __name__ == "__main__":
    main()
