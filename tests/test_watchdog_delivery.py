"""A check's delivery loses nothing (issue 20, point 6 and the low ones).

A ``BaseException`` (``KeyboardInterrupt``, ``SystemExit``) raised anywhere in the
delivery of an expiry (``describe``, an enforcement hook, a listener, an instrumentation
hook) or of a leave notification propagates at once; what it interrupted is delivered,
and the expiries returned, by the next ``check()``. Each test failed on the code before
the fix (as its docstring says).
"""

from __future__ import annotations

import gc
import logging
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

import stallguard as sg
from stallguard.testing import FakeClock, record_expiries

SPEC = sg.Spec(
    "delivery",
    {"X": 10, "Y": 20, "Free": None, "Slow": sg.Deadline(stall=50)},
    terminal=["Done"],
)

pytestmark = pytest.mark.usefixtures("no_hooks")


class Interrupt(BaseException):
    """Stands in for KeyboardInterrupt / SystemExit."""


def once(error: type[BaseException]) -> Any:
    """A callable that raises *error* on its first call, then does nothing."""
    calls: list[object] = []

    def fn(*args: object) -> None:
        calls.append(args)
        if len(calls) == 1:
            raise error()

    return fn


def three_overdue(**kwargs: Any) -> tuple[sg.Watchdog[str], list[str]]:
    clock = FakeClock()
    enforced: list[str] = []
    kwargs.setdefault("on_expire", lambda e: enforced.append(e.key))
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock, **kwargs)
    for key in "abc":
        wd.observe(key, "X")
    clock.advance(10)
    return wd, enforced


# --------------------------------------------------------------------------- on_leave


def test_an_interrupting_leave_listener_in_check_loses_nothing() -> None:
    """Before: 3 requests enforced, none ever returned by any check(), 2 of 3 leave
    notifications lost."""
    wd, enforced = three_overdue()
    heard: list[tuple[str, float]] = []
    wd.add_listener(on_leave=once(KeyboardInterrupt))
    wd.add_listener(on_leave=lambda label, seconds: heard.append((label, seconds)))
    with pytest.raises(KeyboardInterrupt):
        wd.check()
    assert enforced == ["a", "b", "c"]  # delivered before the interruption
    assert [e.key for e in wd.check()] == ["a", "b", "c"]  # and returned by the next check
    assert enforced == ["a", "b", "c"]  # once each
    assert heard == [("X", 10.0)] * 3  # every leave notification, once
    assert wd.check() == []
    assert wd.snapshot().expired == 3


def test_an_interrupting_hook_loses_no_leave_notification() -> None:
    """Before: the batch's leave notifications were dropped with the interruption."""
    wd, _ = three_overdue(on_expire=once(Interrupt))
    heard: list[str] = []
    wd.add_listener(on_leave=lambda label, seconds: heard.append(label))
    with pytest.raises(Interrupt):
        wd.check()
    assert [e.key for e in wd.check()] == ["a", "b", "c"]
    assert heard == ["X", "X", "X"]


@pytest.mark.parametrize("how", ["observe", "forget"])
def test_an_interrupting_leave_listener_outside_check_loses_nothing(how: str) -> None:
    """Before: the listeners after the interrupted one never heard of the change."""
    clock = FakeClock()
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock)
    heard: list[tuple[str, float]] = []
    wd.add_listener(on_leave=once(Interrupt))
    wd.add_listener(on_leave=lambda label, seconds: heard.append((label, seconds)))
    wd.observe("k", "X")
    clock.advance(3)
    with pytest.raises(Interrupt):
        if how == "observe":
            wd.observe("k", "Y")
        else:
            wd.forget("k")
    assert wd.state_of("k") == ("Y" if how == "observe" else None)  # the change holds
    assert heard == []
    assert wd.check() == []  # the next check delivers it, even with nothing due
    assert heard == [("X", 3.0)]
    wd.check()
    assert heard == [("X", 3.0)]


def test_an_interrupting_wake_listener_still_wakes_the_others() -> None:
    """Before: a runner listening after it was not woken, and slept past the deadline."""
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=FakeClock())
    woken: list[float | None] = []
    wd.add_listener(on_earlier_deadline=once(Interrupt))
    wd.add_listener(on_earlier_deadline=lambda: woken.append(wd.next_deadline()))
    with pytest.raises(Interrupt):
        wd.observe("k", "X")
    assert woken == [10.0] and wd.state_of("k") == "X"


# --------------------------------------------------------------------------- listeners


def test_a_listener_removed_after_an_interrupted_check_is_not_called() -> None:
    """Before: the carried expiry still went to the listener removed meanwhile."""
    wd, _ = three_overdue(on_expire=once(Interrupt))
    removed: list[str] = []
    kept: list[str] = []
    handle = wd.add_listener(on_expire=lambda e: removed.append(e.key))
    wd.add_listener(on_expire=lambda e: kept.append(e.key))
    leave_removed: list[str] = []
    leave_handle = wd.add_listener(on_leave=lambda label, s: leave_removed.append(label))
    with pytest.raises(Interrupt):
        wd.check()
    assert removed == kept == []
    handle.remove()
    leave_handle.remove()
    assert [e.key for e in wd.check()] == ["a", "b", "c"]
    assert removed == [] and leave_removed == []
    assert kept == ["a", "b", "c"]


