"""Where the CPU of an S3 save goes, on the client and on the gateway: per request, and per first save of W1.

    .venv/bin/python bench/s3_costs.py --runs 5                       # requests, then saves: defaults and boto3
    .venv/bin/python bench/s3_costs.py --runs 5 --variants sync,sync-no-probe,sync-no-commit-check,sync-copied-bodies,boto3

Starts the gateway with ``scripts/ceph-rgw.sh`` (as ``bench_s3.py`` does). Server CPU is read from
``/proc/PID/stat`` of the daemons the script started (mon, OSD, radosgw); client CPU is this process's.

Part 1, per request on one connection pool of 16 threads: HEAD, PutObject of 16 MiB (new key, and
``If-None-Match: *`` on an existing key, which RGW answers 412 only after reading the body), and CopyObject
of a 16 MiB object onto itself (what ``touch`` sends).

Part 2, the first save of W1 (``workloads_incremental.py``) into a fresh vault, interleaved with boto3
``upload_file`` of its torch.save file. Variants (``--variants``, comma-separated):

* ``sync`` / ``async``: ``CheckpointManager(async_save=...)``, defaults otherwise;
* ``sync-no-probe``: the store answers "absent" to the save's per-chunk existence probe (what skipping it
  would save; the commit-time check still runs);
* ``sync-no-commit-check``: the commit skips its existence check of every chunk (what that check costs);
* ``sync-copied-bodies``: request bodies go to botocore as one joined ``bytes`` object, as before
  ``PayloadReader`` (botocore then copies them while signing and sending);
* ``boto3``: ``upload_file`` of the torch.save file (written before the clock starts);
* ``boto3-snapshot``: a host snapshot of the state (every tensor cloned into fresh memory, as any asynchronous
  saver's first snapshot of a CPU state is), then that ``upload_file``: a floor for an asynchronous save built on
  boto3 (torch.save's serialisation is not counted).

The ``no-`` and ``copied-`` variants patch ckptvault internals: they measure costs, they are not settings.

``--pin``: the client on CPU 0 and every thread of the gateway's daemons on CPU 1 (``taskset``), so that neither
side's work takes CPU time from the other, as on separate machines (each then has one core).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_s3  # noqa: E402
import workloads_incremental as wi  # noqa: E402
from ckptvault import CheckpointManager  # noqa: E402
from ckptvault.errors import ObjectNotFoundError  # noqa: E402
from ckptvault.stores import open_store  # noqa: E402
from ckptvault.stores.s3 import S3Store  # noqa: E402
from common import process_cpu  # noqa: E402

MIB16 = 16 << 20


def server_cpu(pids: list[int]) -> float:
    """User + system CPU seconds of the gateway's daemons so far."""
    return sum(process_cpu(pid) for pid in pids)


def measured(pids: list[int], fn: Callable[[], Any]) -> tuple[float, float, float]:
    """(wall, client CPU, server CPU) seconds of ``fn()``."""
    s0, c0, w0 = server_cpu(pids), time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0, server_cpu(pids) - s0


def per_request(gw: bench_s3.Gateway, pids: list[int]) -> None:
    client = gw.bucket_client()
    pool = ThreadPoolExecutor(16)
    small, big = os.urandom(1000), os.urandom(MIB16)
    prefix = f"costs-{uuid.uuid4().hex[:8]}"
    heads = [f"{prefix}/h{i}" for i in range(200)]
    bigs = [f"{prefix}/b{i}" for i in range(32)]
    list(pool.map(lambda k: client.put_object(Bucket=bench_s3.BUCKET, Key=k, Body=small), heads))

    def conditional_put(key: str) -> None:
        try:
            client.put_object(Bucket=bench_s3.BUCKET, Key=key, Body=big, IfNoneMatch="*")
        except client.exceptions.ClientError as exc:
            assert exc.response["Error"]["Code"] == "PreconditionFailed", exc

    cases = [
        ("HEAD", heads * 5, lambda k: client.head_object(Bucket=bench_s3.BUCKET, Key=k)),
        ("PutObject 16 MiB, new key", bigs, conditional_put),
        ("PutObject 16 MiB, existing key (412)", bigs, conditional_put),
        ("CopyObject 16 MiB onto itself (touch)", bigs, lambda k: client.copy_object(
            Bucket=bench_s3.BUCKET, Key=k, CopySource={"Bucket": bench_s3.BUCKET, "Key": k},
            MetadataDirective="REPLACE", Metadata={"t": str(time.time())})),
    ]
    print("| request (16 threads) | wall ms / request | client CPU ms | gateway CPU ms |\n|---|---:|---:|---:|")
    for name, keys, fn in cases:
        wall, cpu, srv = measured(pids, lambda f=fn, ks=keys: list(pool.map(f, ks)))
        n = len(keys)
        print(f"| {name} | {wall / n * 1e3:.1f} | {cpu / n * 1e3:.1f} | {srv / n * 1e3:.1f} |", flush=True)
    for key in heads + bigs:
        client.delete_object(Bucket=bench_s3.BUCKET, Key=key)


