"""Read-ahead of restores: ``Store.prefetch`` hints, and ``_restore/readahead.py`` hinting a restore's chunk objects
in the order its tasks read them, a bounded window ahead of the furthest task started."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from ckptvault import CheckpointManager, DeltaOptions
from ckptvault._format.chunk_object import chunk_key
from ckptvault._restore import readahead
from ckptvault._restore.readahead import ReadAhead, read_ahead
from ckptvault.errors import PermanentStorageError
from ckptvault.stores.local import LocalStore
from ckptvault.stores.memory import MemoryStore
from helpers.page_cache import cached_pages, drops_observable


class HintedStore(MemoryStore):
    """A memory store that records the hints it gets (and fails them when told to)."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.hinted: list[str] = []
        self.fail = fail
        self.changed = threading.Condition()

    def prefetch(self, keys: list[str]) -> None:
        if self.fail:
            raise PermanentStorageError("the store is gone")
        with self.changed:
            self.hinted.extend(keys)
            self.changed.notify_all()

    def wait_for(self, count: int) -> list[str]:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.hinted) >= count, timeout=10), self.hinted
            return list(self.hinted)


def tasks(*ids: str, raw: int = 100) -> list[list[tuple[str, int]]]:
    return [[(cid, raw)] for cid in ids]


def test_hints_follow_the_task_order_and_stay_within_the_window() -> None:
    store = HintedStore()
    ahead = ReadAhead(store, tasks(*"abcdefgh"), window=250)
    try:
        assert store.wait_for(3) == [chunk_key(c) for c in "abc"]
        time.sleep(0.2)
        assert len(store.hinted) == 3  # 300 raw bytes hinted, no task started: the window is full
        ahead.started(0)
        assert store.wait_for(4)[3] == chunk_key("d")
        ahead.started(4)  # tasks start out of order on several threads: the furthest one counts
        assert store.wait_for(8)[4:] == [chunk_key(c) for c in "efgh"]
    finally:
        ahead.stop()


def test_an_object_that_several_tasks_read_is_hinted_once() -> None:
    store = HintedStore()
    with read_ahead(store, [[("a", 1), ("z", 1)], [("b", 1), ("z", 1)], [("a", 1)]] * 8) as ahead:
        assert isinstance(ahead, ReadAhead)
        assert store.wait_for(3) == [chunk_key(c) for c in "azb"]
    time.sleep(0.1)
    assert len(store.hinted) == 3


def test_a_store_that_fails_a_hint_ends_the_read_ahead_quietly() -> None:
    store = HintedStore(fail=True)
    with read_ahead(store, tasks(*"abcdefghijklmnopqrstuvwxyz")) as ahead:
        ahead.started(3)
    assert store.hinted == []


def test_few_tasks_or_a_store_without_hints_get_no_thread() -> None:
    before = threading.active_count()
    with read_ahead(HintedStore(), tasks(*"abc")) as ahead:
        assert not isinstance(ahead, ReadAhead) and threading.active_count() == before
    with read_ahead(MemoryStore(), tasks(*"abcdefghijklmnopqrstuvwxyz")) as ahead:
        assert not isinstance(ahead, ReadAhead) and threading.active_count() == before


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="prefetch needs posix_fadvise")
def test_the_local_store_reads_hinted_objects_into_the_page_cache(tmp_path: Path) -> None:
    if not drops_observable(tmp_path):
        pytest.skip(f"the file system of {tmp_path} does not show page cache drops (tmpfs keeps its pages)")
    store = LocalStore(tmp_path / "v")  # drop-behind: a batch's objects leave the page cache once on disk
    store.root.mkdir()
    batch = store.write_batch()
    for i in range(3):
        assert batch.put_if_absent(f"chunks/0{i}/c{i}", os.urandom(256 << 10))
    batch.finish()
    paths = [store.root / f"chunks/0{i}/c{i}" for i in range(3)]
    assert [cached_pages(p) for p in paths] == [0, 0, 0]
    store.prefetch(["chunks/00/c0", "chunks/missing/c", "../outside", "chunks/02/c2"])  # bad keys are skipped
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (cached_pages(paths[0]), cached_pages(paths[2])) != (64, 64):
        time.sleep(0.01)
    assert [cached_pages(p) for p in paths] == [64, 0, 64]


