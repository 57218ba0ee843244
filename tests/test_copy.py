"""``ckptvault cp`` and ckptvault._maintenance.copy: copies send only missing chunks, keep deltas, commit each step atomically;
and the other CLI commands on an s3:// URL (real Ceph RGW, tests/conftest_s3.py)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptvault import CheckpointManager
from ckptvault._maintenance.copy import copy_checkpoints
from ckptvault.errors import StepExistsError, StepNotFoundError, StorageError
from ckptvault.stores import LocalStore
from ckptvault.testing.faults import FaultyStore
from conftest import assert_same_state

pytest.register_assert_rewrite("conftest_s3")
from conftest_s3 import Gateway  # noqa: E402

pytest_plugins = ["conftest_s3"]  # fixtures rgw (the gateway), s3_url

CHUNK = 64 << 10


def _states() -> dict[int, dict[str, Any]]:
    """Three checkpoints of a real model with a frozen part: later ones reuse chunks and store deltas."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    frozen = torch.randn(200_000, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    out = {}
    for step in (10, 20, 30):
        model(torch.randn(8, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        out[step] = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(), "frozen": frozen})
    return out


@pytest.fixture(scope="module")
def states() -> dict[int, dict[str, Any]]:
    return _states()


def _save(url: str | Path, states: dict[int, dict[str, Any]], steps: tuple[int, ...], **options: Any) -> None:
    with CheckpointManager(url, chunk_size=CHUNK, **options) as mgr:
        for step in steps:
            mgr.save(step, states[step]).wait()


def test_copy_sends_only_missing_chunks(tmp_path: Path, states: dict[int, dict[str, Any]]) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    _save(src, states, (10, 20))
    plan, result = copy_checkpoints(src, dst)
    assert result is not None and result.copied == [10, 20] and plan.skipped == []
    stored = {info.key: info.size for info in LocalStore(src).list("chunks/")}
    assert result.chunks_sent == len(stored) and result.bytes_sent == sum(stored.values())

    plan, again = copy_checkpoints(src, dst)  # everything is there: nothing is sent
    assert again is not None and again.copied == [] and again.bytes_sent == 0 and plan.skipped == [10, 20]

    _save(src, states, (30,))  # a new incremental checkpoint: only what it added travels
    with CheckpointManager(src) as mgr:
        added = mgr.info(30).added_bytes
        assert any("base" in c for c in mgr.manifest(30)["chunks"])
    plan, third = copy_checkpoints(src, dst)
    assert third is not None and third.copied == [30] and third.bytes_sent == added and plan.reuse > 0
    with CheckpointManager(dst) as mgr:
        assert mgr.steps() == [10, 20, 30]
        for step in (10, 20, 30):
            assert_same_state(states[step], mgr.restore(step))
        assert mgr.verify().ok
    assert LocalStore(dst).get("vault.json") == LocalStore(src).get("vault.json")


def test_copying_one_delta_step_brings_its_bases(tmp_path: Path, states: dict[int, dict[str, Any]]) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    _save(src, states, (10, 20, 30))
    _, result = copy_checkpoints(src, dst, [30], verify=True)
    assert result is not None and result.copied == [30] and result.verified
    with CheckpointManager(dst) as mgr:
        assert mgr.steps() == [30]
        assert_same_state(states[30], mgr.restore(30))


def test_conflicts_missing_steps_and_overwrite(tmp_path: Path, states: dict[int, dict[str, Any]]) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    _save(src, states, (10, 20))
    _save(dst, states, (20,))  # same step, other bytes (another time stamp in its manifest)
    with pytest.raises(StepExistsError, match="step 20 is already committed in .*dst"):
        copy_checkpoints(src, dst)
    with pytest.raises(StepNotFoundError, match="step 7 has no committed checkpoint in .*src; committed steps: 10, 20"):
        copy_checkpoints(src, dst, [7])
    _, result = copy_checkpoints(src, dst, overwrite=True)
    assert result is not None and result.copied == [10, 20]
    assert LocalStore(dst).get("manifests/00000000000000000020.json") == LocalStore(src).get(
        "manifests/00000000000000000020.json")


