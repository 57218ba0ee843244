"""Garbage collection: delete chunks no committed checkpoint reaches. Plan, then execute.

Rules (docs/DESIGN.md, "Retention and garbage collection"):

* **Mark.** Every manifest is read and verified; the chunks it names are
  live, and so, transitively, is the base of every delta chunk (from the
  manifest entry's ``"base"``, or from the chunk header when the base is not
  itself a manifest entry). If any manifest cannot be read, gc refuses
  (:class:`MaintenanceRefusedError`) and deletes nothing.
* **Sweep.** A chunk is garbage if it is not live AND its mtime is at least
  ``grace`` seconds older than "now" on the store's clock. Saves write new
  chunks before their manifest and ``touch`` every chunk they reuse, then
  re-check reused chunks right before committing, so a chunk an uncommitted
  save depends on is fresh (skipped) or, if gc wins the race, the save fails
  cleanly with nothing committed. Temp files of interrupted writes, clock
  markers of killed gcs and pins of deleted steps are swept by the same age rule.
* **Execute re-checks.** It re-lists manifests and marks any new or changed
  one, then re-stats each candidate right before deleting it and skips it if
  it is gone or became fresh. Deleting unreferenced objects in any order keeps
  the vault consistent, so killing gc at any moment is safe; the next run
  finishes the job.

Clock: "now" is the mtime of a marker object gc writes (and deletes), so
ages compare the store's clock with itself. The local clock is used only if
the marker cannot be written (read-only store), with a warning.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import blake3

from .._argcheck import check_kind
from .._format.chunk_object import CHUNKS_PREFIX
from .._format.keys import MANIFESTS_PREFIX, MARKER_PREFIX, chunk_id_of_key, is_marker_key, is_temp_key
from .._format.manifest import step_of_key
from .._format.records import Manifest
from .._format.remembered import Remembered
from .._vault import Vault
from ..errors import (
    CorruptDataError,
    FormatVersionError,
    InvalidArgumentError,
    MaintenanceRefusedError,
    ObjectNotFoundError,
    StepNotFoundError,
    StorageError,
)
from ..stores import ObjectInfo, Store
from .pins import PINS_PREFIX, parse_pin_key
from .retention import DEFAULT_GRACE

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Garbage:
    """One object to delete: ``kind`` is ``chunk``, ``temp``, ``pin`` or ``marker``."""

    key: str
    size: int
    mtime: float
    kind: str


@dataclass
class GCPlan:
    """What gc would delete. Build with :func:`plan_gc`; apply with :func:`execute_gc`."""

    now: float
    grace: float
    clock: str
    live: set[str]
    manifests: dict[str, tuple[int, float]]
    candidates: list[Garbage]
    chunks_total: int = 0
    live_bytes: int = 0
    fresh_unreferenced: int = 0

    @property
    def bytes(self) -> int:
        return sum(g.size for g in self.candidates)

    def to_dict(self) -> dict[str, Any]:
        return {"now": self.now, "grace": self.grace, "clock": self.clock, "checkpoints": len(self.manifests),
                "chunks_total": self.chunks_total, "chunks_live": len(self.live), "live_bytes": self.live_bytes,
                "fresh_unreferenced": self.fresh_unreferenced, "bytes": self.bytes,
                "candidates": [vars(g) for g in self.candidates]}


@dataclass
class GCResult:
    """What :func:`execute_gc` deleted and what it skipped at the last moment."""

    deleted: list[Garbage] = field(default_factory=list)
    skipped_live: int = 0
    skipped_fresh: int = 0
    skipped_gone: int = 0

    @property
    def bytes_freed(self) -> int:
        return sum(g.size for g in self.deleted)

    def to_dict(self) -> dict[str, Any]:
        return {"deleted": [vars(g) for g in self.deleted], "bytes_freed": self.bytes_freed,
                "skipped_live": self.skipped_live, "skipped_fresh": self.skipped_fresh,
                "skipped_gone": self.skipped_gone}


def plan_gc(vault: Vault, grace: float = DEFAULT_GRACE, only: Iterable[str] | None = None) -> GCPlan:
    """List what gc would delete; deletes nothing except its own clock marker.

    ``only``: consider just these chunk ids (and no temp files, markers or pins): what an exclusive manager's
    own prune released (DESIGN G6). Raises MaintenanceRefusedError if a manifest is unreadable,
    VaultNotFoundError if there is no vault.
    """
    check_kind("grace", grace, int, float)
    if not grace >= 0:
        raise InvalidArgumentError(f"grace must be >= 0 seconds, got {grace!r}")
    vault.require()
    store = vault.store
    now, clock = store_now(store)
    chunks = [i for i in store.list(CHUNKS_PREFIX) if chunk_id_of_key(i.key) is not None]  # junk is never garbage
    wanted = None if only is None else set(only)
    listed = manifest_infos(store)
    live, _ = mark(vault, listed)
    plan = GCPlan(now, grace, clock, live, {i.key: (i.size, i.mtime) for i in listed}, [], len(chunks))
    cutoff = now - grace
    for info in chunks:
        if info.key.rsplit("/", 1)[1] in live:
            plan.live_bytes += info.size
        elif wanted is not None and info.key.rsplit("/", 1)[1] not in wanted:
            continue
        elif info.mtime <= cutoff:
            plan.candidates.append(Garbage(info.key, info.size, info.mtime, "chunk"))
        else:
            plan.fresh_unreferenced += 1
    committed = {step_of_key(i.key) for i in listed}
    if wanted is None:
        plan.candidates += _other_garbage(store, cutoff, committed)
    log.info("gc plan for %s: %d of %d chunks unreferenced and older than %gs (%d bytes)", vault.url,
             sum(g.kind == "chunk" for g in plan.candidates), len(chunks), grace, plan.bytes)
    return plan


def execute_gc(vault: Vault, plan: GCPlan) -> GCResult:
    """Delete the plan's candidates that are still garbage. Safe to kill at any moment; safe to re-run."""
    store = vault.store
    listed = manifest_infos(store)
    changed = [i for i in listed if plan.manifests.get(i.key) != (i.size, i.mtime)]
    live = plan.live | mark(vault, changed)[0] if changed else plan.live
    committed = {step_of_key(i.key) for i in listed}
    cutoff = plan.now - plan.grace
    result = GCResult()

    def sweep(g: Garbage) -> str:
        if g.kind == "chunk" and g.key.rsplit("/", 1)[1] in live:
            return "live"
        if g.kind == "pin" and (parsed := parse_pin_key(g.key)) is not None and parsed[0] in committed:
            return "live"
        try:
            current = store.stat(g.key)
        except ObjectNotFoundError:
            return "gone"
        if current.mtime > cutoff:
            return "fresh"
        store.delete(g.key)
        return "deleted"

    for g, outcome in zip(plan.candidates, vault.pool.map(sweep, plan.candidates)):
        if outcome == "deleted":
            result.deleted.append(g)
        else:
            setattr(result, f"skipped_{outcome}", getattr(result, f"skipped_{outcome}") + 1)
    log.info("gc of %s deleted %d objects (%d bytes); skipped %d live, %d fresh, %d gone", vault.url,
             len(result.deleted), result.bytes_freed, result.skipped_live, result.skipped_fresh, result.skipped_gone)
    return result


