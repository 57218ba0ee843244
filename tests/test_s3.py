"""S3Store against a real Ceph RADOS Gateway on loopback (tests/conftest_s3.py starts it).

The store conformance suite, what is particular to S3 (multipart, parallel ranged reads of one version, typed
errors that name what to check, lifecycle warnings), and CheckpointManager end to end on an s3:// URL.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import hashlib
import io
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import torch

from ckptvault import CheckpointManager
from ckptvault._format.chunk_object import chunk_key
from ckptvault.errors import InvalidArgumentError, PermanentStorageError, RetryableStorageError, SaveError, StepNotFoundError
from ckptvault.stores import Store, open_store
from ckptvault.stores._s3_support import PayloadReader, S3Options, lifecycle_risks, parse_s3_url
from ckptvault.stores.s3 import S3Store
from ckptvault.testing.faults import FaultProxy
from ckptvault.testing.store_conformance import StoreConformance
from conftest import assert_same_state

pytest.register_assert_rewrite("conftest_s3")
from conftest_s3 import BUCKET, Gateway, gateway  # noqa: E402

pytest_plugins = ["conftest_s3"]  # fixtures rgw (the gateway), s3_url

MiB = 1 << 20


def _unique_url() -> str:
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"


class TestS3Store(StoreConformance):
    mtime_resolution = 1.0  # S3 LastModified has whole seconds

    def make_store(self, tmp_path: Path) -> Store:
        return S3Store(_unique_url(), **gateway().options())

    def make_peer(self, store: Store) -> Store:
        return S3Store(store.url, **gateway().options(check_lifecycle=False))

    def test_open_store_selects_s3(self, store: Store) -> None:
        other = open_store(store.url, gateway().options())
        try:
            assert isinstance(other, S3Store) and other.url == store.url
            store.put("x", b"1")
            assert other.get("x") == b"1"
        finally:
            other.close()


# -- multipart and ranged reads ---------------------------------------------------------
def test_large_put_is_multipart_and_get_reads_ranges_in_parallel(rgw: Gateway, s3_url: str) -> None:
    store = S3Store(s3_url, **rgw.options(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB))
    data = os.urandom(17 * MiB + 123)
    store.put("big", data)
    head = rgw.client().head_object(Bucket=BUCKET, Key=f"{store.prefix}/big")
    assert head["ETag"].strip('"').endswith("-4"), head["ETag"]  # 4 parts
    assert store.get("big") == data
    assert store.get_range("big", 5 * MiB - 10, 20) == data[5 * MiB - 10 : 5 * MiB + 10]
    assert store.stat("big").size == len(data)
    store.close()


def test_put_if_absent_of_a_large_object_is_one_conditional_put(rgw: Gateway, s3_url: str) -> None:
    """Ceph RGW ignores If-None-Match on CompleteMultipartUpload, so create-if-absent never uses multipart (<= 5 GiB)."""
    stores = [S3Store(s3_url, **rgw.options(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB,
                                            check_lifecycle=False)) for _ in range(4)]
    payloads = [bytes([i]) * (6 * MiB) for i in range(4)]
    results: list[bool] = [False] * 4
    barrier = threading.Barrier(4)

    def write(i: int) -> None:
        barrier.wait()
        results[i] = stores[i].put_if_absent("big-once", payloads[i])

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(results) == 1
    assert stores[0].get("big-once") == payloads[results.index(True)]
    head = rgw.client().head_object(Bucket=BUCKET, Key=f"{stores[0].prefix}/big-once")
    assert "-" not in head["ETag"]  # a single PutObject
    for s in stores:
        s.close()


def test_get_of_a_large_object_never_mixes_two_versions(rgw: Gateway, s3_url: str) -> None:
    store = S3Store(s3_url, **rgw.options(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB))
    a, b = b"a" * (12 * MiB), b"b" * (12 * MiB)
    store.put("obj", a)
    torn: list[int] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            data = store.get("obj")
            if data not in (a, b):
                torn.append(len(data))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(6):
            store.put("obj", b if i % 2 == 0 else a)
    finally:
        stop.set()
        reader.join()
    assert torn == []
    store.close()


def test_without_conditional_writes_create_if_absent_is_check_then_write(rgw: Gateway, s3_url: str) -> None:
    store = S3Store(s3_url, **rgw.options(conditional_writes=False))
    sent: list[dict] = []
    store.client.meta.events.register("before-send.s3.PutObject", lambda request, **_: sent.append(dict(request.headers)))
    assert store.put_if_absent("k", b"first") is True
    assert store.put_if_absent("k", b"second") is False
    assert store.get("k") == b"first"
    assert len(sent) == 1 and "If-None-Match" not in sent[0]  # one PUT, unconditional (the second call only HEADs)
    store.close()
    conditional = S3Store(s3_url, **rgw.options(check_lifecycle=False))
    conditional.client.meta.events.register("before-send.s3.PutObject",
                                            lambda request, **_: sent.append(dict(request.headers)))
    assert conditional.put_if_absent("k2", b"x") is True and conditional.put_if_absent("k2", b"y") is False
    assert [h.get("If-None-Match") for h in sent[1:]] == [b"*", b"*"]
    conditional.close()


# -- request bodies -----------------------------------------------------------------------
def test_payload_reader_reads_views_of_the_payload_and_seeks() -> None:
    payload = bytes(range(256)) * 10
    reader = PayloadReader(payload)
    assert len(reader) == 2560 and reader.readable() and reader.seekable()
    first = reader.read(300)
    assert first == payload[:300] and first.obj is payload  # a view, not a copy
    assert reader.tell() == 300
    assert reader.read() == payload[300:] and reader.read(10) == b"" and reader.read() == b""
    assert reader.seek(0) == 0 and reader.read(-1) == payload
    assert reader.seek(-10, io.SEEK_END) == 2550 and reader.read(100) == payload[-10:]
    assert reader.seek(5) == 5 and reader.seek(5, io.SEEK_CUR) == 10
    into = bytearray(6)
    assert reader.readinto(into) == 6 and into == payload[10:16]
    assert reader.seek(10_000) == 10_000 and reader.read(5) == b""  # past the end reads nothing, as a file does
    with pytest.raises(ValueError, match="negative seek position -1"):
        reader.seek(-1)
    shaped = PayloadReader(memoryview(bytearray(b"abcdef")).cast("B", (2, 3)))  # any buffer, read as its bytes
    assert len(shaped) == 6 and shaped.read() == b"abcdef" and shaped.flat() == b"abcdef"


def test_payload_reader_reads_a_list_of_buffers_as_their_concatenation() -> None:
    parts = [b"head", b"", bytearray(b"plane-one"), memoryview(b"plane-two")]
    reader = PayloadReader(parts)
    assert len(reader) == 22 and reader.flat() == b"headplane-oneplane-two"
    assert reader.read(100) == b"head"  # a read stops at the end of a buffer (a short read)
    assert reader.read(5).obj is parts[2] and reader.read(100) == b"-one" and reader.read(3) == b"pla"
    assert reader.read() == b"ne-two" and reader.read() == b""  # to the end, across buffers
    assert reader.seek(4) == 4 and reader.read() == b"plane-oneplane-two"
    assert reader.seek(3) == 3 and reader.read(2) == b"d"
    assert b"".join(iter(lambda: reader.read(4), b"")) == b"plane-oneplane-two"
    assert reader.seek(0) == 0 and b"".join(iter(reader.read, b"")) == b"headplane-oneplane-two"
    assert PayloadReader([b"one"]).flat().obj == b"one" and len(PayloadReader([])) == 0
    assert PayloadReader([]).read() == b"" and PayloadReader([]).flat() == b""


def _bodies_sent(store: S3Store) -> list[object]:
    """The request bodies botocore is about to send (PutObject and UploadPart), recorded in order."""
    bodies: list[object] = []
    for operation in ("PutObject", "UploadPart"):
        store.client.meta.events.register(f"before-send.s3.{operation}",
                                          lambda request, **_: bodies.append(request.body))
    return bodies


@pytest.mark.parametrize("conditional", [False, True], ids=["put", "put_if_absent"])
def test_puts_send_the_payload_where_it_lies(rgw: Gateway, s3_url: str, conditional: bool) -> None:
    """Bodies reach the socket as views of the caller's buffer: no copy of bytes, none of a memoryview."""
    store = S3Store(s3_url, **rgw.options())
    data = os.urandom(3 * MiB + 5)
    buffer = bytearray(data)
    bodies = _bodies_sent(store)
    put = store.put_if_absent if conditional else store.put
    put("from-bytes", data)
    put("from-view", memoryview(buffer))
    parts = [data[:100], bytearray(data[100:MiB]), data[MiB:]]
    if conditional:
        assert store.put_parts_if_absent("from-parts", parts) is True
        assert store.put_parts_if_absent("from-parts", [b"other"]) is False
    assert [type(b) for b in bodies] == [PayloadReader] * (4 if conditional else 2)
    for body in bodies:
        body.seek(0)  # type: ignore[attr-defined]  # botocore read them to the end
    assert bodies[0].read(10).obj is data and bodies[1].read(10).obj is buffer  # type: ignore[attr-defined]
    if conditional:
        assert [bodies[2].read(len(p)).obj for p in parts] == parts  # type: ignore[attr-defined]
        assert store.get("from-parts") == data
    assert store.get("from-bytes") == data and store.get("from-view") == data
    store.close()


