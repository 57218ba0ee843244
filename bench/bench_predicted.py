"""Predicted-delta benchmark (docs/benchmarks/predicted.md): checkpoints one optimizer step apart stored as their
difference from their prediction from the previous checkpoint, against torch.save and against plain XOR deltas.

    .venv/bin/python bench/bench_predicted.py --size full --runs 3              # W1, W2, every-step demo GPT
    .venv/bin/python bench/bench_predicted.py --size tiny --runs 1 --workloads W1 --steps 12   # smoke

One step apart (W1 pretraining, W2 fine-tuning; ``workloads_incremental.py``): a fresh vault, a synchronous
save of the state after ``--warmup`` steps (the keyframe), then of the state one step later, with
``DeltaOptions(predict=True)`` and without; the later checkpoint's added bytes against torch.save of that state,
broken down by kind (weights, exp_avg, exp_avg_sq, other; each new chunk's stored bytes attributed to the
records in it by their share of its raw bytes). Then both checkpoints are restored in a fresh manager, the page
cache dropped first (as root), and checked bit for bit: a predicted checkpoint's restore time against the
keyframe's.

Every step (the demo's GPT, AdamW with warmup-cosine and gradient clipping): ``--steps`` training steps with no
checkpoints, then the same run checkpointed after every step asynchronously with XOR deltas, and with
predictions saved by a thread of the training process, by a saver process (``AsyncOptions(saver="process")``), by
one in the idle scheduling class (``"idle-process"``) and by that one with four saves in flight
(``max_in_flight=4``), in turns; training throughput against the run without
checkpoints (the clock stops once the last checkpoint is committed), and bytes added per step against torch.save
of the state: the new chunks (``added_bytes``), and those plus the checkpoint's manifest file. The first
checkpoint of each run, which starts the saver's threads or process, is taken before the clock starts.
With ``--warm-steps``, every run first trains (and checkpoints) that many steps untimed, so that what a long job
pays once per process (the byte-plane kernels load in the background once 256 MiB of planes went through numpy)
stays out of the timing. Medians over ``--runs``. The whole comparison runs once per OpenMP wait policy
(``--omp``), each in a child process, as libgomp reads ``OMP_WAIT_POLICY`` when torch loads: ``passive`` (idle
intra-op threads sleep) and ``default`` (the variable unset: idle threads spin a while first, and hold both cores
of this machine throughout a training step). Results: stdout (markdown) and
``bench/out/predicted-results.{json,md}``.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workloads_incremental as wi  # noqa: E402
from ckptvault import AsyncOptions, CheckpointManager, DeltaOptions  # noqa: E402
from ckptvault._format.manifest import manifest_key  # noqa: E402
from ckptvault.demo.train import TrainConfig, Trainer  # noqa: E402
from common import drop_caches, fresh_dir, machine  # noqa: E402
from workloads import OUT_DIR, assert_same_tensors  # noqa: E402

log = logging.getLogger("bench_predicted")

TARGETS = {"W1": 0.30, "W2": 0.20, "every step": 0.30}
THROUGHPUT_TARGET = 0.85
RESTORE_TARGET = 1.5
KINDS = ("weights", "exp_avg", "exp_avg_sq", "other")


def torch_bytes(state: Any) -> int:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.tell()


def kind_of(path: str) -> str:
    if path.startswith("model."):
        return "weights"
    if path.endswith(".exp_avg"):
        return "exp_avg"
    if path.endswith((".exp_avg_sq", ".max_exp_avg_sq")):
        return "exp_avg_sq"
    return "other"


def added_by_kind(manifest: dict[str, Any]) -> dict[str, float]:
    """New chunks' stored bytes, attributed to the records in each chunk by their share of its raw bytes."""
    chunks = manifest["chunks"]
    out: dict[str, float] = defaultdict(float)
    for record in manifest["tensors"]:
        for chunk, _offset, length in record["pieces"]:
            entry = chunks[chunk]
            if entry["new"]:
                out[kind_of(record["path"])] += entry["stored"] * length / entry["raw"]
    return dict(out)