def test_an_interrupted_copy_commits_nothing_partial_and_resumes(tmp_path: Path, states: dict[int, dict[str, Any]]) -> None:
    src = tmp_path / "src"
    _save(src, states, (10, 20))
    inner = LocalStore(tmp_path / "dst")
    faulty = FaultyStore(inner, fail=0.5, methods=("put_if_absent",), keys=("chunks/",), seed=2)
    with pytest.raises(StorageError, match="injected fault"):
        copy_checkpoints(src, faulty)
    with CheckpointManager(inner) as mgr:  # whatever was committed before the fault is complete
        committed = mgr.steps()
        assert committed != [10, 20]
        for step in committed:
            assert_same_state(states[step], mgr.restore(step))
    faulty.enabled = False
    _, result = copy_checkpoints(src, faulty)
    assert result is not None and result.copied and set(CheckpointManager(inner).steps()) == {10, 20}
    with CheckpointManager(inner) as mgr:
        assert_same_state(states[20], mgr.restore(20))


# -- the CLI, to and on an S3 vault ---------------------------------------------------------
def cli(*args: object, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in env.items() if not k.startswith("TQDM_")}
    return subprocess.run([sys.executable, "-m", "ckptvault", *map(str, args)], capture_output=True, text=True,
                          timeout=180, env=env)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="drop-behind needs posix_fadvise")
def test_cp_storage_options_reach_the_destination_and_bad_ones_fail(tmp_path: Path,
                                                                    states: dict[int, dict[str, Any]]) -> None:
    """--dst-option reaches the destination's store: with drop_behind=false its chunks stay in the page cache,
    by default they do not (tests/test_drop_behind.py). Bad options (--src-option or --dst-option) fail in one
    line, before anything is created."""
    from helpers.page_cache import cached_pages, drops_observable  # mincore through ctypes: Linux

    if not drops_observable(tmp_path):
        pytest.skip(f"the file system of {tmp_path} does not show page cache drops")
    src = tmp_path / "src"
    _save(src, states, (10,))
    env = dict(os.environ)
    for dst, extra, cached in ((tmp_path / "kept", ["--dst-option", "drop_behind=false"], True),
                               (tmp_path / "dropped", [], False)):
        done = cli("cp", src, dst, *extra, env=env)
        assert done.returncode == 0, done.stderr
        chunks = [p for p in (dst / "chunks").rglob("*") if p.is_file()]
        assert chunks and all((cached_pages(p) > 0) is cached for p in chunks), dst
    bad = cli("cp", src, tmp_path / "x", "--src-option", "bogus=1", env=env)
    assert bad.returncode == 2 and "unknown storage_options for local vaults: ['bogus']" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr and not (tmp_path / "x").exists()
    malformed = cli("cp", src, tmp_path / "x", "--dst-option", "drop_behind", env=env)
    assert malformed.returncode == 2 and "'drop_behind' is not KEY=VALUE" in malformed.stderr, malformed.stderr
    wrong = cli("cp", src, tmp_path / "x", "--dst-option", "drop_behind=sometimes", env=env)
    assert wrong.returncode == 2 and "drop_behind must be true or false, got 'sometimes'" in wrong.stderr, wrong.stderr