def test_multipart_parts_are_views_of_the_payload(rgw: Gateway, s3_url: str) -> None:
    store = S3Store(s3_url, **rgw.options(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB))
    data = os.urandom(12 * MiB)
    bodies = _bodies_sent(store)
    store.put("big", data)
    assert len(bodies) == 3 and all(isinstance(b, PayloadReader) for b in bodies)
    assert sorted(len(b) for b in bodies) == [2 * MiB, 5 * MiB, 5 * MiB]  # type: ignore[arg-type]
    assert all(b.seek(0) == 0 and b.read(1).obj is data for b in bodies)  # type: ignore[attr-defined]
    assert store.get("big") == data
    store.close()


def test_a_put_retried_after_its_body_was_sent_sends_all_of_it_again(rgw: Gateway, s3_url: str) -> None:
    """The first attempt uploads the whole body, then loses its reply; botocore rewinds the reader and sends it
    again, from the start: what the gateway holds is the payload, not a tail of it or nothing."""
    data = os.urandom(2 * MiB + 3)
    with FaultProxy((urlsplit(rgw.endpoint).hostname or "127.0.0.1", urlsplit(rgw.endpoint).port or 80)) as proxy:
        store = S3Store(s3_url, **rgw.options(endpoint_url=proxy.endpoint, check_lifecycle=False, max_attempts=3))
        proxy.then("cut", "pass")
        store.put("retried", memoryview(data))
        assert proxy.counts["cut"] == 1 and proxy.counts["pass"] >= 1
        assert store.get("retried") == data
        store.close()