def logical_by_kind(manifest: dict[str, Any]) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for record in manifest["tensors"]:
        out[kind_of(record["path"])] += record["nbytes"]
    return dict(out)


def one_step_apart(name: str, states: dict[int, Any], work: Path, runs: int) -> dict[str, Any]:
    reference = torch_bytes(states[1])
    result: dict[str, Any] = {"workload": name, "torch_bytes": reference}
    for predict in (False, True):
        path = fresh_dir(work / f"{name}-{'p' if predict else 'x'}")
        with CheckpointManager(path, async_save=False, delta=DeltaOptions(predict=predict, keyframe_every=50)) as mgr:
            mgr.save(0, states[0])
            mgr.save(1, states[1])
            manifest = mgr.manifest(1)
        key = "predicted" if predict else "xor"
        result[f"{key}_added"] = manifest["added_bytes"]
        result[f"{key}_ratio"] = manifest["added_bytes"] / reference
        if predict:
            result["by_kind"] = added_by_kind(manifest)
            result["logical_by_kind"] = logical_by_kind(manifest)
            result["predicted_records"] = sum("predict" in t for t in manifest["tensors"])
            result["records"] = len(manifest["tensors"])
            result.update(restore_times(path, states, runs))
    return result


def restore_times(path: Path, states: dict[int, Any], runs: int) -> dict[str, float]:
    times: dict[int, list[float]] = {0: [], 1: []}
    for _ in range(runs):
        for step in (0, 1):
            with CheckpointManager(path) as mgr:
                drop_caches()  # read from disk, as every restore in BENCHMARKS.md (needs root; else warm)
                start = time.perf_counter()
                restored = mgr.restore(step)
                times[step].append(time.perf_counter() - start)
            assert_same_tensors(states[step], restored)
            del restored
    keyframe, predicted = statistics.median(times[0]), statistics.median(times[1])
    return {"restore_keyframe_s": keyframe, "restore_predicted_s": predicted, "restore_ratio": predicted / keyframe}


def train(trainer: Trainer, mgr: CheckpointManager | None, steps: int) -> None:
    """``steps`` training steps, each saved by ``mgr`` (if any) asynchronously; returns once all are committed."""
    for _ in range(steps):
        trainer.train_step()
        if mgr is not None:
            mgr.save(trainer.step, trainer.state())
    if mgr is not None:
        mgr.wait()


def every_step(work: Path, steps: int, runs: int, max_chain: int, keyframe_every: int,
               warm_steps: int = 0) -> dict[str, Any]:
    """Throughput and bytes per step of the demo GPT checkpointed after every step; with ``warm_steps``, that many
    steps (checkpointed like the rest) run before the clock starts, so one-time costs of a process stay out."""
    seconds: dict[str, list[float]] = defaultdict(list)
    added: dict[str, float] = {}
    manifests: dict[str, float] = {}  # the mean size of a manifest file, which added_bytes does not count
    chains: list[int] = []
    reference = 0
    for _ in range(runs):
        for mode in EVERY_MODES:
            trainer = Trainer(TrainConfig())
            trainer.train_step()  # first-step costs (allocations, thread pools) out of the timing
            path = fresh_dir(work / f"every-{mode}")
            delta = DeltaOptions(predict=mode != "xor", max_chain=max_chain, keyframe_every=keyframe_every)
            mgr = None if mode == "none" else CheckpointManager(path, delta=delta, async_options=SAVER_OPTIONS[mode])
            train(trainer, mgr, max(warm_steps, 1) if mgr is not None else warm_steps)  # starts the saver's threads or process
            start = time.perf_counter()
            train(trainer, mgr, steps)
            seconds[mode].append(time.perf_counter() - start)
            if mgr is not None:
                infos = [mgr.info(s) for s in mgr.steps()]
                added[mode] = sum(i.added_bytes for i in infos[1:]) / (len(infos) - 1)  # the first: the vault's first keyframe
                manifests[mode] = statistics.mean(mgr.vault.store.stat(manifest_key(i.step)).size for i in infos[1:])
                if mode.startswith("predicted"):
                    chains = [len(mgr.manifest(s).get("chain", [])) for s in mgr.steps()]
                    check_every(mgr, trainer)
                mgr.close()
            reference = torch_bytes(trainer.state())
    none = statistics.median(seconds["none"])
    return {"steps": steps, "warm_steps": warm_steps, "torch_bytes": reference, "max_chain": max_chain,
            "keyframe_every": keyframe_every, "chains": chains, **{f"{m}_s": statistics.median(v) for m, v in seconds.items()},
            **{f"{m}_throughput": none / statistics.median(seconds[m]) for m in EVERY_MODES[1:]},
            **{f"{m}_added_per_step": added[m] for m in added},
            **{f"{m}_ratio": added[m] / reference for m in added},
            **{f"{m}_with_manifest_ratio": (added[m] + manifests[m]) / reference for m in added}}


