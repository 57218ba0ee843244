"""Small states: the fixed costs of a ~10 MiB checkpoint, against torch.save and torch.load in the same run.

The state is the demo's: ``GPTConfig.small()`` + AdamW after one step (9.65 MiB, 41 tensors plus the
optimizer's ints and floats), built once and cached in ``bench/out/small/state.pt``.

What is timed (``time.perf_counter``; the page cache stays warm; every repetition of every variant runs in turn,
round-robin, so the machine's load falls on all of them alike):

* **warm process** (this one, every import done, one save of each kind before the runs): each save writes into a
  new empty directory and is durable when the clock stops:

  - ``torch.save + fsync``: torch.save into ``state.pt``, flush, fsync of the file and of its directory;
  - ``ckptvault.save()``: the one-liner (open the vault, create it, save synchronously, close);
  - ``manager, sync``: ``CheckpointManager(d, async_save=False)`` opened before the clock starts, then ``save()``;
  - ``manager, async``: a default manager opened before the clock, ``save()`` then ``handle.wait()``; the time
    ``save()`` blocked is reported too;
  - ``into its vault``: the same two managers kept open for the whole run, each saving the next step into its own
    vault, as a training job does. Every float tensor of the state is scaled by ``1 + 2**-20`` before each
    repetition (outside the clocks, for every variant), so each such save finds no chunk stored already.

* **fresh process** (one new interpreter per repetition; the state is loaded from ``state.pt`` before the clock):

  - save: from after ``import torch`` until durable, ``import ckptvault`` included or not (both are reported),
    ``ckptvault.save()`` against torch.save + fsync; and the whole child process from spawn to exit, as the
    parent sees it (what a script that saves once pays, interpreter exit and joined threads included);
  - restore: from after ``import torch`` until the state is in memory: ``torch.load(path, weights_only=True)``
    against ``ckptvault.load(d)`` with and without ``import ckptvault`` in the timed span;
    and, gc settled, ``torch.load(path, weights_only=False)``: the full unpickler, which runs whatever code a file
    names (ckptvault never unpickles on load), compared with the weights-only default;
  - both again "gc settled": with ``gc.collect()`` run before the clock starts. Importing torch leaves a full
    collection of its ~170k objects due, and whichever code next allocates some thousand objects pays it (0.1 to
    0.5 s here). A restore pauses the collector, so neither side pays it inside the restore unless torch.load
    happens to allocate enough; the settled rows show each side without that debt; the plain rows are what a
    script that does only this sees, and the "then the collection due" rows add the ``gc.collect()`` that
    follows the restore in the same child, which pays the debt wherever it was left.

Run from the repository root::

    .venv/bin/python bench/bench_small.py --runs 15
    .venv/bin/python bench/bench_small.py --runs 15 --write docs/benchmarks/small.md --label "after"
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from common import machine  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out" / "small"
PYTHON = sys.executable


def build_state() -> dict[str, Any]:
    """The demo's model + AdamW after one step on random tokens, as ``{"model", "optimizer", "step"}``."""
    from ckptvault.demo.model import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig.small()
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    idx = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1))
    model.loss(idx[:, :-1], idx[:, 1:]).backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}


def state_bytes(state: Any) -> tuple[int, int]:
    """(bytes, tensors) of the distinct tensor storages in ``state``."""
    seen: dict[int, int] = {}

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            seen[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)

    walk(state)
    return sum(seen.values()), len(seen)


def fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def torch_save_durable(state: Any, dest: Path) -> None:
    """torch.save to ``dest/state.pt``, flush, fsync the file and ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    with open(dest / "state.pt", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(dest, directory=True)


# -- the fresh-process children: each prints one JSON line of perf_counter spans -----------------------------------
_CHILD_PRELUDE = """
import os, sys, time, json
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
sys.path.insert(0, {bench!r})
"""

_SAVE_TORCH = _CHILD_PRELUDE + """
from bench_small import torch_save_durable
from pathlib import Path
state = torch.load({src!r}, weights_only=True)
{settle}
t0 = time.perf_counter()
torch_save_durable(state, Path({dest!r}))
t1 = time.perf_counter()
print(json.dumps({{"import": 0.0, "op": t1 - t0}}))
"""

_SAVE_VAULT = _CHILD_PRELUDE + """
state = torch.load({src!r}, weights_only=True)
{settle}
t0 = time.perf_counter()
import ckptvault
t1 = time.perf_counter()
ckptvault.save(state, {dest!r}, step=1)
t2 = time.perf_counter()
print(json.dumps({{"import": t1 - t0, "op": t2 - t1, "numba": "numba" in sys.modules}}))
"""

_LOAD_TORCH = _CHILD_PRELUDE + """
{settle}
t0 = time.perf_counter()
state = torch.load({src!r}, weights_only={weights_only})
t1 = time.perf_counter()
import gc; gc.collect()
t2 = time.perf_counter()
print(json.dumps({{"import": 0.0, "op": t1 - t0, "collect": t2 - t1}}))
"""

_LOAD_VAULT = _CHILD_PRELUDE + """
{settle}
t0 = time.perf_counter()
import ckptvault
t1 = time.perf_counter()
state = ckptvault.load({src!r})
t2 = time.perf_counter()
import gc; gc.collect()
t3 = time.perf_counter()
print(json.dumps({{"import": t1 - t0, "op": t2 - t1, "collect": t3 - t2, "numba": "numba" in sys.modules}}))
"""


def run_child(code: str) -> dict[str, Any]:
    """Run ``code`` in a new interpreter; its JSON line plus ``process``: spawn to exit, as seen from here."""
    t0 = time.perf_counter()
    done = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if done.returncode:
        raise RuntimeError(f"child failed ({done.returncode}):\n{done.stderr}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process"] = wall
    return result


# -- the runs -------------------------------------------------------------------------------------------------------
class Runs:
    """Named lists of seconds."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {}
        self.flags: dict[str, set[Any]] = {}

    def add(self, name: str, seconds: float) -> None:
        self.samples.setdefault(name, []).append(seconds)

    def median(self, name: str) -> float:
        return statistics.median(self.samples[name])


def scratch(name: str) -> Path:
    path = OUT / "scratch" / name
    if path.exists():
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def perturb(state: Any) -> None:
    """Scale every float tensor of ``state`` by ``1 + 2**-20`` in place: new bytes in every chunk."""
    for value in state.values() if isinstance(state, dict) else state:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            value.mul_(1 + 2**-20)
        elif isinstance(value, (dict, list, tuple)):
            perturb(value)


def warm_round(state: Any, runs: Runs, kept: dict[str, Any], step: int) -> None:
    """One repetition of every in-process save variant; ``kept``: the managers kept open ("sync", "async"), which
    save ``step`` into their vaults."""
    import ckptvault

    perturb(state)
    dest = scratch("torch")
    runs.add("warm torch.save + fsync", timed(lambda: torch_save_durable(state, dest)))

    dest = scratch("oneliner")
    runs.add("warm ckptvault.save()", timed(lambda: ckptvault.save(state, dest, step=1)))

    dest = scratch("sync")
    with ckptvault.CheckpointManager(dest, async_save=False) as mgr:
        runs.add("warm manager, sync", timed(lambda: mgr.save(1, state)))

    dest = scratch("async")
    with ckptvault.CheckpointManager(dest) as mgr:
        t0 = time.perf_counter()
        handle = mgr.save(1, state)
        t1 = time.perf_counter()
        handle.wait()
        t2 = time.perf_counter()
        runs.add("warm manager, async: save() blocked", t1 - t0)
        runs.add("warm manager, async: until durable", t2 - t0)

    runs.add(f"{INTO_ITS_VAULT}, sync", timed(lambda: kept["sync"].save(step, state)))
    t0 = time.perf_counter()
    handle = kept["async"].save(step, state)
    t1 = time.perf_counter()
    handle.wait()
    t2 = time.perf_counter()
    runs.add(f"{INTO_ITS_VAULT}, async: save() blocked", t1 - t0)
    runs.add(f"{INTO_ITS_VAULT}, async: until durable", t2 - t0)


