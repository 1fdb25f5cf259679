"""Regression tests for the holes an adversarial review found in the watchdog core
(issue 10): each failed on the code before the fix."""

from __future__ import annotations

import pytest

import stallguard as sg
from stallguard.instrumentation import set_on_expire_hooks
from stallguard.testing import FakeClock, record_expiries

KV = sg.Spec(
    "kv",
    {"Bootstrapping": 300, "WaitingForInput": 120, "Transferring": 120},
    terminal=["Success", "Failed"],
)
KVPOLL = {0: "Failed", 1: "Bootstrapping", 2: "WaitingForInput", 3: "Transferring", 4: "Success"}


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1000.0)


@pytest.fixture(autouse=True)
def _quiet() -> None:
    set_on_expire_hooks([])


# 1. a finished request is never failed -------------------------------------------


@pytest.mark.parametrize("mode", ["enforce", "report"])
def test_terminal_first_sight_is_remembered(clock: FakeClock, mode: str) -> None:
    wd: sg.Watchdog[str] = sg.Watchdog(KV, clock=clock, mode=mode)  # type: ignore[arg-type]
    wd.observe("k", "Success")  # the first the watchdog hears of k: it is done
    wd.observe("k", "Transferring")  # a stale event from a transfer thread
    assert "k" not in wd
    clock.advance(1000)
    assert wd.check() == []
    assert wd.snapshot().late_events == 1


def test_terminal_first_sight_never_overwrites_an_expiry(clock: FakeClock) -> None:
    wd: sg.Watchdog[str] = sg.Watchdog(KV, clock=clock)
    wd.observe("k", "Transferring")
    clock.advance(120)
    assert [e.key for e in wd.check()] == ["k"]
    wd.observe("k", "Success")  # too late: it was failed
    assert wd.expired("k")


def test_guard_never_fails_a_poll_that_returned_success(clock: FakeClock) -> None:
    wd: sg.Watchdog[str] = sg.Watchdog(KV, clock=clock)
    results = iter([4, 3, 3])  # Success, then stale Transferrings

    @wd.guard(key=lambda room: room, failed=0, state=KVPOLL)
    def poll(room: str) -> int:
        return next(results)

    assert poll("room") == 4
    assert poll("room") == 3
    clock.advance(1000)
    assert poll("room") == 3  # not the failed value
    assert not wd.expired("room")


# 3. NaN / infinite times ----------------------------------------------------------


@pytest.mark.parametrize("now", [float("nan"), float("inf"), float("-inf"), 10**400])
def test_check_refuses_a_non_finite_now(clock: FakeClock, now: float) -> None:
    wd: sg.Watchdog[str] = sg.Watchdog(KV, clock=clock)
    wd.observe("k", "Transferring")
    with pytest.raises(ValueError, match="now must be a finite time"):
        wd.check(now=now)
    assert "k" in wd  # nothing expired


