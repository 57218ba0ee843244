"""The store conformance suite (ckptvault.testing.store_conformance) run for LocalStore and MemoryStore,
plus what is particular to each of them."""

from __future__ import annotations

import ctypes
import errno
import os
import sys
import threading
from pathlib import Path

import pytest
import torch

import ckptvault.stores.local as local_module
from ckptvault import CheckpointManager
from ckptvault.errors import InvalidArgumentError, PermanentStorageError, StorageError
from ckptvault.stores import LocalStore, MemoryStore, Store, open_store
from ckptvault.stores.local import LocalWriteBatch
from ckptvault.testing.store_conformance import StoreConformance
from conftest import drop_memory_store, fresh_memory_url


class TestLocalStore(StoreConformance):
    def make_store(self, tmp_path: Path) -> Store:
        return LocalStore(tmp_path / "store")

    def make_peer(self, store: Store) -> Store:
        assert isinstance(store, LocalStore)
        return LocalStore(store.root)

    def test_writes_leave_no_temporary_files(self, store: Store) -> None:
        assert isinstance(store, LocalStore)
        store.put("a", b"1")
        store.put("a", b"2")
        assert store.put_if_absent("b", b"3") and not store.put_if_absent("b", b"4")
        assert store.temp_files() == []
        assert {info.key for info in store.list()} == {"a", "b"}

    def test_temporary_files_are_not_listed(self, store: Store) -> None:
        assert isinstance(store, LocalStore)
        store.put("real", b"1")
        (store.root / "tmp").mkdir(exist_ok=True)
        (store.root / "tmp" / "leftover.part").write_bytes(b"partial")
        assert {info.key for info in store.list()} == {"real"}
        assert [info.key for info in store.temp_files()] == ["tmp/leftover.part"]

    def test_a_write_batch_shows_its_objects_only_once_they_are_synced(self, store: Store) -> None:
        """A batch's chunks appear under their keys only once durable, so no manifest names a chunk that is not (DESIGN M2)."""
        assert isinstance(store, LocalStore)
        batch = store.write_batch()
        assert isinstance(batch, LocalWriteBatch)  # Linux 5.8+, as here and in CI
        assert batch.put_if_absent("chunks/aa/1", b"one") and batch.put_if_absent("chunks/bb/2", b"two")
        assert not store.exists("chunks/aa/1") and len(store.temp_files()) == 2  # written, not yet linked
        batch.finish()
        assert bytes(store.get("chunks/aa/1")) == b"one" and store.temp_files() == []
        abandoned = store.write_batch()
        assert abandoned.put_if_absent("chunks/cc/3", b"three")
        abandoned.abandon()
        assert not store.exists("chunks/cc/3") and store.temp_files() == []

    def test_a_save_syncs_the_file_system_twice_not_once_per_chunk(self, store: Store, monkeypatch) -> None:  # type: ignore[no-untyped-def]
        assert isinstance(store, LocalStore)
        calls = {"fsync": 0, "syncfs": 0}
        real_fsync, real_syncfs = os.fsync, local_module._syncfs

        def counting_fsync(fd: int) -> None:
            calls["fsync"] += 1
            real_fsync(fd)

        def counting_syncfs(fd: int) -> int:
            calls["syncfs"] += 1
            return real_syncfs(fd)  # type: ignore[misc]

        state = {"w": torch.randn(64, 8192), "b": torch.randn(16384)}  # 33 chunks of 64 KiB
        with CheckpointManager(store, chunk_size=64 << 10, async_save=False) as mgr:
            mgr.save(0, {"w": torch.zeros(1)})  # the vault's config and first manifest, before counting
            monkeypatch.setattr(local_module.os, "fsync", counting_fsync)
            monkeypatch.setattr(local_module, "_syncfs", counting_syncfs)
            mgr.save(1, state)
            info = mgr.info(1)
            assert info.num_chunks >= 33 and calls["syncfs"] == 2
            assert calls["fsync"] <= 3  # the manifest's file and directories, not one per chunk
            assert mgr.restore(1)["w"].equal(state["w"])

    def test_a_failed_sync_fails_the_save_and_leaves_nothing(self, store: Store, monkeypatch) -> None:  # type: ignore[no-untyped-def]
        assert isinstance(store, LocalStore)

        def failing_syncfs(fd: int) -> int:
            ctypes.set_errno(errno.EIO)
            return -1

        state = {"w": torch.randn(64, 8192)}
        with CheckpointManager(store, chunk_size=64 << 10, async_save=False) as mgr:
            monkeypatch.setattr(local_module, "_syncfs", failing_syncfs)
            with pytest.raises(StorageError, match="Input/output error"):
                mgr.save(1, state)
            assert mgr.steps() == [] and store.temp_files() == []
            assert not any(info.key.startswith("chunks/") for info in store.list())  # never linked into place
            monkeypatch.undo()
            mgr.save(1, state)  # retried once the file system is healthy again
            assert mgr.restore(1)["w"].equal(state["w"])

    @pytest.mark.parametrize("key", ["", "/abs", "../escape", "a/../../b"])
    def test_rejects_keys_outside_the_root(self, store: Store, key: str) -> None:
        with pytest.raises(PermanentStorageError, match="invalid storage key"):
            store.put(key, b"x")

    def test_objects_are_plain_files(self, store: Store) -> None:
        assert isinstance(store, LocalStore)
        store.put("chunks/ab/abcd", b"payload")
        assert (store.root / "chunks" / "ab" / "abcd").read_bytes() == b"payload"

    @pytest.mark.skipif(sys.platform == "win32" or os.geteuid() == 0, reason="root ignores permissions")
    def test_permission_denied_is_permanent(self, store: Store) -> None:
        assert isinstance(store, LocalStore)
        store.put("ro/x", b"1")
        os.chmod(store.root / "ro", 0o500)
        try:
            with pytest.raises(PermanentStorageError, match="permission denied"):
                store.put("ro/y", b"2")
        finally:
            os.chmod(store.root / "ro", 0o700)