#: the every-step run's variants: no checkpoints, XOR deltas, predicted deltas saved by a thread of the training
#: process, by a saver process, and by a saver process in the idle scheduling class
EVERY_MODES = ("none", "xor", "predicted", "predicted-process", "predicted-idle", "predicted-idle-4")
SAVER_OPTIONS = {"xor": AsyncOptions(), "predicted": AsyncOptions(), "predicted-process": AsyncOptions(saver="process"),
                 "predicted-idle": AsyncOptions(saver="idle-process"),
                 "predicted-idle-4": AsyncOptions(saver="idle-process", max_in_flight=4)}
SAVER_LABELS = {"predicted": "predicted, thread", "predicted-process": "predicted, saver process",
                "predicted-idle": "predicted, idle saver process",
                "predicted-idle-4": "predicted, idle saver process, `max_in_flight=4`"}


#: the OpenMP wait policies the every-step run is measured under: the value of OMP_WAIT_POLICY (None: unset)
OMP_POLICIES = {"passive": "PASSIVE", "default": None}


def every_step_per_policy(args: argparse.Namespace) -> dict[str, Any]:
    """:func:`every_step` in a child process per OpenMP wait policy named by ``--omp``."""
    out = {}
    for name in args.omp.split(","):
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        if OMP_POLICIES[name] is not None:
            env["OMP_WAIT_POLICY"] = OMP_POLICIES[name]
        result = args.work / f"every-{name}.json"
        subprocess.run([sys.executable, __file__, "--every-child", str(result), "--steps", str(args.steps),
                        "--runs", str(args.runs), "--max-chain", str(args.max_chain),
                        "--keyframe-every", str(args.keyframe_every), "--warm-steps", str(args.warm_steps),
                        "--work", str(args.work)], env=env, check=True)
        out[name] = json.loads(result.read_text())
    return out


def check_every(mgr: CheckpointManager, trainer: Trainer) -> None:
    """The last checkpoint (the deepest chain's end, often) restores bit for bit."""
    assert_same_tensors(trainer.state(), mgr.restore(trainer.step))


