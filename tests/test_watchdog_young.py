"""Deferred admission (issue 25): a new request is *young*, with no entry on any
deadline clock, until a check or ``next_deadline()`` that could need it admits it.
Every deadline of a young request must fire at exactly the time it would if it were on
the clocks: these tests pin the edges (docs/watchdog.md, "How it works")."""

from __future__ import annotations

import pytest

import stallguard as sg
from stallguard.instrumentation import set_on_expire_hooks
from stallguard.testing import FakeClock

#: the shortest duration is 1 s (Short): a request is admitted by a check that runs at
#: least 0.5 s after it was first seen
SPEC = sg.Spec(
    "young",
    {"Long": 100, "Short": 1, "Slow": sg.Deadline(50, stall=10), "Free": None},
    terminal=["Done"],
    lifetime=30,
)


@pytest.fixture
def clock() -> FakeClock:
    set_on_expire_hooks([])
    return FakeClock(1000.0)


def entries(wd: sg.Watchdog[str]) -> int:
    return sum(len(c.q) + len(c.heap) for c in wd._clocks)


def young(wd: sg.Watchdog[str]) -> list[str]:
    return [rec.key for rec in wd._where.values() if rec.young]


def test_a_request_that_ends_before_admission_never_touches_a_clock(clock: FakeClock) -> None:
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock)
    wd.observe("r", "Long")
    wd.observe("r", "Slow")
    wd.heartbeat("r")
    wd.observe("r", "Long")
    assert young(wd) == ["r"] and entries(wd) == 0
    wd.observe("r", "Done")
    assert entries(wd) == 0 and len(wd._young.q) == 0  # its queue entry went with it
    clock.advance(1000)
    assert wd.check() == [] and wd.next_deadline() is None
    assert wd._footprint()["entries"] == 0


def test_a_short_deadline_entered_while_young_fires_exactly_on_time(clock: FakeClock) -> None:
    """A request young for a long time (no check ran) moves into the 1 s state: the
    check at its deadline admits it and expires it, not a moment later or earlier."""
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock)
    wd.observe("r", "Long")
    clock.advance(20)
    assert wd.check() == []  # nothing due: no admission either
    wd.observe("r", "Short")  # 1020
    assert young(wd) == ["r"]
    clock.advance(0.999)
    assert wd.check() == []
    clock.advance(0.001)
    [expiry] = wd.check()
    assert (expiry.key, expiry.reason, expiry.entered_at, expiry.elapsed) == (
        "r",
        "state",
        1020.0,
        pytest.approx(1.0),
    )
    assert wd.check() == [] and wd.expired("r")


def test_a_deadline_shorter_than_the_admission_delay_is_not_missed(clock: FakeClock) -> None:
    """Right after a request is first seen it is young, and a check at its first
    possible deadline (the shortest duration) finds it due: admission is never later
    than a deadline."""
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock)
    wd.observe("r", "Short")
    assert wd.next_deadline() == 1001.0
    assert wd.check(now=1000.999) == []
    [expiry] = wd.check(now=1001.0)
    assert expiry.key == "r" and expiry.elapsed == 1.0


def test_young_and_admitted_requests_expire_in_deadline_order(clock: FakeClock) -> None:
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock)
    wd.observe("old", "Long")  # lifetime due 1030
    clock.advance(5)
    wd.next_deadline()  # admits "old" (it might be due before anything known)
    assert young(wd) == []
    wd.observe("new", "Short")  # 1005: due 1006, young
    assert young(wd) == ["new"]
    clock.advance(100)
    assert [(e.key, e.reason) for e in wd.check()] == [("new", "state"), ("old", "lifetime")]


def test_next_deadline_is_exact_with_young_requests(clock: FakeClock) -> None:
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock)
    wd.observe("a", "Long")
    assert wd.next_deadline() == 1030.0  # the lifetime
    clock.advance(2)
    wd.observe("b", "Slow")  # stall window: 1012
    wd.observe("c", "Free")  # lifetime only: 1032
    assert wd.next_deadline() == 1012.0
    clock.advance(1)
    wd.heartbeat("b")  # 1003: the window to 1013
    assert wd.next_deadline() == 1013.0
    wd.forget("b")
    assert wd.next_deadline() == 1030.0


def test_an_earlier_deadline_of_a_young_request_wakes_the_runner(clock: FakeClock) -> None:
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock)
    wakes: list[float | None] = []
    wd.add_listener(on_earlier_deadline=lambda: wakes.append(wd.next_deadline()))
    wd.observe("a", "Long")  # lifetime 1030
    clock.advance(1)
    wd.observe("b", "Long")  # 1031: later, no wake
    wd.observe("b", "Short")  # 1002: earlier, a wake
    assert wakes == [1030.0, 1002.0]