class TestMemoryStore(StoreConformance):
    def make_store(self, tmp_path: Path) -> Store:
        return MemoryStore(fresh_memory_url("conf").removeprefix("memory://"))

    def make_peer(self, store: Store) -> Store:
        return MemoryStore(store.url.removeprefix("memory://"))

    @pytest.fixture
    def store(self, tmp_path: Path):  # type: ignore[no-untyped-def]
        made = self.make_store(tmp_path)
        yield made
        drop_memory_store(made.url)

    def test_same_name_shares_objects(self, store: Store) -> None:
        store.put("k", b"v")
        assert open_store(store.url).get("k") == b"v"
        assert not MemoryStore("some-other-name-" + store.url[-8:]).exists("k")

    def test_put_if_absent_one_winner_across_handles_under_contention(self, store: Store) -> None:
        """Handles of one name must share one lock, not only one dict."""
        old = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        try:
            peers = [self.make_peer(store) for _ in range(8)]
            def go(peer: Store, key: str, barrier: threading.Barrier, wins: list[bool]) -> None:
                barrier.wait()
                wins.append(peer.put_if_absent(key, b"x"))

            for round_ in range(200):
                wins: list[bool] = []
                barrier = threading.Barrier(len(peers))
                threads = [threading.Thread(target=go, args=(p, f"k{round_}", barrier, wins)) for p in peers]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                assert sum(wins) == 1, f"round {round_}: {sum(wins)} winners"
        finally:
            sys.setswitchinterval(old)


def test_open_store_selects_by_url(tmp_path: Path) -> None:
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    assert isinstance(open_store(f"file://{tmp_path}"), LocalStore)
    assert open_store(f"file://{tmp_path}").root == tmp_path
    assert isinstance(open_store("memory://x"), MemoryStore)
    store = MemoryStore("y")
    assert open_store(store) is store
    with pytest.raises(InvalidArgumentError, match="unsupported vault URL scheme 'gopher'"):
        open_store("gopher://host/path")
    with pytest.raises(InvalidArgumentError, match="storage_options are not used by memory:// stores"):
        open_store("memory://z", {"anon": True})
