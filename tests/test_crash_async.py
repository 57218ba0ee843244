"""kill -9 while an asynchronous save's background writer runs: nothing committed earlier is lost.

The saver of tests/test_crash.py runs in ``overlap`` mode: ``mgr.save`` returns once the state is
staged (logged ``returned``), the next optimizer step then changes every saved tensor in place while
the background thread writes chunks and commits, and ``committed`` is logged after ``.wait()``. The
kill lands at a random moment between ``returned`` and the expected commit, so it hits the
background phase (chunk writes, the manifest commit, retention) or just after it. Afterwards the
checks of test_crash.py apply: every step logged as committed restores bit-exactly to the digest
taken before its save (so neither the kill nor the in-place training step reached it), the step in
flight is absent or whole, verify passes and every chunk object is complete; at the end gc removes
exactly the leftovers. The seed is printed; rerun with CKPTVAULT_CRASH_SEED=<seed>.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from test_crash import Campaign, SaverServer, _temp_count, check_against_log, finish_campaign, read_log, wait_for


@dataclass
class AsyncCampaign(Campaign):
    background: list[float] = field(default_factory=lambda: [0.1])  # seconds from "returned" to "committed"
    in_background: int = 0  # kills that found the save in flight after save() had returned

    def background_time(self) -> float:
        return statistics.median(self.background[-20:])


def kill_in_background(path: Path, pid: int, campaign: AsyncCampaign, overwrite: bool) -> str:
    """Let 0-2 saves commit (at least 1 to overwrite), wait for the next save() to return, SIGKILL within its background time."""
    rng = campaign.rng
    warmup = rng.randint(1 if overwrite else 0, 2)
    first = wait_for(path, lambda log: log.ready and len(log.committed) >= warmup, f"{warmup} commits")
    wait_for(path, lambda log: log.returns > first.returns, "a save to return")
    t = campaign.background_time()
    delay = rng.uniform(0, 1.05 * t)
    time.sleep(delay)
    os.kill(pid, signal.SIGKILL)
    return f"+{delay:.4f}s after save() returned (background ~{t:.3f}s, after commit {warmup})"


def run_async_trial(server: SaverServer, campaign: AsyncCampaign, trial: int, tmp: Path) -> None:
    overwrite = trial % 3 == 2
    start = trial * 1000
    path = tmp / f"trial-{trial}.log"
    temps_before = _temp_count(campaign.vault)
    pid = server.start(campaign.vault, path, start, start if overwrite else -1, trial, mode="overlap")
    moment = kill_in_background(path, pid, campaign, overwrite)
    status = server.reap(pid)
    log = read_log(path)
    ctx = f"seed {campaign.seed}, async trial {trial} ({'overwrite' if overwrite else 'append'}, kill {moment})"
    print(ctx, f"-> {len(log.committed)} committed, in flight {log.inflight}, returned {log.inflight_returned}")
    assert not log.errors, f"{ctx}: the saver failed: {log.errors}"
    assert status == "signal 9", f"{ctx}: saver ended with {status}, not by SIGKILL"
    assert log.returns >= len(log.committed), f"{ctx}: the saver did not run in overlap mode"
    campaign.background.extend(log.background)
    campaign.in_background += log.inflight is not None and log.inflight_returned
    outcome = check_against_log(campaign, log, ctx, full_verify=trial % 8 == 7)
    campaign.outcomes[outcome] += 1
    if _temp_count(campaign.vault) > temps_before:
        campaign.outcomes["left tmp/*.part (killed mid-write)"] += 1


def run_async_campaign(tmp_path: Path, trials: int) -> AsyncCampaign:
    seed = int(os.environ.get("CKPTVAULT_CRASH_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"async crash campaign seed {seed} (rerun with CKPTVAULT_CRASH_SEED={seed})")
    campaign = AsyncCampaign(tmp_path / "vault", seed, random.Random(seed))
    server = SaverServer()
    try:
        for trial in range(trials):
            run_async_trial(server, campaign, trial, tmp_path)
    finally:
        server.close()
    finish_campaign(campaign)
    print(f"seed {seed}: {campaign.in_background} of {trials} kills hit a save's background phase")
    return campaign


def test_kill_nine_during_background_writes(tmp_path: Path) -> None:
    """SIGKILL during background writes: exactly the committed manifests are listed, each complete (DESIGN M1, M2)."""
    campaign = run_async_campaign(tmp_path, trials=24)
    assert campaign.expected, "no trial committed anything"
    assert campaign.in_background >= 12, (
        f"seed {campaign.seed}: only {campaign.in_background} of 24 kills hit a background phase: {dict(campaign.outcomes)}")


@pytest.mark.slow
def test_kill_nine_during_background_writes_many_trials(tmp_path: Path) -> None:
    campaign = run_async_campaign(tmp_path, trials=200)
    assert campaign.in_background >= 100, dict(campaign.outcomes)
    assert campaign.outcomes["in-flight save lost (not visible)"], dict(campaign.outcomes)
