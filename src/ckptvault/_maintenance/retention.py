"""Retention: which checkpoints to keep, as a pure function of their infos.

A policy looks at every committed checkpoint (:class:`RetentionInfo`) and
returns the steps it keeps, each with a reason. Policies compose by union: a
checkpoint is kept if ANY policy keeps it. On top of the policies,
:func:`decide` always keeps the latest step and every pinned step.

Every policy here is *stable under its own result*: applied to the kept set
it keeps the same steps again, so pruning twice (with the same ``now``)
deletes nothing more the second time.

Interval buckets are aligned to the Unix epoch in UTC (days start at 00:00
UTC, weeks on Monday 00:00 UTC). The checkpoint's ``time`` is the writer's
wall clock at save time, ``now`` the pruner's: skew between the two only
shifts which bucket is "current" by the skew.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .._format.keys import is_valid_tag
from ..errors import InvalidArgumentError

#: default grace period of garbage collection, in seconds (see ``_maintenance/gc.py``)
DEFAULT_GRACE = 3600.0
DAY = 86400.0
WEEK = 7 * DAY
#: 1970-01-01 was a Thursday: shifting by 3 days starts weeks on Monday
_MONDAY_OFFSET = 3 * DAY



@dataclass(frozen=True)
class RetentionInfo:
    """What retention knows about one committed checkpoint.

    ``keyframe``: the step of the keyframe this checkpoint's delta chunks are
    against (its own step for a keyframe, None if unknown).
    """

    step: int
    time: float
    metrics: Mapping[str, Any] = field(default_factory=dict)
    pins: frozenset[str] = frozenset()
    keyframe: int | None = None


@dataclass(frozen=True)
class Decision:
    """Keep or drop ``step``; ``reasons`` name every rule that keeps it (empty when dropped)."""

    step: int
    keep: bool
    reasons: tuple[str, ...]


class Policy(Protocol):
    """A retention rule: maps every checkpoint to the steps it keeps, with a reason each."""

    def keeps(self, infos: Sequence[RetentionInfo], now: float) -> dict[int, str]: ...


def _positive(name: str, value: int) -> int:
    if type(value) is not int or value < 1:
        raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True)
class KeepLast:
    """Keep the ``n`` checkpoints with the highest steps."""

    n: int

    def __post_init__(self) -> None:
        _positive("keep_last", self.n)

    def keeps(self, infos: Sequence[RetentionInfo], now: float) -> dict[int, str]:
        newest = sorted((i.step for i in infos), reverse=True)[: self.n]
        return {s: f"last {self.n}" for s in newest}


@dataclass(frozen=True)
class KeepEvery:
    """Keep every checkpoint whose step is a multiple of ``k``."""

    k: int

    def __post_init__(self) -> None:
        _positive("keep_every", self.k)

    def keeps(self, infos: Sequence[RetentionInfo], now: float) -> dict[int, str]:
        return {i.step: f"every {self.k} steps" for i in infos if i.step % self.k == 0}


@dataclass(frozen=True)
class KeepBest:
    """Keep the ``n`` best checkpoints by ``metric`` (``mode`` ``min`` or ``max``).

    Checkpoints without a finite numeric value for the metric are not
    candidates. Ties are broken in favour of the higher step.
    """

    n: int
    metric: str
    mode: str = "min"

    def __post_init__(self) -> None:
        _positive("keep_best", self.n)
        if not isinstance(self.metric, str) or not self.metric:
            raise InvalidArgumentError(f"keep_best needs a metric name, got {self.metric!r}")
        if self.mode not in ("min", "max"):
            raise InvalidArgumentError(f"mode must be 'min' or 'max', got {self.mode!r}")

    def keeps(self, infos: Sequence[RetentionInfo], now: float) -> dict[int, str]:
        scored = [(v, i.step) for i in infos if (v := _number(i.metrics.get(self.metric))) is not None]
        sign = 1.0 if self.mode == "min" else -1.0
        best = sorted(scored, key=lambda vs: (sign * vs[0], -vs[1]))[: self.n]
        return {s: f"best {self.n} by {self.metric} ({self.mode})" for _, s in best}


@dataclass(frozen=True)
class KeepInterval:
    """Keep the newest checkpoint of each time bucket of ``interval`` seconds, for the last ``count`` buckets.

    Buckets are ``floor((time + offset) / interval)``; the horizon is the
    bucket holding ``now`` and the ``count - 1`` before it (checkpoints
    stamped later than ``now`` count as inside the horizon).
    """

    interval: float
    count: int
    name: str = ""
    offset: float = 0.0

    def __post_init__(self) -> None:
        _positive("count", self.count)
        if not (isinstance(self.interval, (int, float)) and math.isfinite(self.interval) and self.interval > 0):
            raise InvalidArgumentError(f"interval must be a positive number of seconds, got {self.interval!r}")

    def _bucket(self, t: float) -> int:
        return math.floor((t + self.offset) / self.interval)

    def keeps(self, infos: Sequence[RetentionInfo], now: float) -> dict[int, str]:
        first = self._bucket(now) - self.count + 1
        newest: dict[int, RetentionInfo] = {}
        for info in infos:
            b = self._bucket(info.time)
            if b >= first and (b not in newest or (info.time, info.step) > (newest[b].time, newest[b].step)):
                newest[b] = info
        label = self.name or f"one per {self.interval:g}s for {self.count}"
        return {i.step: label for i in newest.values()}


def KeepDaily(days: int) -> KeepInterval:  # noqa: N802 - reads as a policy class
    """One checkpoint (the day's newest) per UTC day, for the last ``days`` days."""
    return KeepInterval(DAY, _positive("keep_daily", days), f"daily for {days} days")


def KeepWeekly(weeks: int) -> KeepInterval:  # noqa: N802
    """One checkpoint (the week's newest) per week starting Monday 00:00 UTC, for the last ``weeks`` weeks."""
    return KeepInterval(WEEK, _positive("keep_weekly", weeks), f"weekly for {weeks} weeks", _MONDAY_OFFSET)


@dataclass(frozen=True)
class KeepIf:
    """Keep every checkpoint for which ``predicate(info)`` is true."""

    predicate: Callable[[RetentionInfo], bool]
    name: str = "predicate"

    def keeps(self, infos: Sequence[RetentionInfo], now: float) -> dict[int, str]:
        return {i.step: self.name for i in infos if self.predicate(i)}


class Retention:
    """A set of policies applied together (union). Build it from policies, keywords, or both.

    ``Retention(keep_last=3, keep_every=1000)`` equals
    ``Retention(KeepLast(3), KeepEvery(1000))``. Empty retention is refused:
    it would drop everything but the latest and pinned checkpoints.

    ``gc`` and ``gc_grace`` only matter to ``CheckpointManager(retention=...)``:
    after a prune that dropped something, it collects garbage with that grace
    period (seconds), so chunks of dropped checkpoints are freed once that old
    (at most once per sixteenth of the grace period: docs/DESIGN.md section 11).

    What it does to disk: a prune deletes manifests only. Besides what the
    policies keep, the latest step, every pinned step and the keyframe of every
    kept checkpoint stay (a kept delta checkpoint's changed chunks are encoded
    against its keyframe's chunks, which must stay on disk anyway; keeping that
    manifest costs nothing more and lets the next save keep encoding deltas), so
    ``Retention(keep_last=2, keep_best=1, metric="val_loss")`` may keep up to
    three checkpoints plus their keyframes. The chunks only dropped checkpoints
    used are deleted once older than ``gc_grace`` (default one hour): a gc right
    after a prune frees 0 bytes, which keeps it safe next to another process's
    save. ``CheckpointManager(exclusive=True)`` (the only writer) frees them at
    once (docs/DESIGN.md, G6).
    """

    def __init__(self, *policies: Policy, keep_last: int | None = None, keep_every: int | None = None,
                 keep_best: int | None = None, metric: str | None = None, mode: str = "min",
                 keep_daily: int | None = None, keep_weekly: int | None = None,
                 keep_if: Callable[[RetentionInfo], bool] | None = None, gc: bool = True,
                 gc_grace: float = DEFAULT_GRACE) -> None:
        found: list[Policy] = list(policies)
        if keep_last is not None:
            found.append(KeepLast(keep_last))
        if keep_every is not None:
            found.append(KeepEvery(keep_every))
        if keep_best is not None:
            found.append(KeepBest(keep_best, metric or "", mode))
        elif metric is not None:
            raise InvalidArgumentError("metric is only used with keep_best; pass keep_best=N too")
        if keep_daily is not None:
            found.append(KeepDaily(keep_daily))
        if keep_weekly is not None:
            found.append(KeepWeekly(keep_weekly))
        if keep_if is not None:
            found.append(KeepIf(keep_if))
        for p in found:
            if not callable(getattr(p, "keeps", None)):
                raise InvalidArgumentError(f"{p!r} is not a retention policy (it has no keeps(infos, now) method)")
        if not found:
            raise InvalidArgumentError(
                "retention needs at least one policy (keep_last, keep_every, keep_best, keep_daily, keep_weekly, "
                "keep_if); with none, every checkpoint but the latest and pinned ones would be dropped"
            )
        if not (isinstance(gc_grace, (int, float)) and gc_grace >= 0):
            raise InvalidArgumentError(f"gc_grace must be a number of seconds >= 0, got {gc_grace!r}")
        self.policies: tuple[Policy, ...] = tuple(found)
        self.gc, self.gc_grace = bool(gc), float(gc_grace)

    @classmethod
    def coerce(cls, value: Retention | Policy | Iterable[Policy] | None) -> Retention | None:
        """Accept a Retention, one policy, or an iterable of policies (None stays None)."""
        if value is None or isinstance(value, Retention):
            return value
        if callable(getattr(value, "keeps", None)):
            return cls(value)  # type: ignore[arg-type]
        if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):  # a str would iterate its letters
            raise InvalidArgumentError(
                f"retention takes a Retention, a policy or a list of policies, not {value!r}: for example "
                "Retention(keep_last=3, keep_every=1000) or [KeepLast(3), KeepEvery(1000)]")
        return cls(*value)

    def decide(self, infos: Sequence[RetentionInfo], now: float) -> list[Decision]:
        return decide(infos, self.policies, now)

    def __repr__(self) -> str:
        return f"Retention({', '.join(map(repr, self.policies))})"


