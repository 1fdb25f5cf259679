"""Time-in-state statistics (stallguard/_stats.py) and the watchdog's recording of them.

Promises tested here (docs/advice.md):
* a quantile is never below the true sample quantile and at most RESOLUTION above it;
* counts above any LADDER value are exact;
* every stay a request leaves (state change, terminal, forget, expiry) is recorded once,
  in both modes, with its exact duration;
* a request whose deadline fired counts once, in the state of its first report, and its
  ending is classified once;
* memory stays bounded; a copy taken while threads record is consistent.
"""

from __future__ import annotations

import math
import sys
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stallguard as sg
from stallguard._stats import (
    BOUNDS,
    FORGOTTEN,
    LADDER,
    RESOLUTION,
    Distribution,
    StatsRecorder,
    sample_quantile,
)
from stallguard.instrumentation import set_on_expire_hooks
from stallguard.testing import FakeClock

SPEC = sg.Spec(
    "stats",
    {"a": 3, "b": 5, "c": sg.Deadline(seconds=8, stall=2), "d": None},
    terminal=["ok", "err"],
    lifetime=12,
)

# seconds between 1 ms and one week, spread over every decade
durations = st.floats(min_value=-3, max_value=math.log10(604800)).map(lambda e: 10.0**e)
QUANTILES = st.sampled_from([0.0, 0.1, 0.5, 0.9, 0.99, 0.999, 1.0])


def record(values: list[float]) -> Distribution:
    rec = StatsRecorder(SPEC)
    for v in values:
        rec.left("a", v)
    return rec.freeze("enforce").states["a"].distribution


def test_layout():
    assert BOUNDS[-1] == math.inf
    assert BOUNDS[0] == 1e-3 and BOUNDS[-2] == 604800
    assert set(LADDER) <= set(BOUNDS)
    assert 1.04 < RESOLUTION <= 2 ** (1 / 16) + 1e-12
    assert len(BOUNDS) < 800


@settings(max_examples=200, deadline=None)
@given(st.lists(durations, min_size=1, max_size=300), QUANTILES)
def test_quantile_is_never_low_and_at_most_the_resolution_high(values, q):
    dist = record(values)
    true = sample_quantile(values, q)
    estimate = dist.quantile(q)
    assert true <= estimate <= true * RESOLUTION
    low, high = dist.quantile_range(q)
    assert low < true <= high


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0, 1e-3), min_size=1, max_size=50), QUANTILES)
def test_below_a_millisecond_quantiles_read_at_most_one_millisecond(values, q):
    estimate = record(values).quantile(q)
    assert sample_quantile(values, q) <= estimate <= 1e-3


@settings(max_examples=200, deadline=None)
@given(st.lists(durations, max_size=200))
def test_count_above_a_ladder_value_is_exact(values):
    dist = record(values)
    for value in LADDER:
        assert dist.count_above(value) == sum(1 for v in values if v > value)
    assert dist.count == len(values)
    assert dist.total == pytest.approx(sum(values))
    assert dist.max == (max(values) if values else None)


def test_count_above_between_bounds_counts_the_straddling_bucket():
    dist = record([1.001, 1.002])  # one bucket just above 1 s
    assert dist.count_above(1.0015) == 2  # conservative: the bucket straddles it
    assert dist.count_above(1.0) == 2
    assert dist.count_above(2.0) == 0


def test_distribution_validation_and_arithmetic():
    with pytest.raises(ValueError, match="one count per bound"):
        Distribution((1.0, math.inf), (1,))
    with pytest.raises(ValueError, match="end with inf"):
        Distribution((1.0, 2.0), (1, 1))
    with pytest.raises(ValueError, match="increasing"):
        Distribution((2.0, 1.0, math.inf), (0, 0, 0))
    with pytest.raises(ValueError, match="quantile q"):
        record([1.0]).quantile(1.5)
    a = record([1.0, 2.0])
    b = record([1.0, 2.0, 30.0])
    assert (b - a).count == 1 and (b - a).quantile(1) == 30.0
    assert (a + b).count == 5 and (a + b).max == 30.0
    with pytest.raises(ValueError, match="later"):
        a - b
    assert record([]).quantile(0.5) is None


# --------------------------------------------------------------------------- watchdog

STATES = ["a", "b", "c", "d", "ok", "err"]
KEYS = st.integers(0, 5)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("observe"), KEYS, st.sampled_from(STATES)),
        st.tuples(st.just("heartbeat"), KEYS),
        st.tuples(st.just("forget"), KEYS),
        st.tuples(st.just("advance"), st.sampled_from([0, 0.5, 1, 2, 3, 5])),
        st.tuples(st.just("check")),
    ),
    max_size=100,
)