def test_snapshot_counts_and_ages_young_requests(clock: FakeClock) -> None:
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock)
    wd.observe("a", "Long")
    clock.advance(10)
    wd.next_deadline()  # "a" admitted
    wd.observe("b", "Long")
    wd.observe("c", "Free")
    clock.advance(1)
    snap = wd.snapshot(requests=False)
    assert snap.tracked == 3
    assert (snap.states["Long"].count, snap.states["Long"].oldest_age) == (2, 11.0)
    assert (snap.states["Free"].count, snap.states["Free"].oldest_age) == (1, 1.0)
    assert snap.states["Short"].oldest_age is None
    assert [r.key for r in wd.snapshot().requests] == ["a", "b", "c"]


def test_report_mode_reports_a_young_request_once_per_deadline(clock: FakeClock) -> None:
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock, mode="report")
    wd.observe("r", "Short")
    clock.advance(1)
    assert [(e.key, e.reason) for e in wd.check()] == [("r", "state")]
    clock.advance(5)
    assert wd.check() == []
    clock.advance(24)
    assert [(e.key, e.reason) for e in wd.check()] == [("r", "lifetime")]
    assert wd.state_of("r") == "Short"  # report mode: still tracked


def test_stall_window_and_lifetime_of_a_young_request(clock: FakeClock) -> None:
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock)
    wd.observe("s", "Slow")
    wd.observe("l", "Free")
    for _ in range(3):
        clock.advance(9)
        wd.heartbeat("s")  # renewed while young: 1027 + 10
    assert young(wd) == ["s", "l"]
    clock.advance(2.999)  # 1029.999
    assert wd.check() == []
    clock.advance(0.001)  # 1030: both lifetimes
    assert [(e.key, e.reason) for e in wd.check()] == [("s", "lifetime"), ("l", "lifetime")]


def test_a_young_requests_at_is_raised_as_on_the_clocks(clock: FakeClock) -> None:
    """An ``at=`` earlier than the latest start given on a clock is raised to it,
    whether the request that got that start is young or not (as before deferral)."""
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock)
    clock.advance(10)
    wd.observe("late", "Short")  # 1010, young
    wd.observe("early", "Short", at=1005.0)  # raised to 1010
    assert [r.entered_at for r in wd.snapshot().requests] == [1010.0, 1010.0]
    assert wd.check(now=1010.999) == []
    assert sorted(e.key for e in wd.check(now=1011.0)) == ["early", "late"]


def test_an_at_earlier_than_the_young_queue_is_admitted_at_once(clock: FakeClock) -> None:
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock)
    clock.advance(10)
    wd.observe("a", "Long")  # 1010
    wd.observe("b", "Free", at=1004.0)  # first seen before the queue's tail: admitted
    assert young(wd) == ["a"]
    assert [len(c.q) + len(c.heap) for c in wd._clocks if c.reason == "lifetime"] == [1]
    # b's lifetime starts at 1010, raised to a's (as it always was: the lifetime clock's
    # latest start)
    assert wd.next_deadline() == 1040.0
    assert wd.check(now=1039.999) == []
    # (equal due times on one clock: in the order the entries were admitted)
    assert sorted(e.key for e in wd.check(now=1040.0)) == ["a", "b"]


def test_forget_and_track_again_while_young(clock: FakeClock) -> None:
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock)
    wd.observe("r", "Short")
    clock.advance(0.5)
    assert wd.forget("r", remember=False)
    wd.observe("r", "Short")  # 1000.5: a new record, a new queue entry
    clock.advance(0.5)
    assert wd.check() == []  # the first record's deadline (1001) is not the new one's
    clock.advance(0.5)
    [expiry] = wd.check()
    assert expiry.entered_at == 1000.5


def test_the_young_queue_holds_at_most_twice_the_young_requests(clock: FakeClock) -> None:
    """No check runs: the queue is compacted as young requests end, so it keeps no
    more than twice their keys."""
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock)
    for n in range(10_000):
        wd.observe(f"r{n}", "Long")
        if n >= 10:
            wd.observe(f"r{n - 10}", "Done")
        assert len(wd._young.q) <= 2 * len(young(wd)) + 1 if n % 997 == 0 else True
    assert len(young(wd)) == 10
    assert len(wd._young.q) <= 20
