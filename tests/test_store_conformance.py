"""The store conformance suite (ckptvault.stores.conformance) run for LocalStore and MemoryStore,
plus what is particular to each of them."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

from ckptvault.errors import InvalidArgumentError, PermanentStorageError
from ckptvault.stores import LocalStore, MemoryStore, Store, open_store
from ckptvault.stores.conformance import StoreConformance
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
