"""Lossy benchmark (docs/benchmarks/lossy.md): lossy presets on W1: stored bytes, encoding throughput, training fidelity.

    .venv/bin/python bench/bench_fidelity.py                                 # every part (docs/benchmarks/lossy.md)
    .venv/bin/python bench/bench_fidelity.py --size tiny --train-size tiny --steps 20 --reps 1   # smoke, a minute

Three parts (``--parts``):

* ``sizes``: the W1 states of ``bench_incremental`` (``--size full``: the 85M GPT + AdamW, 20 steps in, then
  +1 and +10 steps). Per preset, one vault: a synchronous save of the keyframe, then of the +1 and +10 states
  (deltas against the keyframe; ``keyframe_growth`` is raised so that +10 is not made a keyframe). Stored
  bytes of the keyframe and bytes each delta checkpoint added, relative to ``torch.save`` of the same state;
  save wall times; which tensors fell back to a safer codec.
* ``throughput``: the same +10 state, one thread, per tensor group (weights, exp_avg, exp_avg_sq): the
  lossless default (zstd byte planes over 4 MiB slices, as a save chunks) vs each lossy codec through
  ``encode_safely`` (error measurement and fallbacks included) followed by that lossless codec on what it
  stores. Residuals are against the +0 keyframe. Best of ``--reps``. Lossy outputs go to buffers kept
  from one rep to the next (``LossyBuffers``), as asynchronous saves keep them from one save to the next.
  Measured twice, interleaved: the codecs alone, and as a save encodes, which also names each 4 MiB chunk
  by the blake3 hash of its stored bytes (``chunk_id``) before compressing it.
* ``saves``: the same +10 state, per tensor group: a real synchronous save of the group alone into a fresh
  vault (in ``--save-dir``, tmpfs by default, so the disk does not decide) with one worker, every tensor
  ruled to the codec, no deltas. Median wall and CPU time of ``--reps`` saves, codecs interleaved; ratios
  to the lossless save. Lossy outputs go to fresh memory, as in any synchronous save.
* ``fidelity``: a GPT of ``--train-size`` (default ``dev``: 9M parameters, the full model trains at seconds
  per step on 2 shared cores) trained ``--warmup`` steps; its state 10 steps earlier is saved as the
  keyframe and the state at ``--warmup`` as the checkpoint with each preset, restored, and trained on for
  ``--steps`` steps on the same batches as the uninterrupted lossless run. Run-to-run noise: the same
  continuation on other data orders (two seeds). Compared: eval loss on 8 fixed held-out batches every
  ``--eval-every`` steps, and the training loss in 10-step means.

Results: stdout (markdown) and ``bench/out/fidelity-results[-SIZE][-TAG].{json,md}``.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import workloads_incremental as wi  # noqa: E402
from ckptvault import CheckpointManager  # noqa: E402
from ckptvault._codecs import chain_for, encode_chain  # noqa: E402
from ckptvault._codecs.lossy import LossySafety, encode_safely, parse_codec  # noqa: E402
from ckptvault._format.chunk_object import chunk_id  # noqa: E402
from ckptvault._save.lossy import LossyBuffers  # noqa: E402
from ckptvault.demo.data import batch, stdlib_bytes  # noqa: E402
from ckptvault.demo.model import GPT, num_params  # noqa: E402
from ckptvault.rules import PRESETS  # noqa: E402
from common import fresh_dir, machine  # noqa: E402
from workloads import OUT_DIR, SIZES, W1_BATCH, W1_LR, assert_same_tensors, tensor_leaves  # noqa: E402

log = logging.getLogger("bench_fidelity")

LOSSY_PRESETS = [p for p in PRESETS if p != "lossless"]
#: preset -> (what is measured, limit as a fraction of torch.save): the targets of docs/benchmarks/lossy.md
TARGETS = {"moments-compact": ("keyframe", 0.50), "fp16": ("delta +1", 0.40), "bf16": ("delta +1", 0.40),
           "residual": ("delta +10", 0.25)}  # moments-bf16 is a variant with no target
SLICE = 4 << 20
EVAL_BATCHES, EVAL_BATCH_SIZE = 8, 8


# -- sizes -------------------------------------------------------------------------------------------------------
def torch_save_bytes(state: Any, work: Path) -> int:
    path = work / "torch.pt"
    torch.save(state, path)
    size = path.stat().st_size
    path.unlink()
    return size


def fallbacks(info: Any) -> dict[str, int]:
    """'requested -> used' -> number of tensors, for tensors whose lossy codec fell back."""
    out: dict[str, int] = {}
    for t in info.tensors:
        for note in t.notes:
            key = f"{note.split(' on ', 1)[0]} -> {note.rsplit('fell back to ', 1)[-1] if 'fell back' in note else 'kept'}"
            out[key] = out.get(key, 0) + 1
    return out


def sizes(states: wi.States, work: Path) -> dict[str, Any]:
    reference = {gap: torch_save_bytes(states[gap], work) for gap in states}
    rows = {}
    for preset in PRESETS:
        root = fresh_dir(work / f"vault-{preset}")
        row: dict[str, Any] = {}
        with warnings.catch_warnings(), CheckpointManager(root, codec_rules=preset, async_save=False,
                                                          keyframe_growth=100.0) as mgr:
            warnings.simplefilter("ignore", RuntimeWarning)
            for gap in sorted(states):
                start = time.perf_counter()
                info = mgr.save(gap, states[gap]).wait()
                label = "keyframe" if gap == 0 else f"delta +{gap}"
                row[label] = {"stored": info.stored_bytes, "added": info.added_bytes, "save_s": time.perf_counter() - start,
                              "ratio": (info.stored_bytes if gap == 0 else info.added_bytes) / reference[gap],
                              "fallbacks": fallbacks(info)}
        shutil.rmtree(root)
        rows[preset] = row
        log.info("sizes %s: %s", preset, {k: round(v["ratio"], 3) for k, v in row.items()})
    return {"torch_save_bytes": reference, "presets": rows}


# -- throughput ----------------------------------------------------------------------------------------------------
def lossless_bytes(t: torch.Tensor, codec: str = "zstd", chunk_ids: bool = False) -> int:
    """Bytes ``codec`` stores of ``t`` in 4 MiB slices; ``chunk_ids``: also hash each slice, as a save names it."""
    raw = memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    stages = chain_for(codec, t.element_size())
    stored = 0
    for s in range(0, raw.nbytes, SLICE):
        if chunk_ids:
            chunk_id(raw[s : s + SLICE])
        stored += len(encode_chain(raw[s : s + SLICE], stages)[1])
    return stored


#: output memory kept from one rep to the next, as an asynchronous save keeps it from one save to the next
BUFFERS = LossyBuffers()


def lossy_bytes(path: str, t: torch.Tensor, codec: str, base: torch.Tensor | None, chunk_ids: bool = False
                ) -> tuple[int, str]:
    spec, lossless = parse_codec(codec, "zstd")
    assert spec is not None
    encoded, _notes = encode_safely(path, t, spec, LossySafety(), base, BUFFERS.allocator(f"{codec}/{path}"))
    if encoded is None:
        return lossless_bytes(t, lossless, chunk_ids), "lossless"
    return sum(lossless_bytes(p, lossless, chunk_ids) for p in encoded.parts.values()), encoded.spec.name


def groups_of(state: Any) -> dict[str, list[tuple[str, torch.Tensor]]]:
    leaves = [(p, t) for p, t in tensor_leaves(state) if t.dtype == torch.float32 and t.numel() > 1]
    seen: set[int] = set()
    unique = [(p, t) for p, t in leaves if not (t.data_ptr() in seen or seen.add(t.data_ptr()))]  # tied: once
    return {"weights": [(p, t) for p, t in unique if p.startswith("model.")],
            "exp_avg": [(p, t) for p, t in unique if p.endswith("exp_avg")],
            "exp_avg_sq": [(p, t) for p, t in unique if p.endswith("exp_avg_sq")]}


def throughput(states: wi.States, reps: int) -> dict[str, Any]:
    """Best of ``reps`` per codec, alone and with chunk ids; the reps interleave the codecs and both ways, so a
    change in the machine's load hits all alike."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    keyframe = dict(tensor_leaves(states[0]))
    out: dict[str, Any] = {}
    try:
        for group, tensors in groups_of(states[10]).items():
            nbytes = sum(t.numel() * 4 for _p, t in tensors)
            codecs = ["lossless", "bf16", "fp16", "int8-block:256"] + (["residual-int8:256"] if group == "weights" else [])
            best = {(codec, ids): float("inf") for codec in codecs for ids in (False, True)}
            out[group] = {"bytes": nbytes}
            for _ in range(reps):
                for codec in codecs:
                    for ids in (False, True):
                        start = time.perf_counter()
                        stored, used = _encode_group(tensors, codec, keyframe, ids)
                        best[codec, ids] = min(best[codec, ids], time.perf_counter() - start)
                    out[group][codec] = {"gbps": nbytes / best[codec, False] / 1e9, "ratio": stored / nbytes,
                                         "used": used, "gbps_with_ids": nbytes / best[codec, True] / 1e9}
            for codec in codecs:
                log.info("throughput %s %s: %s", group, codec, out[group][codec])
    finally:
        torch.set_num_threads(threads)
    return out