class Patched:
    """The ``no-`` variants: patch one internal for the duration of a save."""

    def __init__(self, variant: str) -> None:
        self.variant = variant
        self.undo: list[Callable[[], None]] = []

    def __enter__(self) -> Patched:
        if "no-probe" in self.variant:
            save_mod = sys.modules["ckptvault._save.chunks"]
            original_store, original_stat = save_mod._ChunkWriter._store, S3Store.stat
            probing = threading.local()

            def store_without_probe(writer: Any, *args: Any) -> Any:
                probing.on = True  # only the writer's probe of its chunk, not the commit's check
                try:
                    return original_store(writer, *args)
                finally:
                    probing.on = False

            def stat(store: S3Store, key: str) -> Any:
                if getattr(probing, "on", False) and key.startswith("chunks/"):
                    probing.on = False
                    raise ObjectNotFoundError(key)
                return original_stat(store, key)

            save_mod._ChunkWriter._store, S3Store.stat = store_without_probe, stat
            self.undo.append(lambda: setattr(save_mod._ChunkWriter, "_store", original_store))
            self.undo.append(lambda: setattr(S3Store, "stat", original_stat))
        if "copied-bodies" in self.variant:
            s3_mod = sys.modules["ckptvault.stores.s3"]
            original_reader = s3_mod.PayloadReader
            s3_mod.PayloadReader = lambda parts: b"".join(parts)
            self.undo.append(lambda: setattr(s3_mod, "PayloadReader", original_reader))
        if "no-commit-check" in self.variant:
            saver_mod = sys.modules["ckptvault._save.pipeline"]
            original_commit = saver_mod.commit

            def commit_without_check(vault: Any, step: int, manifest: dict[str, Any], overwrite: bool,
                                     guard: Any = None) -> None:
                save_mod = sys.modules["ckptvault._save.commit"]
                vault.store.put_if_absent(save_mod.manifest_key(step), save_mod.encode_manifest(manifest))

            saver_mod.commit = commit_without_check
            self.undo.append(lambda: setattr(saver_mod, "commit", original_commit))
        return self

    def __exit__(self, *exc: object) -> None:
        for undo in self.undo:
            undo()


def cloned(state: Any) -> Any:
    """``state`` with every tensor cloned into fresh memory (dicts, lists and tuples followed)."""
    import torch

    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {key: cloned(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(cloned(value) for value in state)
    return state


def first_saves(gw: bench_s3.Gateway, pids: list[int], variants: list[str], runs: int) -> None:
    states = wi.w1_states("full")
    client = gw.bucket_client()
    path = bench_s3.OUT_DIR / "s3-costs-state.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    import torch

    torch.save(states[0], path)
    results: dict[str, list[tuple[float, float, float]]] = {v: [] for v in variants}
    for run in range(runs):
        for variant in variants:
            if variant.startswith("boto3"):
                key = f"boto3/{uuid.uuid4().hex}.pt"

                def upload(k: str = key, snapshot: bool = variant == "boto3-snapshot") -> None:
                    held = cloned(states[0]) if snapshot else None
                    client.upload_file(str(path), bench_s3.BUCKET, k)
                    del held

                results[variant].append(measured(pids, upload))
                client.delete_object(Bucket=bench_s3.BUCKET, Key=key)
            else:
                url = f"s3://{bench_s3.BUCKET}/costs-{uuid.uuid4().hex[:8]}"
                with CheckpointManager(url, storage_options=gw.options(), async_save=variant.startswith("async")) as mgr:
                    with Patched(variant):
                        results[variant].append(measured(pids, lambda m=mgr: m.save(0, states[0]).wait()))
                store = open_store(url, gw.options())
                for info in list(store.list()):
                    store.delete(info.key)
                store.close()
            wall, cpu, srv = results[variant][-1]
            print(f"  run {run + 1} {variant}: wall {wall:.2f} client {cpu:.2f} gateway {srv:.2f}", flush=True)
    path.unlink()
    peer = statistics.median(w for w, _, _ in results["boto3"]) if "boto3" in results else None
    print(f"\nW1 first save, medians of {runs} interleaved runs (s)\n")
    print("| variant | wall | client CPU | gateway CPU | / boto3 upload |\n|---|---:|---:|---:|---:|")
    for variant, rows in results.items():
        wall, cpu, srv = (statistics.median(r[i] for r in rows) for i in range(3))
        ratio = f"{wall / peer:.2f}x" if peer else ""
        print(f"| {variant} | {wall:.2f} | {cpu:.2f} | {srv:.2f} | {ratio} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--variants", default="sync,async,boto3")
    parser.add_argument("--parts", default="requests,saves")
    parser.add_argument("--pin", action="store_true", help="client on CPU 0, gateway on CPU 1")
    args = parser.parse_args()
    if args.pin and len(os.sched_getaffinity(0)) < 2:
        parser.error("--pin needs CPUs 0 and 1")
    if args.pin:
        os.sched_setaffinity(0, {0})  # before any thread starts: threads inherit it
    gw = bench_s3.Gateway(None)
    try:
        pids = [int(p) for p in Path(gw.state_dir or "", "pids").read_text().split()]
        if args.pin:
            for pid in pids:
                subprocess.run(["taskset", "--all-tasks", "--pid", "--cpu-list", "1", str(pid)], check=True,
                               capture_output=True)
        if "requests" in args.parts:
            per_request(gw, pids)
        if "saves" in args.parts:
            first_saves(gw, pids, args.variants.split(","), args.runs)
    finally:
        gw.stop()


if __name__ == "__main__":
    main()