# -- errors -----------------------------------------------------------------------------
def test_wrong_secret_fails_fast_and_says_what_to_check(rgw: Gateway, s3_url: str) -> None:
    start = time.monotonic()
    with pytest.raises(PermanentStorageError, match=r"rejected the credentials \(SignatureDoesNotMatch\).*"
                       "AWS_SECRET_ACCESS_KEY"):
        S3Store(s3_url, **rgw.options(aws_secret_access_key="wrong"))
    assert time.monotonic() - start < 5


def test_unknown_access_key_fails_fast(rgw: Gateway, s3_url: str) -> None:
    start = time.monotonic()
    store = S3Store(s3_url, **rgw.options(aws_access_key_id="NOSUCHKEY", check_lifecycle=False))
    with pytest.raises(PermanentStorageError, match=r"InvalidAccessKeyId.*AWS_ACCESS_KEY_ID"):
        store.put("k", b"x")
    assert time.monotonic() - start < 5


def test_missing_bucket_is_named_on_open_and_on_use(rgw: Gateway) -> None:
    with pytest.raises(PermanentStorageError, match=r"bucket of s3://ckv-no-such-bucket/p .* does not exist.*create"):
        S3Store("s3://ckv-no-such-bucket/p", **rgw.options())
    store = S3Store("s3://ckv-no-such-bucket/p", **rgw.options(check_lifecycle=False))
    with pytest.raises(PermanentStorageError, match="does not exist"):
        store.get("vault.json")
    with pytest.raises(PermanentStorageError, match="does not exist"):
        store.put("x", b"1")


def test_missing_credentials_say_where_to_put_them(rgw: Gateway, s3_url: str, monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(PermanentStorageError, match="no usable S3 credentials.*AWS_ACCESS_KEY_ID"):
        S3Store(s3_url, endpoint_url=rgw.endpoint, region_name="us-east-1")


def _without_aws_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, config: str = "", credentials: str = "") -> None:
    """No AWS_* variables; the config and credentials files are tmp_path's (with the given text)."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    (tmp_path / "config").write_text(config)
    (tmp_path / "credentials").write_text(credentials)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.mark.parametrize("how", ["option", "AWS_PROFILE"])
def test_a_profile_of_the_shared_files_supplies_credentials_and_region(
        rgw: Gateway, s3_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, how: str) -> None:
    _without_aws_settings(monkeypatch, tmp_path, config="[profile ckv-test]\nregion = us-east-1\n",
                          credentials=f"[ckv-test]\naws_access_key_id = {rgw.access_key}\n"
                                      f"aws_secret_access_key = {rgw.secret_key}\n")
    options: dict[str, Any] = {"endpoint_url": rgw.endpoint}
    if how == "option":
        options["profile"] = "ckv-test"
    else:
        monkeypatch.setenv("AWS_PROFILE", "ckv-test")
    store = S3Store(s3_url, **options)
    try:
        store.put("k", b"from a profile")
        assert bytes(store.get("k")) == b"from a profile"
        assert store.client.meta.region_name == "us-east-1"
    finally:
        store.delete("k")
        store.close()


def test_an_unknown_profile_is_named_with_the_files_it_was_looked_for_in(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _without_aws_settings(monkeypatch, tmp_path, credentials="[other]\naws_access_key_id = a\naws_secret_access_key = b\n")
    with pytest.raises(InvalidArgumentError, match=r"AWS profile 'nosuch' .*\(AWS_CONFIG_FILE.*\(AWS_SHARED_CREDENTIALS_FILE"):
        S3Store("s3://bucket/p", endpoint_url="http://127.0.0.1:9", profile="nosuch", check_lifecycle=False)
    monkeypatch.setenv("AWS_PROFILE", "nosuch")
    with pytest.raises(InvalidArgumentError, match=r"AWS profile 'nosuch' \(storage_options profile, or AWS_PROFILE\)"):
        S3Store("s3://bucket/p", endpoint_url="http://127.0.0.1:9", check_lifecycle=False)


def test_a_malformed_region_is_refused_on_open() -> None:
    with pytest.raises(InvalidArgumentError, match=r"S3 region 'us east 1' is not a region name .* region_name"):
        S3Store("s3://bucket/p", endpoint_url="http://127.0.0.1:9", region_name="us east 1", aws_access_key_id="a",
                aws_secret_access_key="b", check_lifecycle=False)


@pytest.mark.parametrize("endpoint", ["not a url", "ftp://host", "http://", "127.0.0.1:7480", "http://[::1"])
def test_an_endpoint_that_is_not_an_http_url_is_refused_on_open(endpoint: str) -> None:
    expected = re.escape(f"storage_options endpoint_url '{endpoint}' is not an http:// or https:// URL")
    with pytest.raises(InvalidArgumentError, match=expected):
        S3Store("s3://bucket/p", endpoint_url=endpoint, aws_access_key_id="a", aws_secret_access_key="b",
                region_name="us-east-1", check_lifecycle=False)


@pytest.mark.parametrize(("endpoint", "message"), [
    ("ftp://host", "the S3 endpoint from AWS_ENDPOINT_URL or the profile, 'ftp://host' is not an http:// or https:// URL"),
    ("not-a-url", "Invalid endpoint: not-a-url: the S3 endpoint .*AWS_ENDPOINT_URL.* must be an http:// or https:// URL"),
])
def test_an_endpoint_from_the_environment_that_is_not_an_http_url_is_refused_on_open(
        monkeypatch: pytest.MonkeyPatch, endpoint: str, message: str) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    with pytest.raises(InvalidArgumentError, match=message):
        S3Store("s3://bucket/p", aws_access_key_id="a", aws_secret_access_key="b", region_name="us-east-1",
                check_lifecycle=False)


def test_stores_share_the_parsed_service_model_per_aws_data_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """botocore's data loader (the parsed service model and endpoint rules) is read once per process, not per
    store; a different AWS_DATA_PATH (extra or replaced models) gets a loader of its own."""
    options = {"endpoint_url": "http://127.0.0.1:9", "aws_access_key_id": "a", "aws_secret_access_key": "b",
               "region_name": "us-east-1", "check_lifecycle": False}
    monkeypatch.delenv("AWS_DATA_PATH", raising=False)
    first, second = S3Store("s3://bucket/a", **options), S3Store("s3://bucket/b", **options)
    monkeypatch.setenv("AWS_DATA_PATH", str(tmp_path))
    third = S3Store("s3://bucket/c", **options)
    try:
        assert first.client._loader is second.client._loader
        assert third.client._loader is not first.client._loader
        assert str(tmp_path) in third.client._loader.search_paths
    finally:
        for store in (first, second, third):
            store.close()


def test_unreachable_endpoint_is_retryable_and_bounded() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: connections are refused
    start = time.monotonic()
    store = S3Store("s3://bucket/p", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id="a",
                    aws_secret_access_key="b", region_name="us-east-1", check_lifecycle=False, max_attempts=2)
    with pytest.raises(RetryableStorageError, match="transient S3 failure on 'p/k'"):
        store.get("k")
    assert time.monotonic() - start < 10


def test_access_denied_fails_at_once_and_names_the_permissions(rgw: Gateway, s3_url: str) -> None:
    """A second user of the gateway, with no grant on the tests' bucket: every operation is a 403."""
    if rgw.state_dir is None:
        pytest.skip("needs the local gateway, to add a user")
    uid, access, secret = f"ckv-other-{uuid.uuid4().hex[:8]}", f"CKV{uuid.uuid4().hex[:17].upper()}", uuid.uuid4().hex
    subprocess.run(["radosgw-admin", "-c", f"{rgw.state_dir}/ceph.conf", "-n", "client.rgw.a", "user", "create",
                    f"--uid={uid}", "--display-name=no grants", f"--access-key={access}", f"--secret={secret}"],
                   check=True, capture_output=True, timeout=60)
    bucket, prefix = parse_s3_url(s3_url)
    store = S3Store(f"s3://{bucket}/{prefix}", endpoint_url=rgw.endpoint, aws_access_key_id=access,
                    aws_secret_access_key=secret, region_name="us-east-1", check_lifecycle=False)
    for call in (lambda: store.put("k", b"x"), lambda: store.get("k"), lambda: list(store.list())):
        start = time.monotonic()
        with pytest.raises(PermanentStorageError, match=r"access denied \(AccessDenied\) to .* in s3://.*: check that "
                                                        r"the credentials' policy allows s3:GetObject, s3:PutObject"):
            call()
        assert time.monotonic() - start < 5  # not retried


