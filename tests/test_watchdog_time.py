"""Time only moves forward inside the watchdog (issue 20, points 3 to 5).

* Every clock reading is validated: a reading that is not a finite number is a
  :class:`~stallguard.ClockError` naming the clock and the value, never an expiry and
  never a half-made record.
* The clock is read where the order of the deadline FIFOs is decided, and a reading
  earlier than the latest one the watchdog saw counts as that latest one, so each FIFO
  stays in time order and "only the head can be due" holds: nothing that
  ``snapshot()`` shows overdue survives a ``check()``.
* A progress window only ever extends.

The crossings of two ``observe()`` (or ``heartbeat()``) calls are forced, not hoped
for: a clock that pauses one thread between its reading and its return, and a lock that
says when a second thread waits for it. No test sleeps; the only timeouts are safety
bounds against a hang.
"""

from __future__ import annotations

import datetime
import math
import threading
from typing import Any

import pytest

import stallguard as sg
from stallguard.testing import FakeClock

SAFETY = 30  # seconds: only guards against a hang

SPEC = sg.Spec(
    "time",
    {"X": 10, "Y": 20, "W": sg.Deadline(seconds=100, stall=10), "Free": None},
    terminal=["Done"],
)

pytestmark = pytest.mark.usefixtures("no_hooks")


def overdue_in_snapshot(wd: sg.Watchdog[Any], now: float) -> set[object]:
    """Keys the watchdog's own snapshot shows past their state deadline at *now*."""
    return {
        r.key for r in wd.snapshot(now=now).requests if r.remaining is not None and r.remaining <= 0
    }


# --------------------------------------------------------------------------- readings


class Readings:
    """A clock that returns the given readings, then repeats the last one."""

    def __init__(self, *readings: Any) -> None:
        self.readings = list(readings)

    def __call__(self) -> Any:
        if len(self.readings) > 1:
            return self.readings.pop(0)
        return self.readings[0]

    def then(self, *readings: Any) -> None:
        self.readings = list(readings)


BAD_READINGS = [
    float("nan"),
    float("inf"),
    float("-inf"),
    None,
    "12.5",
    datetime.datetime(2026, 1, 1),
    True,
    10**400,
    [1.0],
]


def test_a_nan_clock_never_expires_a_healthy_request() -> None:
    """It did: NaN compares false with every due time, so the first check() failed
    every tracked request at once."""
    clock = Readings(0.0)
    failed: list[object] = []
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock, on_expire=failed.append)
    wd.observe("healthy", "X")  # due at 10
    clock.then(float("nan"))
    with pytest.raises(sg.ClockError, match=r"clock .* returned nan"):
        wd.check()
    assert failed == [] and "healthy" in wd and not wd.expired("healthy")
    clock.then(9.0)
    assert wd.check() == []  # and a good reading later is exact again
    clock.then(10.0)
    assert [e.key for e in wd.check()] == ["healthy"]


@pytest.mark.parametrize("bad", BAD_READINGS, ids=repr)
def test_a_bad_reading_is_a_named_error_and_changes_nothing(bad: Any) -> None:
    """A clock returning None, a string or a datetime failed deep inside observe()
    (``unsupported operand``), after it had half-made the record."""
    clock = Readings(0.0)
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock)
    wd.observe("old", "W")
    clock.then(bad)
    for call in (
        lambda: wd.observe("new", "X"),
        lambda: wd.observe("old", "X"),
        lambda: wd.heartbeat("old"),
        lambda: wd.forget("old"),
        lambda: wd.snapshot(),
    ):
        with pytest.raises(sg.ClockError) as caught:
            call()
        message = str(caught.value)
        assert "'time'" in message and "clock" in message and repr(clock) in message
        assert (repr(bad) if not isinstance(bad, int) or bad is True else "digits") in message
        assert caught.value.reading is bad
        assert isinstance(caught.value, ValueError)
    try:
        got = wd.check()  # a check with nothing due may not even look at the reading
    except sg.ClockError:
        got = []
    assert got == []
    # nothing changed: the same request, in the same state, with the same deadlines
    clock.then(1.0)
    assert "new" not in wd and wd.state_of("old") == "W"
    assert [(r.key, r.entered_at) for r in wd.snapshot().requests] == [("old", 0.0)]
    assert wd.next_deadline() == 10.0
    assert wd.snapshot().tracked == 1


