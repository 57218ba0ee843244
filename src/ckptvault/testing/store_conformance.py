"""The conformance suite every :class:`~ckptvault.stores.base.Store` must pass.

Usage (needs pytest; nothing else in ckptvault imports this module)::

    from ckptvault.testing.store_conformance import StoreConformance

    class TestMyStore(StoreConformance):
        def make_store(self, tmp_path):
            return MyStore(f"bucket/{tmp_path.name}")   # an empty store, private to this test

        def make_peer(self, store):                      # optional: a second handle on the same objects
            return MyStore(store.url)

The tests check the contract stated in ``stores/base.py``: whole-object reads and
ranged reads, atomic replace (a concurrent reader never sees a torn object),
create-if-absent with exactly one winner among concurrent writers (also across
handles), prefix listing, idempotent delete, stat, touch, and that a missing key
raises :class:`~ckptvault.errors.ObjectNotFoundError` (also a ``FileNotFoundError``).

Class attributes a subclass may tune: ``mtime_resolution`` (seconds between two
writes for their mtimes to differ) and ``concurrency`` (threads in race tests).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from ..errors import ObjectNotFoundError, OversizedObjectError, StorageError, VaultError
from ..stores.base import ObjectInfo, Store


class StoreConformance:
    """Mixin of pytest tests for one Store implementation; subclass it and define :meth:`make_store`."""

    mtime_resolution: float = 0.05
    concurrency: int = 8

    def make_store(self, tmp_path: Path) -> Store:
        """Return a new, empty store that only this test uses."""
        raise NotImplementedError

    def make_peer(self, store: Store) -> Store:
        """A second, independent handle on the same objects (default: the same handle)."""
        return store

    @pytest.fixture
    def store(self, tmp_path: Path):  # type: ignore[no-untyped-def]
        made = self.make_store(tmp_path)
        try:
            yield made
        finally:
            made.close()

    # -- get / put --------------------------------------------------------------
    def test_put_then_get(self, store: Store) -> None:
        store.put("a/b/c.bin", b"hello")
        assert store.get("a/b/c.bin") == b"hello"
        assert bytes(self.make_peer(store).get("a/b/c.bin")) == b"hello"

    def test_put_accepts_memoryviews_of_any_format(self, store: Store) -> None:
        import numpy as np

        values = np.arange(1000, dtype=np.float32)
        store.put("floats", values.data)  # a memoryview of format "f"
        store.put("slice", values.view(np.uint8).data[4:12])
        assert bytes(store.get("floats")) == values.tobytes()
        assert bytes(store.get("slice")) == values.tobytes()[4:12]

    def test_empty_object(self, store: Store) -> None:
        store.put("empty", b"")
        assert bytes(store.get("empty")) == b"" and store.exists("empty")
        assert store.stat("empty").size == 0

    def test_put_replaces_whole_object(self, store: Store) -> None:
        store.put("k", b"x" * 1000)
        store.put("k", b"short")
        assert bytes(store.get("k")) == b"short"
        store.put("k", b"y" * 5000)
        assert bytes(store.get("k")) == b"y" * 5000
        assert store.stat("k").size == 5000

    def test_put_is_atomic_for_readers(self, store: Store) -> None:
        old, new = b"a" * (1 << 20), b"b" * (2 << 20)
        store.put("obj", old)
        torn: list[int] = []
        stop = threading.Event()

        def read() -> None:
            reader = self.make_peer(store)
            while not stop.is_set():
                data = bytes(reader.get("obj"))
                if data not in (old, new):
                    torn.append(len(data))

        readers = [threading.Thread(target=read) for _ in range(2)]
        for t in readers:
            t.start()
        try:
            for i in range(20):
                store.put("obj", new if i % 2 == 0 else old)
        finally:
            stop.set()
            for t in readers:
                t.join()
        assert torn == [], f"readers saw torn objects of sizes {torn[:5]}"

    def test_get_missing_raises_object_not_found(self, store: Store) -> None:
        for call in (lambda: store.get("nope"), lambda: store.get_range("nope", 0, 1), lambda: store.stat("dir/nope"),
                     lambda: store.touch("nope")):
            with pytest.raises(ObjectNotFoundError, match="nope") as info:
                call()
            assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, StorageError)
            assert isinstance(info.value, VaultError)

    # -- get_range ----------------------------------------------------------------
    def test_get_range(self, store: Store) -> None:
        data = bytes(range(256)) * 10
        store.put("r", data)
        assert bytes(store.get_range("r", 0, 8)) == data[:8]
        assert bytes(store.get_range("r", 300, 100)) == data[300:400]
        assert bytes(store.get_range("r", len(data) - 5, 100)) == data[-5:]  # short read at the end
        assert bytes(store.get_range("r", len(data), 10)) == b""
        assert bytes(store.get_range("r", 10, 0)) == b""

    # -- put_if_absent --------------------------------------------------------------
    def test_put_if_absent(self, store: Store) -> None:
        """Create-if-absent never replaces an object once written, whichever handle asks (DESIGN C1)."""
        assert store.put_if_absent("once", b"first") is True
        assert store.put_if_absent("once", b"second") is False
        assert self.make_peer(store).put_if_absent("once", b"third") is False
        assert bytes(store.get("once")) == b"first"

    def test_put_if_absent_has_exactly_one_winner(self, store: Store) -> None:
        """Of concurrent create-if-absent writers of one key exactly one wins and the object holds its bytes (DESIGN C1)."""
        stores = [store] + [self.make_peer(store) for _ in range(self.concurrency - 1)]
        for round_ in range(5):
            key = f"race/{round_}"
            payloads = [f"writer {i} ".encode() * (1000 + i) for i in range(self.concurrency)]
            results = _race([partial(stores[i].put_if_absent, key, payloads[i]) for i in range(self.concurrency)])
            assert sum(results) == 1, f"round {round_}: {sum(results)} writers won"
            assert bytes(store.get(key)) == payloads[results.index(True)]

    def test_concurrent_writers_of_different_keys(self, store: Store) -> None:
        def write(i: int) -> None:
            for j in range(10):
                assert store.put_if_absent(f"many/{i}/{j}", bytes([i, j]) * 100)

        _race([partial(write, i) for i in range(self.concurrency)])
        assert len(list(store.list("many/"))) == 10 * self.concurrency
        assert bytes(store.get("many/3/7")) == bytes([3, 7]) * 100

    # -- exists / list / delete / stat / touch ------------------------------------
    def test_exists(self, store: Store) -> None:
        assert not store.exists("e/x")
        store.put("e/x", b"1")
        assert store.exists("e/x") and not store.exists("e") and not store.exists("e/x2")

    def test_list_by_prefix(self, store: Store) -> None:
        keys = ["a/b/1", "a/b/2", "a/bc", "a/c", "ab", "z/deep/er/key"]
        for i, key in enumerate(keys):
            store.put(key, b"x" * (i + 1))
        assert _keys(store.list()) == set(keys)
        assert _keys(store.list("")) == set(keys)
        assert _keys(store.list("a/")) == {"a/b/1", "a/b/2", "a/bc", "a/c"}
        assert _keys(store.list("a/b")) == {"a/b/1", "a/b/2", "a/bc"}  # a string prefix, not a directory
        assert _keys(store.list("a/b/")) == {"a/b/1", "a/b/2"}
        assert _keys(store.list("a")) == {"a/b/1", "a/b/2", "a/bc", "a/c", "ab"}
        assert _keys(store.list("missing/")) == set()
        sizes = {info.key: info.size for info in store.list()}
        assert sizes == {key: i + 1 for i, key in enumerate(keys)}
        assert all(isinstance(info, ObjectInfo) and info.mtime > 0 for info in store.list())

    def test_delete(self, store: Store) -> None:
        store.put("d/1", b"x")
        store.put("d/2", b"y")
        store.delete("d/1")
        assert not store.exists("d/1") and store.exists("d/2")
        assert _keys(store.list("d/")) == {"d/2"}
        with pytest.raises(ObjectNotFoundError):
            store.get("d/1")
        store.delete("d/1")  # missing is fine
        store.delete("never/there")
        assert store.put_if_absent("d/1", b"again") is True  # the key can be created again

    def test_stat(self, store: Store) -> None:
        before = time.time()
        store.put("s", b"12345")
        info = store.stat("s")
        assert info.key == "s" and info.size == 5
        assert before - 300 <= info.mtime <= time.time() + 300  # the store's clock, roughly ours

    def test_touch_advances_mtime(self, store: Store) -> None:
        store.put("t", b"data")
        first = store.stat("t").mtime
        time.sleep(self.mtime_resolution * 2)
        store.touch("t")
        assert store.stat("t").mtime > first
        assert bytes(store.get("t")) == b"data"  # touch does not change the content

    def test_keys_with_many_levels(self, store: Store) -> None:
        key = "chunks/ab/" + "ab" * 32
        store.put(key, b"chunk")
        assert _keys(store.list("chunks/")) == {key}
        assert bytes(store.get(key)) == b"chunk"

    def test_write_batch_objects_exist_after_finish(self, store: Store) -> None:
        store.put("batch/old", b"old")
        batch = store.write_batch()
        assert batch.put_if_absent("batch/new/1", b"one") is True
        assert batch.put_if_absent("batch/new/2", b"") is True
        assert batch.put_if_absent("batch/old", b"other") is False  # an existing object is never replaced
        batch.finish()
        assert [bytes(store.get(k)) for k in ("batch/new/1", "batch/new/2", "batch/old")] == [b"one", b"", b"old"]
        assert _keys(store.list("batch/")) == {"batch/old", "batch/new/1", "batch/new/2"}

    def test_write_batch_objects_from_parts(self, store: Store) -> None:
        parts = [b"head", memoryview(bytes(range(256)) * 40)[7:], b"", bytearray(b"x" * 4093)]
        store.put("parts/old", b"old")
        batch = store.write_batch()
        assert batch.put_parts_if_absent("parts/new", parts) is True
        assert batch.put_parts_if_absent("parts/empty", []) is True
        assert batch.put_parts_if_absent("parts/old", [b"other"]) is False
        batch.finish()
        assert bytes(store.get("parts/new")) == b"".join(bytes(p) for p in parts)
        assert bytes(store.get("parts/empty")) == b"" and bytes(store.get("parts/old")) == b"old"

    def test_write_batch_final_object_appears_only_when_published(self, store: Store) -> None:
        batch = store.write_batch()
        assert batch.put_if_absent("final/chunk", b"chunk") is True
        batch.stage_final("final/manifest", b"names the chunk")
        batch.finish()
        assert bytes(store.get("final/chunk")) == b"chunk"
        assert not store.exists("final/manifest")  # staged: invisible until published
        assert batch.publish_final() is True
        assert bytes(store.get("final/manifest")) == b"names the chunk"

    def test_write_batch_final_object_create_if_absent_or_replace(self, store: Store) -> None:
        store.put("final/taken", b"first")
        batch = store.write_batch()
        batch.stage_final("final/taken", b"second")
        batch.finish()
        assert batch.publish_final() is False  # an existing object wins, unchanged
        assert bytes(store.get("final/taken")) == b"first"
        batch = store.write_batch()
        batch.stage_final("final/taken", b"third")
        batch.finish()
        assert batch.publish_final(overwrite=True) is True
        assert bytes(store.get("final/taken")) == b"third"
        assert _keys(store.list("final/")) == {"final/taken"}
        with pytest.raises(RuntimeError, match="nothing is staged"):
            batch.publish_final()

    def test_write_batch_abandoned_with_a_final_object_leaves_it_absent(self, store: Store) -> None:
        batch = store.write_batch()
        batch.stage_final("final/never", b"manifest")
        batch.abandon()
        assert not store.exists("final/never")
        assert _keys(store.list("final/")) == set()
        assert store.temp_files() == []  # no temporary object of it left for gc

    def test_get_refuses_an_object_larger_than_max_size(self, store: Store) -> None:
        store.put("sized/a", b"a" * 5000)
        assert bytes(store.get("sized/a", max_size=5000)) == b"a" * 5000
        assert bytes(store.get_transient("sized/a", max_size=5000)) == b"a" * 5000
        for get in (store.get, store.get_transient):
            with pytest.raises(OversizedObjectError, match=r"object 'sized/a' in .* is 5000 bytes, more than the 4999") as info:
                get("sized/a", max_size=4999)
            assert (info.value.size, info.value.limit) == (5000, 4999)
            with pytest.raises(ObjectNotFoundError):
                get("sized/missing", max_size=10)

    def test_get_transient_reads_the_whole_object(self, store: Store) -> None:
        store.put("transient/a", b"a" * 5000)
        store.put("transient/b", b"bb")
        assert bytes(store.get_transient("transient/a")) == b"a" * 5000
        assert bytes(store.get_transient("transient/b")) == b"bb"  # a shorter object after a longer one
        large = bytes(range(256)) * 1200  # 300 KiB: large enough that a store may read it another way
        store.put("transient/c", large)
        assert bytes(store.get_transient("transient/c")) == large
        assert bytes(store.get_transient("transient/a")) == b"a" * 5000
        with pytest.raises(ObjectNotFoundError):
            store.get_transient("transient/missing")

    def test_capabilities_are_declared(self, store: Store) -> None:
        """What a vault asks a store (its thread count, chunk size, probe cost, leftover temporaries) is part of
        the interface, with values a vault can use as they are."""
        assert type(store.cheap_stat) is bool
        assert type(store.preferred_workers) is int and store.preferred_workers >= 0
        size = store.preferred_chunk_size
        assert type(size) is int and (size == 0 or 64 << 10 <= size <= 256 << 20)
        store.put("captemp/a", b"x")
        temps = store.temp_files()
        assert isinstance(temps, list) and all(isinstance(i, ObjectInfo) for i in temps)
        assert "captemp/a" not in {i.key for i in temps}  # a committed object is never a leftover temporary


def _keys(infos: Any) -> set[str]:
    return {info.key for info in infos}


def _race(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run ``calls`` in threads released together; return their results (re-raising the first error)."""
    barrier = threading.Barrier(len(calls))
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait()
            results[i] = calls[i]()
        except BaseException as exc:  # noqa: BLE001 - reported to the test below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
