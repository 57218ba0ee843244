"""Retention policies as a pure function: property-based tests of decide() and unit tests of each policy."""

from __future__ import annotations

import calendar

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from ckptvault._maintenance.retention import (
    DAY,
    WEEK,
    KeepBest,
    KeepDaily,
    KeepEvery,
    KeepIf,
    KeepInterval,
    KeepLast,
    KeepWeekly,
    Retention,
    RetentionInfo,
    decide,
    validate_tag,
)
from ckptvault.errors import InvalidArgumentError

NOW = 1_700_000_000.0  # a Tuesday, 22:13 UTC


def utc(year: int, month: int, day: int, hour: int = 0) -> float:
    return float(calendar.timegm((year, month, day, hour, 0, 0)))


def kept(decisions) -> set[int]:  # type: ignore[no-untyped-def]
    return {d.step for d in decisions if d.keep}


# -- strategies -------------------------------------------------------------------------------------
@st.composite
def checkpoint_sets(draw, with_keyframes: bool = True) -> list[RetentionInfo]:  # type: ignore[no-untyped-def]
    """Unique steps; times that mostly grow with the step (as in training) but may jitter; some metrics,
    some pins, and keyframe links that point back to an earlier keyframe step."""
    steps = sorted(draw(st.sets(st.integers(0, 5000), min_size=0, max_size=40)))
    infos: list[RetentionInfo] = []
    keyframe: int | None = None
    for step in steps:
        t = NOW - 30 * DAY + step * draw(st.sampled_from([60.0, 600.0, 3600.0])) + draw(st.floats(-900, 900))
        metrics: dict[str, object] = {}
        if draw(st.booleans()):
            metrics["loss"] = draw(st.floats(0, 10, allow_nan=False) | st.sampled_from([1.0, 2.0]))
        if draw(st.integers(0, 9)) == 0:
            metrics["loss"] = draw(st.sampled_from(["n/a", float("nan"), None, True]))
        pins = frozenset(draw(st.sets(st.sampled_from(["release", "best", "x_1"]), max_size=2))
                         if draw(st.integers(0, 6)) == 0 else ())
        if with_keyframes:
            if keyframe is None or draw(st.integers(0, 3)) == 0:
                keyframe = step
            infos.append(RetentionInfo(step, t, metrics, pins, keyframe))
        else:
            infos.append(RetentionInfo(step, t, metrics, pins))
    return infos


policies = st.one_of(
    st.builds(KeepLast, st.integers(1, 8)),
    st.builds(KeepEvery, st.integers(1, 600)),
    st.builds(KeepBest, st.integers(1, 5), st.just("loss"), st.sampled_from(["min", "max"])),
    st.builds(KeepDaily, st.integers(1, 10)),
    st.builds(KeepWeekly, st.integers(1, 6)),
    st.builds(KeepInterval, st.sampled_from([3600.0, 7200.0, 3 * DAY]), st.integers(1, 20)),
    st.just(KeepIf(lambda info: info.step % 7 == 3, "step % 7 == 3")),
)
policy_lists = st.lists(policies, min_size=0, max_size=4)


# -- properties -------------------------------------------------------------------------------------
@given(checkpoint_sets(), policy_lists)
def test_one_decision_per_step_sorted_and_keep_iff_a_reason(infos, chosen):  # type: ignore[no-untyped-def]
    decisions = decide(infos, chosen, NOW)
    assert [d.step for d in decisions] == sorted(i.step for i in infos)
    for d in decisions:
        assert d.keep == bool(d.reasons)


@given(checkpoint_sets(), policy_lists)
def test_latest_and_pinned_are_always_kept(infos, chosen):  # type: ignore[no-untyped-def]
    decisions = {d.step: d for d in decide(infos, chosen, NOW)}
    if infos:
        latest = max(i.step for i in infos)
        assert decisions[latest].keep and "latest" in decisions[latest].reasons
    for info in infos:
        for tag in info.pins:
            assert decisions[info.step].keep and f"pinned:{tag}" in decisions[info.step].reasons


@given(checkpoint_sets(with_keyframes=False), st.integers(1, 12))
def test_keep_last_n_keeps_exactly_the_n_newest(infos, n):  # type: ignore[no-untyped-def]
    infos = [RetentionInfo(i.step, i.time, i.metrics) for i in infos]  # no pins
    assert kept(decide(infos, [KeepLast(n)], NOW)) == set(sorted(i.step for i in infos)[-n:])


