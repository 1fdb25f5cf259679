"""Watchdog.guard: the poll-loop decorator."""

from __future__ import annotations

import inspect
import typing

import pytest

import stallguard as sg
from stallguard.instrumentation import set_on_expire_hooks
from stallguard.testing import FakeClock

FAILED, BOOT, WAIT, XFER, SUCCESS = range(5)  # SGLang's KVPoll values
NAMES = {0: "Failed", 1: "Bootstrapping", 2: "WaitingForInput", 3: "Transferring", 4: "Success"}
SPEC = sg.Spec(
    "kv_sender",
    {"Bootstrapping": 300, "WaitingForInput": 120, "Transferring": 120},
    terminal=["Success", "Failed"],
)


class Sender:
    def __init__(self, room: int) -> None:
        self.room = room
        self.status = BOOT
        self.polls = 0

    def poll(self) -> int:
        self.polls += 1
        return self.status


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def wd(clock):
    set_on_expire_hooks([])
    return sg.Watchdog(SPEC, clock=clock)


@pytest.fixture
def guarded(wd):
    class Guarded(Sender):
        @wd.guard(key=lambda self: self.room, failed=FAILED, state=NAMES)
        def poll(self) -> int:
            return super().poll()

    return Guarded


def test_passes_states_through_and_tracks(guarded, wd):
    s = guarded(7)
    assert s.poll() == BOOT
    assert wd.state_of(7) == "Bootstrapping"
    s.status = XFER
    assert s.poll() == XFER
    assert wd.state_of(7) == "Transferring"
    s.status = SUCCESS
    assert s.poll() == SUCCESS
    assert 7 not in wd and s.polls == 3


def test_returns_failed_once_expired_even_if_it_later_completes(guarded, wd, clock):
    s = guarded(1)
    s.status = XFER
    assert s.poll() == XFER
    clock.advance(119)
    assert s.poll() == XFER
    clock.advance(1)
    assert s.poll() == FAILED  # the guard's own check found it overdue
    assert wd.expired(1)
    s.status = SUCCESS  # a late completion never un-fails it
    assert s.poll() == FAILED
    assert 1 not in wd


def test_expiry_found_by_another_poll_applies_to_all(guarded, wd, clock):
    a, b = guarded(1), guarded(2)
    a.status = b.status = WAIT
    a.poll()
    b.poll()
    clock.advance(120)
    assert a.poll() == FAILED  # this check expired both
    assert b.poll() == FAILED


def test_check_false_leaves_deadline_to_the_loop(wd, clock):
    calls = []

    @wd.guard(key=lambda room: room, failed="F", state=NAMES, check=False)
    def poll(room: int) -> int:
        calls.append(room)
        return XFER

    poll(5)
    clock.advance(500)
    assert poll(5) == XFER
    assert [e.key for e in wd.check()] == [5]
    assert poll(5) == "F"


def test_report_mode_never_returns_failed(clock):
    set_on_expire_hooks([])
    wd = sg.Watchdog(SPEC, clock=clock, mode="report")

    @wd.guard(key=lambda: "k", failed=FAILED, state=NAMES)
    def poll() -> int:
        return XFER

    poll()
    clock.advance(1000)
    assert poll() == XFER
    assert wd.snapshot().expired == 1


def test_callable_state_mapping_and_identity(clock):
    set_on_expire_hooks([])
    wd = sg.Watchdog(sg.Spec("s", {"a": 1}, terminal=["z"]), clock=clock)

    @wd.guard(key=lambda k: k, failed="FAILED")
    def identity(k):
        return "a"

    @wd.guard(key=lambda k: k, failed="FAILED", state=lambda v: v.lower())
    def upper(k):
        return "A"

    assert identity(1) == "a" and upper(2) == "A"
    assert wd.state_of(1) == wd.state_of(2) == "a"


def test_unknown_poll_value_raises_clear_error(guarded, wd):
    s = guarded(1)
    s.status = 9
    with pytest.raises(sg.UnknownStateError, match="no state 9 .*3 -> Transferring"):
        s.poll()
    assert 1 not in wd


def test_unknown_state_from_callable_raises_clear_error(wd):
    @wd.guard(key=lambda: 1, failed=0)
    def poll():
        return "Nope"

    with pytest.raises(sg.UnknownStateError, match="'Nope'"):
        poll()


def test_bad_guard_arguments(wd):
    with pytest.raises(sg.ConfigError, match="key=.*must be a callable"):
        wd.guard(key="room", failed=0)
    with pytest.raises(sg.ConfigError, match="maps to 'Bogus'"):
        wd.guard(key=lambda s: s, failed=0, state={1: "Bogus"})
    with pytest.raises(sg.ConfigError, match="state=...\\) must be a mapping or a callable"):
        wd.guard(key=lambda s: s, failed=0, state=3)


def test_preserves_metadata_and_type_hints(wd):
    def poll(sender: Sender, *, fast: bool = False) -> int:
        """Poll it."""
        return sender.status

    wrapped = wd.guard(key=lambda sender, **_: sender.room, failed=FAILED, state=NAMES)(poll)
    assert wrapped.__name__ == "poll" and wrapped.__doc__ == "Poll it."
    assert wrapped.__wrapped__ is poll
    assert inspect.signature(wrapped) == inspect.signature(poll)
    assert typing.get_type_hints(wrapped) == {"sender": Sender, "fast": bool, "return": int}
    assert wrapped(Sender(3), fast=True) == BOOT


def test_key_receives_args_and_kwargs(wd):
    seen = []

    def key(a, b=None):
        seen.append((a, b))
        return a

    @wd.guard(key=key, failed=FAILED, state=NAMES)
    def poll(a, b=None):
        return WAIT

    poll(1, b=2)
    assert seen == [(1, 2)]
