"""The native S3 store (``s3://bucket/prefix``): AWS S3 and S3-compatible services (Tencent COS, Ceph RGW, MinIO).

Built on boto3 (see docs/STORAGE.md for why, and for how to point it at each
service): its botocore clients, made from botocore sessions that share one
parsed service model per process. Keys of the vault are object keys under
``prefix/``.

Atomicity and durability come from S3 itself: a PutObject or
CompleteMultipartUpload makes the whole object visible at once, and is durable
when it returns. ``put_if_absent`` sends ``If-None-Match: *``, so exactly one of
several concurrent writers wins (AWS S3 since 2024, Ceph RGW, MinIO, COS). It
always uses one PutObject for objects up to 5 GiB (ckptvault's chunks are at
most 256 MiB, manifests are small), because some services (Ceph RGW 16)
silently ignore ``If-None-Match`` on CompleteMultipartUpload. ``put`` of larger
objects uses multipart upload with parallel parts, ``get`` of large objects
parallel ranged reads; both bounded by ``max_concurrency``.

Retries: botocore's ``standard`` (or ``adaptive``) mode retries 5xx,
throttling, timeouts and connection errors with exponential backoff and
jitter; this store also retries reads whose body was cut off, which botocore
does not. A conditional PUT that botocore retried after an ambiguous failure
and that then finds the key taken reads the object back: if it holds our
bytes, our first attempt created it and the call returns True.

``touch`` copies the object onto itself with replaced metadata, which sets its
LastModified (the mtime gc compares); objects over 5 GiB cannot be touched that
way, and ckptvault never writes such chunks.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ..errors import InvalidArgumentError, ObjectNotFoundError, PermanentStorageError, RetryableStorageError
from ._s3_support import (
    MAX_SINGLE_PUT,
    NOT_FOUND_CODES,
    PayloadReader,
    S3Options,
    check_endpoint,
    classify,
    default_addressing,
    error_code,
    is_transport_error,
    lifecycle_risks,
    parse_s3_url,
    retry_attempts,
)
from .base import ObjectInfo, Store, check_size

log = logging.getLogger(__name__)
T = TypeVar("T")
PREFERRED_CHUNK_SIZE = 16 << 20


class S3Store(Store):
    """Objects under ``s3://bucket/prefix``; thread-safe. ``options``: an :class:`S3Options`, or its fields as
    keywords (``S3Store(url, endpoint_url=...)``), not both."""

    cheap_stat = False  # a HEAD request: client CPU and a round trip per chunk

    def __init__(self, url: str, options: S3Options | None = None, **settings: Any) -> None:
        try:
            import boto3  # noqa: F401
        except ImportError:
            raise InvalidArgumentError(
                f"{url} needs boto3: pip install 'ckptvault[s3]' (or pip install boto3)") from None
        self.bucket, self.prefix = parse_s3_url(url)
        self.url = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        if options is not None and (settings or not isinstance(options, S3Options)):
            raise InvalidArgumentError(f"S3Store takes an S3Options or its fields as keywords, not "
                                       f"{type(options).__name__}{' and keywords' if settings else ''}")
        self.options = options if options is not None else S3Options.from_dict(settings)
        self.preferred_workers = self.options.workers  # Vault sizes its thread pool by this (CheckpointManager(workers=) wins)
        # new vaults here use 16 MiB chunks: fewer, larger objects mean fewer requests and index updates
        # (figures: docs/benchmarks/object-storage.md); CheckpointManager(chunk_size=) wins
        self.preferred_chunk_size = PREFERRED_CHUNK_SIZE
        self.client = _make_client(self.options)
        self.endpoint = self.client.meta.endpoint_url
        if self.options.endpoint_url is None:  # one from AWS_ENDPOINT_URL or a profile is seen only now
            try:
                check_endpoint(self.endpoint, "the S3 endpoint from AWS_ENDPOINT_URL or the profile,")
            except InvalidArgumentError:
                self.client.close()
                raise
        self._where = f"{self.url} (endpoint {self.endpoint})"
        self._pool = ThreadPoolExecutor(self.options.max_concurrency, thread_name_prefix="ckptvault-s3")
        self._closed = False
        if self.options.create_bucket:
            self._create_bucket()
        if self.options.check_lifecycle:
            self.check_lifecycle()

    # -- helpers ------------------------------------------------------------------
    def _key(self, key: str) -> str:
        if not key or key.startswith("/") or ".." in key.split("/"):
            raise PermanentStorageError(f"invalid storage key {key!r}")
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, what: str, fn: Callable[..., T], **kwargs: Any) -> T:
        """One S3 request (botocore retries it), its failure classified."""
        try:
            return fn(Bucket=self.bucket, **kwargs)
        except Exception as exc:  # noqa: BLE001 - classified below
            raise classify(exc, what, self._where) from exc

    def _retrying(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` again, with exponential backoff and full jitter, when a body read was cut off or stalled
        (:class:`_BodyCut`). A request that failed is not: botocore has already retried it ``max_attempts``
        times, and retrying it here too would multiply the attempts."""
        for attempt in range(self.options.max_attempts):
            try:
                return fn()
            except _BodyCut as exc:
                cause = exc.__cause__
                if attempt + 1 >= self.options.max_attempts:
                    raise
                delay = random.uniform(0, min(20.0, 0.1 * 2 ** attempt))
                log.debug("retrying %s in %.2f s after %s", what, delay, cause)
                time.sleep(delay)
        raise AssertionError("unreachable")

    # -- reads --------------------------------------------------------------------
    def get(self, key: str, max_size: int | None = None) -> bytes:
        return self._get_full(self._key(key), key, max_size)

    def _get_full(self, full: str, key: str, max_size: int | None = None) -> bytes:
        """The whole object: one ranged GET, then the rest of a large object in parallel ranges of one version
        (none if it is larger than ``max_size``)."""
        part = self.options.multipart_chunksize if max_size is None else min(self.options.multipart_chunksize, max_size)
        for _ in range(3):  # the object may be replaced between the first and later ranges: read it again
            first, total, etag = self._retrying(full, lambda: self._read_range(full, 0, max(part, 1)))
            check_size(self, key, total, max_size)
            if total <= part:
                return first
            rest = [(start, min(part, total - start)) for start in range(part, total, part)]
            try:
                pieces = list(self._pool.map(lambda r, tag=etag: self._read_part(full, r[0], r[1], tag), rest))
            except _ObjectChanged:
                continue
            return b"".join([first, *pieces])
        raise RetryableStorageError(f"{full!r} in {self._where} kept changing while it was read")

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if length <= 0:
            self.stat(key)  # a missing key is still an error
            return b""
        full = self._key(key)
        return self._retrying(full, lambda: self._read_range(full, start, length)[0])

    def _read_part(self, full: str, start: int, length: int, etag: str) -> bytes:
        return self._retrying(full, lambda: self._read_range(full, start, length, etag)[0])

    def _read_range(self, full: str, start: int, length: int, etag: str | None = None) -> tuple[bytes, int, str]:
        """Bytes [start, start+length) of an object (fewer at its end), its total size and ETag."""
        extra = {"IfMatch": etag} if etag else {}
        try:
            resp = self.client.get_object(Bucket=self.bucket, Key=full, Range=f"bytes={start}-{start + length - 1}", **extra)
        except Exception as exc:  # noqa: BLE001 - classified below
            code = error_code(exc)
            if code == "InvalidRange":  # start at or past the end (an empty object has no byte 0)
                return b"", self._stat_full(full).size, ""
            if code == "PreconditionFailed" and etag:
                raise _ObjectChanged(full) from exc
            raise classify(exc, full, self._where) from exc
        try:
            data = resp["Body"].read()  # streamed after botocore returned: its retries do not cover this
        except Exception as exc:  # noqa: BLE001 - classified below
            if is_transport_error(exc):
                raise _BodyCut(str(classify(exc, full, self._where))) from exc
            raise classify(exc, full, self._where) from exc
        total = int(str(resp.get("ContentRange", "")).rpartition("/")[2] or len(data))
        if len(data) != min(length, max(0, total - start)):
            raise _BodyCut(f"short read of {full!r} in {self._where}: {len(data)} bytes") from (
                ConnectionError("truncated body"))
        return data, total, resp.get("ETag", "")

    def exists(self, key: str) -> bool:
        try:
            self.stat(key)
        except ObjectNotFoundError:
            return False
        return True

    def stat(self, key: str) -> ObjectInfo:
        info = self._stat_full(self._key(key))
        return ObjectInfo(key, info.size, info.mtime)

    def _stat_full(self, full: str) -> ObjectInfo:
        resp = self._call(full, self.client.head_object, Key=full)
        return ObjectInfo(full, int(resp["ContentLength"]), resp["LastModified"].timestamp())

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        base = f"{self.prefix}/" if self.prefix else ""
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=base + prefix):
                for item in page.get("Contents", []):
                    yield ObjectInfo(item["Key"][len(base):], int(item["Size"]), item["LastModified"].timestamp())
        except Exception as exc:  # noqa: BLE001 - classified below
            raise classify(exc, f"listing of {prefix!r}", self._where) from exc

    # -- writes -------------------------------------------------------------------
    def put(self, key: str, data: bytes | memoryview) -> None:
        self._put(self._key(key), [data])

    # builtins.list below: in the class body, ``list`` is the method above
    def _put(self, full: str, parts: builtins.list[Any]) -> None:
        body = PayloadReader(parts)
        if len(body) > self.options.multipart_threshold:
            self._multipart(full, body.flat())
        else:
            self._call(full, self.client.put_object, Key=full, Body=body)

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        return self.put_parts_if_absent(key, [data])

    def put_parts_if_absent(self, key: str, parts: builtins.list[Any]) -> bool:
        """Create-if-absent of the concatenation of ``parts``, sent as they lie (:class:`PayloadReader`):
        a chunk's header and encoded planes go out without being joined into one object first."""
        full = self._key(key)
        if not self.options.conditional_writes:
            if self.exists(key):
                return False
            self._put(full, parts)
            return True
        body = PayloadReader(parts)
        if len(body) > MAX_SINGLE_PUT:
            return self._multipart_if_absent(key, full, body.flat())
        for attempt in range(self.options.max_attempts):
            try:
                body.seek(0)
                self.client.put_object(Bucket=self.bucket, Key=full, Body=body, IfNoneMatch="*")
                return True
            except Exception as exc:  # noqa: BLE001 - classified below
                code = error_code(exc)
                if code == "PreconditionFailed":
                    return retry_attempts(exc) > 0 and self._holds(full, body.flat())
                if code == "NotImplemented":
                    raise PermanentStorageError(
                        f"{self._where} does not support conditional writes (If-None-Match) needed for create-if-absent "
                        f"of {full!r}; set storage_options conditional_writes=False and keep one writer per vault "
                        "(docs/STORAGE.md)") from exc
                if code == "ConditionalRequestConflict" and attempt + 1 < self.options.max_attempts:
                    time.sleep(random.uniform(0, 0.1 * 2 ** attempt))  # a concurrent conditional write: ask again
                    continue
                raise classify(exc, full, self._where) from exc
        raise AssertionError("unreachable")

    def _holds(self, full: str, body: memoryview) -> bool:
        """True if the object now holds exactly ``body`` (our own earlier, retried attempt created it)."""
        try:
            return self._get_full(full, full) == body
        except ObjectNotFoundError:
            return False

    def _multipart_if_absent(self, key: str, full: str, body: memoryview) -> bool:
        if self.exists(key):
            return False
        if not self.options.conditional_multipart:
            log.warning("%s: %d-byte object %r is over S3's single-PUT limit; create-if-absent falls back to check-then-"
                        "write (set conditional_multipart=True where the service honours If-None-Match on "
                        "CompleteMultipartUpload)", self.url, len(body), key)
        try:
            self._multipart(full, body, if_none_match=self.options.conditional_multipart)
        except PermanentStorageError as exc:
            if exc.__cause__ is not None and error_code(exc.__cause__) == "PreconditionFailed":
                return False
            raise
        return True

    def _multipart(self, full: str, body: memoryview, if_none_match: bool = False) -> None:
        """Upload ``body`` in parts of ``multipart_chunksize`` (in parallel); abort the upload on failure."""
        upload = self._call(full, self.client.create_multipart_upload, Key=full)["UploadId"]
        size = self.options.multipart_chunksize
        spans = [(i + 1, start) for i, start in enumerate(range(0, len(body), size))]

        def send(span: tuple[int, int]) -> dict[str, Any]:
            number, start = span
            resp = self._call(full, self.client.upload_part, Key=full, UploadId=upload, PartNumber=number,
                              Body=PayloadReader(body[start:start + size]))
            return {"PartNumber": number, "ETag": resp["ETag"]}

        try:
            parts = list(self._pool.map(send, spans))
            extra = {"IfNoneMatch": "*"} if if_none_match else {}
            self._call(full, self.client.complete_multipart_upload, Key=full, UploadId=upload,
                       MultipartUpload={"Parts": parts}, **extra)
        except BaseException:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload)
            except Exception as exc:  # noqa: BLE001 - best effort; a lifecycle rule can clean up the rest
                log.warning("could not abort multipart upload of %r in %s: %s", full, self._where, exc)
            raise

    def delete(self, key: str) -> None:
        full = self._key(key)
        try:
            self.client.delete_object(Bucket=self.bucket, Key=full)
        except Exception as exc:  # noqa: BLE001 - classified below
            if error_code(exc) in NOT_FOUND_CODES:
                return
            raise classify(exc, full, self._where) from exc

    def touch(self, key: str) -> None:
        full = self._key(key)
        self._call(full, self.client.copy_object, Key=full, CopySource={"Bucket": self.bucket, "Key": full},
                   MetadataDirective="REPLACE", Metadata={"ckptvault-touched": f"{time.time():.3f}"})

    # -- bucket -------------------------------------------------------------------
    def check_lifecycle(self) -> builtins.list[str]:
        """Warn (logging) about lifecycle rules that could expire or archive vault objects; return what was found.

        Raises PermanentStorageError if the bucket does not exist or the
        credentials are rejected; a lifecycle configuration the credentials may
        not read is skipped (debug log).
        """
        try:
            rules = self.client.get_bucket_lifecycle_configuration(Bucket=self.bucket).get("Rules", [])
        except Exception as exc:  # noqa: BLE001 - classified below
            code = error_code(exc)
            if code in ("NoSuchLifecycleConfiguration", "NotImplemented", "MethodNotAllowed"):
                return []
            if code in ("AccessDenied", "403"):
                log.debug("cannot read the lifecycle configuration of %s: %s", self.bucket, code)
                return []
            raise classify(exc, f"bucket {self.bucket}", self._where) from exc
        risks = lifecycle_risks(rules, self.prefix)
        if risks:
            log.warning(
                "bucket lifecycle rules can delete or archive objects of the vault %s: %s. Chunks are shared by many "
                "checkpoints, so an age-based rule would break newer checkpoints that still use old chunks; remove "
                "these rules for the vault prefix and use ckptvault retention (prune + gc) instead (docs/STORAGE.md)",
                self.url, "; ".join(risks))
        return risks

    def _create_bucket(self) -> None:
        region = self.client.meta.region_name
        extra = {}
        if region and region != "us-east-1" and not self.options.endpoint_url:
            extra["CreateBucketConfiguration"] = {"LocationConstraint": region}
        try:
            self.client.create_bucket(Bucket=self.bucket, **extra)
            log.info("created bucket %s at %s", self.bucket, self.endpoint)
        except Exception as exc:  # noqa: BLE001 - classified below
            if error_code(exc) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise classify(exc, f"bucket {self.bucket}", self._where) from exc

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        self.client.close()


