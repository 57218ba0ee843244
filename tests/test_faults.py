"""Faults: saves commit correctly or fail cleanly with nothing committed, restores stay bit-exact.

Two layers: FaultyStore (store calls fail after the store's retries gave up) on a memory store and on the real
S3 gateway, and FaultProxy (TCP resets, 503 SlowDown, stalls, responses cut mid-body) between S3Store and the
real Ceph RGW, which S3Store's retries must absorb.
"""

from __future__ import annotations

import copy
import time
from urllib.parse import urlsplit

import pytest
import torch

from ckptvault import CheckpointManager
from ckptvault.errors import PermanentStorageError, RetryableStorageError, StorageError
from ckptvault.stores import MemoryStore
from ckptvault.stores.s3 import S3Store
from ckptvault.testing.faults import WRITE_METHODS, FaultProxy, FaultyStore
from conftest import assert_same_state, drop_memory_store, fresh_memory_url

pytest.register_assert_rewrite("conftest_s3")
from conftest_s3 import Gateway  # noqa: E402

pytest_plugins = ["conftest_s3"]  # fixtures rgw (the gateway), s3_url


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "seed": seed}


# -- FaultyStore -----------------------------------------------------------------------------
def test_faulty_store_is_deterministic_and_filters_methods_and_keys() -> None:
    url = fresh_memory_url("faults")
    try:
        inner = MemoryStore(url.removeprefix("memory://"))
        outcomes = []
        for _ in range(2):
            faulty = FaultyStore(inner, fail=0.5, seed=7, methods=("put",), keys=("chunks/",))
            row = []
            for i in range(20):
                try:
                    faulty.put(f"chunks/{i}", b"x")
                    row.append(True)
                except RetryableStorageError as exc:
                    assert f"injected fault: put('chunks/{i}')" in str(exc)
                    row.append(False)
            faulty.put("manifests/1", b"m")  # other keys never fail
            assert [faulty.exists(f"chunks/{i}") for i in range(20)] == row  # reads never fail
            outcomes.append(row)
        assert outcomes[0] == outcomes[1] and 3 < outcomes[0].count(False) < 17
        assert faulty.counts["fail:put"] == outcomes[1].count(False)
    finally:
        drop_memory_store(url)


@pytest.mark.parametrize("backend", ["memory", "s3"])
def test_failed_writes_fail_the_save_cleanly_and_a_retry_commits(backend: str, request: pytest.FixtureRequest) -> None:
    if backend == "s3":
        gw: Gateway = request.getfixturevalue("rgw")
        inner = S3Store(request.getfixturevalue("s3_url"), **gw.options())
    else:
        url = fresh_memory_url("faults")
        request.addfinalizer(lambda: drop_memory_store(url))
        inner = MemoryStore(url.removeprefix("memory://"))
    faulty = FaultyStore(inner, fail=0.3, methods=WRITE_METHODS, keys=("chunks/",), seed=3)
    state = _state(1)
    with CheckpointManager(faulty, chunk_size=64 << 10) as mgr:
        faulty.enabled = False
        mgr.save(1, state).wait()  # step 1 commits; step 2 meets the faults
        faulty.enabled = True
        state2 = _state(2)
        handle = mgr.save(2, state2)
        with pytest.raises(RetryableStorageError, match="injected fault"):
            handle.wait()
        assert mgr.steps() == [1]
        assert not inner.exists("manifests/00000000000000000002.json")
        faulty.enabled = False
        mgr.save(2, state2).wait()  # the same save again: now it commits
        assert mgr.steps() == [1, 2]
        assert_same_state(state2, mgr.restore(2))
        assert_same_state(state, mgr.restore(1))
        mgr.gc(grace=0)
        assert mgr.verify().ok


def test_a_permanent_error_fails_the_save_at_once(rgw: Gateway, s3_url: str) -> None:
    faulty = FaultyStore(S3Store(s3_url, **rgw.options()), fail=1.0, methods=("put_if_absent",),
                         keys=("manifests/",), error=PermanentStorageError)
    with CheckpointManager(faulty, chunk_size=64 << 10) as mgr:
        start = time.monotonic()
        with pytest.raises(PermanentStorageError, match="injected fault: put_if_absent\\('manifests/"):
            mgr.save(5, _state(5)).wait()
        assert time.monotonic() - start < 5
        assert mgr.steps() == []
        assert faulty.counts["fail:put_if_absent"] == 1  # not retried


