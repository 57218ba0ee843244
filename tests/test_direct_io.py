"""Direct I/O for a save's chunks on the local store (``direct_io`` storage option).

With ``direct_io="auto"`` on ext4 and XFS a write batch writes each chunk's whole 4 KiB blocks with O_DIRECT,
so a save leaves at most the last partial page of each chunk in the page cache. Checked on the real file
system under ``tmp_path`` with mincore(2), and on tmpfs (``/dev/shm``), where "auto" stays buffered. The
default is buffered writes. Drop-behind is off here, so that only O_DIRECT keeps pages out of the cache
(tests/test_drop_behind.py has both together).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptvault import CheckpointManager
from ckptvault.errors import InvalidArgumentError, PermanentStorageError
from ckptvault.stores import open_store
from ckptvault.stores.local import DIRECT_ALIGN, DIRECT_IO_FILE_SYSTEMS, DIRECT_PIECE, LocalStore, _file_system_type
from helpers.page_cache import cached_pages

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux-only")

SIZES = [0, 1, DIRECT_ALIGN - 1, DIRECT_ALIGN, DIRECT_ALIGN + 1, (4 << 20) + 100, DIRECT_PIECE + 5, 3 * DIRECT_PIECE]


def write_batch(store: LocalStore, blobs: dict[str, bytes]) -> None:
    batch = store.write_batch()
    for key, data in blobs.items():
        assert batch.put_if_absent(key, data)
    batch.finish()


def blobs_of(sizes: list[int]) -> dict[str, bytes]:
    rng = np.random.default_rng(7)
    return {f"chunks/{i:02d}/blob-{size}": rng.integers(0, 256, size, dtype=np.uint8).tobytes()
            for i, size in enumerate(sizes)}


@pytest.fixture
def block_fs_dir(tmp_path: Path) -> Path:
    if _file_system_type(tmp_path) not in DIRECT_IO_FILE_SYSTEMS:
        pytest.skip(f"{tmp_path} is not on ext4 or XFS, where direct_io='auto' writes with O_DIRECT")
    return tmp_path


@pytest.fixture
def tmpfs_dir(tmp_path: Path) -> Path:
    shm = Path("/dev/shm")
    if not shm.is_dir() or _file_system_type(shm) != 0x01021994:
        pytest.skip("needs /dev/shm on tmpfs")
    path = shm / f"ckptvault-test-{tmp_path.name}"
    path.mkdir()
    yield path
    for child in sorted(path.rglob("*"), reverse=True):
        child.rmdir() if child.is_dir() else child.unlink()
    path.rmdir()


def test_auto_writes_chunks_around_the_page_cache(block_fs_dir: Path) -> None:
    direct = LocalStore(block_fs_dir / "direct", direct_io="auto", drop_behind=False)
    buffered = LocalStore(block_fs_dir / "buffered", drop_behind=False)
    blobs = blobs_of(SIZES)
    for store in (direct, buffered):
        (store.root / "chunks").mkdir(parents=True)
        write_batch(store, blobs)
        for key, data in blobs.items():
            assert store.get(key) == data
    assert direct.writes_direct() and not buffered.writes_direct()


def test_direct_chunks_leave_only_their_last_partial_page_cached(block_fs_dir: Path) -> None:
    direct = LocalStore(block_fs_dir / "direct", direct_io="auto", drop_behind=False)
    buffered = LocalStore(block_fs_dir / "buffered", drop_behind=False)
    blobs = blobs_of(SIZES)
    for store in (direct, buffered):
        store.root.mkdir()
        write_batch(store, blobs)
    for key, data in blobs.items():
        partial = 1 if len(data) % DIRECT_ALIGN else 0
        assert cached_pages(direct.root / key) <= partial, key
        assert cached_pages(buffered.root / key) == (len(data) + mmap.PAGESIZE - 1) // mmap.PAGESIZE, key
        assert direct.get(key) == data and buffered.get(key) == data


def test_a_save_with_direct_io_restores_bit_exact(block_fs_dir: Path) -> None:
    state = {"w": torch.randn(1_000_003), "b": torch.arange(1000, dtype=torch.int64), "step": 3}
    with CheckpointManager(block_fs_dir / "vault", chunk_size=1 << 20, async_save=False,
                           storage_options={"direct_io": "auto"}) as mgr:
        mgr.save(3, state)
        assert mgr.vault.store.writes_direct()
    with CheckpointManager(block_fs_dir / "vault") as mgr:
        restored = mgr.restore(3)
    assert torch.equal(restored["w"], state["w"]) and torch.equal(restored["b"], state["b"])
    chunk_files = [p for p in (block_fs_dir / "vault" / "chunks").rglob("*") if p.is_file()]
    assert chunk_files and not list((block_fs_dir / "vault" / "tmp").iterdir())


def test_auto_stays_buffered_on_tmpfs(tmpfs_dir: Path) -> None:
    store = LocalStore(tmpfs_dir, direct_io="auto")
    blobs = blobs_of([DIRECT_ALIGN * 3 + 7])
    (store.root / "chunks").mkdir()
    write_batch(store, blobs)
    assert not store.writes_direct()
    (key, data), = blobs.items()
    assert store.get(key) == data


def test_required_direct_io_that_the_file_system_refuses_fails_the_save(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """No file system here refuses O_DIRECT (tmpfs accepts it since Linux 6.6), so open(2) is made to, as
    such a file system would: EINVAL for O_DIRECT."""
    refuse_direct(monkeypatch)
    state = {"w": torch.randn(300_000)}
    with CheckpointManager(tmp_path / "v", storage_options={"direct_io": True}, async_save=False) as mgr:
        with pytest.raises(PermanentStorageError, match=r"refused a direct \(O_DIRECT\) write .*'direct_io': 'auto'"):
            mgr.save(1, state)
        assert mgr.steps() == []
        assert not list((tmp_path / "v" / "tmp").iterdir())  # the refused temp file is gone too


def test_auto_falls_back_to_buffered_writes_when_refused(block_fs_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    refuse_direct(monkeypatch)
    state = {"w": torch.randn(300_000)}
    with caplog.at_level(logging.WARNING, logger="ckptvault.stores.local"):
        with CheckpointManager(block_fs_dir / "v", async_save=False, storage_options={"direct_io": "auto"}) as mgr:
            mgr.save(1, state)
            assert not mgr.vault.store.writes_direct()
            assert torch.equal(mgr.restore(1)["w"], state["w"])
    assert "refused a direct (O_DIRECT) write" in caplog.text and "through the page cache" in caplog.text


def refuse_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def open_refusing_direct(path, flags, *args, **kwargs):  # type: ignore[no-untyped-def]
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_refusing_direct)


def test_storage_options_of_local_vaults(tmp_path: Path) -> None:
    assert open_store(str(tmp_path / "a"), {"direct_io": False}).direct_io is False
    assert open_store(f"file://{tmp_path / 'b'}", {"direct_io": True}).direct_io is True
    assert open_store(str(tmp_path / "c")).direct_io is False and not open_store(str(tmp_path / "c")).writes_direct()
    with pytest.raises(InvalidArgumentError, match=r"unknown storage_options for local vaults: \['endpoint_url'\]"):
        open_store(str(tmp_path / "d"), {"endpoint_url": "http://x"})
    with pytest.raises(InvalidArgumentError, match="direct_io must be true, false or 'auto', got 'yes'"):
        CheckpointManager(tmp_path / "e", storage_options={"direct_io": "yes"})
    for number in (0, 1):  # equal to False/True, but the store tells the three settings apart by identity
        with pytest.raises(InvalidArgumentError, match=f"direct_io must be true, false or 'auto', got {number}"):
            open_store(str(tmp_path / "f"), {"direct_io": number})


@pytest.mark.parametrize("direct_io", [True, False])
def test_parts_across_the_aligned_buffer(block_fs_dir: Path, direct_io: bool) -> None:
    """Objects handed over in parts (a chunk's header and planes) whose boundaries fall anywhere against the
    4 KiB blocks and the aligned buffer's capacity (``DIRECT_PIECE``)."""
    rng = np.random.default_rng(11)
    piece = lambda n: rng.integers(0, 256, n, dtype=np.uint8).tobytes()  # noqa: E731
    objects = {
        "chunks/a": [piece(40), piece(DIRECT_PIECE - 40), piece(DIRECT_ALIGN)],  # exactly one buffer, then a block
        "chunks/b": [piece(DIRECT_PIECE + 1)],  # one byte past a buffer
        "chunks/c": [b"", piece(3), memoryview(piece(2 * DIRECT_PIECE + 9))[5:], b"", piece(DIRECT_ALIGN - 1)],
        "chunks/d": [piece(DIRECT_ALIGN - 1), piece(1)],  # two parts making exactly one block
    }
    store = LocalStore(block_fs_dir / "v", direct_io=direct_io, drop_behind=False)  # only O_DIRECT keeps pages out
    store.root.mkdir()
    batch = store.write_batch()
    for key, parts in objects.items():
        assert batch.put_parts_if_absent(key, parts)
    batch.finish()
    for key, parts in objects.items():
        data = b"".join(bytes(p) for p in parts)
        if direct_io:  # counted before reading it back, which caches it
            assert cached_pages(store.root / key) <= (1 if len(data) % DIRECT_ALIGN else 0), key
        assert store.get(key) == data, key
