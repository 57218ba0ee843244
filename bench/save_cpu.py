"""CPU per every-step save of the demo GPT, for comparing two versions of the code in alternating processes
(docs/benchmarks/predicted.md, "Less CPU per save").

    .venv/bin/python bench/save_cpu.py --pairs 4 --mode sync --base-src /tmp/base/src
    .venv/bin/python bench/save_cpu.py --pairs 7 --mode process --base-src /tmp/base/src
    .venv/bin/python bench/save_cpu.py --pairs 6 --mode blocked --base-src /tmp/base/src
    .venv/bin/python bench/save_cpu.py --pairs 4 --mode process --retention --base-src /tmp/base/src

``--base-src``: the ``src`` folder of the code to compare with (for example ``git archive <commit> src | tar -x -C
/tmp/base``), run through ``PYTHONPATH``; each pair runs it and then this checkout's ``src``, each in a new process.

- ``sync``: 62 training steps recorded first (copies of the states), then 62 synchronous saves of them with
  predicted deltas (``keyframe_every=20, max_chain=19``), the kernels loaded; reported: wall and CPU time per save
  of the last 60, all threads of the process;
- ``process``: the demo GPT trained 60 steps with ``AsyncOptions(saver="idle-process", max_in_flight=4)``,
  ``save()`` after every step; reported: the training time, the training process's CPU, and the saver process's
  CPU per save (from ``/proc``), its first save and kernel loading left out;
- ``blocked``: the same manager (``saver="process"``), 40 steps, each save waited for before the next step;
  reported: the median time ``save()`` took in the training thread (the snapshot into shared memory and the
  message to the saver process), with nothing queued.

``--retention``: the manager prunes after every save with ``Retention(keep_last=3, keep_every=25)``.

Prints one line per process and the medians of each side. ``OMP_WAIT_POLICY=PASSIVE``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from common import copy_state, process_cpu  # noqa: E402

DELTA = {"predict": True, "keyframe_every": 20, "max_chain": 19}
STEPS = 60


def retention() -> object:
    from ckptvault import Retention

    return Retention(keep_last=3, keep_every=25) if os.environ.get("BENCH_RETENTION") == "1" else None


def run_sync(work: Path) -> dict[str, float]:
    from ckptvault import CheckpointManager, DeltaOptions
    from ckptvault._codecs.planes import load_kernels_in_background, wait_for_kernel_loading
    from ckptvault.demo.train import TrainConfig, Trainer

    trainer = Trainer(TrainConfig())
    states = []
    for _ in range(STEPS + 2):
        trainer.train_step()
        states.append((trainer.step, copy_state(trainer.state())))
    load_kernels_in_background()
    wait_for_kernel_loading()
    with CheckpointManager(work, async_save=False, delta=DeltaOptions(**DELTA), retention=retention()) as mgr:
        for step, state in states[:2]:
            mgr.save(step, state)
        wall, cpu = time.perf_counter(), time.process_time()
        for step, state in states[2:]:
            mgr.save(step, state)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"wall_ms": wall / STEPS * 1e3, "cpu_ms": cpu / STEPS * 1e3}


def run_process(work: Path) -> dict[str, float]:
    from ckptvault import AsyncOptions, CheckpointManager, DeltaOptions
    from ckptvault.demo.train import TrainConfig, Trainer

    trainer = Trainer(TrainConfig())
    trainer.train_step()
    mgr = CheckpointManager(work, delta=DeltaOptions(**DELTA), retention=retention(),
                            async_options=AsyncOptions(saver="idle-process", max_in_flight=4))
    with mgr:
        mgr.save(trainer.step, trainer.state()).wait()
        time.sleep(3)  # the saver process loads its kernels
        pid = mgr._saver.pid  # noqa: SLF001 - the saver process's CPU is what is measured
        assert pid is not None
        child, wall, cpu = process_cpu(pid), time.perf_counter(), time.process_time()
        for _ in range(STEPS):
            trainer.train_step()
            mgr.save(trainer.step, trainer.state())
        mgr.wait()
        child = process_cpu(pid) - child
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"train_s": wall, "train_cpu_s": cpu, "saver_cpu_ms": child / STEPS * 1e3}


def run_blocked(work: Path) -> dict[str, float]:
    from ckptvault import AsyncOptions, CheckpointManager, DeltaOptions
    from ckptvault.demo.train import TrainConfig, Trainer

    trainer = Trainer(TrainConfig())
    trainer.train_step()
    blocked = []
    with CheckpointManager(work, delta=DeltaOptions(**DELTA), retention=retention(),
                           async_options=AsyncOptions(saver="process", max_in_flight=4)) as mgr:
        mgr.save(trainer.step, trainer.state()).wait()
        for _ in range(40):
            trainer.train_step()
            start = time.perf_counter()
            handle = mgr.save(trainer.step, trainer.state())
            blocked.append(time.perf_counter() - start)
            handle.wait()
    return {"save_blocked_ms": statistics.median(blocked) * 1e3}


MODES = {"sync": run_sync, "process": run_process, "blocked": run_blocked}


def child_main(mode: str) -> None:
    with tempfile.TemporaryDirectory(dir=ROOT / "bench" / "out") as tmp:
        result = MODES[mode](Path(tmp) / "vault")
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=tuple(MODES), default="sync")
    parser.add_argument("--pairs", type=int, default=4, help="processes of each side, alternating (default 4)")
    parser.add_argument("--base-src", type=Path, help="the src folder of the code to compare with (required)")
    parser.add_argument("--retention", action="store_true", help="prune after every save (keep_last=3, keep_every=25)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(args.mode)
        return
    if args.base_src is None:
        parser.error("--base-src is required")
    (ROOT / "bench" / "out").mkdir(parents=True, exist_ok=True)
    sides = {"base": args.base_src.resolve(), "this": ROOT / "src"}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    for _ in range(args.pairs):
        for name, src in sides.items():
            env = {**os.environ, "PYTHONPATH": str(src), "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
                   "BENCH_RETENTION": "1" if args.retention else "0"}
            out = subprocess.run([sys.executable, __file__, "--child", "--mode", args.mode], env=env, check=True,
                                 capture_output=True, text=True).stdout
            results[name].append(json.loads(out.strip().splitlines()[-1]))
            print(name, results[name][-1], flush=True)
    for name, rows in results.items():
        print(name, "medians:", {k: round(statistics.median(r[k] for r in rows), 2) for k in rows[0]})


if __name__ == "__main__":
    main()