def decide(infos: Sequence[RetentionInfo], policies: Sequence[Policy], now: float) -> list[Decision]:
    """Keep/drop decision for every checkpoint, sorted by step. Pure: no I/O, no clock.

    Kept: the latest step, every pinned step, every step any policy keeps,
    and the keyframe of each of those (so the next save can still delta-encode
    against it; its chunks are live anyway while a kept delta needs them).
    Steps must be unique.
    """
    steps = [i.step for i in infos]
    if len(set(steps)) != len(steps):
        raise InvalidArgumentError("decide() got the same step twice")
    reasons: dict[int, list[str]] = {s: [] for s in steps}
    if steps:
        reasons[max(steps)].append("latest")
    for info in infos:
        reasons[info.step].extend(f"pinned:{tag}" for tag in sorted(info.pins))
    for policy in policies:
        for step, why in policy.keeps(infos, now).items():
            reasons[step].append(why)
    primary = {s for s in steps if reasons[s]}
    dependents: dict[int, list[int]] = {}
    for info in sorted(infos, key=lambda i: i.step):
        k = info.keyframe
        if info.step in primary and k is not None and k != info.step and k in reasons:
            dependents.setdefault(k, []).append(info.step)
    for k, deps in dependents.items():
        shown = ", ".join(map(str, deps)) if len(deps) <= 4 else f"{deps[0]}, {deps[1]}, ..., {deps[-1]}"
        reasons[k].append(f"keyframe of {shown}")
    return [Decision(s, bool(reasons[s]), tuple(reasons[s])) for s in sorted(steps)]


def validate_tag(tag: str) -> str:
    """A pin tag: 1-128 characters of ASCII letters, digits, ``._-``, not starting with ``.`` or ``-``."""
    if not is_valid_tag(tag):
        raise InvalidArgumentError(
            f"invalid pin tag {tag!r}: use 1-128 letters, digits, '.', '_' or '-', starting with a letter, digit or '_'"
        )
    return tag


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    v = float(value)
    return v if math.isfinite(v) else None
