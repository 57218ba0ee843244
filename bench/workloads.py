"""Benchmark workloads: training states built the same way every time.

W1 (the workload of docs/benchmarks/core.md): the ~85M-parameter GPT of ``ckptvault.demo.model``
(``GPTConfig.gpt85m()``), fp32, AdamW at lr 3e-4, trained ``W1_STEPS`` steps on
the standard library's own sources. The state is
``{"model": model.state_dict(), "optimizer": opt.state_dict(), "step": n}``:
weights, exp_avg and exp_avg_sq of ~342 MB each, about 1.03 GB in all. The
input and output embeddings are tied, so two keys of ``model`` share one tensor.

Training takes minutes on 2 cores, so built states are cached with
``torch.save`` under ``bench/out/`` (git-ignored), keyed by everything that
shapes them. Helpers here also build the peers' views of a state
(:func:`flat_tensors` for safetensors) and preallocated restore targets.
"""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path
from typing import Any

import torch

from ckptvault.demo.data import batch, stdlib_bytes
from ckptvault.demo.model import GPT, GPTConfig, num_params

log = logging.getLogger(__name__)

OUT_DIR = Path(__file__).resolve().parent / "out"
W1_STEPS = 5
W1_BATCH = 4
W1_LR = 3e-4

SIZES: dict[str, GPTConfig] = {
    "full": GPTConfig.gpt85m(),  # ~85M parameters, ~1.03 GB of state: the benchmark
    "dev": GPTConfig(seq_len=256, d_model=384, n_layer=5, n_head=6),  # ~1/10 of it, for development
    "tiny": GPTConfig(seq_len=64, d_model=64, n_layer=2, n_head=2),  # seconds; for smoke checks
}


def train_state(cfg: GPTConfig, steps: int = W1_STEPS, batch_size: int = W1_BATCH, seed: int = 0) -> dict[str, Any]:
    """Train a fresh GPT of ``cfg`` for ``steps`` AdamW steps; return its checkpoint state."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=W1_LR)
    data = stdlib_bytes()
    gen = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    for _ in range(steps):
        train_step(model, opt, data, batch_size, cfg.seq_len, gen)
    log.info("trained %d params for %d steps in %.1f s", num_params(model), steps, time.perf_counter() - start)
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": steps}


def train_step(model: GPT, opt: torch.optim.Optimizer, data: torch.Tensor, batch_size: int, seq_len: int,
               gen: torch.Generator) -> None:
    """One AdamW step of the GPT on a batch of ``data`` drawn with ``gen``."""
    x, y = batch(data, batch_size, seq_len, gen)
    opt.zero_grad(set_to_none=True)
    model.loss(x, y).backward()
    opt.step()


def w1_state(size: str = "full", steps: int = W1_STEPS, use_cache: bool = True) -> dict[str, Any]:
    """The W1 state of ``size`` (a key of :data:`SIZES`), from the cache when it holds it."""
    cfg = SIZES[size]
    name = f"w1-{size}-d{cfg.d_model}-l{cfg.n_layer}-s{steps}-b{W1_BATCH}-torch{torch.__version__}.pt"
    path = OUT_DIR / "cache" / name
    if use_cache and path.exists():
        return torch.load(path, weights_only=True)
    state = train_state(cfg, steps)
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".part")
        torch.save(state, tmp)
        tmp.replace(path)
    return state


def tensor_leaves(state: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """Every tensor of a nested dict/list/tuple state with its dotted key path, in order."""
    if isinstance(state, torch.Tensor):
        return [(prefix, state)]
    if isinstance(state, dict):
        items = state.items()
    elif isinstance(state, (list, tuple)):
        items = enumerate(state)
    else:
        return []
    out: list[tuple[str, torch.Tensor]] = []
    for key, value in items:
        out.extend(tensor_leaves(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def flat_tensors(state: Any) -> dict[str, torch.Tensor]:
    """A str-keyed dict of tensors for safetensors: one entry per storage (tied weights kept once).

    Optimizer states have int keys and 0-d ``step`` tensors; both are fine as
    dotted paths. Non-tensor leaves (``step``, param_groups) are not included:
    safetensors stores tensors only.
    """
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for path, tensor in tensor_leaves(state):
        ident = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if ident in seen and tensor.numel():
            continue
        seen.add(ident)
        out[path] = tensor
    return out


def state_nbytes(state: Any) -> int:
    """Bytes of every distinct tensor of ``state`` (tied weights counted once)."""
    return sum(t.numel() * t.element_size() for t in flat_tensors(state).values())


def zeroed_copy(state: Any) -> Any:
    """A deep copy of ``state`` with every tensor zeroed: a preallocated, already-faulted restore target.

    Tensors that share storage in ``state`` share it in the copy too (tied weights stay tied).
    """
    target = copy.deepcopy(state)
    with torch.no_grad():
        for _, tensor in tensor_leaves(target):
            tensor.zero_()
    return target


def copy_into(target: Any, source: Any) -> None:
    """Copy every tensor of ``source`` into the tensor at the same key path of ``target``."""
    sources = dict(tensor_leaves(source))
    with torch.no_grad():
        for path, tensor in tensor_leaves(target):
            tensor.copy_(sources[path])


def copy_flat_into(target: Any, flat: dict[str, torch.Tensor]) -> None:
    """Copy a :func:`flat_tensors`-style dict into ``target`` (an alias of a tied tensor is skipped)."""
    with torch.no_grad():
        for path, tensor in flat_tensors(target).items():
            tensor.copy_(flat[path])


def assert_same_tensors(expected: Any, actual: Any) -> None:
    """Raise AssertionError unless every tensor of ``expected`` equals the one at its path in ``actual``, bit for bit."""
    got = dict(tensor_leaves(actual))
    for path, tensor in tensor_leaves(expected):
        other = got.get(path)
        if other is None or other.dtype != tensor.dtype or other.shape != tensor.shape:
            raise AssertionError(f"{path}: missing or of another dtype/shape after restore")
        if not torch.equal(tensor.reshape(-1).view(torch.uint8), other.reshape(-1).view(torch.uint8)):
            raise AssertionError(f"{path}: bytes differ after restore")


def perturb_one_layer(state: dict[str, Any], layer: int = 0) -> dict[str, Any]:
    """A copy of a W1 state in which only block ``layer``'s weights and Adam moments changed.

    Models a second save where most of the state is unchanged (a frozen
    backbone, or a partial update), so dedup has something to find.
    """
    changed = copy.copy(state)
    changed["model"] = dict(state["model"])
    changed["optimizer"] = {"state": dict(state["optimizer"]["state"]), "param_groups": state["optimizer"]["param_groups"]}
    names = list(state["model"])
    ids = _param_ids(state, names)
    for name in names:
        if name.startswith(f"blocks.{layer}."):
            changed["model"][name] = state["model"][name] * 1.001
            pid = ids.get(name)
            if pid is not None and pid in state["optimizer"]["state"]:
                slot = state["optimizer"]["state"][pid]
                changed["optimizer"]["state"][pid] = {k: (v * 1.001 if v.dim() else v) for k, v in slot.items()}
    changed["step"] = state["step"] + 1
    return changed


def _param_ids(state: dict[str, Any], names: list[str]) -> dict[str, int]:
    """Model key -> optimizer param id, assuming params were registered in state_dict order (true for GPT)."""
    params = state["optimizer"]["param_groups"][0]["params"]
    unique: list[str] = []
    seen: set[int] = set()
    for name in names:
        ptr = state["model"][name].untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            unique.append(name)
    return dict(zip(unique, params))
