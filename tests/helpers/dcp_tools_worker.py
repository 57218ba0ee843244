"""Rank processes for tests/test_dcp_tools.py: the FSDP2 model of tests/helpers/dcp_worker.py saved with VaultWriter
into a local or s3:// vault, for the CLI and the maintenance tools to work on; and a load at any world size.

Each function runs on every rank (``dcp_worker.spawn``); rank 0 writes the full state dict of every saved step as
``expected_<step>.pt`` under ``out`` (the state as the ranks held it, gathered whole), for the test process to check.
"""

from __future__ import annotations

import collections
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.fsdp import fully_shard

from ckptvault.distributed import VaultReader, VaultWriter
from ckptvault.stores import open_store
from helpers.dcp_worker import CHUNK_SIZE, _init, _save_full, _state, _train, placeholder_values, values

#: steps save_steps writes: (step, training steps before it); step 3 repeats step 2's state unchanged
PLAN = ((1, 2), (2, 1), (3, 0))
#: rows of the frozen layer: 151 + 150 on 2 ranks, 77 KB of float32 each, so every shard spans 2 chunks of 64 KiB
FROZEN_ROWS = 301


class Net(nn.Module):
    """dcp_worker.Net with a larger frozen layer (unchanged by training: deduplicated across steps)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.frozen = nn.Linear(128, FROZEN_ROWS, bias=False)
        self.frozen.weight.requires_grad_(False)
        self.inner = nn.Linear(FROZEN_ROWS, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.inner(self.frozen(x))))


def _sharded(seed: int, mesh: Any) -> tuple[Net, torch.optim.Optimizer]:
    net = Net(seed)
    fully_shard(net, mesh=mesh)
    return net, torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2)


def save_steps(rank: int, world: int, store: str, url: str, out: str, options: dict[str, Any] | None,
               repeat: bool) -> None:
    """Save the steps of PLAN with VaultWriter (``options``: its storage_options), metrics ``loss``=1/step. With
    ``repeat`` (an s3:// ``url``), each rank then saves step 3's state again, unchanged, as step 4, through an
    S3Store whose client counts the requests it sends by operation (``repeat_rank<r>.json``: ``requests``,
    ``seconds``)."""
    mesh = _init(rank, world, store)
    folder = Path(out)
    net, opt = _sharded(0, mesh)
    for step, train in PLAN:
        _train(net, opt, rank, train, seed=10 * step)
        _save_full(net, opt, rank, folder / f"expected_{step}.pt", values(step))
        writer = VaultWriter(url, step, chunk_size=CHUNK_SIZE, storage_options=options,
                             metrics={"loss": 1.0 / step}, metadata={"run": "dcp-tools"})
        dcp.save(_state(net, opt, values(step)), storage_writer=writer)
    if repeat:
        store = open_store(url, options)
        requests: collections.Counter[str] = collections.Counter()
        store.client.meta.events.register("before-parameter-build.s3",  # type: ignore[attr-defined]
                                          lambda model, **_: requests.update([model.name]))
        dist.barrier()
        start = time.perf_counter()
        dcp.save(_state(net, opt, values(3)), storage_writer=VaultWriter(store, 4))
        report = {"requests": dict(requests), "seconds": time.perf_counter() - start}
        (folder / f"repeat_rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


def load_step(rank: int, world: int, store: str, url: str, out: str, step: int,
              options: dict[str, Any] | None) -> None:
    """A fresh (differently initialised) model and optimizer at world size ``world``, loaded from ``step`` with
    VaultReader, gathered whole by rank 0 into ``loaded_<step>_w<world>.pt``."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    mesh = _init(rank, world, store)
    net, opt = _sharded(1, mesh)
    state = _state(net, opt, placeholder_values())
    dcp.load(state, storage_reader=VaultReader(url, step, storage_options=options))
    set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _save_full(net, opt, rank, Path(out) / f"loaded_{step}_w{world}.pt", state["extra"])
    dist.barrier()
    dist.destroy_process_group()
