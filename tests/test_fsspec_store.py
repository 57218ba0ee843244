"""FsspecStore: the conformance suite on fsspec's memory and local filesystems, URL dispatch, and a vault on it."""

from __future__ import annotations

import multiprocessing
import uuid
from pathlib import Path

import fsspec
import pytest
import torch

from ckptvault import CheckpointManager
from ckptvault.errors import InvalidArgumentError, ObjectNotFoundError, StorageError
from ckptvault.stores import LocalStore, MemoryStore, Store, open_store
from ckptvault.stores.fsspec_store import FsspecStore
from ckptvault.testing.store_conformance import StoreConformance
from conftest import assert_same_state


def _memory_url() -> str:
    return f"fsspec+memory://ckv-{uuid.uuid4().hex[:12]}"


def _drop_memory(store: Store) -> None:
    if isinstance(store, FsspecStore) and store.protocol == "memory":
        store.fs.rm(store.root, recursive=True) if store.fs.exists(store.root) else None


class TestFsspecMemoryStore(StoreConformance):
    def make_store(self, tmp_path: Path) -> Store:
        return open_store(_memory_url())

    def make_peer(self, store: Store) -> Store:
        return open_store(store.url)

    @pytest.fixture
    def store(self, tmp_path: Path):  # type: ignore[no-untyped-def]
        made = self.make_store(tmp_path)
        yield made
        _drop_memory(made)

    def test_url_selects_fsspec_not_the_builtin_memory_store(self, store: Store) -> None:
        assert isinstance(store, FsspecStore) and store.protocol == "memory"
        assert isinstance(open_store("memory://plain"), MemoryStore)
        store.put("k", b"v")
        assert fsspec.filesystem("memory").cat_file(f"{store.root}/k") == b"v"  # plain fsspec sees the object

    def test_put_writes_in_place_without_temporary_files(self, store: Store) -> None:
        assert isinstance(store, FsspecStore)
        store.put("a/b", b"1")
        assert store.put_if_absent("a/c", b"2")
        assert sorted(store.fs.find(store.root)) == [f"{store.root}/a/b", f"{store.root}/a/c"]


class TestFsspecLocalStore(StoreConformance):
    def make_store(self, tmp_path: Path) -> Store:
        return open_store(f"fsspec+file://{tmp_path / 'store'}")

    def make_peer(self, store: Store) -> Store:
        return open_store(store.url)

    def test_objects_are_plain_files_that_local_store_reads(self, store: Store, tmp_path: Path) -> None:
        store.put("chunks/ab/abcd", b"payload")
        assert (tmp_path / "store" / "chunks" / "ab" / "abcd").read_bytes() == b"payload"
        assert LocalStore(tmp_path / "store").get("chunks/ab/abcd") == b"payload"
        assert [info.key for info in store.list()] == ["chunks/ab/abcd"]  # tmp/ is not listed

    def test_put_if_absent_has_one_winner_across_processes(self, store: Store) -> None:
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(4) as pool:
            wins = pool.starmap(_create_in_subprocess, [(store.url, "shared", i) for i in range(4)])
        assert sum(wins) == 1
        assert store.get("shared") == f"writer {wins.index(True)}".encode()


def _create_in_subprocess(url: str, key: str, i: int) -> bool:
    return open_store(url).put_if_absent(key, f"writer {i}".encode())


def test_an_fsspec_filesystem_object_can_be_wrapped_directly() -> None:
    fs = fsspec.filesystem("memory")
    root = f"/ckv-{uuid.uuid4().hex[:8]}"
    store = FsspecStore(fs, root)
    try:
        store.put("x", b"1")
        assert store.url == f"fsspec+memory://{root.lstrip('/')}" and store.get("x") == b"1"
        with pytest.raises(ObjectNotFoundError, match="no object 'y' in fsspec\\+memory://"):
            store.get("y")
    finally:
        fs.rm(root, recursive=True)


def test_unknown_protocols_and_missing_implementations_are_named() -> None:
    with pytest.raises(InvalidArgumentError, match="unsupported vault URL scheme 'gopher'"):
        open_store("gopher://host/x")
    with pytest.raises(InvalidArgumentError, match="fsspec cannot open fsspec\\+nosuchproto://x"):
        open_store("fsspec+nosuchproto://x")
    with pytest.raises(StorageError, match="cannot open ftp://no-such-host.invalid/v through fsspec"):
        open_store("ftp://no-such-host.invalid/v")  # fsspec's FTP filesystem connects on creation


def test_checkpoint_manager_on_fsspec_memory() -> None:
    url = _memory_url()
    torch.manual_seed(0)
    model = torch.nn.Linear(300, 200)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 300)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    try:
        with CheckpointManager(url, chunk_size=64 << 10) as mgr:
            mgr.save(1, state).wait()
            model.weight.data[0, 0] += 1.0
            mgr.save(2, state).wait()
            assert mgr.info(2).added_bytes < mgr.info(2).stored_bytes  # unchanged chunks are not written again
        with CheckpointManager(url) as again:
            assert again.steps() == [1, 2]
            assert_same_state(state, again.restore(2))
            again.delete(1)
            again.gc(grace=0)
            assert again.verify().ok
    finally:
        _drop_memory(open_store(url))