@pytest.mark.parametrize("call", ["get", "get_range", "put"])
def test_a_failing_request_is_sent_max_attempts_times_not_more(call: str) -> None:
    """botocore retries a request that fails; the store's own retry covers only a body cut off after botocore
    returned (not the failed request as well, which would make max_attempts squared requests for a read)."""
    with FaultProxy(("127.0.0.1", 9), reset=1.0) as proxy:  # every connection reset: nothing is forwarded
        store = S3Store("s3://bucket/p", endpoint_url=proxy.endpoint, aws_access_key_id="a", aws_secret_access_key="b",
                        region_name="us-east-1", check_lifecycle=False, max_attempts=3)
        calls = {"get": lambda: store.get("k"), "get_range": lambda: store.get_range("k", 0, 10),
                 "put": lambda: store.put("k", b"x")}
        with pytest.raises(RetryableStorageError, match="transient S3 failure on 'p/k'"):
            calls[call]()
        assert proxy.counts["reset"] == 3, proxy.counts


def test_bad_urls_and_options() -> None:
    with pytest.raises(InvalidArgumentError, match="unknown storage_options for s3:// URLs: \\['endpoint'\\]"):
        S3Store("s3://b/p", endpoint="http://x")
    with pytest.raises(InvalidArgumentError, match="addressing_style"):
        S3Store("s3://b/p", addressing_style="dns")
    with pytest.raises(InvalidArgumentError, match="sign_payloads must be true, false or null .*, got 'no'"):
        S3Store("s3://b/p", sign_payloads="no")
    assert parse_s3_url("s3://bucket/a/b/") == ("bucket", "a/b")
    assert parse_s3_url("s3://bucket") == ("bucket", "")
    with pytest.raises(InvalidArgumentError, match="invalid key prefix"):
        parse_s3_url("s3://bucket/a/../b")


def test_every_option_of_the_right_type_is_taken() -> None:
    """Each field, given a value of its own type, passes the type check (a field whose annotation the check does not
    know would fail here rather than on a user's open)."""
    samples = {"str | None": "x", "bool | str | None": True, "bool | None": False, "str": "standard", "bool": True,
               "int": 6 << 20, "float": 2.5}
    for field in dataclasses.fields(S3Options):
        S3Options.from_dict({field.name: samples[field.type]} if field.name not in {
            "endpoint_url", "addressing_style", "retry_mode", "verify", "multipart_threshold"} else {})
    S3Options.from_dict({"retry_mode": "adaptive", "verify": True, "endpoint_url": "https://host", "addressing_style": "path",
                         "multipart_threshold": 64 << 20, "multipart_chunksize": 8 << 20})


