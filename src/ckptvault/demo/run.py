"""The demo job end to end: train, checkpoint every K steps, restore in a fresh process, compare.

:func:`run_demo` trains :class:`~ckptvault.demo.train.Trainer` for a time or
step budget, saves its full state into a vault every ``every`` steps (and at
the last step), saves the same state with ``torch.save`` (fsync included) for
comparison, then runs ``python -m ckptvault.demo.check`` in a new interpreter
to restore the latest checkpoint and check it bit for bit against digests the
training process wrote. It returns a :class:`DemoReport`; it prints nothing.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .._maintenance.mixin import Retention
from .._vault import DESCRIPTOR_KEY
from ..errors import InvalidArgumentError, VaultError
from ..manager import CheckpointManager
from ..options import AsyncOptions, DeltaOptions
from ..stores import LocalStore, open_store
from .check import STORAGE_OPTIONS_ENV, write_reference
from .model import num_params
from .train import TrainConfig, Trainer

log = logging.getLogger(__name__)

OnStep = Callable[[int, "int | None", float], None]
"""Progress callback: (steps done in this run, steps planned or None for a time budget, loss).

On the last step of the run, ``planned`` equals ``done``."""


class DemoError(VaultError, RuntimeError):
    """The demo could not complete its restore check (the fresh process failed or reported garbage)."""


@dataclass(frozen=True)
class DemoOptions:
    """What :func:`run_demo` does. ``steps`` (when set) replaces the ``minutes`` budget."""

    vault: str = "./demo-vault"
    minutes: float = 2.0
    steps: int | None = None
    every: int = 50
    codec: str = "zstd"
    resume: bool = False
    fresh: bool = False
    batch_size: int = 16
    seed: int = 0
    repeat: int = 3
    storage_options: dict[str, Any] | None = None  # for an s3:// (or fsspec) --vault; also given to the check process
    codec_rules: str | dict[str, str] | None = None  # a preset name ("fp16": the seed workflow) or rules
    keep_last: int | None = None  # retention after each save (the vault's lifecycle; gc included)
    predict: bool = False  # predicted deltas, for checkpoints one step apart (--every 1)
    saver: str = "thread"  # AsyncOptions.saver: where the work after each host copy runs


@dataclass
class DemoReport:
    """What the demo measured. Byte counts are bytes; times are seconds."""

    vault: str
    codec: str
    params: int
    steps: list[int]
    start_step: int
    final_step: int
    final_loss: float
    train_s: float
    logical_bytes: int
    stored_bytes: int
    vault_bytes: int
    added_bytes: list[int] = field(default_factory=list)
    save_s: list[float] = field(default_factory=list)
    save_blocked_s: list[float] = field(default_factory=list)
    torch_save_s: list[float] = field(default_factory=list)
    torch_save_bytes: int = 0
    check: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when the fresh-process restore matched the saved state bit for bit."""
        return bool(self.check.get("ok"))

    def medians(self) -> dict[str, float]:
        return {"save_s": statistics.median(self.save_s), "save_blocked_s": statistics.median(self.save_blocked_s),
                "torch_save_s": statistics.median(self.torch_save_s),
                "added_bytes": statistics.median(self.added_bytes),
                "restore_s": self.check["restore_median_s"], "torch_load_s": self.check["torch_load_median_s"]}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"ok": self.ok, "medians": self.medians()}


def run_demo(opts: DemoOptions, on_step: OnStep | None = None) -> DemoReport:
    """Run the demo; see the module docstring. Raises InvalidArgumentError on bad options or a vault
    that already holds checkpoints (unless ``resume`` or ``fresh``), DemoError if the check cannot run."""
    _validate(opts)
    if opts.fresh:
        _remove_vault(opts.vault, opts.storage_options)
    retention = Retention(keep_last=opts.keep_last) if opts.keep_last else None
    with CheckpointManager(opts.vault, codec=opts.codec, storage_options=opts.storage_options,
                           codec_rules=opts.codec_rules, retention=retention, delta=_delta_options(opts),
                           async_options=AsyncOptions(saver=opts.saver)) as mgr, tempfile.TemporaryDirectory(
        prefix=".ckptvault-demo-", dir=_scratch_parent(mgr)
    ) as scratch:
        latest = _resume_point(mgr, opts)
        trainer = Trainer(TrainConfig(batch_size=opts.batch_size, seed=opts.seed))
        if latest is not None:
            start = time.perf_counter()
            trainer.load_state(mgr.restore(latest))
            log.info("resumed from step %d in %.3f s", latest, time.perf_counter() - start)
        report = DemoReport(vault=mgr.url, codec=opts.codec, params=num_params(trainer.model), steps=[],
                            start_step=trainer.step, final_step=trainer.step, final_loss=float("nan"), train_s=0.0,
                            logical_bytes=0, stored_bytes=0, vault_bytes=0)
        _train(mgr, trainer, opts, report, Path(scratch), on_step)
        report.check = _check_in_fresh_process(mgr.url, report.final_step, Path(scratch), opts.repeat,
                                               opts.storage_options)
        report.steps = mgr.steps()
        final = mgr.info(report.final_step)
        report.logical_bytes, report.stored_bytes = final.logical_bytes, final.stored_bytes
        report.vault_bytes = sum(mgr.info(s).added_bytes for s in report.steps)
    log.info("demo finished: %d checkpoints, restore check %s", len(report.steps), "passed" if report.ok else "FAILED")
    return report


def _delta_options(opts: DemoOptions) -> DeltaOptions:
    """The keyframe cadence every-step checkpoints want with predictions (docs/benchmarks/predicted.md)."""
    return DeltaOptions(predict=True, keyframe_every=20, max_chain=19) if opts.predict else DeltaOptions()


