"""What reading predicted chains costs: ``ckptvault verify`` of a vault checkpointed every step, and a restore of a
checkpoint deep in its chain (docs/benchmarks/predicted.md, "Chain levels checked once").

    .venv/bin/python bench/chain_reads.py --runs 3
    .venv/bin/python bench/chain_reads.py --runs 3 --base-src /tmp/base/src   # and the code before, in turns

The vaults (made once, in ``bench/out/chain-reads/``): the demo GPT trained ``--steps`` steps (18 and 60 by default),
a synchronous save after every step with ``DeltaOptions(predict=True, keyframe_every=20, max_chain=19)``. Per run
and code, each in new processes: ``ckptvault verify`` of each vault (wall seconds), and a restore of the last step
of the shorter vault (17 levels deep) timed as the first restore of a process and again, warm (median of 5).
``--base-src``: the ``src`` folder of other code (``git archive <commit> src | tar -x -C /tmp/base``), run through
``PYTHONPATH`` in turns with this checkout's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out" / "chain-reads"


def make_vault(steps: int) -> Path:
    """The vault of ``steps`` every-step checkpoints (made if missing)."""
    vault = OUT / f"every-{steps}"
    if not (vault / "manifests").exists():
        from ckptvault import CheckpointManager, DeltaOptions
        from ckptvault.demo.train import TrainConfig, Trainer

        trainer = Trainer(TrainConfig())
        delta = DeltaOptions(predict=True, keyframe_every=20, max_chain=19)
        with CheckpointManager(vault, delta=delta, async_save=False) as mgr:
            for _ in range(steps):
                trainer.train_step()
                mgr.save(trainer.step, trainer.state())
    return vault


def restore_child(vault: Path, step: int) -> None:
    """Print the first restore of ``step`` in this process and the median of 5 more, in ms."""
    from ckptvault import CheckpointManager

    with CheckpointManager(vault) as mgr:
        start = time.perf_counter()
        mgr.restore(step)
        first = time.perf_counter() - start
        again = []
        for _ in range(5):
            start = time.perf_counter()
            mgr.restore(step)
            again.append(time.perf_counter() - start)
    print(json.dumps({"first_ms": first * 1e3, "warm_ms": statistics.median(again) * 1e3}))


def run(src: Path, vaults: list[Path], deep: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    out: dict[str, float] = {}
    for vault in vaults:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "ckptvault", "verify", str(vault)], env=env, check=True,
                       capture_output=True)
        out[f"verify {vault.name} s"] = time.perf_counter() - start
    child = subprocess.run([sys.executable, __file__, "--child", str(vaults[0]), str(deep)], env=env, check=True,
                           capture_output=True, text=True).stdout
    restore = json.loads(child.strip().splitlines()[-1])
    out[f"restore step {deep}, first ms"], out[f"restore step {deep}, warm ms"] = restore["first_ms"], restore["warm_ms"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each code, in turns (default 3)")
    parser.add_argument("--steps", default="18,60", help="checkpoints of each vault (default 18,60)")
    parser.add_argument("--base-src", type=Path, help="the src folder of code to compare with, run in turns")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        restore_child(Path(args.child[0]), int(args.child[1]))
        return
    steps = [int(s) for s in args.steps.split(",")]
    vaults = [make_vault(s) for s in steps]
    sides = {"this": ROOT / "src"} if args.base_src is None else {"base": args.base_src.resolve(), "this": ROOT / "src"}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    for _ in range(args.runs):
        for name, src in sides.items():
            results[name].append(run(src, vaults, steps[0]))
            print(name, {k: round(v, 2) for k, v in results[name][-1].items()}, flush=True)
    for name, rows in results.items():
        print(name, "medians:", {k: round(statistics.median(r[k] for r in rows), 2) for k in rows[0]})


if __name__ == "__main__":
    main()
