"""Watchdog semantics on a fake clock."""

from __future__ import annotations

import enum
import logging

import pytest

import stallguard as sg
from stallguard.instrumentation import set_on_expire_hooks
from stallguard.testing import FakeClock, record_expiries

KV = sg.Spec(
    "kv_sender",
    {"Bootstrapping": 300, "WaitingForInput": 120, "Transferring": 120, "Parked": None},
    terminal=["Success", "Failed"],
)


@pytest.fixture
def clock():
    return FakeClock(1000.0)


@pytest.fixture
def wd(clock):
    set_on_expire_hooks([])
    return sg.Watchdog(KV, clock=clock)


def keys(expiries):
    return [e.key for e in expiries]


def test_expires_at_deadline_not_before(wd, clock):
    wd.observe("r", "Transferring")
    clock.advance(119.999)
    assert wd.check() == []
    clock.advance(0.001)
    [expiry] = wd.check()
    assert expiry == sg.Expiry(
        key="r",
        spec="kv_sender",
        state="Transferring",
        entered_at=1000.0,
        elapsed=pytest.approx(120.0),
        deadline=120.0,
        reason="state",
        mode="enforce",
    )
    assert "r" not in wd and len(wd) == 0
    assert wd.expired("r")


def test_exactly_once(wd, clock):
    wd.observe("r", "WaitingForInput")
    clock.advance(500)
    assert keys(wd.check()) == ["r"]
    assert wd.check() == []
    clock.advance(500)
    assert wd.check() == []


def test_same_state_does_not_reset_clock(wd, clock):
    wd.observe("r", "Transferring")
    for _ in range(12):
        clock.advance(10)
        wd.observe("r", "Transferring")
    assert keys(wd.check()) == ["r"]


def test_new_state_restarts_clock(wd, clock):
    wd.observe("r", "WaitingForInput")
    clock.advance(100)
    wd.observe("r", "Transferring")
    clock.advance(100)
    assert wd.check() == []
    clock.advance(20)
    [e] = wd.check()
    assert (e.state, e.entered_at, e.elapsed) == ("Transferring", 1100.0, 120.0)


def test_state_without_deadline_never_expires(wd, clock):
    wd.observe("r", "Parked")
    clock.advance(10**9)
    assert wd.check() == []
    assert wd.state_of("r") == "Parked"
    assert wd.next_deadline() is None


def test_terminal_untracks_and_prevents_expiry(wd, clock):
    wd.observe("r", "Transferring")
    clock.advance(119)
    wd.observe("r", "Success")
    assert "r" not in wd
    clock.advance(100)
    assert wd.check() == []


def test_first_observation_terminal_is_not_tracked(wd):
    wd.observe("r", "Success")
    assert len(wd) == 0


def test_forget_is_idempotent_and_untracks(wd, clock):
    wd.observe("r", "Transferring")
    assert wd.forget("r") is True
    assert wd.forget("r") is False
    assert wd.forget("never-seen") is False
    clock.advance(1000)
    assert wd.check() == []


def test_late_observe_after_expiry_does_not_resurrect(wd, clock):
    wd.observe("r", "Transferring")
    clock.advance(120)
    assert keys(wd.check()) == ["r"]
    wd.observe("r", "Transferring")  # a transfer thread's stale update
    wd.observe("r", "Bootstrapping")
    assert "r" not in wd
    clock.advance(1000)
    assert wd.check() == []
    assert wd.snapshot().late_events == 2


def test_late_observe_after_forget_and_terminal_is_dropped(wd):
    wd.observe("a", "Transferring")
    wd.forget("a")
    wd.observe("a", "Transferring")
    wd.observe("b", "Transferring")
    wd.observe("b", "Success")
    wd.observe("b", "Transferring")
    assert len(wd) == 0


def test_forget_without_remember_allows_reuse(wd):
    wd.observe("a", "Transferring")
    wd.forget("a", remember=False)
    wd.observe("a", "Bootstrapping")
    assert wd.state_of("a") == "Bootstrapping"


