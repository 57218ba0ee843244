"""Pieces of the S3 store that need no connection: URL and option parsing, error classification, lifecycle rules.

Kept apart from ``s3.py`` so that each can be read (and tested) on its own.
"""

from __future__ import annotations

import bisect
import io
import ipaddress
import itertools
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import urlsplit

from .._argcheck import check_kind
from ..errors import (
    InvalidArgumentError,
    ObjectNotFoundError,
    PermanentStorageError,
    RetryableStorageError,
    StorageError,
    StorageFullError,
)

MiB = 1 << 20
#: S3's limit for one PutObject / CopyObject; larger objects need multipart upload
MAX_SINGLE_PUT = 5 << 30

NOT_FOUND_CODES = {"NoSuchKey", "404", "NotFound"}
CREDENTIAL_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "TokenRefreshRequired",
                    "InvalidClientTokenId", "AuthorizationHeaderMalformed", "RequestTimeTooSkewed"}
DENIED_CODES = {"AccessDenied", "403", "AllAccessDisabled", "AccountProblem", "InvalidObjectState", "UserSuspended"}
FULL_CODES = {"QuotaExceeded", "EntityTooLarge", "StorageFull", "InsufficientStorage"}
RETRYABLE_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewedRetry",
                   "InternalError", "ServiceUnavailable", "503", "500", "502", "504", "ConditionalRequestConflict",
                   "OperationAborted", "RequestLimitExceeded", "BandwidthLimitExceeded", "TooManyRequests"}
#: storage classes whose objects cannot be read without a restore request first
ARCHIVE_CLASSES = {"GLACIER", "DEEP_ARCHIVE", "ARCHIVE", "DEEP_ARCHIVE_ACCESS", "ARCHIVE_ACCESS"}


