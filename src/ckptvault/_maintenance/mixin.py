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
from ..errors import InvalidArgumentError
from . import pins as _pins
from .gc import GCPlan, GCResult, collect
from .prune import PrunePlan, PruneResult, apply_retention, prune
from .retention import DEFAULT_GRACE, Policy, Retention

__all__ = ["MaintenanceMixin", "Retention", "apply_retention"]


class MaintenanceMixin:
    """Methods that need only ``self.vault`` and ``self.retention``."""

    vault: Vault
    retention: Retention | None

    def pin(self, step: int, tag: str) -> None:
        """Protect committed ``step`` from every retention policy under ``tag`` (a pin object in the vault).

        Idempotent. Raises StepNotFoundError if ``step`` is not committed,
        InvalidArgumentError for a bad tag (1-128 of ``A-Za-z0-9._-``).
        """
        _pins.pin(self.vault, step, tag)

    def unpin(self, step: int, tag: str) -> bool:
        """Remove pin ``tag`` from ``step``; True if it was there. Other tags of the step stay."""
        return _pins.unpin(self.vault, step, tag)

    def pins(self) -> dict[int, frozenset[str]]:
        """Every pinned step and its tags."""
        return _pins.list_pins(self.vault)

    def prune(self, retention: Retention | Policy | Iterable[Policy] | None = None, *, dry_run: bool = False,
              now: float | None = None) -> tuple[PrunePlan, PruneResult | None]:
        """Delete the checkpoints ``retention`` (default: the manager's) does not keep.

        Returns the plan (every step with keep/drop and reasons) and what was
        deleted (None with ``dry_run``). Only manifests are deleted; call
        :meth:`gc` to reclaim the chunks. Raises MaintenanceRefusedError if a
        manifest is unreadable, InvalidArgumentError without any policy.
        """
        chosen = Retention.coerce(retention) or self.retention
        if chosen is None:
            raise InvalidArgumentError("prune needs a retention policy: pass one, or set CheckpointManager(retention=...)")
        return prune(self.vault, chosen, dry_run=dry_run, now=now)

    def gc(self, grace: float | None = None, *, dry_run: bool = False) -> tuple[GCPlan, GCResult | None]:
        """Delete chunks no checkpoint references that are older than ``grace`` seconds on the store's clock.

        ``grace`` defaults to the retention's ``gc_grace`` or one hour; it must
        exceed the longest time a save in any process may take from writing
        its first chunk to committing. Raises MaintenanceRefusedError (deleting
        nothing) if any manifest is unreadable.
        """
        if grace is None:
            grace = self.retention.gc_grace if self.retention is not None else DEFAULT_GRACE
        return collect(self.vault, grace, dry_run)