@pytest.mark.parametrize("predict", [False, True])
def test_restores_hint_every_chunk_they_read_and_stay_exact(tmp_path: Path, monkeypatch, predict: bool) -> None:
    """Every chunk a restore reads is handed to its read-ahead, and only those are hinted. (Which of them are hinted
    before the restore ends depends on the timing: a task that has started needs no hint.)"""
    monkeypatch.setattr(readahead, "MIN_TASKS", 1)
    planned: list[str] = []
    hinted: list[str] = []
    real_init, real_prefetch = ReadAhead.__init__, LocalStore.prefetch

    def planning(self, store, tasks, window=readahead.WINDOW_BYTES):
        planned.extend(chunk_key(cid) for task in tasks for cid, _raw in task)
        real_init(self, store, tasks, window)

    def counting(self, keys):
        hinted.extend(keys)
        return real_prefetch(self, keys)

    monkeypatch.setattr(ReadAhead, "__init__", planning)
    monkeypatch.setattr(LocalStore, "prefetch", counting)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 512), torch.nn.ReLU(), torch.nn.Linear(512, 96))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    saved = {}
    with CheckpointManager(tmp_path / "v", async_save=False, chunk_size=64 << 10,
                           delta=DeltaOptions(predict=predict, keyframe_every=50)) as mgr:
        for step in (1, 2):
            model(torch.randn(8, 96)).square().mean().backward()
            opt.step()
            state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
            mgr.save(step, state)
            saved[step] = {k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict()["state"][0]["exp_avg"].clone()
        if predict:
            assert any("predict" in t for t in mgr.manifest(2)["tensors"])
    with CheckpointManager(tmp_path / "v") as fresh:
        planned.clear()
        hinted.clear()
        restored = fresh.restore(2)
        fresh_manifest = fresh.manifest(2)
        chunks = [chunk_key(c["id"]) for c in fresh_manifest["chunks"]]
        table = set(chunks)
        levels = {chunks[piece[0]] for level in fresh_manifest.get("chain", []) for piece in level["pieces"]}
    weights, exp_avg = saved[2]
    for name, value in weights.items():
        assert torch.equal(restored["model"][name], value), name
    assert torch.equal(restored["optimizer"]["state"][0]["exp_avg"], exp_avg)
    # every chunk of an array is handed to a read-ahead (a predicted restore's two passes may hand one twice); a
    # chain level is read alone, before any array
    assert set(planned) == table - levels
    assert set(hinted) <= set(planned)


@pytest.mark.parametrize("codec", ["zstd", "lz4", "none", "fast"])
def test_a_chunk_read_into_a_buffer_is_the_chunk_there(tmp_path: Path, codec: str) -> None:
    """``Vault.read_chunk(into=)`` for every codec, XOR deltas against a keyframe included (whose base is read into
    the same thread's read buffer as the delta): the bytes of a plain read, as a view of the buffer."""
    torch.manual_seed(0)
    state = {"w": torch.randn(40_000), "b": torch.randn(300).double(), "raw": torch.randint(0, 255, (70_000,), dtype=torch.uint8)}
    with CheckpointManager(tmp_path / "v", async_save=False, codec=codec, chunk_size=64 << 10) as mgr:
        mgr.save(1, state)
        state["w"][::7] += 1e-3  # most chunks of the next save are XOR deltas of these
        mgr.save(2, state)
        table = mgr.vault.read_manifest(2).chunks
        for ref in table:
            buffer = bytearray(b"\xaa" * (ref.raw + 100))
            got = mgr.vault.read_chunk(ref.id, expected_raw=ref.raw, into=memoryview(buffer))
            assert bytes(got) == bytes(mgr.vault.read_chunk(ref.id)), ref.id
            assert isinstance(got, memoryview) and got.obj is buffer and len(got) == ref.raw
        with pytest.raises(ValueError, match="cannot take chunk"):
            mgr.vault.read_chunk(table[0].id, into=memoryview(bytearray(table[0].raw - 1)))


def test_a_damaged_chunk_read_into_a_buffer_is_refused(tmp_path: Path) -> None:
    from ckptvault.errors import CorruptChunkError

    with CheckpointManager(tmp_path / "v", async_save=False) as mgr:
        mgr.save(1, {"w": torch.randn(100_000)})
        ref = mgr.vault.read_manifest(1).chunks[0]
        path = tmp_path / "v" / chunk_key(ref.id)
        data = bytearray(path.read_bytes())
        data[-10] ^= 0xFF
        path.chmod(0o644)
        path.write_bytes(bytes(data))
        with pytest.raises(CorruptChunkError, match=ref.id[:12]):
            mgr.vault.read_chunk(ref.id, into=memoryview(bytearray(ref.raw)))
