"""kill -9 of a saving process at random moments: committed checkpoints survive, nothing partial shows.

A saver process (tests/helpers/saver.py) trains a small GPT with AdamW and saves a
checkpoint after every step, logging ``begin STEP DIGEST`` before each save and
``committed STEP DIGEST`` after ``.wait()`` (fsynced). The test SIGKILLs it at a
random moment, then checks the vault against the log:

* every step logged as committed is listed and restores to exactly its digest;
* the one step begun but not logged (its commit may have raced the kill) is either
  absent or present and complete with its digest; no other step is visible;
* with ``overwrite=True`` the step holds the old or the new version, complete;
* ``verify`` passes, and every object under ``chunks/`` decodes against its name
  (a crash leaves unreferenced garbage and ``tmp/*.part`` files, never a partial object).

One vault is reused across trials, so later saves dedup against chunks that
killed saves left behind. The random choices are seeded; the seed is printed and
named in every failure (rerun with CKPTVAULT_CRASH_SEED=<seed>).
"""

from __future__ import annotations

import os
import random
import select
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptvault
from ckptvault import CheckpointManager
from ckptvault._format.chunk_object import chunk_key
from helpers.statedigest import state_digest

HELPERS = Path(__file__).parent / "helpers"
SAVER = HELPERS / "saver.py"
CHUNK_SIZE = 256 << 10
IO_TIMEOUT = 120.0


# -- the saver's log -------------------------------------------------------------------------------
@dataclass
class SaverLog:
    """What a saver logged: its commits in order and the save it had begun when it died."""

    ready: bool = False
    committed: list[tuple[int, str]] = field(default_factory=list)
    inflight: tuple[int, str] | None = None
    begins: int = 0
    errors: list[str] = field(default_factory=list)
    durations: list[float] = field(default_factory=list)
    begin_times: list[float] = field(default_factory=list)
    returns: int = 0  # "returned" lines (overlap mode: save() returned, the background writes)
    inflight_returned: bool = False  # the save in flight had returned: a kill now hits its background phase
    background: list[float] = field(default_factory=list)  # seconds from "returned" to "committed"


def read_log(path: Path) -> SaverLog:
    """Parse complete lines only (a kill may cut the last one)."""
    log = SaverLog()
    text = path.read_text() if path.exists() else ""
    begun_at = returned_at = 0.0
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        words = line.split()
        if words[0] == "ready":
            log.ready = True
        elif words[0] == "begin":
            log.inflight, begun_at = (int(words[1]), words[2]), float(words[3])
            log.begins += 1
            log.begin_times.append(begun_at)
            log.inflight_returned = False
        elif words[0] == "returned":
            assert log.inflight == (int(words[1]), words[2]), f"log returns {words[1:3]} but had begun {log.inflight}"
            log.returns += 1
            log.inflight_returned, returned_at = True, float(words[3])
        elif words[0] == "committed":
            entry = (int(words[1]), words[2])
            assert log.inflight == entry, f"log commits {entry} but had begun {log.inflight}"
            log.committed.append(entry)
            log.durations.append(float(words[3]) - begun_at)
            if log.inflight_returned:
                log.background.append(float(words[3]) - returned_at)
            log.inflight, log.inflight_returned = None, False
        elif words[0] == "error":
            log.errors.append(line)
    return log


def wait_for(path: Path, predicate, what: str, timeout: float = IO_TIMEOUT) -> SaverLog:  # type: ignore[no-untyped-def]
    """Poll the log until ``predicate(log)`` holds."""
    deadline = time.monotonic() + timeout
    last_size = -1
    while True:
        size = path.stat().st_size if path.exists() else 0
        if size != last_size:
            last_size = size
            log = read_log(path)
            assert not log.errors, f"saver failed: {log.errors[0]}"
            if predicate(log):
                return log
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what} in {path}")
        time.sleep(0.002)