@dataclass(frozen=True)
class S3Options:
    """The storage options of an ``s3://`` vault (``storage_options=S3Options(...)``, or the same keys in a dict;
    see docs/STORAGE.md). Checked when made: a wrong type or value is an InvalidArgumentError naming the field."""

    endpoint_url: str | None = None        # any S3-compatible service; default: AWS (or AWS_ENDPOINT_URL[_S3])
    region_name: str | None = None         # default: AWS_REGION / AWS_DEFAULT_REGION / config file
    profile: str | None = None             # a profile of ~/.aws/config and ~/.aws/credentials
    aws_access_key_id: str | None = None
    aws_secret_access_key: str | None = None
    aws_session_token: str | None = None
    addressing_style: str | None = None    # "virtual" (bucket.host, COS needs it), "path" (host/bucket), "auto"
    verify: bool | str | None = None       # TLS verification: False, or a CA bundle path
    sign_payloads: bool | None = None      # SHA-256 of request bodies in the signature; None: unless verified TLS
    workers: int = 16                      # threads a vault uses for chunk I/O here (requests wait on the network)
    max_concurrency: int = 8               # parallel part uploads / ranged reads of one object
    multipart_threshold: int = 64 * MiB    # put() of larger objects uses multipart upload
    multipart_chunksize: int = 16 * MiB    # part size of uploads and of parallel ranged reads
    max_attempts: int = 5                  # tries per request, the first included (botocore; ours for torn bodies)
    retry_mode: str = "standard"           # botocore retry mode: "standard" or "adaptive" (client-side rate limiting)
    connect_timeout: float = 5.0
    read_timeout: float = 30.0             # seconds without a byte before a request counts as stalled
    max_pool_connections: int = 64
    conditional_writes: bool = True        # put_if_absent with If-None-Match: *; False: HEAD then PUT (one writer only)
    conditional_multipart: bool = False    # objects over 5 GiB: complete the multipart upload with If-None-Match
    check_lifecycle: bool = True           # on open, warn about lifecycle rules that could expire vault objects
    create_bucket: bool = False            # create the bucket on open if it does not exist

    def __post_init__(self) -> None:
        if self.addressing_style not in (None, "auto", "virtual", "path"):
            raise InvalidArgumentError(f"addressing_style must be 'virtual', 'path' or 'auto', got {self.addressing_style!r}")
        if self.retry_mode not in ("standard", "adaptive", "legacy"):
            raise InvalidArgumentError(f"retry_mode must be 'standard' or 'adaptive', got {self.retry_mode!r}")
        if not isinstance(self.sign_payloads, (bool, type(None))):
            raise InvalidArgumentError(f"sign_payloads must be true, false or null (sign unless over verified https), got "
                                       f"{self.sign_payloads!r}")
        for f in fields(self):  # the rest: the type each field's annotation admits
            check_kind(f"storage_options {f.name}", getattr(self, f.name), *_OPTION_TYPES[str(f.type)])
        if self.multipart_chunksize < 5 * MiB or self.multipart_threshold < self.multipart_chunksize:
            raise InvalidArgumentError("multipart_chunksize must be at least 5 MiB (S3's minimum part size) and "
                                       "multipart_threshold at least multipart_chunksize")
        if min(self.max_concurrency, self.max_attempts, self.workers, self.max_pool_connections) < 1:
            raise InvalidArgumentError("workers, max_concurrency, max_attempts and max_pool_connections must be at least 1")
        if self.connect_timeout <= 0 or self.read_timeout <= 0:
            raise InvalidArgumentError(f"connect_timeout and read_timeout must be positive seconds, got "
                                       f"{self.connect_timeout!r} and {self.read_timeout!r}")
        if isinstance(self.verify, str) and not os.path.exists(self.verify):
            raise InvalidArgumentError(f"storage_options verify names a CA bundle {self.verify!r} that does not exist: "
                                       "give the path of a PEM file (or directory) of certificates, or true")
        if self.endpoint_url is not None:
            check_endpoint(self.endpoint_url, "storage_options endpoint_url")

    @classmethod
    def from_dict(cls, options: Mapping[str, Any] | None) -> S3Options:
        """Options from a ``storage_options`` dict; unknown keys are an InvalidArgumentError naming the known ones."""
        options = dict(options or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidArgumentError(f"unknown storage_options for s3:// URLs: {unknown}; known: {sorted(known)}")
        return cls(**options)


#: the types each annotation of S3Options admits (``check_kind`` takes no bool for a number)
_OPTION_TYPES: dict[str, tuple[type, ...]] = {
    "str | None": (str, type(None)), "bool | str | None": (bool, str, type(None)), "bool | None": (bool, type(None)),
    "str": (str,), "bool": (bool,), "int": (int,), "float": (int, float),
}


def check_endpoint(endpoint: str, source: str) -> None:
    """InvalidArgumentError unless ``endpoint`` (from ``source``, for the message) is an http(s) URL with a host."""
    try:
        parts = urlsplit(endpoint) if isinstance(endpoint, str) else None
    except ValueError:  # e.g. an unclosed IPv6 bracket
        parts = None
    if parts is None or parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise InvalidArgumentError(
            f"{source} {endpoint!r} is not an http:// or https:// URL with a host: give the service's address, such "
            "as http://127.0.0.1:7480 or https://cos.ap-guangzhou.myqcloud.com")


class PayloadReader(io.RawIOBase):
    """A request body that hands botocore views of the payload instead of copies.

    botocore wraps a ``bytes`` body in ``io.BytesIO``; signing then reads it in 1 MiB copies (each a fresh
    allocation that page-faults) and urllib3 sends it in 16 KiB copies, two copies of every byte uploaded. This
    reader returns ``memoryview`` slices of the payload, which ``hashlib`` and ``socket.sendall`` take as they
    are. The payload may be one buffer or a list of buffers read as their concatenation (an encoded chunk's
    header and planes), so it need not be joined first; a read then stops at the end of a buffer, a short
    read that file readers allow. The reader is seekable, so botocore rewinds it for a retry as it rewinds a
    ``BytesIO``; it is read-only, and serves one request at a time (make one per call).
    """

    def __init__(self, payload: bytes | memoryview | list[Any]) -> None:
        super().__init__()
        buffers = payload if isinstance(payload, list) else [payload]
        self._views = [view for view in (memoryview(b).cast("B") for b in buffers) if len(view)]
        self._starts = list(itertools.accumulate((len(v) for v in self._views), initial=0))
        self._position = 0

    def __len__(self) -> int:
        return self._starts[-1]

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> memoryview:
        """Up to ``size`` bytes from the current position, within one buffer; empty at the end. A negative
        ``size`` reads to the end, as files do (a joined copy where the rest spans buffers)."""
        index = bisect.bisect_right(self._starts, self._position) - 1
        if index >= len(self._views):
            return memoryview(b"")
        view, offset = self._views[index], self._position - self._starts[index]
        if size is None or size < 0:
            rest = [view[offset:], *self._views[index + 1 :]]
            self._position = len(self)
            return rest[0] if len(rest) == 1 else memoryview(b"".join(rest))
        end = min(len(view), offset + size)
        self._position += end - offset
        return view[offset:end]

    def readinto(self, buffer: Any) -> int:
        target = memoryview(buffer).cast("B")
        chunk = self.read(len(target))
        target[: len(chunk)] = chunk
        return len(chunk)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: len(self)}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._position = base + offset
        return self._position

    def tell(self) -> int:
        return self._position

    def flat(self) -> memoryview:
        """The whole payload as one flat view: of its buffer if it has one, else of a joined copy."""
        return self._views[0] if len(self._views) == 1 else memoryview(b"".join(self._views))


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix/`` -> ("bucket", "some/prefix"); the prefix may be empty."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc:
        raise InvalidArgumentError(f"not an S3 URL: {url!r} (expected s3://BUCKET/PREFIX)")
    prefix = parts.path.strip("/")
    if "//" in prefix or any(p in (".", "..") for p in prefix.split("/") if prefix):
        raise InvalidArgumentError(f"invalid key prefix {prefix!r} in {url!r}")
    return parts.netloc, prefix


