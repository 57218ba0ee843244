"""Retention, pins and garbage collection as methods of :class:`~ckptvault.CheckpointManager`.

``CheckpointManager(url, retention=Retention(keep_last=3, keep_every=1000))``
prunes after every committed save (never the step just saved, never the
latest, never a pinned step) and then collects garbage older than
``Retention.gc_grace``. The same operations are available on demand here and
as ``ckptvault prune|gc|pin|unpin``; all are safe to run from another process
(a cron job) while training saves.
"""

from __future__ import annotations

from collections.abc import Iterable

from .._vault import Vault
from ..errors import InvalidArgumentError, PinNotFoundError
from . import pins as _pins
from .gc import GCPlan, GCResult, collect
from .prune import PrunePlan, PruneResult, apply_retention, prune
from .retention import DEFAULT_GRACE, KeepBest, Policy, Retention, RetentionInfo, validate_tag

__all__ = ["MaintenanceMixin", "Retention", "apply_retention"]


class MaintenanceMixin:
    """Methods that need only ``self.vault`` and ``self.retention``."""

    vault: Vault
    retention: Retention | None

    def _check_open(self, what: str) -> None:
        """Raise if the owner was closed (CheckpointManager overrides this)."""

    def pin(self, step: int, tag: str) -> None:
        """Protect committed ``step`` from every retention policy under ``tag`` (a pin object in the vault).

        Idempotent. Raises StepNotFoundError if ``step`` is not committed,
        InvalidArgumentError for a bad tag (1-128 of ``A-Za-z0-9._-``).
        """
        self._check_open("pin()")
        _pins.pin(self.vault, step, tag)

    def unpin(self, step: int, tag: str) -> bool:
        """Remove pin ``tag`` from ``step``; True if it was there. Other tags of the step stay."""
        self._check_open("unpin()")
        return _pins.unpin(self.vault, step, tag)

    def pins(self) -> dict[int, frozenset[str]]:
        """Every pinned step and its tags."""
        self._check_open("pins()")
        return _pins.list_pins(self.vault)

    def step_of(self, tag: str) -> int:
        """The committed step pinned under ``tag`` (the newest, if several are); ``restore``, ``info`` and
        ``manifest`` take a tag for it.

        Raises PinNotFoundError (listing the tags in use) if no committed checkpoint has that pin.
        """
        self._check_open("step_of()")
        validate_tag(tag)
        pinned = _pins.list_pins(self.vault)
        committed = set(self.vault.steps())
        steps = [s for s, tags in pinned.items() if tag in tags and s in committed]
        if not steps:
            raise PinNotFoundError(tag, self.vault.url, sorted({t for s, ts in pinned.items() if s in committed for t in ts}))
        return max(steps)

    def best_step(self, metric: str, mode: str = "min") -> int | None:
        """The committed step whose ``metric`` (as given to ``save(metrics=...)``) is lowest (``mode="min"``) or
        highest (``"max"``); ties go to the newer step, as in :class:`~ckptvault.KeepBest`. Checkpoints without a
        finite number for it (missing, NaN, infinity, not a number) are ignored; None if no checkpoint has one.
        Reads every manifest."""
        self._check_open("best_step()")
        policy = KeepBest(1, metric, mode)  # validates metric and mode
        steps = self.vault.steps()
        manifests = self.vault.pool.map(self.vault.read_manifest, steps)
        infos = [RetentionInfo(m.step, m.time, m.metrics) for m in manifests]
        best = policy.keeps(infos, 0.0)
        return next(iter(best), None)

    def prune(self, retention: Retention | Policy | Iterable[Policy] | None = None, *, dry_run: bool = False,
              now: float | None = None) -> tuple[PrunePlan, PruneResult | None]:
        """Delete the checkpoints ``retention`` (default: the manager's) does not keep.

        Returns the plan (every step with keep/drop and reasons) and what was
        deleted (None with ``dry_run``). Only manifests are deleted; call
        :meth:`gc` to reclaim the chunks, which it does once they are older
        than its grace period (the manager's after-commit retention with
        ``exclusive=True`` frees its own prune's chunks at once; this method
        does not). Kept besides what the policies keep: the latest and pinned
        steps and the keyframe of every kept checkpoint (a kept delta needs the
        keyframe's chunks). Raises MaintenanceRefusedError if a
        manifest is unreadable, InvalidArgumentError without any policy.
        """
        self._check_open("prune()")
        chosen = Retention.coerce(retention) or self.retention
        if chosen is None:
            raise InvalidArgumentError("prune needs a retention policy: pass one, or set CheckpointManager(retention=...)")
        return prune(self.vault, chosen, dry_run=dry_run, now=now)

    def gc(self, grace: float | None = None, *, dry_run: bool = False) -> tuple[GCPlan, GCResult | None]:
        """Delete chunks no checkpoint references that are older than ``grace`` seconds on the store's clock.

        ``grace`` defaults to the retention's ``gc_grace`` or one hour; it must
        exceed the longest time a save in any process may take from writing
        its first chunk to committing. So right after a prune this frees
        nothing (``bytes_freed == 0``): the pruned checkpoints' chunks are
        younger than ``grace``; they go on a later run (or at once with
        ``CheckpointManager(exclusive=True)``'s retention). Raises MaintenanceRefusedError (deleting
        nothing) if any manifest is unreadable.
        """
        self._check_open("gc()")
        if grace is None:
            grace = self.retention.gc_grace if self.retention is not None else DEFAULT_GRACE
        return collect(self.vault, grace, dry_run)