def markdown(results: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = ["| workload | torch.save | XOR delta | predicted delta | target | predicted records "
             "| restore predicted / keyframe |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results["one_step"]:
        lines.append(f"| {r['workload']} one step apart | {r['torch_bytes'] / 2**20:.1f} MiB | {r['xor_ratio']:.3f}x | "
                     f"**{r['predicted_ratio']:.3f}x** | <= {TARGETS[r['workload']]:.2f}x | "
                     f"{r['predicted_records']}/{r['records']} | {r['restore_ratio']:.2f}x "
                     f"({r['restore_predicted_s']:.2f} s / {r['restore_keyframe_s']:.2f} s) |")
    lines += ["", "Added bytes of the predicted checkpoint by kind (share of torch.save; logical share in brackets):", "",
              "| workload | " + " | ".join(KINDS) + " |", "|---|" + "---:|" * len(KINDS)]
    for r in results["one_step"]:
        cells = [f"{r['by_kind'].get(k, 0) / r['torch_bytes']:.3f} ({r['logical_by_kind'].get(k, 0) / r['torch_bytes']:.2f})"
                 for k in KINDS]
        lines.append(f"| {r['workload']} | " + " | ".join(cells) + " |")
    policies = results.get("every_step") or {}
    for name, e in policies.items():
        lines += ["", f"Every step, demo GPT ({e['torch_bytes'] / 2**20:.2f} MiB state), {e['steps']} steps timed after "
                  f"{e.get('warm_steps', 0)} untimed, async, "
                  f"keyframe_every={e['keyframe_every']}, max_chain={e['max_chain']}, OpenMP wait policy {name} "
                  f"(OMP_WAIT_POLICY={OMP_POLICIES[name] or 'unset'}):", "",
                  "| checkpoints | training time | throughput vs none | added per step vs torch.save | with the manifest |",
                  "|---|---:|---:|---:|---:|",
                  f"| none | {e['none_s']:.2f} s | 1.00x | - | - |",
                  f"| every step, XOR deltas | {e['xor_s']:.2f} s | {e['xor_throughput']:.2f}x | {e['xor_ratio']:.3f}x "
                  f"| {e['xor_with_manifest_ratio']:.3f}x |",
                  *(f"| every step, {SAVER_LABELS[m]} | {e[m + '_s']:.2f} s | **{e[m + '_throughput']:.2f}x** "
                    f"(target >= {THROUGHPUT_TARGET}) | **{e[m + '_ratio']:.3f}x** (target <= {TARGETS['every step']}) "
                    f"| {e[m + '_with_manifest_ratio']:.3f}x |" for m in SAVER_LABELS)]
    if policies:
        lines += ["", f"Chain length of each checkpoint: {next(iter(policies.values()))['chains']}"]
    lines += ["", f"Machine: {meta['machine']}; command: `{meta['command']}`"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=("full", "dev", "tiny"), default="full", help="W1 model size")
    parser.add_argument("--workloads", default="W1,W2,every", help="comma-separated subset of W1,W2,every")
    parser.add_argument("--runs", type=int, default=3, help="rounds; medians are reported (default 3)")
    parser.add_argument("--warmup", type=int, default=wi.WARMUP, help="training steps before the keyframe")
    parser.add_argument("--steps", type=int, default=60, help="steps of the every-step run")
    parser.add_argument("--warm-steps", type=int, default=0,
                        help="steps of the every-step run, checkpointed alike, before its clock starts (one-time costs "
                             "of a process out of the timing: the byte-plane kernels load after 256 MiB of planes)")
    parser.add_argument("--max-chain", type=int, default=DeltaOptions().max_chain, help="DeltaOptions.max_chain")
    parser.add_argument("--keyframe-every", type=int, default=DeltaOptions().keyframe_every,
                        help="DeltaOptions.keyframe_every of the every-step run")
    parser.add_argument("--omp", default=",".join(OMP_POLICIES),
                        help=f"comma-separated OpenMP wait policies of the every-step run ({', '.join(OMP_POLICIES)})")
    parser.add_argument("--work", type=Path, default=OUT_DIR / "predicted", help="scratch directory")
    parser.add_argument("--every-child", type=Path, help=argparse.SUPPRESS)  # one policy's every-step run, to JSON
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.every_child is not None:
        found = every_step(args.work, args.steps, args.runs, args.max_chain, args.keyframe_every, args.warm_steps)
        args.every_child.write_text(json.dumps(found))
        return 0
    if not set(args.omp.split(",")) <= set(OMP_POLICIES):
        parser.error(f"--omp takes {', '.join(OMP_POLICIES)}, got {args.omp!r}")
    wanted = set(args.workloads.split(","))
    results: dict[str, Any] = {"one_step": []}
    if "W1" in wanted:
        results["one_step"].append(one_step_apart("W1", wi.w1_states(args.size, args.warmup), args.work, args.runs))
    if "W2" in wanted:
        results["one_step"].append(one_step_apart("W2", wi.w2_states(args.warmup), args.work, args.runs))
    if "every" in wanted:
        args.work.mkdir(parents=True, exist_ok=True)
        results["every_step"] = every_step_per_policy(args)
    meta = {"machine": machine(), "command": "python bench/bench_predicted.py " + " ".join(argv or sys.argv[1:])}
    text = markdown(results, meta)
    print(text)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "predicted-results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (OUT_DIR / "predicted-results.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