def default_addressing(endpoint_url: str | None) -> str | None:
    """Path-style for endpoints given as an IP address or localhost (no DNS names per bucket); else botocore's choice."""
    endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if not endpoint:
        return None
    host = urlsplit(endpoint).hostname or ""
    if host == "localhost":
        return "path"
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return None
    return "path"


# -- errors ---------------------------------------------------------------------------
def error_code(exc: BaseException) -> str:
    """The S3 error code of a botocore ClientError ("" for anything else)."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return ""
    return str(response.get("Error", {}).get("Code", ""))


def http_status(exc: BaseException) -> int:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return 0
    return int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def retry_attempts(exc: BaseException) -> int:
    """How many times botocore retried the request that raised ``exc`` (0 if unknown)."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return 0
    return int(response.get("ResponseMetadata", {}).get("RetryAttempts") or 0)


def is_transport_error(exc: BaseException) -> bool:
    """A connection reset, timeout or truncated body: the request may be retried."""
    from botocore import exceptions as be
    from urllib3 import exceptions as ue

    transport = (be.ConnectionError, be.ConnectionClosedError, be.ReadTimeoutError, be.ConnectTimeoutError,
                 be.IncompleteReadError, be.ResponseStreamingError, ue.ProtocolError, ue.ReadTimeoutError, ConnectionError,
                 TimeoutError)
    return isinstance(exc, transport)