@pytest.mark.parametrize(("options", "message"), [
    ({"workers": "4"}, r"storage_options workers must be an integer, got '4' \(str\)"),
    ({"max_attempts": True}, r"storage_options max_attempts must be an integer, got True \(bool\)"),
    ({"read_timeout": "30"}, r"storage_options read_timeout must be a number, got '30' \(str\)"),
    ({"region_name": 5}, r"storage_options region_name must be a string or None, got 5 \(int\)"),
    ({"check_lifecycle": "no"}, r"storage_options check_lifecycle must be true/false, got 'no' \(str\)"),
    ({"verify": 1}, r"storage_options verify must be true/false or a string or None, got 1 \(int\)"),
    ({"sign_payloads": 1}, r"sign_payloads must be true, false or null .*, got 1"),
    ({"max_pool_connections": 0}, "max_pool_connections must be at least 1"),
    ({"connect_timeout": 0}, "connect_timeout and read_timeout must be positive seconds, got 0 and 30.0"),
    ({"read_timeout": -1.5}, "connect_timeout and read_timeout must be positive seconds, got 5.0 and -1.5"),
    ({"verify": "/no/such/ca.pem"}, "verify names a CA bundle '/no/such/ca.pem' that does not exist"),
])
def test_options_of_the_wrong_type_or_range_are_refused_on_open(options: dict[str, Any], message: str) -> None:
    usable = {"endpoint_url": "http://127.0.0.1:9", "aws_access_key_id": "a", "aws_secret_access_key": "b",
              "region_name": "us-east-1", "check_lifecycle": False}
    with pytest.raises(InvalidArgumentError, match=message):
        S3Store("s3://bucket/p", **{**usable, **options})


def test_create_bucket_option(rgw: Gateway) -> None:
    name = f"ckv-new-{uuid.uuid4().hex[:8]}"
    store = S3Store(f"s3://{name}/vault", **rgw.options(create_bucket=True))
    store.put("k", b"v")
    assert S3Store(f"s3://{name}/vault", **rgw.options(create_bucket=True)).get("k") == b"v"  # exists: fine


# -- lifecycle rules --------------------------------------------------------------------
def test_lifecycle_rule_expiring_the_vault_prefix_warns_on_open(rgw: Gateway, caplog: pytest.LogCaptureFixture) -> None:
    bucket = f"ckv-lc-{uuid.uuid4().hex[:8]}"
    client = rgw.client()
    client.create_bucket(Bucket=bucket)
    client.put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration={"Rules": [
        {"ID": "expire-ckpts", "Status": "Enabled", "Filter": {"Prefix": "ckpts/"}, "Expiration": {"Days": 30}},
        {"ID": "expire-logs", "Status": "Enabled", "Filter": {"Prefix": "logs/"}, "Expiration": {"Days": 1}},
        {"ID": "abort-uploads", "Status": "Enabled", "Filter": {"Prefix": ""},
         "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 1}},
    ]})
    with caplog.at_level(logging.WARNING, logger="ckptvault"):
        S3Store(f"s3://{bucket}/ckpts/run1", **rgw.options()).close()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1
    assert "rule 'expire-ckpts' expires objects after 30 days" in warned[0] and "prune + gc" in warned[0]
    assert "expire-logs" not in warned[0] and "abort-uploads" not in warned[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ckptvault"):
        S3Store(f"s3://{bucket}/other", **rgw.options()).close()
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_lifecycle_risks_rules() -> None:
    rules = [
        {"ID": "all", "Status": "Enabled", "Filter": {}, "Expiration": {"Days": 7}},
        {"ID": "disabled", "Status": "Disabled", "Filter": {}, "Expiration": {"Days": 7}},
        {"ID": "legacy", "Status": "Enabled", "Prefix": "v", "Expiration": {"Date": "2030-01-01"}},
        {"ID": "tagged", "Status": "Enabled", "Filter": {"Tag": {"Key": "tmp", "Value": "1"}}, "Expiration": {"Days": 1}},
        {"ID": "deep", "Status": "Enabled", "Filter": {"And": {"Prefix": "vault/chunks/"}},
         "Transitions": [{"Days": 30, "StorageClass": "DEEP_ARCHIVE"}]},
        {"ID": "ia", "Status": "Enabled", "Filter": {"Prefix": "vault/"},
         "Transitions": [{"Days": 30, "StorageClass": "STANDARD_IA"}]},
        {"ID": "old-versions", "Status": "Enabled", "Filter": {}, "NoncurrentVersionExpiration": {"NoncurrentDays": 3}},
    ]
    risks = lifecycle_risks(rules, "vault")
    assert [r.split("'")[1] for r in risks] == ["all", "legacy", "deep"]
    assert "DEEP_ARCHIVE, which cannot be read without a restore" in risks[2]
    assert lifecycle_risks(rules, "other") == [lifecycle_risks(rules, "other")[0]]  # only the rule on every key


# -- CheckpointManager end to end --------------------------------------------------------
def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(4096, 128), torch.nn.Flatten(), torch.nn.Linear(128 * 4, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 512))
    model[0].weight.requires_grad_(False)  # frozen: deduplicated across checkpoints
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    return model, opt


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 4096, (16, 4), generator=g)
    loss = torch.nn.functional.cross_entropy(model(x), x[:, 0] % 512)
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_checkpoint_manager_end_to_end_on_s3(rgw: Gateway, s3_url: str) -> None:
    model, opt = _model()
    saved = {}
    with CheckpointManager(s3_url, storage_options=rgw.options(), chunk_size=64 << 10) as mgr:
        calls: list[str] = []  # operations botocore sends, counted on the store's own client
        mgr.vault.store.client.meta.events.register("before-call.s3", lambda model, **_: calls.append(model.name))
        for step in range(1, 5):
            _train_step(model, opt, step)
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
            handle = mgr.save(step, state, metrics={"step": step})  # asynchronous: returns once staged
            saved[step] = copy.deepcopy(state)
            assert handle.wait() is not None
        assert mgr.steps() == [1, 2, 3, 4]
        assert "PutObject" in calls and "CopyObject" not in calls, "incremental saves touch (copy) no chunk"
        infos = [mgr.info(s) for s in (1, 2, 3, 4)]
        assert all(i.added_bytes < 0.8 * i.stored_bytes for i in infos[1:]), [(i.added_bytes, i.stored_bytes) for i in infos]
        assert any("base" in c for c in mgr.manifest(4)["chunks"])  # incremental: XOR deltas against the keyframe
        assert mgr.verify().ok
    with CheckpointManager(s3_url, storage_options=rgw.options()) as fresh:  # a new connection reads it all back
        for step, state in saved.items():
            assert_same_state(state, fresh.restore(step))
        fresh.delete(2)
        fresh.delete(3)
        plan, result = fresh.gc(grace=0)
        assert result is not None and result.deleted and plan.bytes > 0
        assert fresh.steps() == [1, 4]
        assert_same_state(saved[4], fresh.restore(4))
        assert_same_state(saved[1], fresh.restore(1))
        assert fresh.verify().ok
        with pytest.raises(StepNotFoundError, match="step 2 has no committed checkpoint in s3://"):
            fresh.restore(2)


