"""Disk full during a save, on a real (small) tmpfs mount.

What must hold wherever the space runs out (chunk writes, the manifest commit, the
vault descriptor, directory or inode creation):

* the failing save raises ``StorageFullError`` (also an ``OSError`` with errno ENOSPC)
  whose message says space ran out, where, and what to do;
* the failed step is not listed and no manifest file, whole or partial, exists for it;
* every earlier checkpoint is intact: listed, bit-exact on restore, ``verify`` passes;
* the leftovers are invisible and removable: the failed write removed its own temp file,
  and so did the chunks written before it (a save's chunks are linked into place only once all
  are written, see ``LocalWriteBatch``); any chunk that is there unreferenced is complete, and gc
  (plan with grace 0, then execute) removes exactly those; after freeing space the same save succeeds.

Mounting needs root (CAP_SYS_ADMIN); without it every test here is skipped with that reason.
"""

from __future__ import annotations

import base64
import errno
import os
import random
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ckptvault import CheckpointManager
from ckptvault._format.manifest import manifest_key
from ckptvault.errors import PermanentStorageError, StorageFullError
from ckptvault.stores import LocalStore
from helpers.statedigest import state_digest

CHUNK_SIZE = 128 << 10
NOISE_BYTES = 384 << 10  # incompressible: each save needs about this much new space