def classify(exc: BaseException, what: str, where: str) -> StorageError:
    """Turn a botocore/urllib3 exception into ckptvault's storage error, with a message saying what to check.

    ``what`` names the object or operation, ``where`` the store (URL and endpoint).
    """
    from botocore import exceptions as be

    if isinstance(exc, StorageError):
        return exc
    code, status = error_code(exc), http_status(exc)
    if isinstance(exc, (be.NoCredentialsError, be.PartialCredentialsError)):
        return PermanentStorageError(
            f"no usable S3 credentials for {where}: {exc}. Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "AWS_PROFILE, or storage_options aws_access_key_id/aws_secret_access_key/profile")
    if code in NOT_FOUND_CODES:
        return ObjectNotFoundError(f"no object {what!r} in {where}")
    if code == "NoSuchBucket":
        return PermanentStorageError(
            f"the bucket of {where} does not exist: check the bucket name, the endpoint and the region, or create it "
            "(storage_options create_bucket=True)")
    if code in CREDENTIAL_CODES:
        return PermanentStorageError(
            f"{where} rejected the credentials ({code}) while accessing {what!r}: check AWS_ACCESS_KEY_ID / "
            "AWS_SECRET_ACCESS_KEY (or the profile), that they belong to this endpoint and region, and the clock")
    if code in DENIED_CODES or status == 403:
        return PermanentStorageError(
            f"access denied ({code or status}) to {what!r} in {where}: check that the credentials' policy allows "
            "s3:GetObject, s3:PutObject, s3:DeleteObject and s3:ListBucket on the bucket and prefix")
    if code in ("PermanentRedirect", "301", "AuthorizationQueryParametersError", "IllegalLocationConstraintException"):
        region = getattr(exc, "response", {}).get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("x-amz-bucket-region")
        hint = f" (the bucket is in {region})" if region else ""
        return PermanentStorageError(f"{where} is in another region{hint}: set region_name or AWS_REGION accordingly")
    if code in FULL_CODES:
        return StorageFullError(f"the store refused to write {what!r} in {where}: {code}. Committed checkpoints are "
                                "intact; free space or raise the quota, then save again")
    if isinstance(exc, be.SSLError) and "certificate verify failed" in str(exc).lower():
        return PermanentStorageError(
            f"the TLS certificate of {where} is not trusted ({_short(exc)}): pass storage_options "
            "verify='/path/to/ca-bundle.pem' with the CA that signed it (or set AWS_CA_BUNDLE), or verify=False to "
            "skip the check")
    if isinstance(exc, (be.EndpointConnectionError, be.ConnectTimeoutError)):  # nothing answered: not our request
        return RetryableStorageError(
            f"transient S3 failure on {what!r} in {where} after retries: {_short(exc)}. Nothing answered at the "
            "endpoint: check the endpoint URL (storage_options endpoint_url, AWS_ENDPOINT_URL or the profile's; host, "
            "port, http or https) and that the S3 service there is running")
    if code in RETRYABLE_CODES or status >= 500 or status == 429 or is_transport_error(exc):
        return RetryableStorageError(f"transient S3 failure on {what!r} in {where} after retries: {_short(exc)}")
    if isinstance(exc, (be.ParamValidationError, be.InvalidRegionError, be.InvalidEndpointConfigurationError)):
        return PermanentStorageError(f"invalid S3 request for {what!r} in {where}: {exc}")
    if isinstance(exc, be.BotoCoreError):
        return PermanentStorageError(f"S3 client error on {what!r} in {where}: {exc}")
    return PermanentStorageError(f"S3 error on {what!r} in {where}: {_short(exc)}")


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) < 300 else text[:297] + "..."


# -- lifecycle rules ---------------------------------------------------------------------
def lifecycle_risks(rules: list[dict[str, Any]], prefix: str) -> list[str]:
    """Descriptions of the enabled lifecycle rules that could expire or archive objects under ``prefix``.

    ``rules`` are the ``Rules`` of a GetBucketLifecycleConfiguration answer. A
    rule is dangerous when it applies to some key under the vault prefix
    (its prefix and the vault's overlap; tag filters never match, since
    ckptvault does not tag objects) and it expires current objects (``Expiration``
    with ``Days`` or ``Date``) or moves them to an archive class that needs a
    restore before reads. Rules that only expire noncurrent versions, delete
    markers or incomplete multipart uploads are safe.
    """
    vault_prefix = prefix + "/" if prefix else ""
    risks = []
    for rule in rules:
        if rule.get("Status") != "Enabled" or not _rule_matches(rule, vault_prefix):
            continue
        name = rule.get("ID") or "(unnamed)"
        expiration = rule.get("Expiration") or {}
        if "Days" in expiration or "Date" in expiration:
            when = f"after {expiration['Days']} days" if "Days" in expiration else f"on {expiration['Date']}"
            risks.append(f"rule {name!r} expires objects {when}")
        for transition in rule.get("Transitions") or []:
            if transition.get("StorageClass") in ARCHIVE_CLASSES:
                risks.append(f"rule {name!r} moves objects to {transition['StorageClass']}, which cannot be read "
                             "without a restore")
    return risks


def _rule_matches(rule: dict[str, Any], vault_prefix: str) -> bool:
    filt = rule.get("Filter")
    if filt is None:
        rule_prefix = rule.get("Prefix", "")
    elif "Tag" in filt or (filt.get("And") or {}).get("Tags"):
        return False
    else:
        rule_prefix = filt.get("Prefix", (filt.get("And") or {}).get("Prefix", ""))
    rule_prefix = rule_prefix or ""
    return rule_prefix.startswith(vault_prefix) or vault_prefix.startswith(rule_prefix)