def collect(vault: Vault, grace: float = DEFAULT_GRACE, dry_run: bool = False) -> tuple[GCPlan, GCResult | None]:
    """Plan and, unless ``dry_run``, execute. Only chunks older than ``grace`` go: with the default hour, the
    chunks a prune just released stay on disk (``0 B freed``) until then; an exclusive manager frees its own
    prune's at once (``CheckpointManager(exclusive=True)``, DESIGN G6)."""
    check_kind("dry_run", dry_run, bool)  # "no" would be a dry run, 0 not
    plan = plan_gc(vault, grace)
    return plan, (None if dry_run else execute_gc(vault, plan))


def store_now(store: Store) -> tuple[float, str]:
    """Current time on the store's clock (mtime of a fresh marker object), and ``"store"`` or ``"local"``."""
    key = f"{MARKER_PREFIX}{uuid.uuid4().hex}"
    try:
        store.put(key, b"")
        try:
            return store.stat(key).mtime, "store"
        finally:
            store.delete(key)
    except StorageError as exc:
        log.warning("cannot write a clock marker to %s (%s); judging chunk ages by the local clock", store.url, exc)
        return time.time(), "local"


@dataclass(frozen=True)
class ManifestSummary:
    """What maintenance needs of one manifest: retention's inputs, and each chunk it names with its delta base
    (None for a full chunk) and stored size."""

    step: int
    time: float
    metrics: dict[str, Any]
    keyframe: int
    chunks: dict[str, str | None]
    stored: dict[str, int]


def mark(vault: Vault, listed: Iterable[ObjectInfo]) -> tuple[set[str], dict[int, ManifestSummary]]:
    """Live chunk ids reachable from these manifests (delta bases followed), and a summary per step.

    Raises MaintenanceRefusedError if any manifest is unreadable (see :func:`read_summaries`).
    """
    summaries = read_summaries(vault, listed)
    live: set[str] = set()
    bases: dict[str, str | None] = {}
    for summary in summaries.values():
        for cid, base in summary.chunks.items():
            live.add(cid)
            if base is not None or cid not in bases:
                bases[cid] = base
    _follow_bases(vault, live, bases)
    return live, summaries


def read_summaries(vault: Vault, listed: Iterable[ObjectInfo]) -> dict[int, ManifestSummary]:
    """step -> the parts of its manifest maintenance needs (time, metrics, keyframe, chunks).

    A manifest deleted meanwhile is skipped; any other read failure raises
    MaintenanceRefusedError naming every unreadable step, since what such a
    checkpoint references is unknown.
    """
    steps = [s for s in (step_of_key(i.key) for i in listed) if s is not None]
    summaries: dict[int, ManifestSummary] = {}
    problems: dict[int, str] = {}
    for step, outcome in zip(steps, _in_batches(vault, lambda s: _summarise(vault, s), steps), strict=True):
        if isinstance(outcome, str):
            problems[step] = outcome
        elif outcome is not None:
            summaries[step] = outcome
    if problems:
        raise MaintenanceRefusedError(problems, vault.url)
    return summaries


