"""A real S3 server for the tests: Ceph RADOS Gateway on 127.0.0.1, started by ``scripts/ceph-rgw.sh``.

Load the fixtures in a test module with::

    pytest_plugins = ["conftest_s3"]

* ``rgw`` (session): a :class:`Gateway` (endpoint, keys, ``options()`` for
  storage_options, ``env()`` for subprocesses, and ``tls_options()`` for the
  same gateway over https with its self-signed certificate). The gateway starts once per
  test process (the first test that needs it pays ~3-10 s, plus the apt-get
  install of Ceph on a fresh machine) and is stopped at exit; a watchdog of the
  script stops it too if the process is killed.
* ``s3_url``: ``s3://ckv-tests/<unique prefix>``, a vault location no other test uses.

Set ``CKV_S3_ENDPOINT``, ``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY`` to
test against another S3 service instead (the bucket ``ckv-tests`` is created).
When the gateway cannot start, tests that need it are skipped with the
reason, except in CI (``CI=true``), where that is a failure.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "ceph-rgw.sh"
BUCKET = "ckv-tests"
START_TIMEOUT_S = 600  # includes apt-get update + install on a fresh machine


@dataclass(frozen=True)
class Gateway:
    endpoint: str
    access_key: str
    secret_key: str
    state_dir: str | None  # None for an external service
    tls_endpoint: str | None = None  # the same gateway over https (None for an external service)
    ca_file: str | None = None  # the CA bundle that verifies tls_endpoint's certificate

    def options(self, **extra: Any) -> dict[str, Any]:
        """storage_options for an S3Store on this gateway."""
        return {"endpoint_url": self.endpoint, "aws_access_key_id": self.access_key,
                "aws_secret_access_key": self.secret_key, "region_name": "us-east-1", **extra}

    def tls_options(self, **extra: Any) -> dict[str, Any]:
        """storage_options for an S3Store on this gateway over https (skips the test without one)."""
        if self.tls_endpoint is None:
            pytest.skip("the external S3 service has no https endpoint configured for the tests")
        return self.options(**{"endpoint_url": self.tls_endpoint, "verify": self.ca_file, **extra})

    def env(self) -> dict[str, str]:
        """Environment for a subprocess (the CLI) that should reach this gateway through the standard variables."""
        return {**os.environ, "AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_DEFAULT_REGION": "us-east-1"}

    def client(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key, region_name="us-east-1",
                            config=Config(request_checksum_calculation="when_required",
                                          response_checksum_validation="when_required"))


_lock = threading.Lock()
_gateway: Gateway | None = None
_failure: str | None = None


def _start() -> Gateway:
    external = os.environ.get("CKV_S3_ENDPOINT")
    if external:
        return Gateway(external, os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"], None)
    env = {**os.environ, "CKV_RGW_PARENT_PID": str(os.getpid())}
    proc = subprocess.run([str(SCRIPT), "start"], capture_output=True, text=True, timeout=START_TIMEOUT_S, env=env,
                          check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{SCRIPT.name} start exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    env_file = Path(proc.stdout.strip().splitlines()[-1])
    values = dict(line.split("=", 1) for line in env_file.read_text().splitlines() if "=" in line)
    values = {k: v.strip().strip('"') for k, v in values.items()}
    state_dir = values["CKV_RGW_DIR"]
    atexit.register(_stop, state_dir)
    return Gateway(values["CKV_S3_ENDPOINT"], values["AWS_ACCESS_KEY_ID"], values["AWS_SECRET_ACCESS_KEY"], state_dir,
                   values["CKV_S3_TLS_ENDPOINT"], values["CKV_S3_CA"])


def _stop(state_dir: str) -> None:
    subprocess.run([str(SCRIPT), "stop", state_dir], capture_output=True, timeout=60, check=False)


def gateway() -> Gateway:
    """The process-wide gateway, started on first use, with the test bucket created."""
    global _gateway, _failure
    with _lock:
        if _gateway is None and _failure is None:
            try:
                gw = _start()
                _ensure_bucket(gw)
                _gateway = gw
            except Exception as exc:  # noqa: BLE001 - reported by the fixture below
                _failure = f"{type(exc).__name__}: {exc}"
        if _gateway is None:
            message = f"cannot start the Ceph RGW S3 gateway ({SCRIPT}): {_failure}"
            if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
                pytest.fail(message, pytrace=False)
            pytest.skip(message)
        return _gateway


def _ensure_bucket(gw: Gateway) -> None:
    client = gw.client()
    try:
        client.create_bucket(Bucket=BUCKET)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass


@pytest.fixture(scope="session")
def rgw() -> Gateway:
    return gateway()


@pytest.fixture
def s3_url(rgw: Gateway) -> str:
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"