@given(checkpoint_sets(), policy_lists, policy_lists)
def test_policies_compose_by_union(infos, first, second):  # type: ignore[no-untyped-def]
    both = kept(decide(infos, first + second, NOW))
    assert both == kept(decide(infos, first, NOW)) | kept(decide(infos, second, NOW))


@given(checkpoint_sets(), policy_lists)
def test_applying_twice_deletes_nothing_more(infos, chosen):  # type: ignore[no-untyped-def]
    survivors = [i for i in infos if i.step in kept(decide(infos, chosen, NOW))]
    again = decide(survivors, chosen, NOW)
    assert all(d.keep for d in again), [d.step for d in again if not d.keep]


@given(checkpoint_sets(), policy_lists)
def test_kept_checkpoints_keep_their_keyframe(infos, chosen):  # type: ignore[no-untyped-def]
    decisions = kept(decide(infos, chosen, NOW))
    for info in infos:
        if info.step in decisions and info.keyframe is not None:
            assert info.keyframe in decisions


@given(checkpoint_sets(), policy_lists)
def test_decide_is_pure(infos, chosen):  # type: ignore[no-untyped-def]
    before = list(infos)
    assert decide(infos, chosen, NOW) == decide(infos, chosen, NOW)
    assert infos == before


@given(checkpoint_sets(with_keyframes=False), st.integers(1, 5), st.sampled_from(["min", "max"]))
def test_keep_best_keeps_the_best_finite_values(infos, n, mode):  # type: ignore[no-untyped-def]
    infos = [RetentionInfo(i.step, i.time, i.metrics) for i in infos]
    scored = [(float(i.metrics["loss"]), i.step) for i in infos
              if type(i.metrics.get("loss")) is float and i.metrics["loss"] == i.metrics["loss"]]
    assume(scored)
    chosen = KeepBest(n, "loss", mode).keeps(infos, NOW)
    values = sorted(v for v, _ in scored)
    cutoff = values[min(n, len(values)) - 1] if mode == "min" else sorted(values, reverse=True)[min(n, len(values)) - 1]
    assert len(chosen) == min(n, len(scored))
    for v, s in scored:
        if (mode == "min" and v < cutoff) or (mode == "max" and v > cutoff):
            assert s in chosen
        if s in chosen:
            assert (v <= cutoff) if mode == "min" else (v >= cutoff)


# -- policies one by one ------------------------------------------------------------------------------
def infos_at(steps, times=None, metrics=None):  # type: ignore[no-untyped-def]
    times = times or [NOW - (max(steps) - s) * 60.0 for s in steps]
    metrics = metrics or [{} for _ in steps]
    return [RetentionInfo(s, t, m) for s, t, m in zip(steps, times, metrics)]


def test_keep_every_keeps_multiples_of_k():
    infos = infos_at([0, 5, 7, 10, 15, 20, 23])
    assert KeepEvery(10).keeps(infos, NOW) == {0: "every 10 steps", 10: "every 10 steps", 20: "every 10 steps"}
    assert kept(decide(infos, [KeepEvery(10)], NOW)) == {0, 10, 20, 23}


def test_keep_best_ignores_checkpoints_without_the_metric():
    infos = infos_at([1, 2, 3, 4, 5], metrics=[{"loss": 3.0}, {}, {"loss": "bad"}, {"acc": 0.1}, {"loss": 1.0}])
    assert set(KeepBest(5, "loss").keeps(infos, NOW)) == {1, 5}
    assert set(KeepBest(1, "loss", "max").keeps(infos, NOW)) == {1}
    assert set(KeepBest(1, "loss", "min").keeps(infos, NOW)) == {5}
    assert KeepBest(2, "missing").keeps(infos, NOW) == {}


def test_keep_best_breaks_ties_towards_the_newer_step():
    infos = infos_at([1, 2, 3], metrics=[{"loss": 1.0}, {"loss": 1.0}, {"loss": 2.0}])
    assert set(KeepBest(1, "loss").keeps(infos, NOW)) == {2}


def test_keep_daily_keeps_the_newest_checkpoint_of_each_of_the_last_days():
    now = utc(2024, 3, 20, 12)
    times = [utc(2024, 3, d, h) for d in range(1, 21) for h in (1, 7, 13, 19) if utc(2024, 3, d, h) <= now]
    infos = [RetentionInfo(i, t) for i, t in enumerate(times)]
    chosen = KeepDaily(7).keeps(infos, now)
    assert len(chosen) == 7
    assert {times[i] for i in chosen} == {utc(2024, 3, d, 19) for d in range(14, 20)} | {utc(2024, 3, 20, 7)}
    assert set(chosen.values()) == {"daily for 7 days"}