def _in_batches(vault: Vault, fn: Callable[[int], T], steps: list[int]) -> list[T]:
    """``[fn(s) for s in steps]``, one task per worker thread, each running its share in turn: as many requests in
    flight as one task per step, without a task's overhead for every (mostly remembered) manifest."""
    per = -(-len(steps) // vault.workers) or 1
    batches = [steps[i : i + per] for i in range(0, len(steps), per)]
    return [out for batch in vault.pool.map(lambda b: [fn(s) for s in b], batches) for out in batch]


def _summarise(vault: Vault, step: int) -> ManifestSummary | str | None:
    """The parts of a manifest maintenance needs, None if it vanished, or a problem description. Each manifest's is
    made once per process: remembered by the exact bytes it was made from (a retention applied after every save
    reads every kept manifest each time)."""
    try:
        data = vault.manifest_bytes(step)
        key = _summary_key(vault, step, data)
        summary = _summaries.get(key)
        if summary is None:
            summary = _written.get(key) or _summary_of(step, vault.decode_manifest(step, data))
            _summaries.put(key, summary)
    except StepNotFoundError:
        return None
    except (CorruptDataError, FormatVersionError, StorageError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return summary


def remember_written(vault: Vault, step: int, data: bytes, manifest: Manifest) -> None:
    """Remember the summary of ``data``, the manifest of ``step`` this process just committed, made from
    ``manifest``, the manifest it encodes: the retention that runs after the commit then reads it without decoding
    and checking it again (the writer made it; the bytes must match for the memo to answer). Kept apart from the
    maintenance memo, and only the last few: a process that saves without retention holds no more."""
    _written.put(_summary_key(vault, step, data), _summary_of(step, manifest))


def _summary_key(vault: Vault, step: int, data: bytes) -> tuple[bytes, int, int]:
    return blake3.blake3(data).digest(), step, vault.chunk_size()


def _summary_of(step: int, m: Manifest) -> ManifestSummary:
    return ManifestSummary(step, m.time, m.metrics, m.keyframe, m.chunk_bases(), {c.id: c.stored for c in m.chunks})


#: manifests whose summaries are remembered (a summary holds a manifest's chunk ids: about 200 bytes a chunk), by
#: the BLAKE3 of their bytes, step and chunk size (a summary is a function of those alone)
SUMMARIES_KEPT = 2048
_summaries: Remembered[tuple[bytes, int, int], ManifestSummary] = Remembered(SUMMARIES_KEPT)
#: the summaries of the last manifests this process committed, until maintenance reads them (remember_written)
WRITTEN_KEPT = 4
_written: Remembered[tuple[bytes, int, int], ManifestSummary] = Remembered(WRITTEN_KEPT)


def _follow_bases(vault: Vault, live: set[str], bases: dict[str, str | None]) -> None:
    """Add every delta base reachable from ``live`` (reading chunk headers for bases no manifest lists)."""
    todo = [b for b in bases.values() if b is not None and b not in live]
    while todo:
        cid = todo.pop()
        if cid in live:
            continue
        live.add(cid)
        base = bases[cid] if cid in bases else _header_base(vault, cid)
        if base is not None and base not in live:
            todo.append(base)


def _header_base(vault: Vault, cid: str) -> str | None:
    """The base named in a chunk object's header (None for a keyframe or a missing/damaged chunk)."""
    try:
        return vault.chunk_base(cid)
    except ObjectNotFoundError:
        log.warning("delta base chunk %s is missing from %s: run `ckptvault verify`", cid, vault.url)
    except (CorruptDataError, FormatVersionError) as exc:
        log.warning("cannot read the header of delta base chunk %s: %s", cid, exc)
    return None


def manifest_infos(store: Store) -> list[ObjectInfo]:
    """Listing entries of every manifest object."""
    return [i for i in store.list(MANIFESTS_PREFIX) if step_of_key(i.key) is not None]


def _other_garbage(store: Store, cutoff: float, committed: set[int | None]) -> list[Garbage]:
    """Old temp files, old clock markers, and old pins of steps that are not committed: only objects named exactly
    as ckptvault names them (anything else in those folders is not ckptvault's to delete)."""
    out: list[Garbage] = []
    for info in store.temp_files():
        if is_temp_key(info.key) and info.mtime <= cutoff:
            out.append(Garbage(info.key, info.size, info.mtime, "temp"))
    for info in store.list(MARKER_PREFIX):
        if is_marker_key(info.key) and info.mtime <= cutoff:
            out.append(Garbage(info.key, info.size, info.mtime, "marker"))
    for info in store.list(PINS_PREFIX):
        parsed = parse_pin_key(info.key)
        if parsed is not None and parsed[0] not in committed and info.mtime <= cutoff:
            out.append(Garbage(info.key, info.size, info.mtime, "pin"))
    return out
