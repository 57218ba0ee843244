"""What background CPU work of any kind costs the demo GPT's training on this machine, next to what checkpointing
every step costs it (docs/benchmarks/predicted.md, "Why every-step throughput stops at about 0.73x").

    .venv/bin/python bench/every_step_contention.py --runs 3 --steps 60

Each variant trains the demo's GPT (``ckptvault.demo``, ``OMP_WAIT_POLICY=PASSIVE``) for ``--steps`` steps and
times them; the variants run in turns, ``--runs`` rounds, medians:

- **alone**: no checkpoints, nothing else running;
- **busy loop, nice 19** / **busy loop, SCHED_IDLE**: beside another process that only spins, started at the
  lowest nice level or in Linux's idle scheduling class (it runs only on a core nothing else wants);
- **async saves in this process**: ``CheckpointManager`` with predicted deltas (``keyframe_every=20,
  max_chain=19``), ``save()`` after every step, as ``bench_predicted.py --workloads every`` does;
- **saver process, normal** / **saver process, SCHED_IDLE**: a second process holds the states of the next steps
  (made before the clock starts) and saves one, synchronously with predicted deltas, each time the trainer
  finishes a step; the trainer never waits for it. Reported: the trainer's time, and the time until the saver
  committed its last checkpoint (what checkpointing every step really costs once the saves keep up).

Throughput is the alone time over the variant's time. Results: stdout (markdown) and
``bench/out/every-step-contention.{json,md}``. Linux only (SCHED_IDLE).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read by libgomp when torch loads

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ckptvault import CheckpointManager, DeltaOptions  # noqa: E402
from ckptvault.demo.train import TrainConfig, Trainer  # noqa: E402
from common import copy_state, fresh_dir, machine  # noqa: E402
from workloads import OUT_DIR  # noqa: E402

DELTA = {"predict": True, "keyframe_every": 20, "max_chain": 19}
SPIN = "while True:\n    pass\n"


def _idle() -> None:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def saver(conn: Connection, vault: str, steps: int, idle: bool) -> None:
    """The saver process: trains its own copy ``steps + 3`` steps untimed (one thread), keeps every state, saves the
    first three, then one per message from the trainer; sends the seconds from the first message to its last
    commit."""
    torch.set_num_threads(1)
    trainer = Trainer(TrainConfig())
    states = []
    for _ in range(steps + 3):
        trainer.train_step()
        states.append((trainer.step, copy_state(trainer.state())))
    with CheckpointManager(vault, async_save=False, delta=DeltaOptions(**DELTA)) as mgr:
        for step, state in states[:3]:
            mgr.save(step, state)
        if idle:
            _idle()
        conn.send("ready")
        start = None
        for step, state in states[3:]:
            conn.recv()
            start = time.perf_counter() if start is None else start
            mgr.save(step, state)
    conn.send(time.perf_counter() - (start or time.perf_counter()))


def train(steps: int, variant: str, work: Path) -> dict[str, float]:
    """One timed run of ``variant``: the trainer's seconds (and for a saver process, until its last commit)."""
    trainer = Trainer(TrainConfig())
    trainer.train_step()  # first-step costs out of the timing
    spinner = process = conn = mgr = None
    if variant.startswith("busy loop"):
        prefix = ["chrt", "-i", "0"] if variant.endswith("SCHED_IDLE") else ["nice", "-n", "19"]
        spinner = subprocess.Popen([*prefix, sys.executable, "-c", SPIN])
        time.sleep(0.3)
    elif variant.startswith("saver process"):
        conn, child = multiprocessing.Pipe()
        process = multiprocessing.get_context("spawn").Process(
            target=saver, args=(child, str(fresh_dir(work / "saver")), steps, variant.endswith("SCHED_IDLE")))
        process.start()
        conn.recv()
    elif variant == "async saves in this process":
        mgr = CheckpointManager(fresh_dir(work / "async"), delta=DeltaOptions(**DELTA))
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
        if mgr is not None:
            mgr.save(trainer.step, trainer.state())
        if conn is not None:
            conn.send(trainer.step)
    if mgr is not None:
        mgr.wait()
    trained = time.perf_counter() - start
    result = {"train_s": trained, "done_s": trained}
    if mgr is not None:
        mgr.close()
    if spinner is not None:
        spinner.kill()
        spinner.wait()
    if process is not None and conn is not None:
        conn.recv()
        result["done_s"] = time.perf_counter() - start
        process.join()
    return result


VARIANTS = ("alone", "busy loop, nice 19", "busy loop, SCHED_IDLE", "async saves in this process",
            "saver process, normal", "saver process, SCHED_IDLE")


def markdown(found: dict[str, list[dict[str, float]]], steps: int, runs: int) -> str:
    alone = statistics.median(r["train_s"] for r in found["alone"])
    where = machine()
    lines = [f"Demo GPT, {steps} steps, medians of {runs} rounds ({where['cpu_model']}, {where['cpus']} CPUs, "
             f"torch {where['torch']} with {where['torch_threads']} threads; code {where['code']}):", "",
             "| variant | training | throughput | until the last checkpoint is committed | throughput with it |",
             "|---|---:|---:|---:|---:|"]
    for name in VARIANTS:
        train_s = statistics.median(r["train_s"] for r in found[name])
        done_s = statistics.median(r["done_s"] for r in found[name])
        lines.append(f"| {name} | {train_s:.2f} s | {alone / train_s:.2f}x | {done_s:.2f} s | {alone / done_s:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="timed training steps per run")
    parser.add_argument("--runs", type=int, default=3, help="rounds of every variant, in turns")
    parser.add_argument("--work", type=Path, default=OUT_DIR / "every-step-contention", help="scratch vaults")
    args = parser.parse_args(argv)
    found: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    for _ in range(args.runs):
        for name in VARIANTS:
            found[name].append(train(args.steps, name, args.work))
    text = markdown(found, args.steps, args.runs)
    print(text)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "every-step-contention.json").write_text(json.dumps(found, indent=1))
    (OUT_DIR / "every-step-contention.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