@pytest.mark.parametrize("bad", ["1", None, [1.0]])
def test_check_refuses_a_now_that_is_not_a_number(clock: FakeClock, bad: object) -> None:
    wd: sg.Watchdog[str] = sg.Watchdog(KV, clock=clock)
    if bad is None:
        assert wd.check(now=bad) == []  # None means "the clock's now"
        return
    with pytest.raises(TypeError, match="now must be a time in seconds"):
        wd.check(now=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("at", [float("-inf"), float("nan"), -(10**400)])
def test_observe_refuses_a_non_finite_at(clock: FakeClock, at: float) -> None:
    wd: sg.Watchdog[str] = sg.Watchdog(KV, clock=clock)
    with pytest.raises(ValueError, match="at must be a finite time"):
        wd.observe("k", "Transferring", at=at)
    assert "k" not in wd


# 4. a BaseException in a hook loses nothing ---------------------------------------


class Interrupt(BaseException):
    pass


def test_an_interrupted_check_delivers_the_rest_next_time(clock: FakeClock) -> None:
    calls: list[str] = []

    def fail(expiry: sg.Expiry[str]) -> None:
        calls.append(expiry.key)
        if expiry.key == "a":
            raise Interrupt

    wd: sg.Watchdog[str] = sg.Watchdog(KV, clock=clock, on_expire=fail)
    seen: list[str] = []
    wd.add_listener(on_expire=lambda e: seen.append(e.key))
    for key in "abc":
        wd.observe(key, "Transferring")
    clock.advance(120)
    with pytest.raises(Interrupt):
        wd.check()
    assert calls == ["a"] and seen == []  # interrupted at the first expiry
    # the next check delivers a's remaining hooks and b, c in full, and returns them
    assert [e.key for e in wd.check()] == ["a", "b", "c"]
    assert calls == ["a", "b", "c"]  # the enforcement action ran once per request
    assert seen == ["a", "b", "c"]
    assert wd.check() == []
    assert all(wd.expired(k) for k in "abc")


def test_an_interrupted_check_is_not_hidden_by_a_quiet_clock(clock: FakeClock) -> None:
    """The carried expiries are delivered by the very next check, even when nothing
    new is due (check() would otherwise return at its one comparison)."""
    raised = []

    def fail(expiry: sg.Expiry[str]) -> None:
        if not raised:
            raised.append(1)
            raise KeyboardInterrupt

    wd: sg.Watchdog[str] = sg.Watchdog(KV, clock=clock, on_expire=fail)
    wd.observe("a", "Transferring")
    wd.observe("b", "Bootstrapping")
    clock.advance(120)
    with pytest.raises(KeyboardInterrupt):
        wd.check()
    assert wd.next_deadline() == 1300.0
    assert [e.key for e in wd.check()] == ["a"]


# 9. guard on an unhashable poll value ---------------------------------------------


def test_guard_maps_an_unhashable_poll_value_to_unknown_state(clock: FakeClock) -> None:
    wd: sg.Watchdog[str] = sg.Watchdog(KV, clock=clock)

    @wd.guard(key=lambda room: room, failed=0)
    def poll(room: str) -> object:
        return ["Transferring"]

    with pytest.raises(sg.UnknownStateError, match=r"no state \['Transferring'\]"):
        poll("r")

    @wd.guard(key=lambda room: room, failed=0, state=KVPOLL)
    def poll_mapped(room: str) -> object:
        return {"status": 3}

    with pytest.raises(sg.UnknownStateError, match="no state"):
        poll_mapped("r")


def test_unhashable_keys_get_a_clear_type_error(clock: FakeClock) -> None:
    wd: sg.Watchdog[object] = sg.Watchdog(KV, clock=clock)
    for call in (
        lambda: wd.observe(["k"], "Transferring"),
        lambda: wd.heartbeat(["k"]),
        lambda: wd.forget(["k"]),
        lambda: wd.annotate(["k"], attributes={"a": 1}),
    ):
        with pytest.raises(TypeError, match=r"a request key must be hashable, got \['k'\]"):
            call()


def test_annotate_refuses_bad_arguments(clock: FakeClock) -> None:
    wd: sg.Watchdog[str] = sg.Watchdog(KV, clock=clock)
    wd.observe("k", "Transferring")
    with pytest.raises(TypeError, match="attributes must be a mapping"):
        wd.annotate("k", attributes=[("a", 1)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="attribute names must be strings"):
        wd.annotate("k", attributes={1: "a"})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="trace_links must be an iterable"):
        wd.annotate("k", trace_links=42)  # type: ignore[arg-type]


# 11. mode and spec are read-only ---------------------------------------------------


def test_mode_and_spec_are_read_only(clock: FakeClock) -> None:
    wd: sg.Watchdog[str] = sg.Watchdog(KV, clock=clock, mode="report")
    with pytest.raises(AttributeError):
        wd.mode = "bogus"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        wd.spec = KV  # type: ignore[misc]
    assert wd.mode == "report" and wd.options.mode == "report"
    wd.observe("k", "Transferring")
    clock.advance(120)
    assert [e.mode for e in wd.check()] == ["report"]


# 6 (spec part). numbers too large for a float --------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: sg.Deadline(10**400),
        lambda: sg.Deadline(seconds=1, stall=10**400),
        lambda: sg.Spec("s", {"a": 10**400}),
        lambda: sg.Spec("s", {"a": 1}, lifetime=10**400),
    ],
)
def test_huge_durations_are_a_config_error(make: object) -> None:
    with pytest.raises(sg.ConfigError, match="an integer of 401 digits, which is too large"):
        make()  # type: ignore[operator]