class _ObjectChanged(Exception):
    """The object was replaced between two ranged reads of one get()."""


class _BodyCut(RetryableStorageError):
    """A GET's body was cut off or stalled after botocore returned the response (which botocore does not retry):
    :meth:`S3Store._retrying` sends the request again."""


_SESSION_LOCK = threading.Lock()  # boto3 sessions are not thread-safe; clients are
#: botocore's data loaders, one per AWS_DATA_PATH: every store's session shares it, so the service model and
#: endpoint rules are read and parsed once per process (a fresh loader parses them again for every client)
_LOADERS: dict[str | None, Any] = {}


def _new_session(profile: str | None) -> Any:
    """A botocore session whose data loader (the parsed service models) is shared by this process's stores. Call
    with ``_SESSION_LOCK`` held. (Not a boto3 session: each of those appends boto3's data path to its loader.)"""
    import botocore.session

    session = botocore.session.Session(profile=profile)
    data_path = os.environ.get("AWS_DATA_PATH")
    if data_path in _LOADERS:
        session.register_component("data_loader", _LOADERS[data_path])
    else:
        _LOADERS[data_path] = session.get_component("data_loader")
    return session


def _make_client(opts: S3Options) -> Any:
    """A boto3 S3 client for ``opts``.

    Request bodies are signed (their SHA-256 goes into the SigV4 signature, client CPU per byte uploaded:
    docs/benchmarks/object-storage.md) per ``opts.sign_payloads``; by default unless the endpoint is https with its certificate
    verified. There TLS already protects a body in transit, and every object ckptvault writes carries its own
    hash (a chunk's name, a manifest's checksum), checked on every read. botocore would sign there too, because
    the CRC checksum headers that would let it skip signing are off for the services below; so such a client
    (AWS's default endpoint included) is made with payload signing off."""
    from botocore.config import Config

    style = opts.addressing_style or default_addressing(opts.endpoint_url)

    def client(sign_payloads: bool | None) -> Any:
        s3: dict[str, Any] = {"addressing_style": style} if style else {}
        if sign_payloads is not None:
            s3["payload_signing_enabled"] = sign_payloads
        config = Config(
            retries={"mode": opts.retry_mode, "total_max_attempts": opts.max_attempts},
            connect_timeout=opts.connect_timeout, read_timeout=opts.read_timeout,
            max_pool_connections=opts.max_pool_connections,
            # S3-compatible services (Ceph RGW 16, older MinIO, COS) do not all understand the CRC checksums
            # botocore >= 1.36 adds to every request; MD5/ETag and our own blake3 hashes already cover integrity.
            request_checksum_calculation="when_required", response_checksum_validation="when_required",
            s3=s3 or None,
            user_agent_extra="ckptvault",
        )
        return session.create_client(
            "s3", endpoint_url=opts.endpoint_url, region_name=opts.region_name, verify=opts.verify, config=config,
            aws_access_key_id=opts.aws_access_key_id, aws_secret_access_key=opts.aws_secret_access_key,
            aws_session_token=opts.aws_session_token)

    def tls_protects(endpoint: str) -> bool:
        return endpoint.lower().startswith("https:") and opts.verify is not False

    sign = opts.sign_payloads
    if sign is None and opts.endpoint_url:
        sign = not tls_protects(opts.endpoint_url)
    with _SESSION_LOCK, _configuration_errors():
        session = _new_session(opts.profile)
        made = client(sign)  # None: botocore signs every body (no checksum headers are sent)
        if sign is None and tls_protects(made.meta.endpoint_url):
            made.close()  # an endpoint from the environment or a profile is known only once botocore resolved it
            made = client(False)
        return made