#: what a child runs before its clock starts in the "gc settled" variant: the full collection that importing torch
#: leaves due (~170k objects; 0.1-0.5 s here), which whatever code next allocates some thousand objects pays
SETTLE = "import gc; gc.collect()"


def fresh_round(runs: Runs, src: Path, vault: Path) -> None:
    """One repetition of every fresh-process variant, as a process starts and with the garbage collector settled."""
    bench = str(ROOT / "bench")
    for suffix, settle in (("", ""), (" (gc settled)", SETTLE)):
        dest = scratch("fresh-torch")
        r = run_child(_SAVE_TORCH.format(bench=bench, src=str(src), dest=str(dest), settle=settle))
        runs.add(f"fresh save{suffix}: torch.save + fsync", r["op"])
        if not settle:
            runs.add("fresh save process: torch.save + fsync", r["process"])

        dest = scratch("fresh-vault")
        r = run_child(_SAVE_VAULT.format(bench=bench, src=str(src), dest=str(dest), settle=settle))
        runs.add(f"fresh save{suffix}: ckptvault.save()", r["op"])
        runs.add(f"fresh save{suffix}: import ckptvault + ckptvault.save()", r["import"] + r["op"])
        if not settle:
            runs.add("fresh save process: ckptvault.save()", r["process"])
        runs.flags.setdefault("numba after save", set()).add(r["numba"])

        r = run_child(_LOAD_TORCH.format(bench=bench, src=str(src), settle=settle, weights_only=True))
        runs.add(f"fresh restore{suffix}: torch.load", r["op"])
        if not settle:
            runs.add("fresh restore process: torch.load", r["process"])
            runs.add(f"{THEN_COLLECT}: torch.load", r["op"] + r["collect"])
        else:
            r = run_child(_LOAD_TORCH.format(bench=bench, src=str(src), settle=settle, weights_only=False))
            runs.add(UNPICKLED, r["op"])

        r = run_child(_LOAD_VAULT.format(bench=bench, src=str(vault), settle=settle))
        runs.add(f"fresh restore{suffix}: ckptvault.load()", r["op"])
        runs.add(f"fresh restore{suffix}: import ckptvault + ckptvault.load()", r["import"] + r["op"])
        if not settle:
            runs.add("fresh restore process: ckptvault.load()", r["process"])
            runs.add(f"{THEN_COLLECT}: ckptvault.load()", r["op"] + r["collect"])
        runs.flags.setdefault("numba after load", set()).add(r["numba"])


THEN_COLLECT = "fresh restore, then the collection due"
#: torch.load's full unpickler, which a checkpoint may make run any code: what the weights-only default guards against
UNPICKLED = "fresh restore (gc settled): torch.load(weights_only=False)"
INTO_ITS_VAULT = "warm manager into its vault"


def _rows() -> list[tuple[str, str | None]]:
    """(row, the peer it is compared with, or None for a peer)."""
    rows: list[tuple[str, str | None]] = [("warm torch.save + fsync", None)]
    rows += [(name, "warm torch.save + fsync") for name in (
        "warm ckptvault.save()", "warm manager, sync", "warm manager, async: until durable",
        "warm manager, async: save() blocked", f"{INTO_ITS_VAULT}, sync", f"{INTO_ITS_VAULT}, async: until durable",
        f"{INTO_ITS_VAULT}, async: save() blocked")]
    for suffix in ("", " (gc settled)"):
        peer = f"fresh save{suffix}: torch.save + fsync"
        rows += [(peer, None), (f"fresh save{suffix}: ckptvault.save()", peer),
                 (f"fresh save{suffix}: import ckptvault + ckptvault.save()", peer)]
    rows += [("fresh save process: torch.save + fsync", None),
             ("fresh save process: ckptvault.save()", "fresh save process: torch.save + fsync")]
    for suffix in ("", " (gc settled)"):
        peer = f"fresh restore{suffix}: torch.load"
        rows += [(peer, None), (f"fresh restore{suffix}: ckptvault.load()", peer),
                 (f"fresh restore{suffix}: import ckptvault + ckptvault.load()", peer)]
    rows += [(UNPICKLED, "fresh restore (gc settled): torch.load")]
    rows += [(f"{THEN_COLLECT}: torch.load", None),
             (f"{THEN_COLLECT}: ckptvault.load()", f"{THEN_COLLECT}: torch.load")]
    rows += [("fresh restore process: torch.load", None),
             ("fresh restore process: ckptvault.load()", "fresh restore process: torch.load")]
    return rows