# options: one validated owner -----------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"mode": "bogus"}, "mode must be 'enforce' or 'report', got 'bogus'"),
        ({"mode": "enforced"}, "did you mean 'enforce'"),
        ({"unknown_state": "drop"}, "unknown_state must be 'raise' or 'ignore', got 'drop'"),
        ({"memory": -5}, "memory must be a positive int, got -5"),
        ({"memory": True}, "memory must be a positive int, got True"),
        ({"clock": 42}, "clock must be a callable returning seconds, got 42"),
    ],
)
def test_options_refuse_bad_values(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(sg.ConfigError, match=needle):
        sg.WatchdogOptions(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(sg.ConfigError, match=needle):
        sg.Watchdog(KV, **kwargs)  # type: ignore[arg-type]


def test_options_are_shared_and_overridden_by_keywords(clock: FakeClock) -> None:
    options = sg.WatchdogOptions(mode="report", memory=7, clock=clock)
    wd: sg.Watchdog[str] = sg.Watchdog(KV, options=options, memory=9)
    assert wd.options == sg.WatchdogOptions(mode="report", memory=9, clock=clock)
    assert wd.clock is clock
    with pytest.raises(sg.ConfigError, match="WatchdogOptions has no field 'mood'"):
        options.evolve(mood="x")
    with pytest.raises(sg.ConfigError, match="options must be a stallguard.WatchdogOptions"):
        sg.Watchdog(KV, options={"mode": "report"})  # type: ignore[arg-type]


# listeners ------------------------------------------------------------------------


def test_listeners_run_outside_the_lock_and_may_call_back(clock: FakeClock) -> None:
    """An on_leave that reads a snapshot used to deadlock on the next state change."""
    wd: sg.Watchdog[str] = sg.Watchdog(KV, clock=clock)
    seen: list[tuple[str, float, int]] = []
    wd.add_listener(on_leave=lambda label, s: seen.append((label, s, wd.snapshot().tracked)))
    wakes: list[float | None] = []
    wd.add_listener(on_earlier_deadline=lambda: wakes.append(wd.next_deadline()))
    expired: list[int] = []
    wd.add_listener(on_expire=lambda e: expired.append(len(wd)))
    wd.observe("k", "Bootstrapping")
    clock.advance(2)
    wd.observe("k", "Transferring")
    clock.advance(120)
    wd.check()
    assert seen == [("Bootstrapping", 2, 1), ("Transferring", 120, 0)]
    assert wakes == [1300.0, 1122.0]
    assert expired == [0]


def test_expiry_listeners_see_both_modes_and_raising_ones_are_counted(clock: FakeClock) -> None:
    for mode in ("enforce", "report"):
        enforced: list[str] = []
        wd: sg.Watchdog[str] = sg.Watchdog(
            KV,
            clock=clock,
            mode=mode,  # type: ignore[arg-type]
            on_expire=lambda e, enforced=enforced: enforced.append(e.key),
        )
        heard: list[str] = []

        def broken(expiry: sg.Expiry[str]) -> None:
            raise RuntimeError("listener bug")

        wd.add_listener(on_expire=broken)
        handle = wd.add_listener(on_expire=lambda e, heard=heard: heard.append(e.key))
        wd.observe("k", "Transferring")
        clock.advance(120)
        with record_expiries() as recorded:
            assert [e.key for e in wd.check()] == ["k"]
        assert heard == ["k"] and [e.key for e in recorded] == ["k"]
        assert enforced == (["k"] if mode == "enforce" else [])
        assert wd.snapshot().hook_errors == 1
        assert handle.remove() is True and handle.remove() is False
        assert len(wd.listeners) == 1


def test_add_listener_refuses_bad_arguments(clock: FakeClock) -> None:
    wd: sg.Watchdog[str] = sg.Watchdog(KV, clock=clock)
    with pytest.raises(sg.ConfigError, match="needs at least one"):
        wd.add_listener()
    with pytest.raises(sg.ConfigError, match=r"add_listener\(on_leave=...\) must be callable"):
        wd.add_listener(on_leave=42)  # type: ignore[arg-type]


def test_forgetting_without_remembering_keeps_older_memories(clock: FakeClock) -> None:
    """Found by the stateful test: forget(k, remember=False) buried k and dug it up
    again, pushing the oldest remembered key out of a full memory."""
    wd: sg.Watchdog[int] = sg.Watchdog(KV, clock=clock, memory=1)
    wd.forget(1)  # remembered
    wd.observe(0, "Transferring")
    wd.forget(0, remember=False)
    wd.observe(1, "Transferring")  # still a late event for a concluded key
    assert 1 not in wd and wd.snapshot().late_events == 1


def test_a_second_interruption_still_returns_everything_once(clock: FakeClock) -> None:
    """Found by the stateful test: an expiry carried over and fully delivered by a check
    that is interrupted again must still be returned by the next one."""
    interrupts = [True, True]

    def action(expiry: sg.Expiry[str]) -> None:
        if interrupts:
            interrupts.pop()
            raise Interrupt

    wd: sg.Watchdog[str] = sg.Watchdog(KV.evolve(lifetime=12), clock=clock, mode="report")
    seen: list[tuple[str, str]] = []
    wd.add_listener(on_expire=lambda e: seen.append((e.key, e.reason)))
    wd.add_listener(on_expire=action)
    wd.observe("k", "WaitingForInput")
    clock.advance(200)
    for _ in range(2):
        with pytest.raises(Interrupt):
            wd.check()
    assert sorted((e.key, e.reason) for e in wd.check()) == [("k", "lifetime"), ("k", "state")]
    assert sorted(seen) == [("k", "lifetime"), ("k", "state")]  # each delivered once
    assert wd.check() == []


def test_statistics_are_opt_in_and_say_so(clock: FakeClock) -> None:
    wd: sg.Watchdog[str] = sg.Watchdog(KV, clock=clock)
    assert wd.options.statistics is False
    with pytest.raises(sg.StallguardError, match=r"records no statistics \(statistics=False\)"):
        wd.statistics()
    with pytest.raises(sg.ConfigError, match="statistics must be True or False, got 'yes'"):
        sg.Watchdog(KV, statistics="yes")  # type: ignore[arg-type]
    on: sg.Watchdog[str] = sg.Watchdog(KV, clock=clock, statistics=True)
    on.observe("k", "Transferring")
    clock.advance(2)
    on.observe("k", "Success")
    assert on.statistics().states["Transferring"].count == 1