def test_cp_local_to_s3_then_cli_commands_on_the_s3_vault(tmp_path: Path, states: dict[int, dict[str, Any]], rgw: Gateway,
                                                           s3_url: str) -> None:
    src = tmp_path / "src"
    _save(src, states, (10, 20, 30))
    env = rgw.env()
    first = cli("cp", src, s3_url, "--steps", "10-20", "--progress", "--json", env=env)
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)
    assert report["copied"] == [10, 20] and report["chunks_sent"] > 0 and report["bytes_sent"] == report["bytes_to_send"]
    assert f"sending to {s3_url}" in first.stderr  # the progress bar

    second = cli("cp", src, s3_url, "--json", env=env)
    report = json.loads(second.stdout)
    assert second.returncode == 0 and report["copied"] == [30] and report["skipped"] == [10, 20]
    with CheckpointManager(src) as mgr:
        assert report["bytes_sent"] == mgr.info(30).added_bytes  # only what step 30 added
    third = cli("cp", src, s3_url, env=env)
    assert third.returncode == 0 and "copied 0 checkpoints (none)" in third.stdout and "0 chunks sent (0 B)" in third.stdout
    assert "3 already in the destination: (10, 20, 30)" in third.stdout

    listing = json.loads(cli("ls", s3_url, "--json", env=env).stdout)
    assert [c["step"] for c in listing["checkpoints"]] == [10, 20, 30]
    assert cli("verify", s3_url, env=env).returncode == 0
    assert cli("rm", s3_url, "10", env=env).returncode == 0
    gc = cli("gc", s3_url, "--grace", "0", "--json", env=env)
    assert gc.returncode == 0 and json.loads(gc.stdout)["removed"], gc.stdout + gc.stderr
    with CheckpointManager(s3_url, storage_options=rgw.options()) as mgr:
        assert mgr.steps() == [20, 30]
        assert_same_state(states[30], mgr.restore(30))

    back = tmp_path / "back"  # and back from S3 to a local vault
    assert cli("cp", s3_url, back, env=env).returncode == 0
    with CheckpointManager(back) as mgr:
        assert mgr.steps() == [20, 30]
        assert_same_state(states[20], mgr.restore(20))


def test_cli_storage_option_gives_the_s3_endpoint(rgw: Gateway, s3_url: str) -> None:
    """With no endpoint in the environment, ``--storage-option endpoint_url=...`` before the command finds the
    gateway (without it the command would go to AWS)."""
    with CheckpointManager(s3_url, storage_options=rgw.options()) as mgr:
        mgr.save(1, {"w": torch.arange(1000, dtype=torch.float32)}).wait()
    env = {k: v for k, v in rgw.env().items() if k not in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")}
    done = cli("--storage-option", f"endpoint_url={rgw.endpoint}", "--storage-option", "addressing_style=path",
               "ls", s3_url, "--json", env=env)
    assert done.returncode == 0, done.stderr
    assert [c["step"] for c in json.loads(done.stdout)["checkpoints"]] == [1]


def test_cli_on_s3_reports_bad_credentials_in_one_line(rgw: Gateway, s3_url: str) -> None:
    env = {**rgw.env(), "AWS_SECRET_ACCESS_KEY": "wrong"}
    done = cli("ls", s3_url, env=env)
    assert done.returncode == 3
    assert done.stderr.startswith("error: ") and "rejected the credentials (SignatureDoesNotMatch)" in done.stderr
    assert "Traceback" not in done.stderr
    env = {k: v for k, v in rgw.env().items() if k != "AWS_ENDPOINT_URL"} | {"AWS_ENDPOINT_URL": rgw.endpoint}
    missing = cli("ls", "s3://ckv-no-such-bucket/x", env=env)
    assert missing.returncode == 3 and "does not exist" in missing.stderr and os.linesep not in missing.stderr.strip()


def test_cp_refuses_steps_it_cannot_parse_and_a_reversed_range(tmp_path: Path, states: dict[int, dict[str, Any]]) -> None:
    src = tmp_path / "src"
    _save(src, states, (10, 20))
    for steps, message in (("x", "'x' is not a step, a list (100,200) or a range (100-500)"),
                           ("20-10", "range 20-10 is empty: write the lower step first (10-20)")):
        result = cli("cp", src, tmp_path / "dst", "--steps", steps, env=dict(os.environ))
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert not (tmp_path / "dst").exists()
    assert cli("cp", src, tmp_path / "dst", "--steps", "10-20", env=dict(os.environ)).returncode == 0
    with CheckpointManager(tmp_path / "dst") as mgr:
        assert mgr.steps() == [10, 20]