def test_integer_readings_are_times() -> None:
    clock = Readings(3)
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock)
    wd.observe("k", "X")
    [request] = wd.snapshot().requests
    assert request.entered_at == 3.0 and type(request.entered_at) is float
    clock.then(13)
    assert [e.key for e in wd.check()] == ["k"]


def test_guard_names_a_bad_clock_too() -> None:
    clock = Readings(0.0)
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock)

    @wd.guard(key=lambda room: room, failed="failed")
    def poll(room: str) -> str:
        return "X"

    assert poll("r") == "X"
    clock.then(float("nan"))
    with pytest.raises(sg.ClockError):
        poll("r")  # same state: only the check reads the clock
    assert "r" in wd


# --------------------------------------------------------------------------- backwards


def test_a_reading_that_goes_backwards_counts_as_the_latest_one() -> None:
    """Before: the FIFO took the earlier reading behind the later one, and a request
    the snapshot showed overdue survived check() until the one in front fell due."""
    clock = Readings(100.0)
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock)
    wd.observe("a", "X")
    clock.then(90.0)  # a clock that stepped back (a broken one, or a race)
    wd.observe("b", "X")
    entered = {r.key: r.entered_at for r in wd.snapshot(now=100.0).requests}
    assert entered == {"a": 100.0, "b": 100.0}  # b never starts before what was seen
    for now in (100.0, 105.0, 109.9):
        assert overdue_in_snapshot(wd, now) == set()
        assert wd.check(now) == []
    assert wd._in_time_order()
    assert sorted(e.key for e in wd.check(110.0)) == ["a", "b"]


def test_a_heartbeat_that_goes_backwards_never_shortens_the_window() -> None:
    clock = Readings(90.0)
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock)
    wd.observe("k", "W")
    clock.then(105.0)
    assert wd.heartbeat("k")  # the window now ends at 115
    clock.then(100.0)
    assert wd.heartbeat("k")
    assert wd.check(114.9) == []  # before: failed at 110 while healthy
    [expiry] = wd.check(115.0)
    assert (expiry.reason, expiry.entered_at) == ("stall", 105.0)
    assert wd._in_time_order()


def test_forget_and_snapshot_never_see_negative_time() -> None:
    clock = Readings(50.0)
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock)
    left: list[float] = []
    wd.add_listener(on_leave=lambda label, seconds: left.append(seconds))
    wd.observe("k", "X")
    clock.then(40.0)
    [request] = wd.snapshot().requests
    assert request.age == 0.0
    wd.forget("k")
    assert left == [0.0]


# --------------------------------------------------------------------------- crossings


class GatedClock:
    """A settable clock that pauses one chosen thread between taking its reading and
    returning it: the moment another thread can overtake it."""

    def __init__(self, now: float) -> None:
        self.now = now
        self.target: threading.Thread | None = None
        self.paused = threading.Event()
        self.resume = threading.Event()

    def pause(self, thread: threading.Thread) -> None:
        self.target = thread

    def __call__(self) -> float:
        reading = self.now
        if threading.current_thread() is self.target:
            self.target = None
            self.paused.set()
            assert self.resume.wait(SAFETY), "never resumed"
        return reading


class ContendedLock:
    """The watchdog's lock, saying (through *progress*) when a thread has to wait for
    it: then the thread that holds it can be let go."""

    def __init__(self, progress: threading.Event) -> None:
        self._lock = threading.Lock()
        self.progress = progress

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            self.progress.set()
            self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def cross(wd: sg.Watchdog[Any], clock: GatedClock, first: Any, second: Any, later: float) -> None:
    """Run *first* on a thread whose clock reading is paused; while it is paused, move
    the clock to *later* and run *second* on another thread as far as it gets (to its
    end, or until it waits for the watchdog's lock); then let *first* finish."""
    progress = threading.Event()
    wd._lock = ContendedLock(progress)  # type: ignore[assignment]
    errors: list[BaseException] = []

    def run(fn: Any, done: threading.Event | None) -> None:
        try:
            fn()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            if done is not None:
                done.set()

    a = threading.Thread(target=run, args=(first, None), daemon=True)
    clock.pause(a)
    a.start()
    assert clock.paused.wait(SAFETY), "the first call never read the clock"
    clock.now = later
    b = threading.Thread(target=run, args=(second, progress), daemon=True)
    b.start()
    assert progress.wait(SAFETY), "the second call neither ended nor waited for the lock"
    clock.resume.set()
    for thread in (a, b):
        thread.join(SAFETY)
        assert not thread.is_alive()
    assert not errors, errors


