"""Property tests: the watchdog against a naive reference model, on a fake clock.

The reference scans every request at every check, which is obviously correct and
obviously too slow; the watchdog must agree with it on every check.
"""

from __future__ import annotations

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import stallguard as sg
from stallguard.instrumentation import set_on_expire_hooks
from stallguard.testing import FakeClock

SPEC = sg.Spec(
    "prop",
    {"a": 3, "b": 5, "c": sg.Deadline(seconds=8, stall=2), "d": None},
    terminal=["ok", "err"],
    lifetime=12,
)
STATES = ["a", "b", "c", "d", "ok", "err"]
KEYS = st.integers(0, 7)

ops = st.lists(
    st.one_of(
        st.tuples(st.just("observe"), KEYS, st.sampled_from(STATES)),
        st.tuples(st.just("heartbeat"), KEYS),
        st.tuples(st.just("forget"), KEYS),
        st.tuples(st.just("advance"), st.sampled_from([0, 0.5, 1, 2, 2.5, 3, 5])),
        st.tuples(st.just("check")),
    ),
    max_size=120,
)


class Reference:
    """Per key: state, entered, beat, born. Scans everything."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.live: dict[int, dict] = {}
        self.gone: set[int] = set()
        self.reported: set[tuple[int, str]] = set()

    def observe(self, key, state, now):
        if key in self.gone:
            return
        rec = self.live.get(key)
        terminal = state in SPEC.terminal
        if rec is None:
            if terminal:
                self.gone.add(key)  # a finished request is never tracked again
            else:
                self.live[key] = {"state": state, "entered": now, "beat": now, "born": now}
            return
        if rec["state"] == state:
            return
        if terminal:
            del self.live[key]
            self.gone.add(key)
            return
        rec.update(state=state, entered=now, beat=now)
        self.reported -= {(key, "state"), (key, "stall")}

    def heartbeat(self, key, now):
        rec = self.live.get(key)
        if rec is not None and now > rec["beat"]:  # a renewal that renews nothing re-arms nothing
            rec["beat"] = now
            self.reported.discard((key, "stall"))

    def forget(self, key):
        self.live.pop(key, None)
        self.gone.add(key)

    def due(self, key, rec):
        deadline = SPEC.deadlines[rec["state"]]
        out = []
        if deadline.seconds is not None:
            out.append((rec["entered"] + deadline.seconds, "state"))
        if deadline.stall is not None:
            out.append((rec["beat"] + deadline.stall, "stall"))
        out.append((rec["born"] + SPEC.lifetime, "lifetime"))
        return sorted(out, key=lambda x: x[0])

    def check(self, now):
        result = set()
        for key, rec in list(self.live.items()):
            overdue = [(d, r) for d, r in self.due(key, rec) if d <= now]
            if not overdue:
                continue
            if self.mode == "enforce":
                result.add((key, overdue[0][1]))
                del self.live[key]
                self.gone.add(key)
            else:
                for _, reason in overdue:
                    if (key, reason) not in self.reported:
                        self.reported.add((key, reason))
                        result.add((key, reason))
        return result


def run(mode, operations):
    """An observe/heartbeat operation with a trailing *lag* is applied late: with
    ``at=`` that much before now, kept in time order across operations (as a caller
    applying captured changes in the order they happened does)."""
    set_on_expire_hooks([])
    clock = FakeClock()
    wd = sg.Watchdog(SPEC, clock=clock, mode=mode)
    ref = Reference(mode)
    last_at = float("-inf")
    for op in operations:
        kind = op[0]
        if kind in ("observe", "heartbeat"):
            lag = op[-1] if isinstance(op[-1], float) else None
            if lag is None:
                at = None
                t = last_at = clock()
            else:
                t = at = last_at = max(clock() - lag, last_at)
        if kind == "observe":
            wd.observe(op[1], op[2], at=at)
            ref.observe(op[1], op[2], t)
        elif kind == "heartbeat":
            wd.heartbeat(op[1], at=at)
            ref.heartbeat(op[1], t)
        elif kind == "forget":
            wd.forget(op[1])
            ref.forget(op[1])
        elif kind == "advance":
            clock.advance(op[1])
        else:
            got = {(e.key, e.reason) for e in wd.check()}
            assert got == ref.check(clock())
        assert set(wd._where) == set(ref.live)
        for key, rec in ref.live.items():
            assert wd.state_of(key) == rec["state"]
    # a final check far in the future: whatever is left with a deadline expires
    clock.advance(100)
    assert {(e.key, e.reason) for e in wd.check()} == ref.check(clock())


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_enforce_matches_reference(operations):
    run("enforce", operations)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_report_matches_reference(operations):
    run("report", operations)


LAGS = st.sampled_from([0.0, 0.5, 1.0, 1.5])
FEW_KEYS = st.integers(0, 2)  # fewer keys: more operations on the same request
late_ops = st.lists(
    st.one_of(
        st.tuples(st.just("observe"), FEW_KEYS, st.sampled_from(STATES), LAGS),
        st.tuples(st.just("heartbeat"), FEW_KEYS, LAGS),
        st.tuples(st.just("forget"), FEW_KEYS),
        st.tuples(st.just("advance"), st.sampled_from([0, 0.5, 1, 2, 2.5, 3, 5])),
        st.tuples(st.just("check")),
    ),
    max_size=120,
)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(late_ops)
@example([("observe", 0, "a", 1.5), ("advance", 2), ("check",)])
@example(
    [("observe", 0, "c", 0.0), ("advance", 1), ("heartbeat", 0, 1.0), ("advance", 1), ("check",)]
)
def test_changes_applied_late_with_at_match_reference(operations):
    """observe/heartbeat with ``at=`` behave as if made at *at*."""
    run("enforce", operations)
    run("report", operations)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(KEYS, st.sampled_from(["a", "b", "c"]), st.floats(0, 1.9)), max_size=60))
def test_never_fails_a_request_whose_states_all_end_in_time(steps):
    """Every state is left before its deadline (and stall window, and lifetime):
    nothing ever expires, however the checks interleave."""
    set_on_expire_hooks([])
    clock = FakeClock()
    wd = sg.Watchdog(SPEC.evolve(lifetime=None), clock=clock)
    for key, state, dwell in steps:
        wd.observe(key, state)
        clock.advance(dwell)  # < 2 s: inside every deadline and the stall window
        assert wd.check() == []
        wd.observe(key, "ok")
        assert wd.check() == []
    assert len(wd) == 0


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["a", "b", "c"]), st.floats(0, 20)), min_size=1, max_size=40
    ),
    st.lists(st.floats(0, 3), min_size=1, max_size=40),
)
def test_each_overdue_key_fails_at_first_check_at_or_after_deadline(entries, check_gaps):
    set_on_expire_hooks([])
    clock = FakeClock()
    wd = sg.Watchdog(SPEC.evolve(lifetime=None), clock=clock)
    due = {}
    for key, (state, offset) in enumerate(entries):
        clock.set(max(clock(), offset))
        wd.observe(key, state)
        d = SPEC.deadlines[state]
        due[key] = clock() + min(x for x in (d.seconds, d.stall) if x is not None)
    failed_at = {}
    previous_check = -1.0
    for gap in check_gaps * 20:
        clock.advance(gap)
        for e in wd.check():
            assert e.key not in failed_at  # exactly once
            failed_at[e.key] = clock()
            # the first check at or after its deadline: not earlier, and the check
            # before this one came before the deadline
            assert previous_check < due[e.key] <= clock()
        previous_check = clock()
        if len(failed_at) == len(due):
            break
    assert set(failed_at) == {k for k, d in due.items() if d <= clock()}


def test_a_million_requests_leave_nothing_behind():
    set_on_expire_hooks([])
    clock = FakeClock()
    spec = SPEC.evolve(lifetime=30)
    wd = sg.Watchdog(spec, clock=clock, memory=1000)
    expired = 0
    for key in range(1_000_000):
        wd.observe(key, "a")
        if key % 3:
            wd.observe(key, "c")
            wd.heartbeat(key)
            wd.observe(key, "ok" if key % 5 else "err")
        elif key % 2:
            wd.forget(key)
        if key % 1000 == 0:
            clock.advance(1)
            expired += len(wd.check())
    clock.advance(100)
    expired += len(wd.check())
    assert expired == len(range(0, 1_000_000, 6))  # the ones left in "a"
    assert len(wd) == 0
    footprint = wd._footprint()
    assert footprint.pop("remembered") == 1000  # bounded tombstones
    assert set(footprint.values()) == {0}, footprint  # nothing left, not even stale entries
    assert wd.next_deadline() is None
