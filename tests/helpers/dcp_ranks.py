"""VaultWriter's DCP protocol driven by hand for several "ranks" in one process (no process group): the plans, the
global plan, each rank's write_data and the coordinator's finish, in DCP's order. Fast and deterministic, for the
golden manifest and the schema tests; tests/helpers/dcp_worker.py runs the real thing.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from ckptvault.distributed import VaultWriter


@dataclass
class Shard:
    """The box of a global tensor of ``size`` at ``offsets`` that one rank holds."""

    size: tuple[int, ...]
    offsets: tuple[int, ...]
    tensor: torch.Tensor


class _Planner:
    """What VaultWriter asks of a planner: resolve_data (tensors) and lookup_object (values)."""

    def __init__(self, items: dict[str, Any]) -> None:
        self.items = items

    def resolve_data(self, item: WriteItem) -> Any:
        value = self.items[item.index.fqn]
        return value.tensor if isinstance(value, Shard) else value

    def lookup_object(self, index: MetadataIndex) -> Any:
        return self.items[index.fqn]


def _write_item(fqn: str, value: Any) -> WriteItem:
    if not isinstance(value, Shard):
        return WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)
    chunk = ChunkStorageMetadata(torch.Size(value.offsets), value.tensor.size())
    return WriteItem(index=MetadataIndex(fqn, value.offsets), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(chunk, TensorProperties.create_from_tensor(value.tensor),
                                                 torch.Size(value.size)))


class _StreamPlanner(_Planner):
    """A planner that hands values over only as DCP's default does: torch.save streams (no lookup_object)."""

    lookup_object = None

    def resolve_data(self, item: WriteItem) -> Any:
        value = super().resolve_data(item)
        if item.type != WriteItemType.BYTE_IO:
            return value
        stream = io.BytesIO()
        torch.save(value, stream)
        return stream


def save_as_ranks(url: Any, step: int, ranks: list[dict[str, Any]], *, streams: bool = False,
                  **writer_options: Any) -> None:
    """Save one checkpoint of ``ranks`` (per rank: fqn -> Shard or value) as DCP would; rank 0 coordinates.
    ``url``: the vault, or one URL or Store per rank; ``streams``: a planner without ``lookup_object``."""
    urls = url if isinstance(url, list) else [url] * len(ranks)
    writers = [VaultWriter(u, step, **writer_options) for u in urls]
    planner = _StreamPlanner if streams else _Planner
    plans = []
    for rank, writer in enumerate(writers):
        writer.set_up_storage_writer(rank == 0, rank=rank)
        plans.append(writer.prepare_local_plan(SavePlan([_write_item(k, v) for k, v in ranks[rank].items()])))
    plans, metadata = create_default_global_save_plan(plans)
    plans = writers[0].prepare_global_plan(plans)
    results = [writer.write_data(plan, planner(items)).value()  # type: ignore[arg-type]
               for writer, plan, items in zip(writers, plans, ranks, strict=True)]
    writers[0].finish(metadata, results)


def golden_ranks() -> list[dict[str, Any]]:
    """Two ranks: ``w`` (6x4 float32) cut along rows 4 + 2, ``m`` (2x3 int16) cut along columns 2 + 1, a replicated
    scalar tensor on rank 0, and values."""
    w = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    m = torch.tensor([[1, -2, 3], [-4, 5, -6]], dtype=torch.int16)
    return [
        {"w": Shard((6, 4), (0, 0), w[:4].clone()), "m": Shard((2, 3), (0, 0), m[:, :2].contiguous()),
         "step": Shard((), (), torch.tensor(3.0)), "lr": 0.5, "name": "golden"},
        {"w": Shard((6, 4), (4, 0), w[4:].clone()), "m": Shard((2, 3), (0, 2), m[:, 2:].contiguous()),
         "tags": ["a", 1, None]},
    ]


def golden_whole() -> dict[str, Any]:
    """The state golden_ranks() holds, whole."""
    return {"w": torch.arange(24, dtype=torch.float32).reshape(6, 4),
            "m": torch.tensor([[1, -2, 3], [-4, 5, -6]], dtype=torch.int16),
            "step": torch.tensor(3.0), "lr": 0.5, "name": "golden", "tags": ["a", 1, None]}