def test_memory_is_bounded(clock):
    set_on_expire_hooks([])
    wd = sg.Watchdog(KV, clock=clock, memory=3)
    for k in range(10):
        wd.observe(k, "Transferring")
        wd.observe(k, "Success")
    assert len(wd._gone) == 3
    assert list(wd._gone) == [7, 8, 9]


def test_unknown_state_raises_clear_error(wd):
    with pytest.raises(sg.UnknownStateError) as info:
        wd.observe("r", "Transfering")
    msg = str(info.value)
    assert "'Transfering'" in msg and "'r'" in msg and "Transferring" in msg
    assert info.value.state == "Transfering"
    assert isinstance(info.value, ValueError)
    with pytest.raises(sg.UnknownStateError):
        wd.observe("r", ["unhashable"])
    with pytest.raises(sg.UnknownStateError):
        wd.observe("r", 3)
    assert len(wd) == 0


def test_unknown_state_ignore_mode_counts(clock):
    wd = sg.Watchdog(KV, clock=clock, unknown_state="ignore")
    wd.observe("r", "nope")
    assert len(wd) == 0 and wd._unknown == 1


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"mode": "strict"}, "mode must be 'enforce' or 'report', got 'strict'"),
        ({"clock": 3}, "clock must be a callable"),
        ({"on_expire": 3}, "on_expire must be a callable"),
        ({"on_expire": [print, 3]}, "on_expire must hold callables, got 3"),
        ({"unknown_state": "drop"}, "unknown_state must be"),
        ({"memory": 0}, "memory must be a positive int, got 0"),
    ],
)
def test_bad_watchdog_arguments(kwargs, needle):
    with pytest.raises(sg.ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        sg.Watchdog(KV, **kwargs)


def test_spec_must_be_a_spec():
    with pytest.raises(sg.ConfigError, match="spec must be a stallguard.Spec"):
        sg.Watchdog({"a": 1})  # type: ignore[arg-type]


def test_enum_states(clock):
    class P(enum.Enum):
        A = "a"
        B = "b"
        Z = "z"

    wd = sg.Watchdog(sg.Spec("e", {P.A: 1, P.B: 2}, terminal=[P.Z]), clock=clock)
    wd.observe(1, P.A)
    clock.advance(1)
    with record_expiries() as seen:
        [e] = wd.check()
    assert e.state is P.A and e.state_label == "A"
    assert seen == [e]


def test_expiries_are_ordered_by_deadline(wd, clock):
    wd.observe("boot", "Bootstrapping")  # due 1300
    clock.advance(10)
    wd.observe("wait", "WaitingForInput")  # due 1130
    clock.advance(5)
    wd.observe("xfer", "Transferring")  # due 1135
    clock.advance(1000)
    assert keys(wd.check()) == ["wait", "xfer", "boot"]


def test_check_with_explicit_now(wd, clock):
    wd.observe("r", "Transferring")
    assert wd.check(now=1119.0) == []
    assert keys(wd.check(now=1120.0)) == ["r"]


def test_next_deadline_tracks_heads(wd, clock):
    assert wd.next_deadline() is None
    wd.observe("a", "Bootstrapping")
    assert wd.next_deadline() == 1300.0
    wd.observe("b", "Transferring")
    assert wd.next_deadline() == 1120.0
    wd.forget("b")
    assert wd.next_deadline() == 1300.0


def test_on_expire_called_in_enforce_only(clock):
    set_on_expire_hooks([])
    got = []
    wd = sg.Watchdog(KV, clock=clock, on_expire=got.append)
    wd.observe("r", "Transferring")
    clock.advance(120)
    wd.check()
    assert keys(got) == ["r"]
    report = sg.Watchdog(KV, clock=clock, on_expire=got.append, mode="report")
    report.observe("q", "Transferring")
    clock.advance(120)
    assert keys(report.check()) == ["q"]
    assert keys(got) == ["r"]


def test_raising_hook_is_logged_counted_and_loses_nothing(clock, caplog):
    calls = []

    def bad(expiry):
        calls.append(("bad", expiry.key))
        raise RuntimeError("boom")

    set_on_expire_hooks([bad, lambda e: calls.append(("inst", e.key))])
    wd = sg.Watchdog(KV, clock=clock, on_expire=[bad, lambda e: calls.append(("act", e.key))])
    for k in ("a", "b"):
        wd.observe(k, "Transferring")
    clock.advance(120)
    with caplog.at_level(logging.ERROR, logger="stallguard"):
        assert keys(wd.check()) == ["a", "b"]
    assert calls == [
        ("bad", "a"), ("act", "a"), ("bad", "a"), ("inst", "a"),
        ("bad", "b"), ("act", "b"), ("bad", "b"), ("inst", "b"),
    ]  # fmt: skip
    assert wd.snapshot().hook_errors == 4
    assert "boom" in caplog.text


def test_hook_may_call_back_into_watchdog(clock):
    set_on_expire_hooks([])
    wd = sg.Watchdog(KV, clock=clock)
    wd._enforce_hooks = (lambda e: wd.observe(("next", e.key), "Bootstrapping"),)
    wd.observe("r", "Transferring")
    clock.advance(120)
    wd.check()
    assert ("next", "r") in wd


def test_default_logging_hook_writes_one_line(clock, caplog):
    wd = sg.Watchdog(KV, clock=clock)
    wd.observe("room-7", "Transferring")
    clock.advance(121)
    with caplog.at_level(logging.WARNING, logger="stallguard"):
        wd.check()
    [record] = [r for r in caplog.records if r.name == "stallguard"]
    assert record.levelno == logging.WARNING
    assert "forced failure" in record.getMessage()
    assert "'room-7'" in record.getMessage() and "Transferring" in record.getMessage()
    assert record.stallguard_deadline_s == 120.0
    assert record.stallguard_elapsed_s == 121.0


class TestLifetimeAndStall:
    SPEC = sg.Spec(
        "job",
        {"queued": 50, "running": sg.Deadline(seconds=100, stall=10), "idle": None},
        terminal=["done"],
        lifetime=200,
    )

    @pytest.fixture
    def wd(self, clock):
        set_on_expire_hooks([])
        return sg.Watchdog(self.SPEC, clock=clock)

    def test_lifetime_spans_states(self, wd, clock):
        wd.observe("j", "queued")
        for _ in range(10):
            clock.advance(19)
            wd.observe("j", "idle")
            clock.advance(1)
            wd.observe("j", "queued")
        # t = 200 after first sight
        [e] = wd.check()
        assert (e.reason, e.deadline, e.entered_at, e.state) == ("lifetime", 200, 1000.0, "queued")

    def test_heartbeat_renews_stall_window(self, wd, clock):
        wd.observe("j", "running")
        for _ in range(9):
            clock.advance(9)
            assert wd.heartbeat("j")
            assert wd.check() == []
        clock.advance(10)
        [e] = wd.check()
        assert (e.reason, e.deadline, e.elapsed, e.entered_at) == ("stall", 10, 10, 1081.0)

    def test_state_deadline_still_applies_with_heartbeats(self, wd, clock):
        wd.observe("j", "running")
        for _ in range(11):
            clock.advance(9.5)
            wd.heartbeat("j")
        [e] = wd.check()
        assert (e.reason, e.elapsed) == ("state", pytest.approx(104.5))

    def test_renewed_head_does_not_strand_overdue_entries(self, wd, clock):
        # vllm#58222: renewing the head must move it to the tail
        wd.observe("a", "running")
        wd.observe("b", "running")
        clock.advance(9)
        wd.heartbeat("a")
        clock.advance(1)
        assert keys(wd.check()) == ["b"]

    def test_heartbeat_untracked_or_without_window(self, wd):
        assert wd.heartbeat("nope") is False
        wd.observe("q", "queued")
        assert wd.heartbeat("q") is True

    def test_earliest_reason_wins_and_fires_once(self, wd, clock):
        wd.observe("j", "running")
        clock.advance(500)  # stall (1010), state (1100) and lifetime (1200) all overdue
        [e] = wd.check()
        assert e.reason == "stall"
        assert wd.check() == []


class TestReportMode:
    @pytest.fixture
    def wd(self, clock):
        set_on_expire_hooks([])
        return sg.Watchdog(TestLifetimeAndStall.SPEC, clock=clock, mode="report")

    def test_reports_once_keeps_tracking(self, wd, clock):
        wd.observe("j", "queued")
        clock.advance(50)
        [e] = wd.check()
        assert (e.mode, e.enforced, e.reason) == ("report", False, "state")
        assert "j" in wd and not wd.expired("j")
        clock.advance(10)
        assert wd.check() == []
        snap = wd.snapshot()
        assert snap.states["queued"].count == 1
        assert snap.states["queued"].oldest_age == 60
        # the request moves on: it is tracked normally
        wd.observe("j", "running")
        clock.advance(10)
        [e2] = wd.check()
        assert e2.reason == "stall"
        clock.advance(200)
        # running's state deadline (due 1160) and the lifetime (due 1200) are both
        # overdue: both reported by the same check, earliest first, each exactly once
        [e3, e4] = wd.check()
        assert (e3.reason, e3.entered_at) == ("state", 1060.0)
        assert (e4.reason, e4.entered_at) == ("lifetime", 1000.0)
        assert wd.check() == []
        wd.observe("j", "done")
        assert len(wd) == 0
        assert wd.snapshot().states["running"].count == 0


def test_snapshot(wd, clock):
    wd.observe("a", "Bootstrapping")
    clock.advance(5)
    wd.observe("b", "Transferring")
    wd.observe("c", "Transferring")
    clock.advance(5)
    snap = wd.snapshot()
    assert snap.tracked == 3 and snap.at == 1010.0
    assert snap.states["Transferring"].count == 2
    assert snap.states["Transferring"].oldest_age == 5
    assert snap.states["Bootstrapping"].oldest_age == 10
    assert snap.states["WaitingForInput"] == sg.StateSummary(
        state="WaitingForInput", deadline=sg.Deadline(120), count=0, oldest_age=None
    )
    assert [(r.key, r.state, r.age, r.remaining) for r in snap.requests] == [
        ("a", "Bootstrapping", 10, 290),
        ("b", "Transferring", 5, 115),
        ("c", "Transferring", 5, 115),
    ]
    assert wd.snapshot(requests=False).requests == ()


def test_annotate_reaches_expiry(wd, clock):
    assert wd.annotate("r", attributes={"x": 1}) is False  # untracked: dropped
    wd.observe("r", "Transferring")
    assert wd.annotate("r", attributes={"sglang.rid": "abc"}, trace_parent="ctx")
    assert wd.annotate("r", attributes={"n": 2}, trace_links=["l1"])
    clock.advance(120)
    [e] = wd.check()
    assert e.attributes == {"sglang.rid": "abc", "n": 2}
    assert (e.trace_parent, e.trace_links) == ("ctx", ("l1",))
    assert wd._footprint()["tracked"] == 0


def test_describe_names_state_time_and_deadline(wd, clock):
    wd.observe("r", "Transferring")
    clock.advance(121.25)
    [e] = wd.check()
    text = e.describe()
    assert "Transferring" in text and "121.250s" in text and "120s deadline" in text


def test_on_leave_sees_time_in_state(clock):
    set_on_expire_hooks([])
    wd = sg.Watchdog(KV, clock=clock)
    left = []
    wd.add_listener(on_leave=lambda label, s: left.append((label, s)))
    wd.observe("r", "Bootstrapping")
    clock.advance(2)
    wd.observe("r", "Transferring")
    clock.advance(3)
    wd.observe("r", "Success")
    wd.observe("q", "WaitingForInput")
    clock.advance(120)
    wd.check()
    assert left == [("Bootstrapping", 2), ("Transferring", 3), ("WaitingForInput", 120)]


def test_on_earlier_deadline_fires_only_for_earlier(clock):
    wd = sg.Watchdog(KV, clock=clock)
    wakes = []
    wd.add_listener(on_earlier_deadline=lambda: wakes.append(wd.next_deadline()))
    wd.observe("a", "Bootstrapping")
    wd.observe("b", "Bootstrapping")
    wd.observe("c", "Transferring")
    assert wakes == [1300.0, 1120.0]


def test_repr(wd):
    wd.observe(1, "Transferring")
    assert repr(wd) == "<stallguard.Watchdog spec='kv_sender' mode='enforce' tracked=1>"


# --------------------------------------------------------------------------- at=


class TestAt:
    """``observe(..., at=)`` / ``heartbeat(..., at=)``: changes captured with a clock
    reading where they happen and applied later (the SGLang adapter's pattern). Same
    spec and fixture as TestLifetimeAndStall."""

    SPEC = TestLifetimeAndStall.SPEC
    wd = TestLifetimeAndStall.wd

    def test_stall_window_starts_at_at_not_when_applied(self, wd, clock):
        wd.observe("r", "queued")
        clock.advance(30)
        wd.observe("r", "running", at=1010.0)  # moved at 1010, applied at 1030
        [e] = wd.check()  # its 10 s progress window ran out at 1020
        assert (e.reason, e.state, e.entered_at) == ("stall", "running", 1010.0)

    def test_deadline_counts_from_at(self, clock):
        set_on_expire_hooks([])
        wd = sg.Watchdog(KV, clock=clock)
        wd.observe("r", "Bootstrapping")
        clock.advance(50)
        wd.observe("r", "Transferring", at=1020.0)
        clock.advance(89.999)  # 1139.999 < 1020 + 120
        assert wd.check() == []
        clock.advance(0.001)
        [e] = wd.check()
        assert (e.state, e.entered_at, e.elapsed) == ("Transferring", 1020.0, pytest.approx(120))

    def test_first_observe_with_at_starts_lifetime_there(self, wd, clock):
        clock.advance(10)
        wd.observe("r", "queued", at=1004.0)
        [(key, state, entered)] = [(t.key, t.state, t.entered_at) for t in wd.snapshot().requests]
        assert (key, state, entered) == ("r", "queued", 1004.0)
        clock.advance(40)  # 1050 = 1004 + 46: queued's 50 s not yet over
        assert wd.check() == []
        clock.advance(4)
        assert [e.reason for e in wd.check()] == ["state"]

    def test_at_earlier_than_the_fifo_tail_is_raised_to_it(self, clock):
        set_on_expire_hooks([])
        wd = sg.Watchdog(KV, clock=clock)
        clock.advance(10)
        wd.observe("late", "Transferring")  # 1010
        wd.observe("early", "Transferring", at=1005.0)  # raised to 1010: FIFO stays ordered
        clock.advance(119.999)
        assert wd.check() == []  # neither expired early, in particular not "early" at 1125
        clock.advance(0.001)
        assert sorted(e.key for e in wd.check()) == ["early", "late"]

    def test_a_state_never_starts_before_the_one_it_ends(self, clock):
        set_on_expire_hooks([])
        wd = sg.Watchdog(KV, clock=clock)
        left = []
        wd.add_listener(on_leave=lambda label, s: left.append((label, s)))
        clock.advance(10)
        wd.observe("r", "WaitingForInput")  # 1010
        wd.observe("r", "Transferring", at=1002.0)  # an event from before: starts at 1010
        assert left == [("WaitingForInput", 0)]
        clock.advance(119.999)
        assert wd.check() == []
        clock.advance(0.001)
        assert [e.entered_at for e in wd.check()] == [1010.0]

    def test_heartbeat_at(self, wd, clock):
        wd.observe("r", "running")  # 1000
        clock.advance(9)
        assert wd.heartbeat("r", at=1008.0)  # window renewed from 1008: due 1018
        clock.advance(8.999)  # 1017.999
        assert wd.check() == []
        clock.advance(0.001)
        [e] = wd.check()
        assert (e.reason, e.entered_at) == ("stall", 1008.0)

    def test_an_older_heartbeat_never_shortens_a_window(self, wd, clock):
        wd.observe("r", "running")
        clock.advance(9)
        wd.heartbeat("r")  # 1009
        wd.heartbeat("r", at=1003.0)  # applied late, older than the last renewal
        clock.advance(9.999)  # 1018.999 < 1019
        assert wd.check() == []
        assert not wd.heartbeat("nobody", at=1000.0)

    @pytest.mark.parametrize(
        ("at", "error", "needle"),
        [
            (1000.5, ValueError, r"at=1000\.5 is later than the watchdog clock's now \(1000\.0\)"),
            (float("nan"), ValueError, "at must be a finite time on the watchdog's clock, got nan"),
            (float("-inf"), ValueError, "at must be a finite time .* got -inf"),
            (10**400, ValueError, "at must be a finite time"),
            ("1000", TypeError, "at must be a time in seconds on the watchdog's clock, got '1000'"),
            (True, TypeError, "got True"),
        ],
    )
    def test_bad_at(self, wd, at, error, needle):
        with pytest.raises(error, match=needle):
            wd.observe("r", "queued", at=at)
        assert "r" not in wd
        wd.observe("r", "queued")
        with pytest.raises(error, match=needle):
            wd.heartbeat("r", at=at)


def test_a_watchdog_keeps_its_attributes_in_the_shared_key_table():
    """CPython 3.11 keeps an instance's attributes in its class's shared-key table up to
    29 of them; past that, every attribute load of every method is slower (measured
    6.9 -> 7.7 ns a load: about 5 % on a state change). Group or drop one before
    adding one."""
    wd = sg.Watchdog(KV.evolve(lifetime=10), statistics=True, describe=lambda k: {})
    wd.add_listener(on_leave=lambda label, seconds: None)
    assert len(vars(wd)) <= 29, sorted(vars(wd))


def test_a_state_change_leaves_nothing_for_the_garbage_collector():
    """A FIFO entry names its request by key and stamp, not by record: with int (or
    string) keys CPython's collector stops tracking it at its first young collection,
    so state changes leave no survivors for the full collections to walk (issue 25:
    those collections were a third of a state change's cost)."""
    import gc

    set_on_expire_hooks([])
    clock = FakeClock(1000.0)
    stall = {**KV.deadlines, "Transferring": sg.Deadline(120, stall=5)}
    wd = sg.Watchdog(KV.evolve(lifetime=600, deadlines=stall), clock=clock)
    for k in range(100):
        wd.observe(k, "Bootstrapping")
    # young records put no entry on a clock; next_deadline() admits those that might
    # be due before the earliest deadline it knows (here: all, least = 5 s)
    assert [e for clock in wd._clocks for e in (*clock.q, *clock.heap)] == []
    assert wd.next_deadline() == 1300.0
    for k in range(100):
        wd.observe(k, "Transferring")
    clock.advance(1)
    for k in range(100):
        wd.heartbeat(k)
    gc.collect()
    entries = [item for clock in wd._clocks for item in (*clock.q, *clock.heap)]
    # 100 x (admitted: lifetime, Bootstrapping; then Transferring, 2 progress windows)
    assert len(entries) == 500
    assert [e for e in entries if gc.is_tracked(e)] == []


@pytest.mark.parametrize("reason", ["state", "stall", "lifetime"])
def test_a_key_tracked_again_is_not_expired_by_its_old_entries(clock, reason):
    """A key forgotten without memory and tracked again is a new record: the entries
    its previous record left on every clock (state, progress window, lifetime) are
    stale, though they name the same key; the new record's own deadlines hold."""
    set_on_expire_hooks([])
    state, lifetime = (300, 50) if reason == "lifetime" else (30, 100)
    spec = KV.evolve(
        lifetime=lifetime,
        deadlines={**KV.deadlines, "Transferring": sg.Deadline(state, stall=10)},
    )
    wd = sg.Watchdog(spec, clock=clock)
    wd.observe("r", "Transferring")
    clock.advance(5)
    assert wd.forget("r", remember=False)
    wd.observe("r", "Transferring")  # a new record, its clocks start at +5
    first = {"state": 30, "stall": 10, "lifetime": 50}[reason]  # the first to pass
    clock.advance(first - 5 + 0.001)  # the old record's deadline of that kind passed
    if reason == "stall":
        assert wd.check() == []
        clock.advance(5)  # the new record's window: from +5, 10 s
        [expiry] = wd.check()
        assert (expiry.key, expiry.reason) == ("r", "stall")
        return
    wd.heartbeat("r")
    assert wd.check() == []
    assert wd.state_of("r") == "Transferring"
    assert wd._overdue(clock()) == []
