"""A save relies on the chunks of the manifests it read without touching them, and touches them if those change.

Real local vaults and real gc-like deletions; the store only records touches and runs a hook at one moment.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from ckptvault import CheckpointManager
from ckptvault._format.chunk_object import chunk_key
from ckptvault._format.manifest import manifest_key
from ckptvault.errors import SaveError
from ckptvault.stores.local import LocalStore
from conftest import assert_same_state

CHUNK = 64 << 10


class TouchLog(LocalStore):
    """A LocalStore that records the keys it touches, and can run ``on_stat(key)`` before a stat of one key."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.touched: list[str] = []
        self.on_stat: Callable[[str], None] | None = None
        self._lock = threading.Lock()

    def touch(self, key: str) -> None:
        with self._lock:
            self.touched.append(key)
        super().touch(key)

    def stat(self, key: str):  # type: ignore[no-untyped-def]
        if self.on_stat is not None:
            self.on_stat(key)
        return super().stat(key)


def states() -> dict[int, dict[str, torch.Tensor]]:
    """"frozen" never changes; "tuned" changes at step 1 only; "w" changes at every step (delta chunks)."""
    g = torch.Generator().manual_seed(0)
    frozen, tuned0, w = (torch.randn(40_000, generator=g) for _ in range(3))
    tuned1 = tuned0 + 1e-3 * torch.randn(40_000, generator=g)
    out = {}
    for step in range(3):
        w = w + 1e-4 * torch.randn(40_000, generator=g)
        out[step] = {"frozen": frozen.clone(), "tuned": (tuned0 if step == 0 else tuned1).clone(), "w": w.clone()}
    return out


def chunk_ids(mgr: CheckpointManager, step: int) -> set[str]:
    return {c["id"] for c in mgr.manifest(step)["chunks"]}


Saved = tuple[dict[int, dict[str, torch.Tensor]], TouchLog, CheckpointManager]


@pytest.fixture
def saved(tmp_path: Path) -> Iterator[Saved]:
    """The states, and a manager over a TouchLog vault holding steps 0 (keyframe) and 1 (deltas), saved synchronously."""
    s = states()
    store = TouchLog(tmp_path / "v")
    with CheckpointManager(store, chunk_size=CHUNK, async_save=False) as mgr:
        mgr.save(0, s[0])
        mgr.save(1, s[1])
        yield s, store, mgr


def test_incremental_saves_touch_nothing_while_the_manifests_they_read_stay(saved: Saved) -> None:
    """Chunks named by the manifests a save read need no touch while those manifests stay as they were (DESIGN G5)."""
    s, store, mgr = saved
    mgr.save(2, s[2])
    assert store.touched == [], "reused chunks and delta bases are protected by the manifests that name them"
    assert any(c.get("base") for c in mgr.manifest(2)["chunks"]), "step 2 holds deltas against step 0"
    assert chunk_ids(mgr, 0) & chunk_ids(mgr, 2) and chunk_ids(mgr, 1) & chunk_ids(mgr, 2) - chunk_ids(mgr, 0)
    for step in range(3):
        assert_same_state(s[step], mgr.restore(step))


def test_without_a_manifest_to_rely_on_reused_chunks_are_touched(tmp_path: Path) -> None:
    """With no manifest to rely on, every reused chunk is touched when it is reused (DESIGN G5)."""
    s = states()
    store = TouchLog(tmp_path / "v")
    with CheckpointManager(store, chunk_size=CHUNK, async_save=False, incremental=False) as mgr:
        mgr.save(0, s[0])
        store.touched.clear()
        mgr.save(1, s[1])
        shared = chunk_ids(mgr, 0) & chunk_ids(mgr, 1)
        assert shared and {chunk_key(c) for c in shared} <= set(store.touched)


def _prune_at_commit(store: TouchLog, watched: str, also: Callable[[], None] = lambda: None) -> None:
    """Delete manifest ``watched`` (and run ``also``) right before the save's commit-time stat of it, as a
    concurrent prune (and gc) would."""
    seen = []

    def hook(key: str) -> None:
        if key == watched:
            seen.append(key)
            if len(seen) == 2:  # the first stat is the save's own, before it read the manifest
                (store.root / watched).unlink()
                also()

    store.on_stat = hook


def test_a_manifest_pruned_during_the_save_makes_it_touch_what_it_relied_on(saved: Saved) -> None:
    """A relied-on manifest pruned during the save: its reused chunks and the bases used are touched at commit (DESIGN G5)."""
    s, store, mgr = saved
    named = chunk_ids(mgr, 0) | chunk_ids(mgr, 1)
    _prune_at_commit(store, manifest_key(1))
    mgr.save(2, s[2])
    reused = named & chunk_ids(mgr, 2)
    bases = {c["base"] for c in mgr.manifest(2)["chunks"] if c.get("base") and c["new"]}  # encoded against
    assert reused and bases and set(store.touched) == {chunk_key(c) for c in reused | bases}
    assert mgr.steps() == [0, 2]
    assert_same_state(s[2], mgr.restore(2))


def test_a_relied_on_chunk_collected_before_commit_fails_the_save_cleanly(saved: Saved) -> None:
    """A reused chunk gone at commit fails the save with nothing committed, and a retry commits (DESIGN M3, G5)."""
    s, store, mgr = saved
    only_in_1 = chunk_ids(mgr, 1) - chunk_ids(mgr, 0)  # step 2 reuses those of "tuned"

    def gc() -> None:
        for cid in only_in_1:
            (store.root / chunk_key(cid)).unlink()

    _prune_at_commit(store, manifest_key(1), also=gc)  # prune step 1, then gc takes its chunks
    with pytest.raises(SaveError, match="removed by a concurrent gc before it committed.*nothing was committed"):
        mgr.save(2, s[2])
    assert mgr.steps() == [0]
    store.on_stat = None
    mgr.save(2, s[2])  # the retry writes the chunks again
    assert_same_state(s[2], mgr.restore(2))


@pytest.mark.parametrize("cached", [False, True])
def test_a_keyframe_chunk_missing_from_a_damaged_vault_is_stored_in_full(tmp_path: Path, cached: bool) -> None:
    """No touch checks a base: the save must still notice a base the store lost (read, or stat when cached)."""
    s = states()
    with CheckpointManager(tmp_path / "v", chunk_size=CHUNK, async_save=False, cache_keyframe=cached) as mgr:
        mgr.save(0, s[0])
        manifest = mgr.manifest(0)
        w = next(t for t in manifest["tensors"] if t["path"] == "w")
        lost = manifest["chunks"][w["pieces"][0][0]]["id"]  # a chunk step 1 encodes a delta against
        (tmp_path / "v" / chunk_key(lost)).unlink()
        mgr.save(1, s[1])
        assert all(c.get("base") != lost for c in mgr.manifest(1)["chunks"]), "stored in full, not against it"
        assert any(c.get("base") for c in mgr.manifest(1)["chunks"]), "the other chunks are still deltas"
        assert_same_state(s[1], mgr.restore(1))
