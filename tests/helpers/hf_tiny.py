"""A tiny GPT-2 and its data for real Hugging Face ``Trainer.train`` runs on the CPU in a second or two.

Nothing is downloaded: the model is built from a config, the data are random token ids made from a seed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

SEQ = 16
VOCAB = 128


def tiny_model(seed: int = 0) -> GPT2LMHeadModel:
    """2 layers, 32 wide (about 30k parameters); dropout on, so a resume must restore the RNG to match."""
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                                      bos_token_id=0, eos_token_id=0))


def token_rows(n: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """``n`` examples of ``SEQ`` random token ids, each its own label (causal LM)."""
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": row, "labels": row} for row in ids]


def tiny_args(output_dir: Path, **overrides: Any) -> TrainingArguments:
    """CPU, no reporting, no progress bars, batch 4, a checkpoint every 2 steps unless overridden."""
    settings: dict[str, Any] = dict(output_dir=str(output_dir), per_device_train_batch_size=4, save_steps=2,
                                    logging_steps=1, learning_rate=1e-2, report_to=[], use_cpu=True,
                                    disable_tqdm=True, seed=0)
    settings.update(overrides)
    return TrainingArguments(**settings)


class StopAt(TrainerCallback):
    """Ends training after global step ``step``, as a crash right after that step's checkpoint would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


class ScriptedScore:
    """A ``compute_metrics`` that reports ``score`` values in a fixed order, one per evaluation."""

    def __init__(self, scores: Sequence[float]) -> None:
        self._scores: Iterator[float] = iter(scores)

    def __call__(self, prediction: Any) -> dict[str, float]:
        return {"score": float(next(self._scores))}


def argmax_logits(logits: Any, labels: Any) -> Any:
    """``preprocess_logits_for_metrics``: keep one id per position instead of every logit."""
    return logits.argmax(dim=-1)
