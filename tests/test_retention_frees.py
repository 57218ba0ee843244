"""Retention that frees space: ``CheckpointManager(exclusive=True)`` deletes the chunks its own prune released at
once (DESIGN G6), while without it nothing is deleted before gc's grace period (G2).

Each step's state has a weight tensor that changes a little per step (stored as deltas against the keyframe,
keyframe_every=3, so retention also keeps keyframes) and a fresh noise tensor (new chunks every step).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptvault import AsyncOptions, CheckpointManager, DeltaOptions, Retention
from conftest import assert_same_state, chunk_files

CHUNK = 64 << 10
STEPS = range(1, 8)
#: a chunk no manifest names, as another writer's save in flight would have written it
FOREIGN = "ab" + "0" * 62


def state(step: int) -> dict[str, Any]:
    w = torch.randn(1 << 17, generator=torch.Generator().manual_seed(0))
    w[: step * 4096] += 0.5
    return {"model": {"w": w}, "noise": torch.randn(1 << 16, generator=torch.Generator().manual_seed(100 + step)),
            "step": step}


def chunk_bytes(vault: Path) -> int:
    return sum(p.stat().st_size for p in chunk_files(vault))


def manager(vault: Path, exclusive: bool, saver: str = "thread") -> CheckpointManager:
    return CheckpointManager(str(vault), chunk_size=CHUNK, retention=Retention(keep_last=2), exclusive=exclusive,
                             delta=DeltaOptions(keyframe_every=3), async_options=AsyncOptions(saver=saver))


def foreign_chunk(vault: Path) -> Path:
    path = vault / "chunks" / FOREIGN[:2] / FOREIGN
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"another writer's chunk, not yet named by a manifest")
    return path


def run(vault: Path, exclusive: bool, saver: str = "thread") -> tuple[list[int], list[set[Path]]]:
    """Save every step (waiting for its retention); the chunk bytes and chunk files after each."""
    sizes, files = [], []
    with manager(vault, exclusive, saver) as mgr:
        mgr.save(0, {"step": 0}).wait()  # creates the vault, so the foreign chunk goes into a real one
        foreign = foreign_chunk(vault)
        for step in STEPS:
            mgr.save(step, state(step), metrics={"val_loss": 1.0 / step})
            mgr.wait()  # the commit and the retention after it
            sizes.append(chunk_bytes(vault))
            files.append(set(chunk_files(vault)))
        assert foreign.exists(), "exclusive retention deleted a chunk its own prune did not release"
    return sizes, files


@pytest.mark.parametrize("saver", ["thread", "process"])  # the saver process applies the retention itself
def test_exclusive_retention_frees_released_chunks_at_once(tmp_path: Path, saver: str) -> None:
    """(DESIGN G6) chunk bytes shrink right after a prune; only referenced chunks (and the foreign one) remain."""
    vault = tmp_path / "v"
    sizes, files = run(vault, exclusive=True, saver=saver)
    assert any(b < a for a, b in zip(sizes, sizes[1:])), f"chunk bytes never shrank: {sizes}"
    with CheckpointManager(str(vault)) as mgr:
        kept = mgr.steps()
        assert kept[-2:] == [6, 7] and len(kept) <= 3, kept  # the last two, and at most their keyframe
        plan, _ = mgr.gc(grace=0, dry_run=True)
        leftovers = {g.key for g in plan.candidates if g.kind == "chunk"}
        assert leftovers == {f"chunks/{FOREIGN[:2]}/{FOREIGN}"}, leftovers  # nothing released is left behind
        for step in kept:
            assert_same_state(mgr.restore(step), state(step))
        report = mgr.verify()
        assert report.ok, report


def test_without_exclusive_nothing_is_deleted_before_the_grace_period(tmp_path: Path) -> None:
    """(DESIGN G2) no chunk file disappears; gc with the default grace right after frees nothing."""
    vault = tmp_path / "v"
    sizes, files = run(vault, exclusive=False)
    for before, after in zip(files, files[1:]):
        assert before <= after, f"chunks were deleted: {sorted(p.name for p in before - after)}"
    exclusive_sizes, _ = run(tmp_path / "x", exclusive=True)
    assert exclusive_sizes[-1] < sizes[-1], (exclusive_sizes, sizes)
    with CheckpointManager(str(vault)) as mgr:
        assert mgr.steps()[-2:] == [6, 7]
        plan, result = mgr.gc()
        assert result is not None and result.bytes_freed == 0 and plan.fresh_unreferenced > 0
        for step in mgr.steps():
            assert_same_state(mgr.restore(step), state(step))
    assert os.path.getsize(vault / "chunks" / FOREIGN[:2] / FOREIGN) > 0