def _content_hashes_sent(store: S3Store) -> list[str]:
    """The x-amz-content-sha256 header of every PUT the store's client sends from now on."""
    sent: list[str] = []
    store.client.meta.events.register("before-send.s3.PutObject",
                                      lambda request, **_: sent.append(request.headers["X-Amz-Content-SHA256"].decode()))
    return sent


@pytest.mark.parametrize(("tls", "extra", "signed"), [
    (False, {}, True), (False, {"sign_payloads": False}, False), (True, {}, False),
    (True, {"sign_payloads": True}, True), (True, {"verify": False}, True)],
    ids=["http", "http, sign_payloads=False", "https", "https, sign_payloads=True", "https, verify=False"])
@pytest.mark.filterwarnings("ignore:Unverified HTTPS request")
def test_bodies_are_signed_over_http_and_not_over_https_unless_told(rgw: Gateway, tls: bool, extra: dict[str, Any],
                                                                     signed: bool) -> None:
    """By default a PUT's body is hashed into its signature over http, where nothing else protects it in transit,
    and not over https with a verified certificate, where TLS does (botocore would sign it there too: the vault
    sends no checksum headers); over https without verification, which a man in the middle can answer, it is.
    ``sign_payloads`` decides either way. The gateway accepts both, over both."""
    store = S3Store(_unique_url(), **(rgw.tls_options(**extra) if tls else rgw.options(**extra)))
    sent = _content_hashes_sent(store)
    data = os.urandom(MiB + 3)
    store.put("plain", data)
    assert store.put_parts_if_absent("conditional", [data[:10], data[10:]]) is True
    assert store.get("plain") == data and store.get("conditional") == data
    digest = hashlib.sha256(data).hexdigest()
    assert sent == ([digest] * 2 if signed else ["UNSIGNED-PAYLOAD"] * 2)
    store.close()


def test_a_manager_saves_and_restores_over_https(rgw: Gateway) -> None:
    """A vault over TLS (verified against the gateway's CA bundle): asynchronous saves, a delta, and restores in
    a new manager, bit for bit; without the CA bundle the certificate is refused, and the error says so."""
    url = _unique_url()
    model, opt = _model()
    saved = {}
    with CheckpointManager(url, storage_options=rgw.tls_options()) as mgr:
        for step in (1, 2):
            _train_step(model, opt, step)
            saved[step] = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
            mgr.save(step, saved[step]).wait()
        assert any("base" in c for c in mgr.manifest(2)["chunks"])
    with CheckpointManager(url, storage_options=rgw.tls_options()) as fresh:
        for step, state in saved.items():
            assert_same_state(state, fresh.restore(step))
    start = time.monotonic()
    with pytest.raises(PermanentStorageError, match=r"TLS certificate of s3://.* is not trusted .*verify='/path/to/ca"):
        CheckpointManager(url, storage_options=rgw.tls_options(verify=None))
    assert time.monotonic() - start < 10


def test_new_vaults_on_s3_use_16_mib_chunks_unless_told(rgw: Gateway, s3_url: str) -> None:
    with CheckpointManager(s3_url + "/default", storage_options=rgw.options()) as mgr:
        mgr.save(1, {"x": torch.zeros(10)}).wait()
        assert mgr.vault.require().chunk_size == 16 << 20
    with CheckpointManager(s3_url + "/chosen", storage_options=rgw.options(), chunk_size=1 << 20) as mgr:
        mgr.save(1, {"x": torch.zeros(10)}).wait()
        assert mgr.vault.require().chunk_size == 1 << 20


