"""Prune: apply a :class:`~ckptvault.Retention` to a vault. Plan, then execute.

Pruning deletes manifests only (each checkpoint disappears atomically with its
manifest); the chunks only dropped checkpoints used become garbage that
:mod:`ckptvault._maintenance.gc` reclaims once they are older than its grace period.

Safety rules:

* The plan reads every manifest; if one is unreadable, prune refuses
  (:class:`MaintenanceRefusedError`) and deletes nothing.
* Right before deleting each manifest, execute re-lists that step's pins and
  the committed steps: a step pinned meanwhile, or that is now the latest
  committed step, is skipped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .._argcheck import check_kind
from .._format.manifest import manifest_key, step_of_key
from .._vault import Vault
from ..errors import InvalidArgumentError, ObjectNotFoundError, VaultError
from .gc import ManifestSummary, collect, execute_gc, manifest_infos, plan_gc, read_summaries
from .pins import PINS_PREFIX, list_pins, parse_pin_key
from .retention import Decision, Policy, Retention, RetentionInfo

log = logging.getLogger(__name__)


@dataclass
class PrunePlan:
    """Decisions for every committed checkpoint, and what dropping them frees."""

    now: float
    decisions: list[Decision]
    manifest_bytes: dict[int, int]
    released_bytes: int = 0
    #: chunk ids (and delta bases) only the dropped checkpoints name: what gc may free once they are deleted
    released_chunks: frozenset[str] = frozenset()

    @property
    def drop(self) -> list[int]:
        return [d.step for d in self.decisions if not d.keep]

    @property
    def keep(self) -> list[int]:
        return [d.step for d in self.decisions if d.keep]

    @property
    def bytes(self) -> int:
        """Bytes of the manifests that would be deleted."""
        return sum(self.manifest_bytes.get(s, 0) for s in self.drop)

    def to_dict(self) -> dict[str, Any]:
        return {"now": self.now, "keep": self.keep, "drop": self.drop, "manifest_bytes": self.bytes,
                "released_bytes": self.released_bytes,
                "decisions": [{"step": d.step, "keep": d.keep, "reasons": list(d.reasons)} for d in self.decisions]}


@dataclass
class PruneResult:
    """Steps whose manifests were deleted, and steps skipped at the last moment (with why)."""

    deleted: list[int] = field(default_factory=list)
    skipped: dict[int, str] = field(default_factory=dict)
    bytes_freed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"deleted": self.deleted, "skipped": {str(k): v for k, v in self.skipped.items()},
                "bytes_freed": self.bytes_freed}


def plan_prune(vault: Vault, retention: Retention | Policy | Iterable[Policy], now: float | None = None,
               protect: Iterable[int] = ()) -> PrunePlan:
    """Decide what ``retention`` keeps; deletes nothing.

    ``now`` defaults to the local clock (compared with the checkpoints'
    ``time``, which is their writer's clock). ``protect``: steps kept
    whatever the policies say (the manager protects the step it just saved).
    """
    policy = Retention.coerce(retention)
    if policy is None:
        raise InvalidArgumentError("prune needs a retention policy")
    vault.require()
    now = time.time() if now is None else now
    listed = manifest_infos(vault.store)
    summaries = read_summaries(vault, listed)
    pins = list_pins(vault)
    infos = [RetentionInfo(s.step, s.time, s.metrics, pins.get(s.step, frozenset()), s.keyframe)
             for s in summaries.values()]
    decisions = _protect(policy.decide(infos, now), set(protect))
    sizes = {s: i.size for i in listed if (s := step_of_key(i.key)) is not None}
    plan = PrunePlan(now, decisions, sizes)
    plan.released_chunks = _released_chunks(summaries, set(plan.drop))
    plan.released_bytes = _released(summaries, set(plan.drop))
    return plan


def execute_prune(vault: Vault, plan: PrunePlan) -> PruneResult:
    """Delete the manifests of the plan's dropped steps, re-checking pins and the latest step first."""
    result = PruneResult()
    store = vault.store
    latest = max(plan.manifest_bytes, default=None)  # the newest step the plan listed; checked to exist before each delete
    for step in plan.drop:
        if any(parse_pin_key(i.key) is not None for i in store.list(f"{PINS_PREFIX}{step:020d}/")):
            result.skipped[step] = "pinned"
            continue
        if latest is not None and not store.exists(manifest_key(latest)):
            latest = _latest(vault)  # the newest step was deleted meanwhile: list again
        if latest is None or step >= latest:
            result.skipped[step] = "latest"
            continue
        try:
            size = store.stat(manifest_key(step)).size
        except ObjectNotFoundError:
            result.skipped[step] = "gone"
            continue
        store.delete(manifest_key(step))
        result.deleted.append(step)
        result.bytes_freed += size
    if result.deleted:
        log.info("pruned %d checkpoints from %s: %s", len(result.deleted), vault.url, result.deleted)
    return result


def prune(vault: Vault, retention: Retention | Policy | Iterable[Policy], *, dry_run: bool = False,
          now: float | None = None, protect: Iterable[int] = ()) -> tuple[PrunePlan, PruneResult | None]:
    """Plan and, unless ``dry_run``, execute."""
    check_kind("dry_run", dry_run, bool)  # "no" would be a dry run, 0 not
    plan = plan_prune(vault, retention, now, protect)
    return plan, (None if dry_run else execute_prune(vault, plan))


#: a manager's gc with ``Retention.gc_grace`` runs at most once per this fraction of the grace period
#: (:class:`GcPacer`)
GC_SPREAD = 16


class GcPacer:
    """When a manager's retention collects garbage with its grace period: after a prune that deleted something, but
    at most once every ``gc_grace / GC_SPREAD`` seconds, and then if any prune deleted something since the last one.
    Only chunks older than ``gc_grace`` go, so one gc frees what a gc after each prune of a save every step would
    (each listing every chunk of the vault), at most a sixteenth of the grace period later."""

    def __init__(self) -> None:
        self._due = False
        self._last: float | None = None  # time.monotonic() of the last gc

    def due(self, pruned: bool, grace: float) -> bool:
        """Whether to collect now, after a prune that ``pruned`` something or not; True also marks it done."""
        self._due = self._due or pruned
        now = time.monotonic()
        if not self._due or (self._last is not None and now - self._last < grace / GC_SPREAD):
            return False
        self._due, self._last = False, now
        return True


def apply_retention(vault: Vault, retention: Retention, step: int, exclusive: bool = False,
                    pacer: GcPacer | None = None) -> PruneResult | None:
    """What ``CheckpointManager`` runs after committing ``step``: prune (keeping ``step``), then gc if asked (paced
    by ``pacer``; without one, after every prune that deleted something).

    ``exclusive`` (the manager is the vault's only writer; it runs this in its save task, so no save of its own
    is in flight): the chunks only the manifests this prune deleted named, which no remaining manifest reaches,
    are deleted at once instead of after ``gc_grace`` (DESIGN G6); other garbage still waits for the grace
    period. Never raises a VaultError: the checkpoint is already committed, so a failed prune or gc is logged
    as a warning and retried after the next save.
    """
    try:
        plan, result = prune(vault, retention, protect=(step,))
        if result is not None and result.deleted and exclusive:
            if plan.released_chunks:  # gc marks every remaining manifest (a step skipped at the last moment too)
                freed = execute_gc(vault, plan_gc(vault, 0.0, only=plan.released_chunks))
                log.info("exclusive retention after step %d freed %d chunks (%d bytes) of pruned steps %s", step,
                         len(freed.deleted), freed.bytes_freed, result.deleted)
        pruned = result is not None and bool(result.deleted)
        if retention.gc and (pacer.due(pruned, retention.gc_grace) if pacer is not None else pruned):
            collect(vault, retention.gc_grace)
        return result
    except VaultError as exc:
        log.warning("retention after step %d was not applied: %s", step, exc)
        return None


def _latest(vault: Vault) -> int | None:
    steps = vault.steps()
    return steps[-1] if steps else None


def _protect(decisions: list[Decision], protect: set[int]) -> list[Decision]:
    return [Decision(d.step, True, d.reasons + ("protected",)) if d.step in protect else d for d in decisions]


def _released_chunks(summaries: dict[int, ManifestSummary], drop: set[int]) -> frozenset[str]:
    """Ids of the chunks and delta bases dropped checkpoints name that no kept checkpoint names."""
    kept: set[str] = set()
    for step, s in summaries.items():
        if step not in drop:
            kept.update(s.chunks)
            kept.update(b for b in s.chunks.values() if b is not None)
    named: set[str] = set()
    for step in drop:
        named.update(summaries[step].chunks)
        named.update(b for b in summaries[step].chunks.values() if b is not None)
    return frozenset(named - kept)


def _released(summaries: dict[int, ManifestSummary], drop: set[int]) -> int:
    """Stored bytes of chunks that only dropped checkpoints name (gc frees them after the grace period)."""
    kept: set[str] = set()
    for step, s in summaries.items():
        if step not in drop:
            kept.update(s.chunks)
            kept.update(b for b in s.chunks.values() if b is not None)
    freed: dict[str, int] = {}
    for step in drop:
        freed.update((cid, size) for cid, size in summaries[step].stored.items() if cid not in kept)
    return sum(freed.values())