def test_crossing_observes_keep_the_fifo_in_time_order() -> None:
    """Before: observe() read the clock, then took the lock; a call that read 100 and
    appended after one that read 105 put the FIFO out of order, and the request that
    entered at 100 survived check(110) although the snapshot showed it overdue (and a
    runner slept past it) until the one in front fell due at 115."""
    clock = GatedClock(100.0)
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock)
    cross(wd, clock, lambda: wd.observe("a", "X"), lambda: wd.observe("b", "X"), later=105.0)
    entered = {r.key: r.entered_at for r in wd.snapshot(now=105.0).requests}
    assert entered == {"a": 100.0, "b": 105.0}
    assert wd.next_deadline() == 110.0
    assert overdue_in_snapshot(wd, 110.0) == {"a"}
    assert [e.key for e in wd.check(110.0)] == ["a"]  # nothing overdue survives
    assert overdue_in_snapshot(wd, 110.0) == set()
    assert wd._in_time_order()
    assert [e.key for e in wd.check(115.0)] == ["b"]


@pytest.mark.parametrize("admitted", [False, True], ids=["young", "admitted"])
def test_crossing_state_changes_keep_the_fifo_in_time_order(admitted: bool) -> None:
    """(With *admitted*, the requests are on the clocks before the crossing changes,
    whose entries then go onto the FIFO: its order is what is checked; young ones put
    no entry anywhere and must expire the same.)"""
    clock = GatedClock(100.0)
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock)
    wd.observe("a", "Y")
    wd.observe("b", "Y")
    if admitted:
        wd.next_deadline()  # admits both (they might be due before anything known)
    assert [r.young for r in wd._where.values()] == [not admitted] * 2
    cross(wd, clock, lambda: wd.observe("a", "X"), lambda: wd.observe("b", "X"), later=105.0)
    assert overdue_in_snapshot(wd, 110.0) == {"a"}
    assert [e.key for e in wd.check(110.0)] == ["a"]
    assert wd._in_time_order()


@pytest.mark.parametrize("admitted", [False, True], ids=["young", "admitted"])
def test_crossing_heartbeats_never_move_a_window_back(admitted: bool) -> None:
    """Before: heartbeats that read 100 and 105 and appended in the opposite order
    moved the window back to 100, and the request was failed at 110 while healthy."""
    clock = GatedClock(90.0)
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock)
    wd.observe("k", "W")  # the window starts at 90
    if admitted:
        wd.next_deadline()
    assert wd._where["k"].young is not admitted
    clock.now = 100.0
    cross(wd, clock, lambda: wd.heartbeat("k"), lambda: wd.heartbeat("k"), later=105.0)
    assert wd.check(114.9) == []
    [expiry] = wd.check(115.0)
    assert (expiry.key, expiry.reason, expiry.entered_at) == ("k", "stall", 105.0)
    assert wd._in_time_order()


# --------------------------------------------------------------------------- at=


@pytest.mark.parametrize(
    ("at", "error"),
    [
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        (float("-inf"), ValueError),
        ("1", TypeError),
        (2000.0, ValueError),  # later than now
    ],
    ids=repr,
)
def test_a_same_state_observe_refuses_a_bad_at_like_any_other(at: Any, error: type) -> None:
    """Before: observe(k, same_state, at=nan) returned without a word."""
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=FakeClock(1000.0))
    wd.observe("k", "X")
    with pytest.raises(error, match="at"):
        wd.observe("k", "X", at=at)
    wd.observe("k", "X", at=999.0)  # a good one is still a no-op
    assert [r.entered_at for r in wd.snapshot().requests] == [1000.0]


def test_time_never_runs_backwards_through_at() -> None:
    clock = FakeClock(100.0)
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock)
    wd.observe("a", "X")
    wd.observe("b", "X", at=95.0)  # raised to the tail: the FIFO stays in order
    assert wd._in_time_order()
    assert math.isclose(wd.next_deadline() or 0, 110.0)