# -- the seed's example workflow as one command -------------------------------------------------
def test_demo_workflow_on_s3(rgw: Gateway, s3_url: str) -> None:
    """`ckptvault demo --store s3://...`: checkpoints every 2 steps, async saves, fp16 weights with LZ4, retention."""
    env = {**rgw.env(), "OMP_NUM_THREADS": "1"}
    args = ["demo", "--store", s3_url, "--steps", "6", "--every", "2", "--codec-rules", "fp16", "--keep-last", "1",
            "--batch-size", "4", "--repeat", "1", "--no-progress", "--json"]
    done = subprocess.run([sys.executable, "-m", "ckptvault", *args], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["ok"] and report["check"]["lossy"] > 0 and report["check"]["num_mismatches"] == 0
    with CheckpointManager(s3_url, storage_options=rgw.options()) as mgr:
        keyframe = mgr.manifest(6)["keyframe_step"]
        assert report["vault"] == s3_url and report["steps"] == sorted({keyframe, 6})  # keep-last 1 (+ its keyframe)
        weights = next(t for t in mgr.manifest(6)["tensors"] if t["path"] == "model.blocks.0.mlp.0.weight")
        assert weights["lossy"]["codec"] in ("fp16", "bf16") and weights["codec"] == "lz4"
        assert mgr.verify().ok


# -- probes before writes ------------------------------------------------------------------------------------------
def _requests_by_key(store: S3Store) -> list[tuple[str, str]]:
    """(operation, object key or listed prefix) of every request the store's client sends from now on."""
    sent: list[tuple[str, str]] = []
    store.client.meta.events.register(
        "before-parameter-build.s3",
        lambda model, params, **_: sent.append((model.name, params.get("Key", params.get("Prefix", "")))))
    return sent


def _chunk_keys(store: S3Store, manifest: dict[str, Any]) -> set[str]:
    return {f"{store.prefix}/{chunk_key(c['id'])}" for c in manifest["chunks"]}


def test_a_new_save_stops_probing_once_probes_keep_missing(rgw: Gateway, s3_url: str) -> None:
    """On S3 a save asks whether a chunk exists (a HEAD) only until PROBE_MISSES such probes in a row found
    nothing; the commit still checks every chunk it names, with one listing of this small vault's chunks."""
    from ckptvault._save.chunks import PROBE_MISSES

    torch.manual_seed(1)  # fixed chunk ids: the commit check's estimate lists this small vault

    state = {"w": torch.randn(48 * 16384)}  # 48 chunks of 64 KiB
    with CheckpointManager(s3_url, storage_options=rgw.options(), chunk_size=64 << 10, workers=1,
                           async_save=False) as mgr:
        sent = _requests_by_key(mgr.vault.store)
        mgr.save(1, state)
        chunks = _chunk_keys(mgr.vault.store, mgr.manifest(1))
        heads = [k for op, k in sent if op == "HeadObject" and k in chunks]
        puts = [k for op, k in sent if op == "PutObject" and k in chunks]
        assert len(chunks) == 48 and sorted(puts) == sorted(chunks)
        assert len(heads) == PROBE_MISSES  # probes of the first chunks
        prefix = mgr.vault.store.prefix
        assert [k for op, k in sent if op == "ListObjectsV2" and "/chunks/" in k] == [
            f"{prefix}/chunks/00/", f"{prefix}/chunks/"]  # the commit's check: the estimate, then the listing
        assert_same_state(state, mgr.restore(1))


def test_a_save_that_finds_chunks_it_did_not_expect_reuses_them_and_probes_again(rgw: Gateway, s3_url: str) -> None:
    """Chunks left in the vault by a deleted checkpoint (no manifest names them) are unknown to the next save.
    Once it has stopped probing, the first of them it meets is sent and refused (412): the save reuses it,
    protects it from gc (a touch, as for any reused chunk nobody names) and probes again, so the others are
    found without being sent. The checkpoint restores exactly and adds only the new chunks."""
    from ckptvault._save.chunks import PROBE_MISSES

    torch.manual_seed(7)  # fixed chunk ids: the commit check's estimate lists this small vault

    old, new = torch.randn(16 * 16384), torch.randn(16 * 16384)  # 16 chunks of 64 KiB each
    with CheckpointManager(s3_url, storage_options=rgw.options(), chunk_size=64 << 10, workers=1,
                           async_save=False) as mgr:
        mgr.save(1, {"b_old": old})
        old_chunks = _chunk_keys(mgr.vault.store, mgr.manifest(1))
        mgr.delete(1)  # its chunks stay until gc
        sent = _requests_by_key(mgr.vault.store)
        mgr.save(2, {"a_new": new, "b_old": old})  # one worker: chunks go in order, the new ones first
        new_chunks = _chunk_keys(mgr.vault.store, mgr.manifest(2)) - old_chunks
        count = collections.Counter((op, "old" if k in old_chunks else "new" if k in new_chunks else "other")
                                    for op, k in sent)
        assert len(old_chunks) == len(new_chunks) == 16
        assert count["PutObject", "new"] == 16 and count["PutObject", "old"] == 1  # the refused one
        assert count["CopyObject", "old"] == 16  # every reused chunk that no manifest names is touched, the refused one too
        assert count["HeadObject", "new"] == PROBE_MISSES  # probes (the commit lists the chunks)
        assert count["HeadObject", "old"] == 15 + 1  # probes again, the refused one's size
        assert mgr.info(2).added_bytes == sum(c["stored"] for c in mgr.manifest(2)["chunks"]
                                              if f"{mgr.vault.store.prefix}/{chunk_key(c['id'])}" in new_chunks)
        assert_same_state({"a_new": new, "b_old": old}, mgr.restore(2))


def _put_garbage(rgw: Gateway, store: S3Store, fan_out: str, count: int) -> None:
    """``count`` objects under ``chunks/<fan_out>/`` that no manifest names, as a crashed save leaves them."""
    other = rgw.client()
    for i in range(count):
        other.put_object(Bucket=BUCKET, Key=f"{store.prefix}/chunks/{fan_out}/{fan_out}{i:062x}", Body=b"x")


@pytest.mark.parametrize("vault", ["small", "estimated large", "larger than estimated"])
def test_the_commit_check_lists_the_chunk_keys_only_while_that_is_cheaper_than_asking_for_each(
        rgw: Gateway, s3_url: str, vault: str) -> None:
    """The commit's existence check estimates the vault's chunk count from one of the 256 key prefixes. A vault
    estimated at up to LIST_PER_PROBE chunks per chunk checked is listed, and a chunk the listing shows needs no
    HEAD; a larger one gets a HEAD per chunk; a listing that passes twice that many keys (the estimate was low)
    stops, and the chunks it did not show get a HEAD."""
    from ckptvault._save.commit import LIST_PER_PROBE

    torch.manual_seed(5)
    state = {"new": torch.randn(4 * 16384)}  # 4 chunks of 64 KiB, none under chunks/00/ or chunks/01/ (seed 5)
    with CheckpointManager(s3_url, storage_options=rgw.options(), chunk_size=64 << 10, workers=1,
                           async_save=False) as mgr:
        store = mgr.vault.store
        if vault == "estimated large":
            _put_garbage(rgw, store, "00", 1)  # estimate 256 > 10 x 4
        elif vault == "larger than estimated":
            _put_garbage(rgw, store, "01", 2 * LIST_PER_PROBE * 4)  # listed first; the estimate sees none
        sent = _requests_by_key(store)
        mgr.save(1, state)
        chunks = sorted(_chunk_keys(store, mgr.manifest(1)))
        assert len(chunks) == 4 and all(k.split("/")[-2] > "01" for k in chunks)
        heads = collections.Counter(k for op, k in sent if op == "HeadObject" and "/chunks/" in k)
        listings = [k for op, k in sent if op == "ListObjectsV2" and "/chunks/" in k]
        assert listings == [f"{store.prefix}/chunks/00/"] + ([] if vault == "estimated large" else [f"{store.prefix}/chunks/"])
        asked = vault != "small"  # every new chunk was probed once before its upload; asked again at commit or not
        assert heads == {k: 1 + asked for k in chunks}
        assert_same_state(state, mgr.restore(1))


@pytest.mark.parametrize("vault", ["small", "estimated large"])
def test_a_chunk_deleted_before_the_commit_fails_the_save_whether_listed_or_asked_for(
        rgw: Gateway, s3_url: str, vault: str) -> None:
    """A gc (here: another client) deletes one of the save's chunks just before its commit check: the check
    finds it missing, by listing a small vault, by a HEAD in a large one; nothing is committed, and the save
    succeeds when retried. (DESIGN M3, G5)"""
    torch.manual_seed(5)
    state = {"new": torch.randn(4 * 16384)}
    with CheckpointManager(s3_url, storage_options=rgw.options(), chunk_size=64 << 10, workers=1,
                           async_save=False) as mgr:
        store, other, deleted = mgr.vault.store, rgw.client(), []
        if vault == "estimated large":
            _put_garbage(rgw, store, "00", 1)
        estimate = f"{store.prefix}/chunks/00/"

        def collect_one(params: dict[str, Any], **_: Any) -> None:
            if deleted or params.get("Prefix") != estimate:  # the commit's check begins
                return
            listed = other.list_objects_v2(Bucket=BUCKET, Prefix=f"{store.prefix}/chunks/").get("Contents", [])
            victim = sorted(o["Key"] for o in listed if "/chunks/00/" not in o["Key"])[0]
            other.delete_object(Bucket=BUCKET, Key=victim)
            deleted.append(victim)

        store.client.meta.events.register("before-parameter-build.s3.ListObjectsV2", collect_one)
        sent = _requests_by_key(store)
        with pytest.raises(SaveError, match="1 chunks of step 1 .* were removed by a concurrent gc before it committed"):
            mgr.save(1, state)
        assert deleted and mgr.steps() == []
        after_check_began = sent[sent.index(("ListObjectsV2", estimate)):]
        assert after_check_began.count(("HeadObject", deleted[0])) == (vault == "estimated large")
        store.client.meta.events.unregister("before-parameter-build.s3.ListObjectsV2", collect_one)
        mgr.save(1, state)
        assert_same_state(state, mgr.restore(1))


def test_a_found_chunk_that_gc_collects_before_it_is_protected_is_written_after_all(rgw: Gateway,
                                                                                      s3_url: str) -> None:
    """Between the 412 that says a chunk is there and the touch that protects it, a concurrent gc may delete it
    (here: deleted when the touch is sent). The save then writes the chunk itself and commits a checkpoint
    that restores exactly. (DESIGN G5)"""
    from ckptvault._save.chunks import PROBE_MISSES

    torch.manual_seed(3)  # fixed chunk ids: the commit check's estimate lists this small vault

    old, new = torch.randn(4 * 16384), torch.randn((PROBE_MISSES + 2) * 16384)
    with CheckpointManager(s3_url, storage_options=rgw.options(), chunk_size=64 << 10, workers=1,
                           async_save=False) as mgr:
        mgr.save(1, {"b_old": old})
        old_chunks = _chunk_keys(mgr.vault.store, mgr.manifest(1))
        mgr.delete(1)
        collected: list[str] = []
        other = rgw.client()

        def collect_first_touched(params: dict[str, Any], **_: Any) -> None:
            if not collected:
                collected.append(params["Key"])
                other.delete_object(Bucket=params["Bucket"], Key=params["Key"])

        store = mgr.vault.store
        store.client.meta.events.register("before-parameter-build.s3.CopyObject", collect_first_touched)
        sent = _requests_by_key(store)
        mgr.save(2, {"a_new": new, "b_old": old})
        assert collected and collected[0] in old_chunks
        sent_for_it = [op for op, k in sent if k == collected[0]]
        assert sent_for_it[:3] == ["PutObject", "CopyObject", "PutObject"] and "HeadObject" not in sent_for_it
        assert mgr.verify().ok
        assert_same_state({"a_new": new, "b_old": old}, mgr.restore(2))