class Model:
    """What the statistics must say, from the operations and the expiries check()
    returned: every stay, per state; per state the first-reported requests and how
    they ended."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.where: dict[int, tuple[str, float]] = {}
        self.gone: set[int] = set()
        self.stays: dict[str, list[float]] = {s: [] for s in ("a", "b", "c", "d")}
        self.fired: dict[str, int] = dict.fromkeys(self.stays, 0)
        self.first: dict[int, str] = {}
        self.then: dict[str, dict[str, int]] = {s: {} for s in self.stays}

    def leave(self, key: int, now: float) -> None:
        state, entered = self.where.pop(key)
        self.stays[state].append(now - entered)

    def ended(self, key: int, how: str) -> None:
        state = self.first.pop(key, None)
        if state is not None:
            self.then[state][how] = self.then[state].get(how, 0) + 1

    def observe(self, key: int, state: str, now: float) -> None:
        if key in self.gone:
            return
        current = self.where.get(key)
        if current is not None and current[0] == state:
            return
        terminal = state in ("ok", "err")
        if current is None:
            if terminal:
                self.gone.add(key)  # a finished request is never tracked again
            else:
                self.where[key] = (state, now)
            return
        self.leave(key, now)
        if terminal:
            self.gone.add(key)
            self.ended(key, state)
        else:
            self.where[key] = (state, now)

    def forget(self, key: int, now: float) -> None:
        if key in self.where:
            self.leave(key, now)
            self.ended(key, FORGOTTEN)
        self.gone.add(key)

    def expired(self, key: int, now: float) -> None:
        state = self.where[key][0]
        if self.mode == "enforce":
            self.fired[state] += 1
            self.leave(key, now)
            self.gone.add(key)
        elif key not in self.first:
            self.first[key] = state
            self.fired[state] += 1


def run(mode: str, operations: list[tuple]) -> None:
    set_on_expire_hooks([])
    clock = FakeClock()
    wd = sg.Watchdog(SPEC, clock=clock, mode=mode, statistics=True)
    model = Model(mode)
    for op in operations:
        kind = op[0]
        if kind == "observe":
            wd.observe(op[1], op[2])
            model.observe(op[1], op[2], clock())
        elif kind == "heartbeat":
            wd.heartbeat(op[1])
        elif kind == "forget":
            wd.forget(op[1])
            model.forget(op[1], clock())
        elif kind == "advance":
            clock.advance(op[1])
        else:
            for expiry in wd.check():
                model.expired(expiry.key, clock())
    stats = wd.statistics()
    assert stats.spec == "stats" and stats.mode == mode
    for state, stays in model.stays.items():
        got = stats.states[state]
        assert got.count == len(stays), state
        assert got.distribution.total == pytest.approx(sum(stays))
        assert got.distribution.max == (max(stays) if stays else None)
        for value in LADDER[:16]:
            assert got.distribution.count_above(value) == sum(1 for v in stays if v > value)
        assert got.fired == model.fired[state]
        assert dict(got.fired_then) == model.then[state]
        assert got.deadline == SPEC.deadlines[state].seconds
        assert got.completed == ("ok",)
    assert wd._stats.reported == len(model.first)  # only tracked, reported requests


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_enforce_records_every_stay_and_every_expiry(operations):
    run("enforce", operations)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_report_records_every_stay_and_counts_each_reported_request_once(operations):
    run("report", operations)


def test_overstay_then_success_counts_once_as_a_would_be_false_positive():
    set_on_expire_hooks([])
    clock = FakeClock()
    wd = sg.Watchdog(SPEC, clock=clock, mode="report", statistics=True)
    wd.observe(1, "a")
    clock.advance(4)  # past a's 3 s
    assert [e.reason for e in wd.check()] == ["state"]
    wd.observe(1, "b")
    clock.advance(9)  # past b's 5 s and the 12 s lifetime: reported twice more
    assert {e.reason for e in wd.check()} == {"state", "lifetime"}
    wd.observe(1, "ok")
    stats = wd.statistics()
    assert stats.states["a"].fired == 1 and stats.states["b"].fired == 0
    assert stats.states["a"].fired_completed == 1
    assert dict(stats.states["a"].fired_then) == {"ok": 1}
    assert stats.states["a"].distribution.max == 4 and stats.states["b"].distribution.max == 9


def test_reported_then_failed_or_forgotten_is_not_a_false_positive():
    set_on_expire_hooks([])
    clock = FakeClock()
    wd = sg.Watchdog(SPEC, clock=clock, mode="report", statistics=True)
    wd.observe(1, "a")
    wd.observe(2, "a")
    clock.advance(4)
    wd.check()
    wd.observe(1, "err")
    wd.forget(2)
    a = wd.statistics().states["a"]
    assert a.fired == 2 and a.fired_completed == 0
    assert dict(a.fired_then) == {"err": 1, FORGOTTEN: 1}


def test_enforce_counts_expiries_and_cuts_the_stay_at_the_check():
    set_on_expire_hooks([])
    clock = FakeClock()
    wd = sg.Watchdog(SPEC, clock=clock, statistics=True)
    wd.observe(1, "b")
    clock.advance(6)
    assert len(wd.check()) == 1
    b = wd.statistics().states["b"]
    assert b.fired == 1 and b.count == 1 and b.distribution.max == 6
    assert b.fired_then == {}


def test_completed_rule_override_and_validation():
    rec = StatsRecorder(SPEC, completed=["err"])
    assert rec.completed == ("err",)
    with pytest.raises(ValueError, match="completed=.*'nope'"):
        StatsRecorder(SPEC, completed=["nope"])
    no_terminal = sg.Spec("nt", {"a": 1})
    assert StatsRecorder(no_terminal).completed == ()


def deep_size(rec: StatsRecorder) -> int:
    """Bytes held by the recorder's own containers and the ints in them."""
    size = sys.getsizeof(rec._reported) + sys.getsizeof(rec._hists)
    for h in rec._hists.values():
        size += sys.getsizeof(h.counts) + sum(sys.getsizeof(c) for c in h.counts)
        size += sys.getsizeof(h.then) + sys.getsizeof(h.forced) + sys.getsizeof(h.reported)
    return size