ROWS = _rows()


def table(runs: Runs) -> str:
    lines = ["| measurement | median ms | min-max ms | vs peer |", "|---|---:|---:|---:|"]
    for name, peer in ROWS:
        if name not in runs.samples:
            continue
        values = runs.samples[name]
        ratio = f"{runs.median(name) / runs.median(peer):.2f}x" if peer else "peer"
        lines.append(f"| {name} | {1e3 * runs.median(name):.1f} | {1e3 * min(values):.1f}-{1e3 * max(values):.1f} "
                     f"| {ratio} |")
    return "\n".join(lines)


def write_section(path: Path, label: str, body: str) -> None:
    """Put ``body`` under ``## <label>`` in ``path``, replacing that section if it is there."""
    text = path.read_text() if path.exists() else "# Small states\n"
    section = f"## {label}\n\n{body}\n"
    pattern = re.compile(rf"^## {re.escape(label)}\n.*?(?=^## |\Z)", re.S | re.M)
    text = pattern.sub(lambda _: section + "\n", text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + section
    path.write_text(text.rstrip("\n") + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15, help="repetitions of every variant (default 15)")
    parser.add_argument("--parts", default="warm,fresh", help="warm, fresh or both (default)")
    parser.add_argument("--write", type=Path, help="markdown file to put the table into (a section per --label)")
    parser.add_argument("--label", default="result", help="section title for --write")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    load_before = os.getloadavg()[0]

    OUT.mkdir(parents=True, exist_ok=True)
    src = OUT / "state.pt"
    if not src.exists():
        torch_save_durable(build_state(), OUT)
    state = torch.load(src, weights_only=True)
    nbytes, ntensors = state_bytes(state)
    vault = OUT / "vault"  # what the fresh restores read
    if vault.exists():
        shutil.rmtree(vault)
    import ckptvault

    ckptvault.save(state, vault, step=1)

    runs = Runs()
    kept = {"sync": ckptvault.CheckpointManager(scratch("kept-sync"), async_save=False),
            "async": ckptvault.CheckpointManager(scratch("kept-async"))}
    if "warm" in parts:
        warm_round(state, Runs(), kept, 0)  # warm-up: imports, first kernels, allocator
    for i in range(args.runs):
        if "warm" in parts:
            warm_round(state, runs, kept, i + 1)
        if "fresh" in parts:
            fresh_round(runs, src, vault)
        print(f"run {i + 1}/{args.runs} done", file=sys.stderr)
    for mgr in kept.values():
        mgr.close()

    command = " ".join(["`.venv/bin/python", "bench/bench_small.py", *sys.argv[1:]]) + "`"
    info = machine()
    source = Path(ckptvault.__file__).resolve().parent.parent
    if source != ROOT / "src":
        info["code"] = f"ckptvault from {source} (PYTHONPATH)"
    flags = ", ".join(f"{k}: {sorted(v)}" for k, v in runs.flags.items())
    body = (f"State: {nbytes / 2**20:.2f} MiB in {ntensors} tensors. Medians of {args.runs} runs, interleaved. "
            f"Command: {command}. Code: {info['code']}; {info['cpus']} CPUs ({info['cpu_model']}), "
            f"Python {info['python']}, torch {info['torch']}; load average before: "
            f"{load_before:.1f}, after: {os.getloadavg()[0]:.1f}.{' ' + flags + '.' if flags else ''}\n\n{table(runs)}")
    print(body)
    (OUT / "results.json").write_text(json.dumps(runs.samples, indent=1))
    if args.write:
        write_section(args.write, args.label, body)


if __name__ == "__main__":
    main()
