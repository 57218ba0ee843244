"""Drop-behind on the local store (``drop_behind`` storage option, on by default on Linux).

A write batch drops its chunks from the page cache once they are written back: during the batch, everything
older than the newest ``DROP_BEHIND_WINDOW`` bytes; after its data sync, all of them. Checked on the real file
system under ``tmp_path`` with mincore(2); they skip where that file system does not show drops (tmpfs keeps its
pages whatever a process advises).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptvault import CheckpointManager
from ckptvault.errors import InvalidArgumentError
from ckptvault.stores import local, open_store
from ckptvault.stores.local import DIRECT_IO_FILE_SYSTEMS, DROP_BEHIND_WINDOW, LocalStore, LocalWriteBatch
from helpers.page_cache import cached_pages, drops_observable

pytestmark = pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="drop-behind needs posix_fadvise")

MIB = 1 << 20


@pytest.fixture
def disk_dir(tmp_path: Path) -> Path:
    if not drops_observable(tmp_path):
        pytest.skip(f"the file system of {tmp_path} does not show page cache drops (tmpfs keeps its pages)")
    return tmp_path


def blob(i: int, size: int = MIB) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


def pages(size: int) -> int:
    return -(-size // os.sysconf("SC_PAGE_SIZE"))


@pytest.mark.parametrize("drop_behind", [True, False])
def test_a_finished_batch_leaves_its_chunks_out_of_the_page_cache(disk_dir: Path, drop_behind: bool) -> None:
    store = LocalStore(disk_dir / "v", drop_behind=drop_behind)
    store.root.mkdir()
    blobs = {f"chunks/{i:02d}/c{i}": blob(i, size) for i, size in enumerate([1, 4096, 4097, 3 * MIB + 5])}
    batch = store.write_batch()
    for key, data in blobs.items():
        assert batch.put_if_absent(key, data)
    batch.finish()
    for key, data in blobs.items():
        assert cached_pages(store.root / key) == (0 if drop_behind else pages(len(data))), key
        assert store.get(key) == data, key


@pytest.mark.parametrize("drop_behind", [True, False])
def test_a_single_put_leaves_its_object_out_of_the_page_cache(disk_dir: Path, drop_behind: bool) -> None:
    store = LocalStore(disk_dir / "v", drop_behind=drop_behind)
    data = blob(3, 2 * MIB + 1)
    store.put("manifests/a", data)
    assert store.put_if_absent("chunks/b", data)
    for key in ("manifests/a", "chunks/b"):
        assert cached_pages(store.root / key) == (0 if drop_behind else pages(len(data))), key
        assert store.get(key) == data


def test_while_a_batch_writes_only_its_newest_window_stays_cached(disk_dir: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Each chunk is made clean (``os.sync``) before the next is written, so whatever the batch drops goes
    at once: every chunk older than the window. The newest window is never dropped by the batch; whether the
    kernel keeps it cached is its own business (memory pressure may evict it), so that part is checked on the
    drops the batch asks for, which go through the store's own ``_drop_cached``, called through."""
    store = LocalStore(disk_dir / "v")
    store.root.mkdir()
    count = DROP_BEHIND_WINDOW // MIB + 24
    batch = store.write_batch()
    if not isinstance(batch, LocalWriteBatch):
        pytest.skip("without syncfs (Linux < 5.8) each chunk is synced and dropped at once: no window")
    asked: list[Path] = []
    drop = local._drop_cached
    monkeypatch.setattr(local, "_drop_cached", lambda path: (asked.append(path), drop(path))[1])
    for i in range(count):
        assert batch.put_if_absent(f"chunks/c{i:03d}", blob(i))
        os.sync()
    by_path = {path: cached_pages(path) for path in (store.root / "tmp").iterdir()}
    assert len(by_path) == count
    index = {blob(i)[:64]: i for i in range(count)}  # which chunk each temporary file holds (read after counting)
    cached = [0] * count
    dropped = [False] * count
    for path, n in by_path.items():
        i = index[path.read_bytes()[:64]]
        cached[i], dropped[i] = n, path in asked
    window = DROP_BEHIND_WINDOW // MIB
    assert cached[: count - window] == [0] * (count - window)
    assert dropped == [True] * (count - window) + [False] * window
    batch.finish()
    assert [cached_pages(store.root / f"chunks/c{i:03d}") for i in range(count)] == [0] * count
    assert store.get("chunks/c007") == blob(7)


def test_a_save_leaves_no_chunk_cached_and_restores_bit_exact(disk_dir: Path) -> None:
    state = {"w": torch.randn(3_000_017), "ids": torch.arange(100_000, dtype=torch.int64), "step": 5}
    with CheckpointManager(disk_dir / "vault", chunk_size=MIB, async_save=False) as mgr:
        mgr.save(5, state)
        assert mgr.vault.store.drop_behind
    chunk_files = [p for p in (disk_dir / "vault" / "chunks").rglob("*") if p.is_file()]
    assert len(chunk_files) >= 12
    assert sum(cached_pages(p) for p in chunk_files) == 0
    with CheckpointManager(disk_dir / "vault") as mgr:
        restored = mgr.restore(5)
    assert torch.equal(restored["w"], state["w"]) and torch.equal(restored["ids"], state["ids"])
    assert restored["step"] == 5


def test_direct_io_and_drop_behind_together_leave_nothing_cached(disk_dir: Path) -> None:
    if local._file_system_type(disk_dir) not in DIRECT_IO_FILE_SYSTEMS:
        pytest.skip("direct_io='auto' writes with O_DIRECT only on ext4 and XFS")
    store = LocalStore(disk_dir / "v", direct_io="auto")
    store.root.mkdir()
    blobs = {f"chunks/c{i}": blob(i, size) for i, size in enumerate([4097, 3 * MIB + 5])}
    batch = store.write_batch()
    for key, data in blobs.items():
        assert batch.put_if_absent(key, data)
    batch.finish()
    assert store.writes_direct()
    for key, data in blobs.items():
        assert cached_pages(store.root / key) == 0, key  # O_DIRECT's last partial page is dropped too
        assert store.get(key) == data


def test_without_posix_fadvise_drop_behind_is_off_and_cannot_be_asked_for(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "_CAN_DROP", False)  # as on macOS and Windows
    assert LocalStore(tmp_path / "a").drop_behind is False
    assert LocalStore(tmp_path / "b", drop_behind=False).drop_behind is False
    with pytest.raises(InvalidArgumentError, match="drop_behind=True needs posix_fadvise, which .* does not have; "
                                                   "leave drop_behind unset or pass False"):
        LocalStore(tmp_path / "c", drop_behind=True)


def test_storage_option_drop_behind(tmp_path: Path) -> None:
    assert open_store(str(tmp_path / "a")).drop_behind is True
    assert open_store(str(tmp_path / "b"), {"drop_behind": False}).drop_behind is False
    with pytest.raises(InvalidArgumentError, match="drop_behind must be true or false, got 'yes'"):
        CheckpointManager(tmp_path / "c", storage_options={"drop_behind": "yes"})
    with pytest.raises(InvalidArgumentError, match="drop_behind must be true or false, got 1"):
        open_store(str(tmp_path / "c"), {"drop_behind": 1})
    with pytest.raises(InvalidArgumentError, match=r"unknown storage_options for local vaults: \['drop'\]; "
                       r"known: \['direct_io', 'drop_behind', 'external_links'\]"):
        open_store(str(tmp_path / "d"), {"drop": True})