# -- FaultProxy in front of the real gateway ---------------------------------------------------
def _upstream(gw: Gateway) -> tuple[str, int]:
    parts = urlsplit(gw.endpoint)
    return parts.hostname or "127.0.0.1", parts.port or 80


def _proxied(gw: Gateway, proxy: FaultProxy, url: str, **extra: object) -> S3Store:
    options = gw.options(**{"endpoint_url": proxy.endpoint, "read_timeout": 1.0, "connect_timeout": 1.0,
                            "max_attempts": 10, "check_lifecycle": False, **extra})
    store = S3Store(url, **options)
    store.client.meta.events.register("before-send.s3", _one_request_per_connection)
    return store


def _one_request_per_connection(request: object, **_: object) -> None:
    """The proxy decides per connection; without keep-alive, every request meets a fresh decision."""
    request.headers["Connection"] = "close"  # type: ignore[attr-defined]


def test_saves_and_restores_through_resets_errors_stalls_and_cut_bodies(rgw: Gateway, s3_url: str) -> None:
    states = {}
    with FaultProxy(_upstream(rgw), reset=0.08, error=0.08, stall=0.02, cut=0.25, stall_s=2.0, cut_within=96 << 10,
                    seed=11) as proxy:
        with CheckpointManager(_proxied(rgw, proxy, s3_url), chunk_size=64 << 10) as mgr:
            for step in (1, 2, 3):
                states[step] = copy.deepcopy(_state(step))
                mgr.save(step, states[step])  # asynchronous; the next save waits for this one
            mgr.wait()
            assert mgr.steps() == [1, 2, 3]
            for step, state in states.items():
                assert_same_state(state, mgr.restore(step))
            assert mgr.verify().ok
        counts = dict(proxy.counts)
    assert all(counts.get(kind, 0) > 0 for kind in ("reset", "error", "stall", "cut")), counts
    with CheckpointManager(s3_url, storage_options=rgw.options()) as direct:  # and without the proxy, the same bits
        assert_same_state(states[3], direct.restore(3))


def test_put_if_absent_whose_reply_was_lost_reports_its_own_win(rgw: Gateway, s3_url: str) -> None:
    """The server created the object, the reply was cut, botocore retried and got 412: the object holds our bytes."""
    with FaultProxy(_upstream(rgw)) as proxy:
        store = _proxied(rgw, proxy, s3_url)
        proxy.then("cut", "pass")
        assert store.put_if_absent("commit", b"mine") is True
        assert proxy.counts["cut"] == 1
        assert store.put_if_absent("commit", b"other") is False  # a real loser still loses
        proxy.then("cut", "pass")
        other = _proxied(rgw, proxy, s3_url)
        assert other.put_if_absent("commit", b"third") is False  # retried after the cut; 412 and not our bytes
        assert store.get("commit") == b"mine"
        store.close()
        other.close()


def test_a_read_cut_mid_body_is_retried(rgw: Gateway, s3_url: str) -> None:
    """botocore does not retry a body cut after the headers arrived; S3Store does."""
    data = bytes(range(256)) * 4096  # 1 MiB
    S3Store(s3_url, **rgw.options()).put("obj", data)
    with FaultProxy(_upstream(rgw)) as proxy:
        store = _proxied(rgw, proxy, s3_url)
        proxy.then("cut-body", "cut-body")
        assert store.get("obj") == data
        assert store.get_range("obj", 1000, 300_000) == data[1000:301_000]
        assert proxy.counts["cut-body"] == 2 and proxy.counts["pass"] >= 1
        store.close()


def test_retries_end_with_a_retryable_error(rgw: Gateway, s3_url: str) -> None:
    with FaultProxy(_upstream(rgw), error=1.0) as proxy:
        store = _proxied(rgw, proxy, s3_url, max_attempts=3)
        start = time.monotonic()
        with pytest.raises(RetryableStorageError, match="transient S3 failure on '.*/k' .* after retries.*SlowDown"):
            store.put("k", b"v")
        assert time.monotonic() - start < 15
        assert proxy.counts["error"] == 3
        assert isinstance(RetryableStorageError("x"), StorageError)