@pytest.mark.slow
def test_bounded_memory_after_a_million_requests():
    """A million requests through the recorder (each reported, recorded and ended) and
    a hundred thousand through a watchdog in report mode leave memory where it was
    after the first ten thousand."""
    rec = StatsRecorder(SPEC)

    def batch(start: int, stop: int) -> None:
        left, fired, ended = rec.left, rec.fired, rec.ended
        for key in range(start, stop):
            left("a", (key % 977) * 0.37)
            fired(key, "b", False, "state")
            ended(key, "ok")

    batch(0, 10_000)
    before = deep_size(rec)
    batch(10_000, 1_000_000)
    assert rec.reported == 0
    # the same structures, a few more ints above the small-int cache: no growth per request
    assert deep_size(rec) - before < 50_000
    stats = rec.freeze("report")
    assert stats.states["a"].count == 1_000_000
    assert stats.states["b"].fired == stats.states["b"].fired_completed == 1_000_000
    assert stats.states["b"].reported == {"state": 1_000_000}

    set_on_expire_hooks([])
    clock = FakeClock()
    wd = sg.Watchdog(
        SPEC.evolve(lifetime=None), clock=clock, mode="report", memory=16, statistics=True
    )
    for key in range(100_000):
        wd.observe(key, "a")
        if key % 100 == 0:
            clock.advance(3)
            wd.check()
        wd.observe(key, "ok")
    assert wd._stats.reported == 0
    assert wd.statistics().states["a"].count == 100_000


def test_statistics_copy_is_consistent_while_threads_record():
    """Writers move keys a -> b -> ok; a reader copies the statistics meanwhile. Every
    copy must satisfy count(b) <= count(a) (a key leaves a before it leaves b), counts
    only grow, and the final copy has every stay."""
    set_on_expire_hooks([])
    wd = sg.Watchdog(SPEC.evolve(lifetime=None), mode="report", statistics=True)
    writers, per = 4, 5_000
    done = threading.Event()
    problems: list[str] = []

    def write(base: int) -> None:
        for i in range(per):
            key = base * per + i
            wd.observe(key, "a")
            wd.observe(key, "b")
            wd.observe(key, "ok")

    def read() -> None:
        last = (0, 0)
        while not done.is_set():
            states = wd.statistics().states
            now = (states["a"].count, states["b"].count)
            if now[1] > now[0] or now[0] < last[0] or now[1] < last[1]:
                problems.append(f"inconsistent copy {now} after {last}")
            total = states["a"].distribution
            if total.count != sum(total.counts):
                problems.append("counts do not add up")
            last = now

    threads = [threading.Thread(target=write, args=(n,)) for n in range(writers)]
    reader = threading.Thread(target=read)
    reader.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    done.set()
    reader.join(timeout=30)
    assert not problems, problems[:3]
    states = wd.statistics().states
    assert states["a"].count == states["b"].count == writers * per
