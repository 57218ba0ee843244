"""Object-storage benchmark (docs/benchmarks/object-storage.md): ckptvault on S3 (a real Ceph RGW) against boto3 + torch.save.

    .venv/bin/python bench/bench_s3.py --size full --runs 5     # the documented run (W1, ~1.03 GB of state)
    .venv/bin/python bench/bench_s3.py --size tiny --runs 1     # smoke check, seconds

States: W1 of ``workloads_incremental.py`` (the ~85M GPT + AdamW) at its keyframe and one step later. Per run:

* peer: torch.save of the keyframe state to a local file (not timed: it is the same for every upload method),
  then boto3 ``upload_file`` of it (default TransferConfig: 8 MiB multipart parts, 10 threads), and
  ``download_file`` + ``torch.load`` (weights_only) back;
* ckptvault: a fresh ``s3://`` vault, save of the keyframe until durable (the first save), then of the state one
  step later (an incremental save: dedup + XOR deltas; timed once the first save's background work after its
  commit, the keyframe cache fill, is done, as it is long before the next save of a training loop), then a
  restore of each in a fresh CheckpointManager (new connections), checked bit for bit.

Both use the same endpoint and botocore settings (plain http, or https with ``--tls``; checksums "when_required";
request bodies signed as each client decides, unless ``--sign-payloads`` / ``--peer-sign-payloads`` say). The gateway is
started by ``scripts/ceph-rgw.sh`` unless ``--endpoint`` (with AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)
names one. Medians over ``--runs``; results on stdout (markdown) and in
``bench/out/s3-results-SIZE-CODEC-CHUNKmib.{json,md}``. The ratio column divides the medians; the last column gives
each run's ratio to the same run's peer, and their median.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workloads_incremental as wi  # noqa: E402
from ckptvault import CheckpointManager  # noqa: E402
from common import Timing, machine  # noqa: E402
from workloads import OUT_DIR, assert_same_tensors, state_nbytes  # noqa: E402

log = logging.getLogger("bench_s3")
ROOT = Path(__file__).resolve().parent.parent
BUCKET = "ckv-bench"


#: --sign-payloads / --peer-sign-payloads: "auto" leaves it to the client (ckptvault: over http only; botocore with
#: these checksum settings: always), "on" / "off" force it
SIGNING = {"auto": None, "on": True, "off": False}


class Gateway:
    """The S3 endpoint: started with scripts/ceph-rgw.sh (and stopped on exit), or given.

    ``tls``: use the started gateway's https endpoint, verified against its certificate. ``peer_sign_payloads``:
    the boto3 peer's ``payload_signing_enabled`` (None: botocore's choice)."""

    def __init__(self, endpoint: str | None, tls: bool = False, peer_sign_payloads: bool | None = None) -> None:
        self.state_dir: str | None = None
        self.verify: str | None = None
        self.peer_sign_payloads = peer_sign_payloads
        if endpoint:
            self.endpoint = endpoint
            self.keys = (os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"])
            return
        out = subprocess.run([str(ROOT / "scripts" / "ceph-rgw.sh"), "start"], capture_output=True, text=True, check=True,
                             env={**os.environ, "CKV_RGW_PARENT_PID": str(os.getpid())})
        env_file = Path(out.stdout.strip().splitlines()[-1])
        values = dict(line.split("=", 1) for line in env_file.read_text().splitlines() if "=" in line)
        self.state_dir = values["CKV_RGW_DIR"]
        self.endpoint = values["CKV_S3_TLS_ENDPOINT"] if tls else values["CKV_S3_ENDPOINT"]
        self.verify = values["CKV_S3_CA"] if tls else None
        self.keys = (values["AWS_ACCESS_KEY_ID"], values["AWS_SECRET_ACCESS_KEY"])

    def options(self) -> dict[str, Any]:
        return {"endpoint_url": self.endpoint, "aws_access_key_id": self.keys[0], "aws_secret_access_key": self.keys[1],
                "region_name": "us-east-1", **({"verify": self.verify} if self.verify else {})}

    def client(self) -> Any:
        import boto3
        from botocore.config import Config

        cfg = Config(request_checksum_calculation="when_required", response_checksum_validation="when_required",
                     max_pool_connections=32, s3=None if self.peer_sign_payloads is None
                     else {"payload_signing_enabled": self.peer_sign_payloads})
        return boto3.client("s3", config=cfg, **self.options())

    def bucket_client(self) -> Any:
        """A boto3 client, after creating the benchmark's bucket if it does not exist yet."""
        client = self.client()
        try:
            client.create_bucket(Bucket=BUCKET)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        return client

    def stop(self) -> None:
        if self.state_dir:
            subprocess.run([str(ROOT / "scripts" / "ceph-rgw.sh"), "stop", self.state_dir], capture_output=True, check=False)