@contextlib.contextmanager
def _configuration_errors() -> Iterator[None]:
    """Turn botocore's errors about the client's configuration (storage_options, AWS_* variables, the config
    files) into InvalidArgumentError saying what to fix."""
    from botocore import exceptions as be

    try:
        yield
    except be.ProfileNotFound as exc:
        raise InvalidArgumentError(
            f"AWS profile {exc.kwargs.get('profile')!r} (storage_options profile, or AWS_PROFILE) is in neither the "
            "config file (AWS_CONFIG_FILE, default ~/.aws/config) nor the credentials file (AWS_SHARED_CREDENTIALS_FILE, "
            "default ~/.aws/credentials): add it there, or name one that is") from None
    except be.InvalidRegionError as exc:
        raise InvalidArgumentError(
            f"S3 region {exc.kwargs.get('region_name')!r} is not a region name such as us-east-1 or ap-guangzhou: fix "
            "storage_options region_name, AWS_DEFAULT_REGION or the profile's region") from None
    except ValueError as exc:  # botocore: "Invalid endpoint: ..." for an endpoint from AWS_ENDPOINT_URL or a profile
        if not str(exc).startswith("Invalid endpoint"):
            raise
        raise InvalidArgumentError(
            f"{exc}: the S3 endpoint (storage_options endpoint_url, AWS_ENDPOINT_URL or the profile's endpoint_url) "
            "must be an http:// or https:// URL with a host") from None