def _encode_group(tensors: list[tuple[str, torch.Tensor]], codec: str, keyframe: dict[str, torch.Tensor],
                  chunk_ids: bool = False) -> tuple[int, list[str]]:
    """(stored bytes, codecs actually used) of encoding ``tensors`` with ``codec`` then its lossless stage."""
    if codec == "lossless":
        return sum(lossless_bytes(t, chunk_ids=chunk_ids) for _p, t in tensors), ["zstd"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        results = [lossy_bytes(p, t, codec, keyframe[p] if codec.startswith("residual") else None, chunk_ids)
                   for p, t in tensors]
    return sum(r[0] for r in results), sorted({r[1] for r in results})


# -- real saves ----------------------------------------------------------------------------------------------------
SAVE_CODECS = ("lossless", "bf16", "fp16", "int8-block:256")


def saves(states: wi.States, reps: int, save_dir: Path) -> dict[str, Any]:
    """Median (wall s, CPU s) of ``reps`` synchronous saves per group and codec; see the module docstring."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    times: dict[str, dict[str, list[tuple[float, float]]]] = {}
    out: dict[str, Any] = {}
    try:
        for codec in SAVE_CODECS:  # untimed: a process's first save loads the numba kernels (about 0.4 s)
            _timed_save({"warm_up": states[10]["model"]["tok.weight"]}, codec, save_dir / codec)
        for _ in range(reps):
            for group, tensors in groups_of(states[10]).items():
                state = {p.replace(".", "_"): t for p, t in tensors}
                out.setdefault(group, {"bytes": sum(t.numel() * 4 for t in state.values())})
                for codec in SAVE_CODECS:
                    times.setdefault(group, {}).setdefault(codec, []).append(_timed_save(state, codec, save_dir / codec))
    finally:
        torch.set_num_threads(threads)
    for group, row in times.items():
        for codec, runs in row.items():
            out[group][codec] = {"wall_s": statistics.median(w for w, _c in runs),
                                 "cpu_s": statistics.median(c for _w, c in runs)}
            log.info("saves %s %s: %s", group, codec, out[group][codec])
    return out


def _timed_save(state: dict[str, torch.Tensor], codec: str, vault: Path) -> tuple[float, float]:
    shutil.rmtree(vault, ignore_errors=True)
    mgr = CheckpointManager(vault, codec_rules=[("*", codec)], workers=1, async_save=False, incremental=False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # fallbacks
            wall, cpu = time.perf_counter(), time.process_time()
            mgr.save(1, state)
            return time.perf_counter() - wall, time.process_time() - cpu
    finally:
        mgr.close()
        shutil.rmtree(vault, ignore_errors=True)


# -- fidelity ------------------------------------------------------------------------------------------------------
class Trainer:
    """Continues a GPT of one config from a state on a seeded data order; eval on fixed held-out batches."""

    def __init__(self, size: str) -> None:
        self.cfg = SIZES[size]
        self.data = stdlib_bytes()
        gen = torch.Generator().manual_seed(12345)
        self.evals = [batch(self.data, EVAL_BATCH_SIZE, self.cfg.seq_len, gen) for _ in range(EVAL_BATCHES)]

    def fresh(self, seed: int = 0) -> tuple[GPT, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = GPT(self.cfg)
        return model, torch.optim.AdamW(model.parameters(), lr=W1_LR)

    def train(self, model: GPT, opt: torch.optim.Optimizer, gen: torch.Generator, steps: int) -> list[float]:
        losses = []
        for _ in range(steps):
            x, y = batch(self.data, W1_BATCH, self.cfg.seq_len, gen)
            opt.zero_grad(set_to_none=True)
            loss = model.loss(x, y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    @torch.no_grad()
    def eval_loss(self, model: GPT) -> float:
        return sum(model.loss(x, y).item() for x, y in self.evals) / len(self.evals)

    def continue_from(self, state: dict[str, Any], data_seed: int, steps: int, every: int) -> dict[str, list[float]]:
        model, opt = self.fresh()
        state = copy.deepcopy(state)  # load_state_dict keeps the optimizer's tensors and steps them in place
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        gen = torch.Generator().manual_seed(1000 + data_seed)
        train, evals = [], [self.eval_loss(model)]
        for _ in range(0, steps, every):
            train += self.train(model, opt, gen, every)
            evals.append(self.eval_loss(model))
        return {"train": train, "eval": evals}


def state_of(model: GPT, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})


def deviation(run: dict[str, list[float]], ref: dict[str, list[float]]) -> dict[str, float]:
    """Max and final |difference| of eval loss, and of the training loss in 10-step means."""
    ev = [abs(a - b) for a, b in zip(run["eval"], ref["eval"], strict=True)]
    means = [[sum(r["train"][i : i + 10]) / 10 for i in range(0, len(r["train"]) - 9, 10)] for r in (run, ref)]
    tr = [abs(a - b) for a, b in zip(*means, strict=True)]
    return {"eval_max": max(ev), "eval_final": ev[-1], "train10_max": max(tr), "train10_final": tr[-1]}


def fidelity(size: str, warmup: int, steps: int, every: int, work: Path) -> dict[str, Any]:
    trainer = Trainer(size)
    model, opt = trainer.fresh()
    gen = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    trainer.train(model, opt, gen, warmup - 10)
    keyframe = state_of(model, opt)
    trainer.train(model, opt, gen, 10)
    state = state_of(model, opt)
    ref = trainer.continue_from(state, 0, steps, every)
    log.info("fidelity: %d params, reference run ready after %.0f s", num_params(model), time.perf_counter() - start)
    noise = {f"data order {s}": trainer.continue_from(state, s, steps, every) for s in (1, 2)}
    runs: dict[str, Any] = {"lossless (uninterrupted)": {"curve": ref}}
    for name, run in noise.items():
        runs[name] = {"curve": run, "deviation": deviation(run, ref)}
    for preset in PRESETS:
        root = fresh_dir(work / f"fidelity-{preset}")
        with warnings.catch_warnings(), CheckpointManager(root, codec_rules=preset, async_save=False) as mgr:
            warnings.simplefilter("ignore", RuntimeWarning)
            mgr.save(warmup - 10, keyframe)
            info = mgr.save(warmup, state).wait()
            restored = mgr.restore(warmup)
        shutil.rmtree(root)
        entry: dict[str, Any] = {"checkpoint_stored": info.stored_bytes, "checkpoint_added": info.added_bytes,
                                 "logical": info.logical_bytes, "fallbacks": fallbacks(info)}
        if preset == "lossless":  # bit-identical state: its run is the reference run, by construction
            assert_same_tensors(state, restored)
            entry["deviation"] = {k: 0.0 for k in ("eval_max", "eval_final", "train10_max", "train10_final")}
        else:
            entry["curve"] = trainer.continue_from(restored, 0, steps, every)
            entry["deviation"] = deviation(entry["curve"], ref)
        runs[f"preset {preset}"] = entry
        log.info("fidelity %s: %s", preset, {k: round(v, 5) for k, v in entry["deviation"].items()})
    noise_max = {k: max(runs[n]["deviation"][k] for n in noise) for k in ("eval_max", "eval_final", "train10_max")}
    return {"size": size, "params": num_params(model), "warmup": warmup, "steps": steps, "every": every,
            "noise": noise_max, "runs": runs}


# -- report --------------------------------------------------------------------------------------------------------
def report(results: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [f"# bench_fidelity ({meta['started']}, W1 size {meta['size']}, load {meta['load_before']} -> "
             f"{meta['load_after']})", ""]
    if "sizes" in results:
        lines += ["## Stored bytes / torch.save (W1; deltas: bytes the checkpoint added)", "",
                  "| preset | keyframe | delta +1 | delta +10 | target | keyframe save s | fallbacks |",
                  "|---|---|---|---|---|---|---|"]
        for preset, row in results["sizes"]["presets"].items():
            what, limit = TARGETS.get(preset, ("", None))
            verdict = f"{what} <= {limit}: {'met' if row[what]['ratio'] <= limit else 'MISSED'}" if limit else "-"
            falls = "; ".join(f"{k}: {v}" for k, v in row["keyframe"]["fallbacks"].items()) or "-"
            lines.append(f"| {preset} | {row['keyframe']['ratio']:.3f} | {row['delta +1']['ratio']:.3f} | "
                         f"{row['delta +10']['ratio']:.3f} | {verdict} | {row['keyframe']['save_s']:.1f} | {falls} |")
        lines.append("")
    if "throughput" in results:
        lines += ["## Encoding throughput, 1 thread, GB/s of float32 input (stored/original)", "",
                  "| group | lossless | bf16 | fp16 | int8-block:256 | residual-int8:256 |", "|---|---|---|---|---|---|"]
        for group, row in results["throughput"].items():
            cells = [_throughput_cell(row[c], c) if c in row else "-"
                     for c in ("lossless", "bf16", "fp16", "int8-block:256", "residual-int8:256")]
            lines.append(f"| {group} | " + " | ".join(cells) + " |")
        lines += ["", "## The same as a save encodes (each 4 MiB chunk also named by its blake3 hash), GB/s "
                  "(ratio to lossless)", "",
                  "| group | lossless | bf16 | fp16 | int8-block:256 | residual-int8:256 |", "|---|---|---|---|---|---|"]
        for group, row in results["throughput"].items():
            lossless = row["lossless"]["gbps_with_ids"]
            cells = [f"{row[c]['gbps_with_ids']:.2f} ({row[c]['gbps_with_ids'] / lossless:.2f}x)" if c in row else "-"
                     for c in ("lossless", "bf16", "fp16", "int8-block:256", "residual-int8:256")]
            lines.append(f"| {group} | " + " | ".join(cells) + " |")
        lines.append("")
    if "saves" in results:
        lines += ["## Synchronous saves of each group alone, one worker, GB/s of float32 input (wall-time and CPU-time "
                  "ratios to lossless)", "", "| group | " + " | ".join(SAVE_CODECS) + " |", "|---" * (len(SAVE_CODECS) + 1) + "|"]
        for group, row in results["saves"].items():
            cells = [f"{row['bytes'] / row[c]['wall_s'] / 1e9:.2f} ({row['lossless']['wall_s'] / row[c]['wall_s']:.2f}x, "
                     f"CPU {row['lossless']['cpu_s'] / row[c]['cpu_s']:.2f}x)" for c in SAVE_CODECS]
            lines.append(f"| {group} | " + " | ".join(cells) + " |")
        lines.append("")
    if "fidelity" in results:
        fid = results["fidelity"]
        lines += [f"## Training fidelity ({fid['size']} GPT, {fid['params']:,} params; restored at step {fid['warmup']}, "
                  f"then {fid['steps']} steps)", "",
                  "| run | eval max dev | eval final dev | train (10-step means) max dev | inside noise |",
                  "|---|---|---|---|---|"]
        noise = fid["noise"]
        for name, run in fid["runs"].items():
            if "deviation" not in run:
                continue
            d = run["deviation"]
            inside = "-" if name.startswith("data") else (
                "yes" if d["eval_max"] <= noise["eval_max"] and d["train10_max"] <= noise["train10_max"] else "NO")
            lines.append(f"| {name} | {d['eval_max']:.5f} | {d['eval_final']:.5f} | {d['train10_max']:.5f} | {inside} |")
        ref = fid["runs"]["lossless (uninterrupted)"]["curve"]["eval"]
        lines += ["", f"Reference eval loss: {ref[0]:.4f} -> {ref[-1]:.4f}.", ""]
    return "\n".join(lines)


def _throughput_cell(cell: dict[str, Any], codec: str) -> str:
    used = "" if codec == "lossless" or cell["used"] == [codec] else ", used " + "/".join(cell["used"])
    return f"{cell['gbps']:.2f} ({cell['ratio']:.3f}{used})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full", help="W1 size for sizes and throughput")
    parser.add_argument("--train-size", choices=sorted(SIZES), default="dev", help="GPT size for the fidelity runs")
    parser.add_argument("--parts", default="sizes,throughput,saves,fidelity")
    parser.add_argument("--reps", type=int, default=3, help="throughput: best of N; saves: median of N")
    parser.add_argument("--save-dir", type=Path, default=Path("/dev/shm/ckptvault-bench-saves") if Path("/dev/shm").is_dir()
                        else OUT_DIR / "saves", help="saves: where the vaults go (tmpfs by default)")
    parser.add_argument("--warmup", type=int, default=20, help="fidelity: training steps before the checkpoint (>= 10)")
    parser.add_argument("--steps", type=int, default=50, help="fidelity: steps trained after the restore")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--work", type=Path, default=OUT_DIR / "fidelity", help="scratch directory")
    parser.add_argument("--tag", default="", help="suffix of the result files (e.g. when running one part again)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    parts = set(args.parts.split(","))
    work = fresh_dir(args.work)
    work.mkdir(parents=True, exist_ok=True)
    meta = {"size": args.size, "train_size": args.train_size, "machine": machine(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "load_before": [round(x, 1) for x in os.getloadavg()],
            "command": " ".join([".venv/bin/python", "bench/bench_fidelity.py", *(argv if argv is not None else sys.argv[1:])])}
    results: dict[str, Any] = {}
    if parts & {"sizes", "throughput", "saves"}:
        states = wi.w1_states(args.size)
        if "sizes" in parts:
            results["sizes"] = sizes(states, work)
        if "throughput" in parts:
            results["throughput"] = throughput(states, args.reps)
        if "saves" in parts:
            results["saves"] = saves(states, args.reps, args.save_dir)
        del states
    if "fidelity" in parts:
        results["fidelity"] = fidelity(args.train_size, args.warmup, args.steps, args.eval_every, work)
    meta["load_after"] = [round(x, 1) for x in os.getloadavg()]
    text = report(results, meta)
    print(text)
    suffix = ("" if args.size == "full" else f"-{args.size}") + (f"-{args.tag}" if args.tag else "")
    (OUT_DIR / f"fidelity-results{suffix}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (OUT_DIR / f"fidelity-results{suffix}.md").write_text(text + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