def test_keep_weekly_buckets_start_on_monday_utc():
    sunday_night, monday_morning = utc(2024, 3, 17, 23), utc(2024, 3, 18, 1)  # 2024-03-18 is a Monday
    infos = [RetentionInfo(1, utc(2024, 3, 12)), RetentionInfo(2, sunday_night), RetentionInfo(3, monday_morning)]
    assert set(KeepWeekly(2).keeps(infos, utc(2024, 3, 19))) == {2, 3}
    assert set(KeepWeekly(1).keeps(infos, utc(2024, 3, 19))) == {3}
    assert WEEK == 7 * DAY


def test_interval_horizon_excludes_old_buckets_and_includes_future_stamps():
    infos = [RetentionInfo(1, NOW - 10 * 3600), RetentionInfo(2, NOW - 1800), RetentionInfo(3, NOW + 5000)]
    assert set(KeepInterval(3600.0, 3).keeps(infos, NOW)) == {2, 3}


def test_predicate_policy_sees_the_info():
    infos = infos_at([1, 2, 3], metrics=[{"tag": "eval"}, {}, {"tag": "eval"}])
    decisions = decide(infos, [KeepIf(lambda i: i.metrics.get("tag") == "eval", "evaluated")], NOW)
    assert [(d.step, d.keep, d.reasons) for d in decisions] == [
        (1, True, ("evaluated",)), (2, False, ()), (3, True, ("latest", "evaluated"))]


def test_keyframe_reason_names_the_dependents():
    infos = [RetentionInfo(s, NOW + s, keyframe=0 if s < 10 else 10) for s in range(12)]
    decisions = {d.step: d for d in decide(infos, [KeepLast(1), KeepEvery(4)], NOW)}
    assert decisions[0].reasons == ("every 4 steps", "keyframe of 4, 8")
    assert decisions[10].reasons == ("keyframe of 11",)
    assert not decisions[1].keep and not decisions[9].keep


def test_retention_keywords_equal_explicit_policies():
    r = Retention(keep_last=3, keep_every=100, keep_best=2, metric="loss", mode="max", keep_daily=7, keep_weekly=4)
    assert r.policies == (KeepLast(3), KeepEvery(100), KeepBest(2, "loss", "max"), KeepDaily(7), KeepWeekly(4))
    assert Retention.coerce(KeepLast(2)).policies == (KeepLast(2),)  # type: ignore[union-attr]
    assert Retention.coerce([KeepLast(2), KeepEvery(3)]).policies == (KeepLast(2), KeepEvery(3))  # type: ignore[union-attr]
    assert Retention.coerce(None) is None and Retention.coerce(r) is r
    assert r.gc and r.gc_grace == 3600.0


@pytest.mark.parametrize("kwargs, message", [
    ({}, "retention needs at least one policy"),
    ({"keep_last": 0}, "keep_last must be a positive int, got 0"),
    ({"keep_every": -5}, "keep_every must be a positive int, got -5"),
    ({"keep_best": 2}, "keep_best needs a metric name"),
    ({"keep_best": 2, "metric": "loss", "mode": "lowest"}, "mode must be 'min' or 'max', got 'lowest'"),
    ({"metric": "loss"}, "metric is only used with keep_best"),
    ({"keep_daily": 1.5}, "keep_daily must be a positive int"),
    ({"keep_last": 1, "gc_grace": -1}, "gc_grace must be a number of seconds >= 0, got -1"),
])
def test_invalid_retention_is_refused(kwargs, message):  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidArgumentError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Retention(**kwargs)


def test_non_policy_is_refused():
    with pytest.raises(InvalidArgumentError, match="is not a retention policy"):
        Retention("keep_last=3")  # type: ignore[arg-type]


def test_duplicate_steps_are_refused():
    with pytest.raises(InvalidArgumentError, match="decide\\(\\) got the same step twice"):
        decide([RetentionInfo(1, NOW), RetentionInfo(1, NOW)], [], NOW)


@pytest.mark.parametrize("tag", ["release-1", "best.v2", "_x", "A" * 128])
def test_valid_tags(tag):  # type: ignore[no-untyped-def]
    assert validate_tag(tag) == tag


@pytest.mark.parametrize("tag", ["", ".hidden", "-x", "a/b", "a b", "../x", "A" * 129, "é"])
def test_invalid_tags(tag):  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidArgumentError, match="invalid pin tag"):
        validate_tag(tag)
