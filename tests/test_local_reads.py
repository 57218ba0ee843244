"""How the local store reads chunk objects (``LocalStore.get_transient``): large objects through a read-only mapping
whose pages are faulted in with one call, small ones (and every object where mapping is not available) into the
reading thread's reused buffer; the bytes are the same either way, and so is every check made on them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import ckptvault
from ckptvault.errors import CorruptChunkError
from ckptvault.stores import local
from ckptvault.stores.local import MAP_FROM, LocalStore


def cache_all(root: Path) -> None:
    """Read every file under ``root`` once, so the page cache holds it (the store drops what it writes)."""
    for path in root.rglob("*"):
        if path.is_file():
            path.read_bytes()


pytestmark = pytest.mark.skipif(not local._can_map, reason="mapped reads need Linux 5.14 or later")


@pytest.fixture(autouse=True)
def _fresh_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test reads as a new thread does (none of its reads mapped yet, no read buffer); one that turns mapped
    reads off (as a kernel without MADV_POPULATE_READ does) turns them off for itself."""
    monkeypatch.setattr(local, "_can_map", local._can_map)
    monkeypatch.setattr(local._buffers, "large_reads", 0, raising=False)
    monkeypatch.setattr(local._buffers, "read", None, raising=False)


def drop_cached(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_a_large_object_is_read_through_a_read_only_mapping_and_a_small_one_into_the_buffer(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "v")
    big, small = os.urandom(MAP_FROM), os.urandom(MAP_FROM - 1)
    store.put("chunks/big", big)
    store.put("chunks/small", small)
    cache_all(tmp_path / "v")
    mapped = store.get_transient("chunks/big")
    assert mapped.readonly and bytes(mapped) == big
    buffered = store.get_transient("chunks/small")
    assert not buffered.readonly and bytes(buffered) == small
    assert bytes(mapped) == big  # the buffered read that came after it left the mapping alone


def test_a_thread_maps_its_first_large_reads_then_reads_into_its_buffer(tmp_path: Path) -> None:
    """Mapping spares a new buffer's fresh memory; once a thread has read that much, its buffer (faulted in by
    then) takes the rest, as a copy into it costs less than a mapping set up and torn down per read."""
    store = LocalStore(tmp_path / "v")
    data = os.urandom(MAP_FROM)
    store.put("chunks/a", data)
    cache_all(tmp_path / "v")
    reads = [store.get_transient("chunks/a") for _ in range(local.MAPPED_READS + 2)]
    assert [view.readonly for view in reads] == [True] * local.MAPPED_READS + [False, False]
    assert all(bytes(view) == data for view in reads[: local.MAPPED_READS]) and bytes(reads[-1]) == data


def test_a_file_the_page_cache_does_not_hold_whole_is_read_once_the_thread_has_a_buffer_for_it(
        tmp_path: Path) -> None:
    """Faults read a mapping in smaller pieces than one read(2) asks for: a file the disk must supply is read into
    the thread's buffer once that is there. Before, the buffer would be new memory, slower to fault in than the
    mapping's smaller reads: the file is mapped."""
    store = LocalStore(tmp_path / "v")
    data = os.urandom(2 * MAP_FROM)
    store.put("chunks/a", data)  # the store drops what it wrote from the page cache once it is durable
    path = tmp_path / "v" / "chunks" / "a"
    drop_cached(path)
    first = store.get_transient("chunks/a")  # no buffer yet: mapped, cold as it is
    assert first.readonly and bytes(first) == data
    store.put("chunks/b", os.urandom(2 * MAP_FROM))
    local._buffers.large_reads = local.MAPPED_READS  # this thread's mapped reads are spent: the next read takes a buffer
    assert not store.get_transient("chunks/b").readonly
    local._buffers.large_reads = 0
    del first  # unmapped: its pages may leave the page cache now
    drop_cached(path)
    second = store.get_transient("chunks/a")  # a buffer large enough is there: read into it
    assert not second.readonly and bytes(second) == data
    assert store.get_transient("chunks/a").readonly  # read once, the file is cached whole: mapped


def test_a_mapped_read_stays_whole_when_the_object_is_deleted_under_it(tmp_path: Path) -> None:
    """A gc that deletes a chunk while a restore still holds its bytes takes nothing from the reader."""
    store = LocalStore(tmp_path / "v")
    data = os.urandom(2 * MAP_FROM)
    store.put("chunks/a", data)
    cache_all(tmp_path / "v")
    view = store.get_transient("chunks/a")
    store.delete("chunks/a")
    assert not store.exists("chunks/a")
    assert bytes(view) == data


def test_a_kernel_that_refuses_the_populate_advice_reads_into_the_buffer_from_then_on(tmp_path: Path,
                                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """An advice the kernel does not know fails with EINVAL (a kernel before 5.14 for MADV_POPULATE_READ): that read,
    and every later one, goes into the thread's buffer instead, with the same bytes."""
    store = LocalStore(tmp_path / "v")
    data = os.urandom(MAP_FROM + 4096)
    store.put("chunks/a", data)
    cache_all(tmp_path / "v")
    monkeypatch.setattr(local, "_MADV_POPULATE_READ", 0x7FFF)  # no such advice
    first = store.get_transient("chunks/a")
    assert not first.readonly and bytes(first) == data
    assert local._can_map is False
    monkeypatch.setattr(local, "_MADV_POPULATE_READ", 22)
    assert not store.get_transient("chunks/a").readonly  # not tried again


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "buffered"])
def test_restores_read_the_same_bytes_and_find_the_same_damage_either_way(tmp_path: Path, mapped: bool,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "_can_map", local._can_map and mapped)
    maps: list[int] = []
    real_map = local._map_populated

    def counted(fd: int, size: int, key: str, cold: bool = False) -> memoryview | None:
        view = real_map(fd, size, key, cold)
        maps.append(view is not None)
        return view

    monkeypatch.setattr(local, "_map_populated", counted)
    state = {"w": torch.randn(1 << 20), "b": torch.randn(1000), "step": 3}  # a 4 MiB chunk and a small one
    with ckptvault.CheckpointManager(tmp_path / "v", async_save=False) as mgr:
        mgr.save(1, state)
        cache_all(tmp_path / "v")
        restored = mgr.restore(1)
        assert torch.equal(restored["w"], state["w"]) and torch.equal(restored["b"], state["b"])
        manifest = mgr.manifest(1)
    assert any(maps) is mapped  # the 4 MiB chunk was read through a mapping, or not at all through one
    big = max(manifest["chunks"], key=lambda c: c["raw"])
    path = tmp_path / "v" / "chunks" / big["id"][:2] / big["id"]
    damaged = bytearray(path.read_bytes())
    assert len(damaged) >= MAP_FROM
    damaged[len(damaged) // 2] ^= 0x40
    path.write_bytes(bytes(damaged))
    cache_all(tmp_path / "v")
    monkeypatch.setattr(local._buffers, "large_reads", 0)
    with ckptvault.CheckpointManager(tmp_path / "v", async_save=False) as mgr:
        with pytest.raises(CorruptChunkError, match=big["id"]):
            mgr.restore(1)
    assert any(maps) is mapped