# -- the mount ---------------------------------------------------------------------------------------
@contextmanager
def tmpfs(path: Path, size: str, nr_inodes: int | None = None) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` at ``path`` for the duration; skip if mounting is not permitted."""
    if shutil.which("mount") is None or shutil.which("umount") is None:
        pytest.skip("the disk-full tests need the mount and umount commands")
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        pytest.skip("the disk-full tests mount a small tmpfs, which needs root (CAP_SYS_ADMIN)")
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (f",nr_inodes={nr_inodes}" if nr_inodes else "")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {done.stderr.strip() or done.returncode}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path: Path, leave: int = 0) -> Path:
    """Fill the file system holding ``path`` with one file, then give back ``leave`` bytes of it."""
    filler = path / "filler"
    block = b"\xa5" * (64 << 10)
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(block)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
        f.flush()
    if leave:
        os.truncate(filler, max(0, filler.stat().st_size - leave))
    return filler


# -- a real training state ---------------------------------------------------------------------------
class Training:
    """A small MLP with AdamW; each state adds an incompressible ``noise`` tensor, so every save needs new space."""

    def __init__(self, seed: int = 0, small_tensors: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.small = {f"t{i}": torch.full((3,), float(i)) for i in range(small_tensors)}

    def state(self, step: int) -> dict[str, Any]:
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(step))
        loss = self.model(x).square().mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        noise = torch.randint(0, 256, (NOISE_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(step))
        state = {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(), "step": step, "noise": noise}
        if self.small:
            state["small"] = self.small
        return _frozen_copy(state)


def _frozen_copy(state: Any) -> Any:
    """A deep copy, so a state kept for a retry does not change when training goes on."""
    if isinstance(state, dict):
        return {k: _frozen_copy(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_frozen_copy(v) for v in state]
    return state.clone() if isinstance(state, torch.Tensor) else state


# -- checks ------------------------------------------------------------------------------------------
def assert_full_error(exc: BaseException, where: str) -> None:
    """The error type, errno and message a user needs."""
    assert isinstance(exc, StorageFullError) and isinstance(exc, PermanentStorageError), repr(exc)
    assert isinstance(exc, OSError) and exc.errno == errno.ENOSPC, (exc, getattr(exc, "errno", None))
    message = str(exc)
    assert message.startswith("no space left while writing"), message
    assert where in message, f"the message should name {where!r}: {message}"
    assert "Committed checkpoints are intact" in message and "free space" in message and "save again" in message


def save_and_flush(mgr: CheckpointManager, step: int, state: Any, **kwargs: Any) -> None:
    """Save and wait for the commit with ``mgr.wait()``, which raises (once) the error of a failed save, sync or async."""
    handle = mgr.save(step, state, **kwargs)
    try:
        mgr.wait()
    finally:
        assert handle.done()
    assert handle.wait() is not None


def save_until_full(mgr: CheckpointManager, training: Training, first: int, limit: int = 60
                    ) -> tuple[dict[int, str], int, dict[str, Any], StorageFullError]:
    """Save steps first, first+1, ... until one fails. Returns committed digests, the failed step and state, the error."""
    committed: dict[int, str] = {}
    for step in range(first, first + limit):
        state = training.state(step)
        try:
            save_and_flush(mgr, step, state)
        except StorageFullError as exc:
            return committed, step, state, exc
        committed[step] = state_digest(state)
    raise AssertionError(f"{limit} saves fitted: the tmpfs is too large for this test")


def assert_intact(url: Path, committed: dict[int, str], failed: int) -> None:
    """Committed steps listed, bit-exact and verified; nothing of the failed step is visible."""
    with CheckpointManager(url) as mgr:
        assert mgr.steps() == sorted(committed), f"failed step {failed} or a committed one is wrong in {mgr.steps()}"
        assert not (url / manifest_key(failed)).exists(), "a manifest file (maybe partial) exists for the failed step"
        files = sorted(p.name for p in (url / "manifests").iterdir()) if (url / "manifests").exists() else []
        assert files == [Path(manifest_key(s)).name for s in sorted(committed)], f"manifest files {files}"
        for step, digest in committed.items():
            assert state_digest(mgr.restore(step)) == digest, f"step {step} does not restore bit-exactly"
        report = mgr.verify()
        assert report.ok and report.checked == sorted(committed), report.problems


def leftover_chunks(url: Path) -> set[str]:
    """Chunk objects no manifest names (as a chunk or as a delta base); each must be complete (decodes against its name)."""
    with CheckpointManager(url) as mgr:
        named = [c for step in mgr.steps() for c in mgr.manifest(step)["chunks"]]
        referenced = {c["id"] for c in named} | {c["base"] for c in named if c.get("base")}
        present = {i.key.rsplit("/", 1)[-1]: i.key for i in mgr.vault.store.list("chunks/")}
        for cid in set(present) - referenced:
            mgr.vault.read_chunk(cid)  # a partial chunk would raise CorruptChunkError
        return {present[cid] for cid in set(present) - referenced}


def collect_garbage(url: Path, expected: set[str]) -> None:
    """gc with grace 0 removes exactly ``expected`` (falls back to deleting them by hand if there is no gc)."""
    with CheckpointManager(url) as mgr:
        try:
            from ckptvault._maintenance.gc import execute_gc, plan_gc
        except ImportError:
            for key in expected:
                mgr.vault.store.delete(key)
        else:
            plan = plan_gc(mgr.vault, grace=0)
            assert {g.key for g in plan.candidates} == expected
            assert {g.key for g in execute_gc(mgr.vault, plan).deleted} == expected
    assert leftover_chunks(url) == set()


def no_temp_files(url: Path) -> None:
    temps = LocalStore(url).temp_files()
    assert temps == [], f"the failed write left temp files: {temps}"


# -- tests -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_disk_full_during_chunk_writes(tmp_path: Path, async_save: bool) -> None:
    with tmpfs(tmp_path / "mnt", "3m") as mnt:
        url = mnt / "vault"
        training = Training()
        with CheckpointManager(url, chunk_size=CHUNK_SIZE, async_save=async_save) as mgr:
            committed, failed, state, exc = save_until_full(mgr, training, first=1)
        assert len(committed) >= 2, f"only {len(committed)} saves fitted before the disk filled"
        assert_full_error(exc, f"{url}/chunks/")  # the failure hit a chunk write, not the commit
        assert_intact(url, committed, failed)
        no_temp_files(url)
        garbage = leftover_chunks(url)
        assert garbage == set()  # the failed save's chunks were never linked into place
        collect_garbage(url, garbage)
        assert_intact(url, committed, failed)

        with CheckpointManager(url) as mgr:  # free space: drop all but the latest checkpoint, collect, save again
            for step in sorted(committed)[:-1]:
                mgr.delete(step)
                del committed[step]
        collect_garbage(url, leftover_chunks(url))
        with CheckpointManager(url, async_save=async_save) as mgr:
            save_and_flush(mgr, failed, state)
            assert state_digest(mgr.restore(failed)) == state_digest(state)
        committed[failed] = state_digest(state)
        assert_intact(url, committed, failed=failed + 1)


@pytest.mark.parametrize("room", [0, 64 << 10], ids=["no-room", "room-for-part-of-the-manifest"])
@pytest.mark.parametrize("overwrite", [False, True], ids=["new-step", "overwrite"])
def test_disk_full_at_commit(tmp_path: Path, room: int, overwrite: bool) -> None:
    """Every chunk is already stored (same tensors), so the only write that can fail is the manifest's."""
    with tmpfs(tmp_path / "mnt", "4m") as mnt:
        url = mnt / "vault"
        training = Training(small_tensors=1500)
        # random text in the tree: a manifest of about 300 KiB even packed, so `room` cuts it mid-write
        text = base64.b64encode(random.Random(0).randbytes(150_000)).decode()
        state = dict(training.state(1), text=text)
        with CheckpointManager(url, chunk_size=CHUNK_SIZE) as mgr:
            save_and_flush(mgr, 1, state)
        manifest_size = (url / manifest_key(1)).stat().st_size
        assert manifest_size > 2 * room + (64 << 10), f"manifest of {manifest_size} bytes is too small to be cut"
        chunks_before = {i.key for i in LocalStore(url).list("chunks/")}
        filler = fill(mnt, leave=room)

        target = 1 if overwrite else 2
        with CheckpointManager(url) as mgr, pytest.raises(StorageFullError) as caught:
            save_and_flush(mgr, target, state, metrics={"note": 1.0}, overwrite=overwrite)
        assert_full_error(caught.value, str(url / manifest_key(target)))
        assert {i.key for i in LocalStore(url).list("chunks/")} == chunks_before, "the save wrote chunks"
        assert_intact(url, {1: state_digest(state)}, failed=2)
        with CheckpointManager(url) as mgr:
            assert mgr.info(1).metrics == {}, "the old version of step 1 was replaced"
        no_temp_files(url)
        assert leftover_chunks(url) == set()

        filler.unlink()
        with CheckpointManager(url) as mgr:
            save_and_flush(mgr, target, state, metrics={"note": 1.0}, overwrite=overwrite)
            assert mgr.info(target).metrics == {"note": 1.0}
        assert_intact(url, {1: state_digest(state), target: state_digest(state)}, failed=3)


def test_disk_full_creating_the_vault(tmp_path: Path) -> None:
    """The very first save cannot write vault.json: no vault appears, not even a partial descriptor."""
    with tmpfs(tmp_path / "mnt", "1m") as mnt:
        url = mnt / "vault"
        filler = fill(mnt)
        state = Training().state(1)
        with CheckpointManager(url) as mgr, pytest.raises(StorageFullError) as caught:
            save_and_flush(mgr, 1, state)
        assert_full_error(caught.value, str(url / "vault.json"))
        assert not (url / "vault.json").exists()
        with CheckpointManager(url) as mgr:
            assert mgr.vault.descriptor() is None and mgr.steps() == []
        no_temp_files(url)

        filler.unlink()
        with CheckpointManager(url) as mgr:
            save_and_flush(mgr, 1, state)
        assert_intact(url, {1: state_digest(state)}, failed=2)


@pytest.mark.parametrize("inodes", [22, 25, 46, 64])  # fails at: mkdir, link(2) of a chunk, the manifest, a temp file
def test_out_of_inodes(tmp_path: Path, inodes: int) -> None:
    """ENOSPC from file or directory creation (inode table full) is handled like a full disk."""
    with tmpfs(tmp_path / "mnt", "64m", nr_inodes=inodes) as mnt:
        url = mnt / "vault"
        with CheckpointManager(url, chunk_size=CHUNK_SIZE) as mgr:
            committed, failed, state, exc = save_until_full(mgr, Training(), first=1)
        assert_full_error(exc, str(url))
        print(f"{inodes} inodes: {len(committed)} saves fitted; failed with: {exc}")
        if (url / "vault.json").exists():
            assert_intact(url, committed, failed)
            collect_garbage(url, leftover_chunks(url))
            assert_intact(url, committed, failed)
        no_temp_files(url)