def time_it(timing: Timing, fn: Any) -> Any:
    wall0, cpu0 = time.perf_counter(), time.process_time()
    out = fn()
    timing.add(time.perf_counter() - wall0, time.process_time() - cpu0)
    return out


def boto3_run(gw: Gateway, state: Any, scratch: Path, t: dict[str, Timing]) -> int:
    """torch.save to a file, then boto3 upload_file; download_file + torch.load. Returns the file's size."""
    import torch

    client = gw.client()
    path, back = scratch / "state.pt", scratch / "back.pt"
    torch.save(state, path)
    key = f"boto3/{uuid.uuid4().hex}.pt"
    time_it(t["boto3_upload"], lambda: client.upload_file(str(path), BUCKET, key))

    def download_and_load() -> Any:
        client.download_file(BUCKET, key, str(back))
        return torch.load(back, weights_only=True)

    loaded = time_it(t["boto3_download_load"], download_and_load)
    assert_same_tensors(state, loaded)
    del loaded
    client.delete_object(Bucket=BUCKET, Key=key)
    size = path.stat().st_size
    path.unlink()
    back.unlink()
    return size


def ckptvault_run(gw: Gateway, states: wi.States, t: dict[str, Timing], codec: str, chunk_mib: int,
                  workers: int = 0, cache_keyframe: bool | None = None, sign_payloads: bool | None = None
                  ) -> dict[str, int]:
    """First save, incremental save, and both restores (fresh manager) into new tensors, checked bit for bit."""
    url = f"s3://{BUCKET}/vault-{uuid.uuid4().hex[:8]}"
    options = {**gw.options(), **({"workers": workers} if workers else {}),
               **({} if sign_payloads is None else {"sign_payloads": sign_payloads})}
    with CheckpointManager(url, storage_options=options, codec=codec, chunk_size=chunk_mib << 20 or None,
                           cache_keyframe=cache_keyframe) as mgr:
        time_it(t["first_save"], lambda: mgr.save(0, states[0]).wait())
        mgr.wait()  # the first save's work after its commit (the keyframe cache fill): done before a later save in training
        time_it(t["incremental_save"], lambda: mgr.save(1, states[1]).wait())
        sizes = {"first_stored": mgr.info(0).stored_bytes, "incremental_added": mgr.info(1).added_bytes}
    for step, timing in ((0, "first_restore"), (1, "incremental_restore")):
        with CheckpointManager(url, storage_options=gw.options()) as fresh:
            restored = time_it(t[timing], lambda s=step, m=fresh: m.restore(s))
        assert_same_tensors(states[step], restored)
        del restored
    from ckptvault.stores import open_store

    store = open_store(url, gw.options())  # free the gateway's disk for the next run
    for info in list(store.list()):
        store.delete(info.key)
    store.close()
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="full", choices=["full", "dev", "tiny"])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--codec", default="zstd", help="vault codec (zstd, lz4, none)")
    parser.add_argument("--chunk-mib", type=int, default=16, help="vault chunk size in MiB (16: the S3 default)")
    parser.add_argument("--workers", type=int, default=0, help="storage_options workers (0: the S3 store's default, 16)")
    parser.add_argument("--no-keyframe-cache", dest="cache_keyframe", action="store_const", const=False, default=None,
                        help="CheckpointManager(cache_keyframe=False): delta saves read the keyframe back")
    parser.add_argument("--endpoint", default=None, help="an S3 endpoint to use instead of starting Ceph RGW")
    parser.add_argument("--tls", action="store_true", help="both clients use the started gateway's https endpoint")
    parser.add_argument("--sign-payloads", choices=sorted(SIGNING), default="auto",
                        help="ckptvault's sign_payloads (auto: its default, over http only)")
    parser.add_argument("--peer-sign-payloads", choices=sorted(SIGNING), default="auto",
                        help="the boto3 peer's payload_signing_enabled (auto: botocore's choice, which signs here)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    states = wi.w1_states(args.size)
    states = {0: states[0], 1: states[1]}
    gw = Gateway(args.endpoint, args.tls, SIGNING[args.peer_sign_payloads])
    try:
        gw.bucket_client()
        scratch = OUT_DIR / "s3-scratch"
        scratch.mkdir(parents=True, exist_ok=True)
        names = ["boto3_upload", "boto3_download_load", "first_save", "incremental_save", "first_restore",
                 "incremental_restore"]
        t = {n: Timing() for n in names}
        facts: dict[str, int] = {}
        for run in range(args.runs):
            facts["torch_save_bytes"] = boto3_run(gw, states[0], scratch, t)
            facts.update(ckptvault_run(gw, states, t, args.codec, args.chunk_mib, args.workers, args.cache_keyframe,
                                       SIGNING[args.sign_payloads]))
            log.info("run %d: %s", run + 1, {n: round(t[n].wall[-1], 2) for n in names})
        report(args, t, facts, state_nbytes(states[0]))
    finally:
        gw.stop()


def report(args: argparse.Namespace, t: dict[str, Timing], facts: dict[str, int], logical: int) -> None:
    rows = [
        ("first save (until durable) vs boto3 upload_file", "first_save", "boto3_upload"),
        ("incremental save (+1 step) vs boto3 upload_file", "incremental_save", "boto3_upload"),
        ("restore of the first checkpoint vs download_file + torch.load", "first_restore", "boto3_download_load"),
        ("restore of the incremental checkpoint vs download_file + torch.load", "incremental_restore", "boto3_download_load"),
    ]
    lines = [f"W1 {args.size}: {logical / 1e9:.3f} GB logical, torch.save file {facts['torch_save_bytes'] / 1e9:.3f} GB; "
             f"ckptvault codec {args.codec}, chunks of {args.chunk_mib} MiB: first checkpoint stores "
             f"{facts['first_stored'] / 1e9:.3f} GB, the incremental "
             f"one adds {facts['incremental_added'] / 1e9:.3f} GB ({facts['incremental_added'] / facts['torch_save_bytes']:.3f}x "
             "torch.save)", "", "| operation | ckptvault s | boto3 + torch s | ratio | per run (median) |",
             "|---|---|---|---|---|"]
    for name, ours, peer in rows:
        per_run = [a / b for a, b in zip(t[ours].wall, t[peer].wall, strict=True)]  # each against its own run's peer
        lines.append(f"| {name} | {t[ours].median:.2f} | {t[peer].median:.2f} | {t[ours].median / t[peer].median:.2f}x | "
                     f"{', '.join(f'{r:.2f}' for r in per_run)} ({statistics.median(per_run):.2f}x) |")
    lines.append(f"\nmedians of {args.runs} runs; all times: " + json.dumps({n: [round(w, 2) for w in v.wall]
                                                                              for n, v in t.items()}))
    text = "\n".join(lines)
    print(text)
    out = {"args": vars(args), "machine": machine(), "facts": facts, "logical_bytes": logical,
           "times": {n: {"wall": v.wall, "cpu": v.cpu, "median": v.median} for n, v in t.items()}}
    tag = f"{args.size}-{args.codec}-{args.chunk_mib}mib" + (f"-{args.workers}w" if args.workers else "") + (
        "-uncached" if args.cache_keyframe is False else "") + ("-tls" if args.tls else "") + (
        f"-sign-{args.sign_payloads}" if args.sign_payloads != "auto" else "") + (
        f"-peer-sign-{args.peer_sign_payloads}" if args.peer_sign_payloads != "auto" else "")
    (OUT_DIR / f"s3-results-{tag}.json").write_text(json.dumps(out, indent=1))
    (OUT_DIR / f"s3-results-{tag}.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