def _validate(opts: DemoOptions) -> None:
    if opts.every < 1:
        raise InvalidArgumentError(f"--every must be at least 1, got {opts.every}")
    if opts.steps is not None and opts.steps < 1:
        raise InvalidArgumentError(f"--steps must be at least 1, got {opts.steps}")
    if opts.steps is None and not opts.minutes > 0:
        raise InvalidArgumentError(f"--minutes must be positive, got {opts.minutes}")
    if opts.resume and opts.fresh:
        raise InvalidArgumentError("--resume and --fresh exclude each other: continue the run, or start over")
    if opts.vault.startswith("memory://"):
        raise InvalidArgumentError(f"the demo restores in a second process, so it needs a local vault or one on "
                                   f"shared storage (s3://...), not {opts.vault!r}")


def _remove_vault(url: str, storage_options: dict[str, Any] | None = None) -> None:
    """Delete the vault at ``url`` if there is one; refuse to delete a folder that is not a vault."""
    if "://" in url and not url.startswith("file://"):
        store = open_store(url, storage_options)
        try:
            if store.exists(DESCRIPTOR_KEY):
                log.info("removing the previous demo vault at %s", url)
                for info in list(store.list()):
                    store.delete(info.key)
        finally:
            store.close()
        return
    root = Path(url.removeprefix("file://")).expanduser()
    if not root.exists():
        return
    if not (root / DESCRIPTOR_KEY).is_file():
        raise InvalidArgumentError(f"--fresh would delete {root}, which is not a ckptvault vault; choose another --vault")
    log.info("removing the previous demo vault at %s", root)
    shutil.rmtree(root)


def _scratch_parent(mgr: CheckpointManager) -> str:
    """Keep the torch.save comparison files on the vault's own disk, so both are timed on the same device."""
    store = mgr.vault.store
    parent = store.root.parent if isinstance(store, LocalStore) else Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    return str(parent)


def _resume_point(mgr: CheckpointManager, opts: DemoOptions) -> int | None:
    """The step to resume from (None: start at 0); refuses to mix a new run into a vault that has one."""
    latest = mgr.latest_step()
    if latest is not None and not opts.resume:
        raise InvalidArgumentError(
            f"the vault at {mgr.url} already holds checkpoints (latest step {latest}); pass --resume to continue "
            "from it, --fresh to start over, or another --vault"
        )
    return latest


def _train(mgr: CheckpointManager, trainer: Trainer, opts: DemoOptions, report: DemoReport, scratch: Path,
           on_step: OnStep | None) -> None:
    planned = opts.steps
    deadline = time.monotonic() + opts.minutes * 60
    done, loss, saved_at = 0, float("nan"), -1
    start = time.perf_counter()
    while True:
        loss = trainer.train_step()
        done += 1
        finished = done >= planned if planned is not None else time.monotonic() >= deadline
        if on_step is not None:
            on_step(done, done if finished else planned, loss)
        if trainer.step % opts.every == 0 or finished:
            _checkpoint(mgr, trainer, loss, report, scratch)
            saved_at = trainer.step
        if finished:
            break
    report.train_s = time.perf_counter() - start
    report.final_step, report.final_loss = saved_at, loss


def _checkpoint(mgr: CheckpointManager, trainer: Trainer, loss: float, report: DemoReport, scratch: Path) -> None:
    """Save the trainer's state into the vault, then with torch.save; record both costs.

    The vault save is timed twice: until ``save`` returns (what training waits
    for: the state is staged, the rest may run in the background) and until it
    is durable. The demo waits for durability before going on, so the two
    savers never compete for the CPU or the disk.
    """
    state = trainer.state()
    lr = trainer.scheduler.get_last_lr()[0]
    start = time.perf_counter()
    metrics = {"loss": loss, "lr": lr} if math.isfinite(loss) else {"lr": lr}  # metrics must be finite
    handle = mgr.save(trainer.step, state, metrics=metrics, metadata=trainer.metadata())
    report.save_blocked_s.append(time.perf_counter() - start)
    info = handle.wait()
    report.save_s.append(time.perf_counter() - start)
    if info is None:
        raise DemoError(f"the save of step {trainer.step} was skipped")
    report.added_bytes.append(info.added_bytes)
    seconds, size = write_reference(state, scratch)
    report.torch_save_s.append(seconds)
    report.torch_save_bytes = size
    log.info("step %d: loss %.4f, saved %d -> %d bytes (%d new) in %.3f s; torch.save %.3f s", trainer.step, loss,
             info.logical_bytes, info.stored_bytes, info.added_bytes, report.save_s[-1], seconds)


def _check_in_fresh_process(url: str, step: int, reference: Path, repeat: int,
                            storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run ``python -m ckptvault.demo.check`` and return its JSON result (``ok`` says whether it matched)."""
    cmd = [sys.executable, "-m", "ckptvault.demo.check", "--vault", url, "--step", str(step),
           "--reference", str(reference), "--repeat", str(repeat)]
    log.info("restoring step %d in a fresh process", step)
    env = {**os.environ, STORAGE_OPTIONS_ENV: json.dumps(storage_options or {})}  # not argv: it may hold keys
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode not in (0, 1) or not lines:
        raise DemoError(f"the restore check process exited with {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    try:
        result = json.loads(lines[-1])
    except ValueError:
        raise DemoError(f"the restore check process wrote no result: {proc.stdout[-500:]!r}") from None
    if bool(result.get("ok")) != (proc.returncode == 0):
        raise DemoError(f"the restore check process exited {proc.returncode} but reported ok={result.get('ok')}")
    return result