# -- the fork server ---------------------------------------------------------------------------------
class SaverServer:
    """``saver.py serve``: imports torch once, forks a saver per trial (see the helper's docstring)."""

    def __init__(self) -> None:
        # no GPU for the server: its warm-up backward would start autograd's device threads, after which a forked
        # child's backward fails ("Unable to handle autograd's threading in combination with fork-based ...")
        env = dict(os.environ, PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
        self.proc = subprocess.Popen([sys.executable, str(SAVER), "serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        assert self._reply() == "serving"

    def _reply(self) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], IO_TIMEOUT)
        assert ready, "saver server did not answer"
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        assert line, f"saver server exited with {self.proc.wait()}"
        return line.strip()

    def _ask(self, *words: object) -> str:
        self.proc.stdin.write(" ".join(map(str, words)) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self._reply()

    def start(self, vault: Path, log: Path, start: int, overwrite: int, trial: int, mode: str = "wait") -> int:
        return int(self._ask("run", vault, log, start, 100000, overwrite, trial, CHUNK_SIZE, mode))

    def reap(self, pid: int) -> str:
        return self._ask("wait", pid)

    def close(self) -> None:
        try:
            self._ask("quit") if self.proc.poll() is None else None
        except (AssertionError, BrokenPipeError, OSError):
            pass
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()


# -- trials ------------------------------------------------------------------------------------------
STRATEGIES = ("uniform", "in-save", "near-commit", "between-saves")


@dataclass
class Campaign:
    """State carried across trials on one vault: what must be there, and what was already checked."""

    vault: Path
    seed: int
    rng: random.Random
    expected: dict[int, str] = field(default_factory=dict)
    checked_chunks: set[str] = field(default_factory=set)
    durations: list[float] = field(default_factory=lambda: [0.15])
    cycles: list[float] = field(default_factory=lambda: [0.2])
    outcomes: Counter = field(default_factory=Counter)

    def save_time(self) -> float:
        """Median time from ``begin`` to ``committed`` of recent saves."""
        return statistics.median(self.durations[-20:])

    def cycle_time(self) -> float:
        """Median time from one ``begin`` to the next (train step + digest + save)."""
        return statistics.median(self.cycles[-20:])


def kill_at_random(path: Path, pid: int, campaign: Campaign, strategy: str, overwrite: bool) -> str:
    """Let 0-3 saves commit (at least 1 to overwrite), then pick a moment by ``strategy`` and SIGKILL the saver.

    Returns a description of the moment.
    """
    rng = campaign.rng
    warmup = rng.randint(1 if overwrite else 0, 3)
    first = wait_for(path, lambda log: log.ready and len(log.committed) >= warmup, f"{warmup} commits")
    t = campaign.save_time()
    if strategy == "uniform":
        delay = rng.uniform(0, 2 * campaign.cycle_time())
    elif strategy == "between-saves":
        wait_for(path, lambda log: len(log.committed) > len(first.committed), "a commit")
        delay = rng.uniform(0, 0.01)
    else:
        wait_for(path, lambda log: log.begins > first.begins, "a save to begin")
        delay = rng.uniform(0, t) if strategy == "in-save" else rng.uniform(0.75 * t, 1.05 * t)
    time.sleep(delay)
    os.kill(pid, signal.SIGKILL)
    return f"{strategy} +{delay:.4f}s after commit {warmup} (save time ~{t:.3f}s)"


def run_trial(server: SaverServer, campaign: Campaign, trial: int, tmp: Path) -> None:
    overwrite = trial % 3 == 2
    strategy = STRATEGIES[trial % len(STRATEGIES)]
    start = trial * 1000
    path = tmp / f"trial-{trial}.log"
    temps_before = _temp_count(campaign.vault)
    pid = server.start(campaign.vault, path, start, start if overwrite else -1, trial)
    moment = kill_at_random(path, pid, campaign, strategy, overwrite)
    status = server.reap(pid)
    log = read_log(path)
    ctx = f"seed {campaign.seed}, trial {trial} ({'overwrite' if overwrite else 'append'}, kill {moment})"
    print(ctx, f"-> {len(log.committed)} committed, in flight {log.inflight}")
    assert not log.errors, f"{ctx}: the saver failed: {log.errors}"
    assert status == "signal 9", f"{ctx}: saver ended with {status}, not by SIGKILL"
    campaign.durations.extend(log.durations)
    campaign.cycles.extend(b - a for a, b in zip(log.begin_times, log.begin_times[1:]))
    outcome = check_against_log(campaign, log, ctx, full_verify=trial % 8 == 7)
    campaign.outcomes[outcome] += 1
    if _temp_count(campaign.vault) > temps_before:
        campaign.outcomes["left tmp/*.part (killed mid-write)"] += 1


def check_against_log(campaign: Campaign, log: SaverLog, ctx: str, full_verify: bool = True) -> str:
    """The vault holds every committed step of the log bit-exactly, the in-flight one whole or not at all."""
    allowed: dict[int, set[str]] = {}
    for step, digest in log.committed:
        campaign.expected[step] = digest
    for step, digest in campaign.expected.items():
        allowed[step] = {digest}
    if log.inflight:
        allowed.setdefault(log.inflight[0], set()).add(log.inflight[1])
    with CheckpointManager(campaign.vault) as mgr:
        listed = set(mgr.steps())
        missing = sorted(set(campaign.expected) - listed)
        assert not missing, f"{ctx}: committed steps {missing} are not listed"
        unexpected = sorted(listed - set(allowed))
        assert not unexpected, f"{ctx}: steps {unexpected} are visible but were never committed"
        touched = {step for step, _ in log.committed} | ({log.inflight[0]} if log.inflight else set())
        outcome = "killed between saves"
        for step in sorted(touched & listed):
            got = state_digest(mgr.restore(step))
            assert got in allowed[step], f"{ctx}: step {step} restores to {got}, expected one of {allowed[step]}"
            if log.inflight and step == log.inflight[0] and got == log.inflight[1]:
                outcome = "in-flight save committed before the kill"
            campaign.expected[step] = got
        if log.inflight and outcome == "killed between saves":
            outcome = "in-flight save lost (not visible)"
        for step in sorted(touched & listed):
            report = mgr.verify(step)
            assert report.ok, f"{ctx}: verify of step {step} failed: {report.problems}"
        if full_verify:
            report = mgr.verify()
            assert report.ok and sorted(report.checked) == sorted(listed), f"{ctx}: verify failed: {report.problems}"
        _check_every_chunk_whole(mgr, campaign, ctx)
    return outcome


def _check_every_chunk_whole(mgr: CheckpointManager, campaign: Campaign, ctx: str) -> None:
    """Every chunk object, referenced or not, decodes and matches its name: none is partial."""
    for info in mgr.vault.store.list("chunks/"):
        cid = info.key.rsplit("/", 1)[-1]
        if cid in campaign.checked_chunks:
            continue
        assert info.key == chunk_key(cid), f"{ctx}: stray object {info.key}"
        mgr.vault.read_chunk(cid)  # raises CorruptChunkError on a partial or damaged object
        campaign.checked_chunks.add(cid)


def _temp_count(vault: Path) -> int:
    tmp = vault / "tmp"
    return len(os.listdir(tmp)) if tmp.is_dir() else 0


def finish_campaign(campaign: Campaign) -> None:
    """Leftovers are invisible and removable by gc; afterwards every committed step still verifies and restores."""
    with CheckpointManager(campaign.vault) as mgr:
        store = mgr.vault.store
        temps = store.temp_files()
        assert all(t.key.startswith("tmp/") and t.key.endswith(".part") for t in temps)
        assert not [i for i in store.list() if i.key.startswith("tmp/")], "list() shows temporary files"
        referenced = {c["id"] for step in mgr.steps() for c in mgr.manifest(step)["chunks"]}
        garbage = [i.key for i in store.list("chunks/") if i.key.rsplit("/", 1)[-1] not in referenced]
        remove_leftovers(mgr, {t.key for t in temps} | set(garbage))
        assert store.temp_files() == []  # type: ignore[attr-defined]
        assert {i.key.rsplit("/", 1)[-1] for i in store.list("chunks/")} == referenced
        assert sorted(mgr.steps()) == sorted(campaign.expected)
        report = mgr.verify()
        assert report.ok, f"seed {campaign.seed}: verify after removing leftovers: {report.problems}"
        for step in campaign.rng.sample(sorted(campaign.expected), min(3, len(campaign.expected))):
            assert state_digest(mgr.restore(step)) == campaign.expected[step], f"seed {campaign.seed}: step {step}"
    print(f"seed {campaign.seed}: removed {len(temps)} temp files and {len(garbage)} unreferenced chunks; "
          f"outcomes {dict(campaign.outcomes)}")


def remove_leftovers(mgr: CheckpointManager, leftovers: set[str]) -> None:
    """Delete exactly ``leftovers`` (temp files and unreferenced chunks) with gc, or by hand if there is no gc."""
    try:
        from ckptvault._maintenance.gc import execute_gc, plan_gc
    except ImportError:
        for key in leftovers:
            mgr.vault.store.delete(key)
        return
    plan = plan_gc(mgr.vault, grace=0)
    assert {g.key for g in plan.candidates} == leftovers, "gc's plan differs from the leftovers of the killed saves"
    result = execute_gc(mgr.vault, plan)
    assert {g.key for g in result.deleted} == leftovers


def run_campaign(tmp_path: Path, trials: int) -> Campaign:
    seed = int(os.environ.get("CKPTVAULT_CRASH_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"crash campaign seed {seed} (rerun with CKPTVAULT_CRASH_SEED={seed})")
    campaign = Campaign(tmp_path / "vault", seed, random.Random(seed))
    server = SaverServer()
    try:
        for trial in range(trials):
            run_trial(server, campaign, trial, tmp_path)
    finally:
        server.close()
    finish_campaign(campaign)
    return campaign


# -- tests -------------------------------------------------------------------------------------------
def test_kill_nine_at_random_moments(tmp_path: Path) -> None:
    """SIGKILL mid-save: exactly the committed manifests are listed, each restoring to its digest (DESIGN M1, M2)."""
    campaign = run_campaign(tmp_path, trials=24)
    assert campaign.expected, "no trial committed anything: the kills came too early to test anything"
    assert sum(campaign.outcomes[o] for o in ("killed between saves", "in-flight save lost (not visible)",
                                               "in-flight save committed before the kill")) == 24


@pytest.mark.slow
def test_kill_nine_many_trials(tmp_path: Path) -> None:
    campaign = run_campaign(tmp_path, trials=240)
    lost = campaign.outcomes["in-flight save lost (not visible)"]
    between = campaign.outcomes["killed between saves"]
    assert lost and between, f"kills did not land both inside and between saves: {dict(campaign.outcomes)}"


def test_kill_standalone_saver_process(tmp_path: Path) -> None:
    """The reproduction path: ``python tests/helpers/saver.py run VAULT LOG``, killed during its saves."""
    vault, path = tmp_path / "vault", tmp_path / "saver.log"
    proc = subprocess.Popen([sys.executable, str(SAVER), "run", str(vault), str(path), "--start", "10"])
    try:
        wait_for(path, lambda log: len(log.committed) >= 2, "two commits")
        seed = random.SystemRandom().randrange(1 << 32)
        delay = random.Random(seed).uniform(0, 0.3)
        print(f"standalone kill after the second commit + {delay:.4f}s (seed {seed})")
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        assert proc.wait() == -signal.SIGKILL
    campaign = Campaign(vault, seed, random.Random(seed))
    check_against_log(campaign, read_log(path), f"standalone saver, kill +{delay:.4f}s")
    assert len(campaign.expected) >= 2


def test_folders_a_put_creates_are_fsynced_into_their_parents(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where there is no syncfs, a first save makes each new folder's name durable in its parent (fsync of the
    parent), as the manifest inside it is (DESIGN M1)."""
    import ckptvault.stores.local as local

    monkeypatch.setattr(local, "_syncfs", None)
    synced: list[Path] = []
    real = local._fsync_dir
    monkeypatch.setattr(local, "_fsync_dir", lambda path: (synced.append(Path(path)), real(path))[1])
    root = tmp_path / "deep" / "vault"
    ckptvault.save({"w": torch.ones(4)}, root, step=1)
    assert tmp_path in synced and root.parent in synced  # "deep" and "vault" were made by the first put
    assert root in synced  # manifests/ (and vault.json) named in the vault folder
    assert root / "manifests" in synced  # the manifest named in manifests/
    assert ckptvault.load(root, 1)["w"].tolist() == [1.0] * 4


def test_a_first_save_names_its_new_folders_durably_with_syncfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With syncfs, one sync makes the names of every folder a put made durable (vault.json's: the vault folder
    and its parents), and the batch's syncs those of manifests/ and chunks/<xx>: a save into a new vault makes
    five syncs, and each new folder is made before a sync that precedes the manifest's link."""
    import ckptvault.stores.local as local

    if local._syncfs is None:
        pytest.skip("needs syncfs (Linux 5.8+)")
    events: list[str] = []
    real_syncfs, real_fsync, real_link, real_mkdir = local._syncfs, os.fsync, os.link, os.mkdir
    monkeypatch.setattr(local, "_syncfs", lambda fd: (events.append("sync"), real_syncfs(fd))[1])
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("sync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "link", lambda a, b, *x, **k: (events.append(f"link {Path(b).parent.name}"),
                                                            real_link(a, b, *x, **k))[1])
    monkeypatch.setattr(os, "mkdir", lambda p, *a, **k: (events.append(f"mkdir {Path(p).name}"),
                                                          real_mkdir(p, *a, **k))[1])
    root = tmp_path / "deep" / "vault"
    w = torch.randn(300_000)
    ckptvault.save({"w": w, "step": 1}, root, step=1)
    assert events.count("sync") == 5
    manifest_link = events.index("link manifests")
    assert events[manifest_link + 1:] == ["sync"] and events[manifest_link - 1] == "sync"
    last_mkdir = max(i for i, e in enumerate(events) if e.startswith("mkdir"))
    assert "sync" in events[last_mkdir:manifest_link]
    assert "sync" in events[events.index("link vault"):events.index("mkdir manifests")]  # vault.json named durably
    assert torch.equal(ckptvault.load(root, 1)["w"], w)


def test_a_save_syncs_its_chunks_names_and_then_its_manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The order a crash can rely on (DESIGN M1, M2), and its price: a save into an existing vault makes three
    syncs, the chunk and manifest bytes (syncfs), the chunk names (syncfs), the manifest's name (its folder's
    fsync); the manifest is linked only after the chunks' names are durable. A save that writes no chunk makes
    two: its manifest's fsync and its folder's."""
    import ckptvault.stores.local as local

    if local._syncfs is None:
        pytest.skip("write batches need syncfs (Linux 5.8+)")
    root = tmp_path / "vault"
    state = {"w": torch.randn(300_000), "b": torch.randn(1_000), "step": 1}
    ckptvault.save(state, root, step=1)
    events: list[str] = []
    real_syncfs, real_fsync, real_link = local._syncfs, os.fsync, os.link

    def syncfs(fd: int) -> int:
        events.append("syncfs")
        return real_syncfs(fd)

    def fsync(fd: int) -> None:
        events.append("fsync")
        real_fsync(fd)

    def link(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        events.append("link manifest" if Path(dst).parent.name == "manifests" else "link chunk")
        real_link(src, dst, *args, **kwargs)

    monkeypatch.setattr(local, "_syncfs", syncfs)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "link", link)
    state["w"] += 1
    ckptvault.save(state, root, step=2)
    chunk_links = events.count("link chunk")
    assert chunk_links >= 1
    assert events == ["syncfs"] + ["link chunk"] * chunk_links + ["syncfs", "link manifest", "fsync"]

    events.clear()
    ckptvault.save(state, root, step=3)  # the same tensors: every chunk is stored already
    assert events == ["fsync", "link manifest", "fsync"]
    assert sorted(p.name for p in (root / "tmp").iterdir()) == []
    for step in (2, 3):
        assert torch.equal(ckptvault.load(root, step)["w"], state["w"])