def test_in_report_mode_a_listener_that_is_on_expire_cannot_withdraw() -> None:
    """Before: the listener's CONCLUDED withdrew the report, because it was the same
    callable as the (report-mode: never called) enforcement hook."""

    def concluded(expiry: sg.Expiry[str]) -> object:
        return sg.CONCLUDED

    wd, _ = three_overdue(on_expire=concluded, mode="report")
    wd.add_listener(on_expire=concluded)
    with record_expiries() as recorded:
        assert [e.key for e in wd.check()] == ["a", "b", "c"]
    assert [e.key for e in recorded] == ["a", "b", "c"]
    assert wd.snapshot().withdrawn == 0


def test_in_enforce_mode_only_the_enforcement_call_can_withdraw() -> None:
    """The same callable as on_expire and as a listener: its return value counts where
    it enforces, and is ignored where it listens (as documented)."""
    calls: list[str] = []

    def hook(expiry: sg.Expiry[str]) -> object:
        calls.append(expiry.key)
        return None if len(calls) % 2 else sg.CONCLUDED  # enforces, then "concludes"

    wd, _ = three_overdue(on_expire=hook)
    wd.add_listener(on_expire=hook)
    assert [e.key for e in wd.check()] == ["a", "b", "c"]
    assert calls == ["a", "a", "b", "b", "c", "c"]
    assert wd.snapshot().withdrawn == 0 and all(wd.expired(k) for k in "abc")


# --------------------------------------------------------------------------- describe


class Items(Mapping[Any, Any]):
    """A mapping whose iteration fails half-way."""

    def __getitem__(self, name: Any) -> Any:
        return 1

    def __len__(self) -> int:
        return 2

    def __iter__(self) -> Iterator[Any]:
        yield "first"
        raise RuntimeError("iteration broke")


@pytest.mark.parametrize(
    ("described", "message"),
    [({"a": 1, 2: "x"}, "attribute names must be strings"), (Items(), "iteration broke")],
    ids=["a non-string name", "a broken mapping"],
)
def test_a_describe_is_taken_whole_or_not_at_all(
    described: Any, message: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: {"a": 1, 2: "x"} left "a" in the attributes."""
    wd, _ = three_overdue(describe=lambda key: described)
    with caplog.at_level(logging.ERROR, logger="stallguard"):
        got = wd.check()
    assert [dict(e.attributes) for e in got] == [{}, {}, {}]
    assert wd.snapshot().hook_errors == 3
    assert message in caplog.text


# --------------------------------------------------------------------------- late events


def test_a_terminal_event_after_a_forced_failure_is_a_late_event() -> None:
    """Before: dropped without being counted (a soak sent 119,907 late events and
    only 86,388 were counted: the Success ones were missing)."""
    clock = FakeClock()
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock)
    wd.observe("k", "X")
    clock.advance(10)
    assert [e.key for e in wd.check()] == ["k"]
    wd.observe("k", "Done")  # the transfer thread's Success, too late
    wd.observe("k", "X")
    assert wd.snapshot().late_events == 2
    assert wd.expired("k")  # still failed, still remembered as such
    # a terminal state repeated for a request that ended normally is not late
    wd.observe("j", "X")
    wd.observe("j", "Done")
    wd.observe("j", "Done")
    wd.observe("new", "Done")  # terminal first sight: remembered, not late
    wd.observe("new", "Done")
    assert wd.snapshot().late_events == 2


# --------------------------------------------------------------------------- memory


class Key:
    """A request key that can be watched for being freed."""

    __slots__ = ("__weakref__", "n")

    def __init__(self, n: int) -> None:
        self.n = n

    def __hash__(self) -> int:
        return self.n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Key) and other.n == self.n


@pytest.mark.parametrize("state", ["Free", "Slow"])
def test_requests_that_left_a_state_without_a_deadline_are_not_kept(state: str) -> None:
    """Before: 10**5 requests through a state without a deadline, all finished, stayed
    referenced (52 MB) until a snapshot() walked the state's FIFO."""
    wd: sg.Watchdog[Key] = sg.Watchdog(SPEC, clock=FakeClock(), memory=1)
    keys = [Key(n) for n in range(5_000)]
    for key in keys:
        wd.observe(key, state)
    for key in keys:
        wd.observe(key, "Done")
    refs = [weakref.ref(k) for k in keys]
    del keys, key
    gc.collect()
    # (Slow has a progress window: its entries are dropped once the window has passed
    # by a check; Free has no clock at all)
    if state == "Slow":
        wd.check(now=50.0)
    alive = sum(ref() is not None for ref in refs)
    assert alive <= 1  # the one key the memory of concluded keys still holds
    assert wd._footprint()["entries"] == 0


def test_the_snapshot_still_sees_the_oldest_request_of_a_state_without_a_deadline() -> None:
    clock = FakeClock()
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock)
    wd.observe("a", "Free")
    clock.advance(5)
    wd.observe("b", "Free")
    clock.advance(5)
    summary = wd.snapshot().states["Free"]
    assert (summary.count, summary.oldest_age) == (2, 10.0)
    wd.observe("a", "Done")
    summary = wd.snapshot().states["Free"]
    assert (summary.count, summary.oldest_age) == (1, 5.0)


def test_an_interrupting_leave_listener_still_lets_observe_wake_the_runners() -> None:
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=FakeClock())
    woken: list[float | None] = []
    wd.add_listener(on_leave=once(Interrupt))
    wd.add_listener(on_earlier_deadline=lambda: woken.append(wd.next_deadline()))
    wd.observe("k", "Y")
    with pytest.raises(Interrupt):
        wd.observe("k", "X")  # leaves Y (the listener raises), brings an earlier deadline
    assert woken == [20.0, 10.0]
