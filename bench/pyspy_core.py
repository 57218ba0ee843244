"""Sample the real (multi-threaded) ckptvault save and restore of the W1 state with py-spy.

    .venv/bin/python bench/pyspy_core.py --size full            # records and summarises
    .venv/bin/python bench/pyspy_core.py --target --phase save   # (what py-spy runs)

``py-spy record --threads --idle --format raw`` samples every thread, idle
ones included, so waits in fsync or on a lock are counted too. Save and
restore are recorded separately; each summary lists the leaf frames that
hold the samples, as thread-seconds, for the main thread and the pool.
Needs ``pip install py-spy`` (not a project dependency) and ptrace rights.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads must not spin against the pool threads measured
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import drop_caches, fresh_dir  # noqa: E402
from workloads import OUT_DIR, SIZES, assert_same_tensors, w1_state, zeroed_copy  # noqa: E402

RATE = 200


def phase_save(state: object, dest: Path, codec: str | None) -> None:
    from ckptvault import CheckpointManager

    with CheckpointManager(dest, codec=codec, async_save=False) as mgr:
        mgr.save(1, state).wait()


def phase_restore(dest: Path, target: object) -> None:
    from ckptvault import CheckpointManager

    with CheckpointManager(dest) as mgr:
        mgr.restore(1, into=target)


def target(size: str, codec: str | None, work: Path, phase: str) -> None:
    """What py-spy runs: a fresh save, or a cold restore of that save into a preallocated state, timed."""
    state = w1_state(size)
    dest = work / "vault"
    if phase == "save":
        fresh_dir(dest)
    else:
        into = zeroed_copy(state)
    time.sleep(0.5)  # lets the sampler attach before the measured phase
    drop_caches()
    t0 = time.perf_counter()
    phase_save(state, dest, codec) if phase == "save" else phase_restore(dest, into)
    print(f"{phase} {time.perf_counter() - t0:.2f} s")
    if phase == "restore":
        assert_same_tensors(state, into)
        shutil.rmtree(dest, ignore_errors=True)


def summarise(raw: Path, phase: str, top: int = 18) -> str:
    """Thread-seconds per leaf frame, from py-spy's raw (collapsed) output of one phase.

    Main-thread samples count only inside the phase function; the pool's
    threads live only during the phase (the manager creates and closes them).
    """
    marker = f"phase_{phase}"
    tables: dict[str, Counter[str]] = {"main thread": Counter(), "pool threads": Counter()}
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        names = [re.sub(r" \(.*?\)$", "", f) for f in frames]
        if "_worker" in names:
            tables["pool threads"][_short(frames[-1])] += int(count)
        elif marker in names:
            tables["main thread"][_short(frames[-1])] += int(count)
    out = []
    for label, table in tables.items():
        total = sum(table.values())
        out.append(f"\n{phase}, {label}: {total / RATE:.2f} thread-s sampled")
        for leaf, n in table.most_common(top):
            out.append(f"  {n / RATE:6.2f} s {100 * n / max(total, 1):5.1f}%  {leaf}")
    return "\n".join(out)


def _short(frame: str) -> str:
    return re.sub(r"\(/.*?site-packages/", "(", re.sub(r"\(/work/main/", "(", frame))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--codec", default=None, help="codec of the vault (default: the library's default)")
    parser.add_argument("--target", action="store_true", help="run the workload itself (py-spy runs this)")
    parser.add_argument("--phase", choices=("save", "restore"), default="save", help="with --target: which phase")
    parser.add_argument("--work", type=Path, default=OUT_DIR / "pyspy")
    args = parser.parse_args(argv)
    if args.target:
        target(args.size, args.codec, args.work, args.phase)
        return 0
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    for phase in ("save", "restore"):
        raw = args.work / f"{args.size}-{args.codec or 'default'}-{phase}.txt"
        raw.parent.mkdir(parents=True, exist_ok=True)
        cmd = [pyspy, "record", "--threads", "--idle", "--format", "raw", "--rate", str(RATE), "-o", str(raw), "--",
               sys.executable, __file__, "--target", "--phase", phase, "--size", args.size, "--work", str(args.work)]
        subprocess.run(cmd + (["--codec", args.codec] if args.codec else []), check=True)
        print(summarise(raw, phase))
    return 0


if __name__ == "__main__":
    sys.exit(main())
