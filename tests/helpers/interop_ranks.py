"""Rank processes for tests/test_export_import.py: the FSDP2 model of tests/helpers/dcp_worker.py (gloo on CPU),
trained one step and saved once with ``dcp.save`` through ckptvault.distributed.VaultWriter, so its arrays are
stored as the shards the 2 ranks held. Rank 0 also writes the whole state (gathered) as ``expected.pt`` under
``out`` for the test to compare an export with."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ckptvault.distributed import VaultWriter
from helpers.dcp_worker import CHUNK_SIZE, _init, _save_full, _sharded, _state, _train, values


def save_sharded(rank: int, world: int, store: str, url: str, out: str) -> None:
    """Train one step on every rank, then save step 1 into the vault at ``url`` with VaultWriter."""
    mesh = _init(rank, world, store)
    net, opt = _sharded(0, mesh)
    _train(net, opt, rank, 1, seed=1)
    _save_full(net, opt, rank, Path(out) / "expected.pt", values(1))
    dcp.save(_state(net, opt, values(1)), storage_writer=VaultWriter(url, 1, chunk_size=CHUNK_SIZE))
    dist.barrier()
    dist.destroy_process_group()
