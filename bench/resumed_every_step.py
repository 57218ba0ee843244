"""A run checkpointed every step with predicted deltas, stopped and resumed: what the saves around the resume store
and cost (docs/benchmarks/predicted.md, "A resumed run").

    .venv/bin/python bench/resumed_every_step.py --runs 3
    .venv/bin/python bench/resumed_every_step.py --runs 3 --base-src /tmp/base/src   # and the code before, in turns
    .venv/bin/python bench/resumed_every_step.py --runs 3 --resume-by load

One process per run: the demo GPT trains ``--before`` steps with a synchronous manager saving after every step
(``DeltaOptions(predict=True, keyframe_every=20, max_chain=19)``), then a new manager on the same vault, as a
resumed run makes, saves after each of ``--after`` more steps; the latest step is restored first by that manager
(``--resume-by manager``, the default) or by ``ckptvault.load`` (``load``: the manager's first save then reads
the step before back). Reported: the bytes each
save from two steps before the resume on added, as a fraction of torch.save of the state, how long the resume's
restore took and how long each save after the resume took.
``--base-src``: the ``src`` folder of other code (``git archive <commit> src | tar -x -C /tmp/base``), run through
``PYTHONPATH`` in turns with this checkout's.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child(before: int, after: int, resume_by: str) -> dict[str, object]:
    import torch

    import ckptvault
    from ckptvault import CheckpointManager, DeltaOptions
    from ckptvault.demo.train import TrainConfig, Trainer

    delta = DeltaOptions(predict=True, keyframe_every=20, max_chain=19)
    trainer = Trainer(TrainConfig())
    buffer = io.BytesIO()
    with tempfile.TemporaryDirectory(dir=ROOT / "bench" / "out") as tmp:
        with CheckpointManager(tmp, delta=delta, async_save=False) as mgr:
            for _ in range(before):
                trainer.train_step()
                mgr.save(trainer.step, trainer.state())
        torch.save(trainer.state(), buffer)
        with CheckpointManager(tmp, delta=delta, async_save=False) as mgr:  # the resumed run's
            start = time.perf_counter()
            if resume_by == "manager":
                mgr.restore(before)
            else:
                ckptvault.load(tmp, before)
            restore_s = time.perf_counter() - start
            save_ms = []
            for _ in range(after):
                trainer.train_step()
                start = time.perf_counter()
                mgr.save(trainer.step, trainer.state())
                save_ms.append(round((time.perf_counter() - start) * 1e3, 1))
            added = {step: round(mgr.info(step).added_bytes / len(buffer.getvalue()), 3)
                     for step in range(before - 1, before + after + 1)}
    return {"added": added, "save_ms": save_ms, "restore_ms": round(restore_s * 1e3, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="processes of each side (default 3)")
    parser.add_argument("--before", type=int, default=18, help="steps saved before the resume (default 18)")
    parser.add_argument("--after", type=int, default=4, help="steps saved after it (default 4)")
    parser.add_argument("--resume-by", choices=("manager", "load"), default="manager",
                        help="what restores the latest step before the saves go on (default: the new manager)")
    parser.add_argument("--base-src", type=Path, help="the src folder of code to compare with, run in turns")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.before, args.after, args.resume_by)))
        return
    (ROOT / "bench" / "out").mkdir(parents=True, exist_ok=True)
    sides = {"this": ROOT / "src"} if args.base_src is None else {"base": args.base_src.resolve(), "this": ROOT / "src"}
    results: dict[str, list[dict[str, object]]] = {name: [] for name in sides}
    for _ in range(args.runs):
        for name, src in sides.items():
            env = {**os.environ, "PYTHONPATH": str(src), "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
            command = [sys.executable, __file__, "--child", "--before", str(args.before), "--after", str(args.after),
                       "--resume-by", args.resume_by]
            out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
            results[name].append(json.loads(out.strip().splitlines()[-1]))
            print(name, results[name][-1], flush=True)
    for name, rows in results.items():
        first = statistics.median(float(r["save_ms"][0]) for r in rows)  # type: ignore[index]
        later = statistics.median(float(ms) for r in rows for ms in r["save_ms"][1:])  # type: ignore[index]
        restore = statistics.median(float(r["restore_ms"]) for r in rows)  # type: ignore[arg-type]
        print(f"{name}: added {rows[0]['added']}; first save after the resume {first:.0f} ms, later saves {later:.0f} "
              f"ms (medians), the resume's restore {restore:.0f} ms")


if __name__ == "__main__":
    main()
