"""``Watchdog.adopt`` and ``Watchdog.record_stays`` (issue 25): an integration that kept
a request itself while none of its deadlines could be due hands it over with the exact
starts it was given (``observe(..., at=)`` would raise them to the latest start on the
clock), and the stays of the requests it never handed over reach the statistics."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import stallguard as sg
from stallguard.instrumentation import set_on_expire_hooks
from stallguard.testing import FakeClock

SPEC = sg.Spec(
    "adopt",
    {"A": 10, "B": 20, "Slow": sg.Deadline(50, stall=5), "Free": None},
    terminal=["Done"],
)


@pytest.fixture
def clock() -> FakeClock:
    set_on_expire_hooks([])
    return FakeClock(1000.0)


def test_adopt_keeps_an_exact_start_that_observe_at_would_raise(clock: FakeClock) -> None:
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock, statistics=True)
    wd.observe("other", "A")  # the latest start on A's clock is now 1000
    assert wd.adopt("kept", "A", since=992.0)
    wd.observe("raised", "A", at=992.0)  # raised to 1000, as documented
    assert wd.state_of("kept") == "A"
    clock.set(1001.999)
    assert wd.check() == []
    clock.set(1002.0)
    [expiry] = wd.check()
    assert (expiry.key, expiry.entered_at, expiry.elapsed) == ("kept", 992.0, 10.0)
    clock.set(1010.0)
    assert sorted((e.key, e.entered_at) for e in wd.check()) == [
        ("other", 1000.0),
        ("raised", 1000.0),
    ]


def test_adopt_progress_window_counts_from_beat(clock: FakeClock) -> None:
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock)
    assert wd.adopt("r", "Slow", since=990.0, beat=998.0)
    assert wd.next_deadline() == 1003.0
    clock.set(1002.9)
    assert wd.check() == []
    assert wd.heartbeat("r")  # renewed at 1002.9: the window now ends at 1007.9
    clock.set(1007.9)
    [expiry] = wd.check()
    assert (expiry.reason, expiry.entered_at) == ("stall", 1002.9)


def test_adopt_refuses_what_observe_would_drop_or_refuse(clock: FakeClock) -> None:
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock)
    wd.observe("tracked", "A")
    assert not wd.adopt("tracked", "B", since=999.0)
    assert wd.state_of("tracked") == "A"
    wd.observe("done", "Done")  # concluded: remembered
    assert not wd.adopt("done", "A", since=999.0)
    assert "done" not in wd
    with pytest.raises(ValueError, match="live state"):
        wd.adopt("x", "Done", since=999.0)
    with pytest.raises(sg.UnknownStateError):
        wd.adopt("x", "Nope", since=999.0)
    with pytest.raises(ValueError, match="later than"):
        wd.adopt("x", "A", since=1000.5)
    with pytest.raises(ValueError, match="earlier than since"):
        wd.adopt("x", "Slow", since=999.0, beat=998.0)
    with pytest.raises(TypeError):
        wd.adopt("x", "A", since="999")  # type: ignore[arg-type]
    assert "x" not in wd


def test_adopt_in_report_mode_reports_once_and_keeps_tracking(clock: FakeClock) -> None:
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock, mode="report")
    assert wd.adopt("r", "A", since=995.0)
    clock.set(1005.0)
    [expiry] = wd.check()
    assert expiry.entered_at == 995.0 and "r" in wd
    clock.set(1100.0)
    assert wd.check() == []


def test_an_adopted_request_statistics_count_its_stay_from_since(clock: FakeClock) -> None:
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock, statistics=True)
    wd.adopt("r", "A", since=996.0)
    clock.set(1002.0)
    wd.observe("r", "Done")
    a = wd.statistics().states["A"].distribution
    assert (a.count, a.total, a.max) == (1, 6.0, 6.0)


def test_record_stays_adds_to_the_statistics_and_validates_the_whole_batch(
    clock: FakeClock,
) -> None:
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock, statistics=True)
    wd.record_stays([("A", 0.25), ("A", 1.5), ("Free", 3.0), ("B", 0)])
    states = wd.statistics().states
    assert (states["A"].distribution.count, states["A"].distribution.total) == (2, 1.75)
    assert (states["Free"].distribution.count, states["B"].distribution.count) == (1, 1)
    for bad, error in (
        ([("A", 1.0), ("Done", 1.0)], ValueError),
        ([("A", 1.0), ("Nope", 1.0)], ValueError),
        ([("A", 1.0), ("B", -1.0)], ValueError),
        ([("A", 1.0), ("B", float("nan"))], ValueError),
        ([("A", 1.0), ("B", "1")], TypeError),
    ):
        with pytest.raises(error):
            wd.record_stays(bad)  # type: ignore[arg-type]
    assert wd.statistics().states["A"].distribution.count == 2  # nothing of those
    quiet: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock)  # statistics off: no-op
    quiet.record_stays([("A", 1.0)])


@settings(max_examples=150, deadline=None)
@given(
    starts=st.lists(
        st.tuples(st.sampled_from(["A", "B"]), st.integers(0, 400)), min_size=1, max_size=12
    ),
    checks=st.lists(st.integers(0, 400), max_size=20),
)
def test_adopted_requests_expire_at_exactly_since_plus_deadline(
    starts: list[tuple[str, int]], checks: list[int]
) -> None:
    """Adopted in any order with any past starts, beside observed requests: each
    expires once, in the first check at or past its start plus its deadline."""
    set_on_expire_hooks([])
    clock = FakeClock(1000.0)
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock)
    wd.observe("observed", "A")
    due: dict[str, tuple[float, float]] = {"observed": (1000.0, 1010.0)}
    for i, (state, back) in enumerate(starts):
        since = 1000.0 - back / 40  # up to 10 s ago
        assert wd.adopt(f"k{i}", state, since=since)
        due[f"k{i}"] = (since, since + SPEC.deadlines[state].seconds)  # type: ignore[operator]
    fired: dict[str, tuple[float, float]] = {}
    for t in sorted({1000.0 + c / 20 for c in checks} | {1030.0}):
        clock.set(t)
        for expiry in wd.check():
            assert expiry.key not in fired
            fired[expiry.key] = (expiry.entered_at, t)
            assert due[expiry.key][1] <= t  # never early
        for key, (_since, at) in due.items():
            if at <= t:
                assert key in fired  # never missed
    assert set(fired) == set(due)
    for key, (since, _t) in fired.items():
        assert since == due[key][0]


def test_adopt_lifetime_counts_from_born_not_from_the_latest_state(clock: FakeClock) -> None:
    """A request kept while young changed state before it was handed over: its
    lifetime counts from when it was first seen (``born``), not from the start of the
    state it is handed over in (the default, ``since``, would give it 6 s more)."""
    spec = sg.Spec("life", {"A": 100, "B": 100}, terminal=["Done"], lifetime=30)
    wd: sg.Watchdog[str] = sg.Watchdog(spec, clock=clock)
    assert wd.adopt("r", "B", since=996.0, born=990.0)
    assert wd.adopt("control", "B", since=996.0)  # lifetime from since: 1026
    assert wd.next_deadline() == 1020.0
    clock.set(1019.999)
    assert wd.check() == []
    clock.set(1020.0)
    [expiry] = wd.check()
    assert (expiry.key, expiry.reason) == ("r", "lifetime")
    clock.set(1026.0)
    assert [e.key for e in wd.check()] == ["control"]
    with pytest.raises(ValueError, match="born=997.0 is later than since=996.0"):
        wd.adopt("x", "A", since=996.0, born=997.0)
    with pytest.raises(TypeError):
        wd.adopt("x", "A", since=996.0, born="990")  # type: ignore[arg-type]
