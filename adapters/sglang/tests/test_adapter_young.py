"""Young requests (issue 25): the prefill lanes hold a request themselves, its state and
that state's start on their own record, until half the shortest deadline after it joined
the queue, then hand it to the watchdog (``Watchdog.adopt``) with those exact starts.
What must hold, on the REAL SGLang 0.5.23 queue (docs/sglang-internals.md):

* a request that changes state several times while young expires by its **latest**
  state's deadline, counted from **that state's entry** (its ``update_status``), in the
  first queue call at or past it, never earlier, exactly once;
* the stays of young requests reach the watchdog's time-in-state statistics;
* controls: an adapter that hands over the wrong time (the join) or the wrong state (the
  first one) is caught by the same checks.

Time is a FakeClock; nothing sleeps.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import sglang_support as sgs
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from stallguard_sglang.testing import installed

import stallguard
from stallguard.testing import FakeClock, record_expiries

SKIP = sgs.skip_reason("0.5.23")
pytestmark = [pytest.mark.sglang, pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]

WFI, TRANSFERRING, SUCCESS = 2, 3, 4
NAMES = {WFI: "WaitingForInput", TRANSFERRING: "Transferring"}
#: the shortest deadline is 8 s: a request is handed over 4 s after it joined
DEADLINES = {"Bootstrapping": 30, "WaitingForInput": 8, "Transferring": 12}
T0 = 1000.0


@pytest.fixture(scope="module", autouse=True)
def _context():
    sgs.setup_context(0, 1)
    yield
    sgs.teardown_context()


@contextlib.contextmanager
def corrupted(how: str | None):
    """The adapter as shipped (None), or handing over the wrong time or state."""
    if how is None:
        yield
        return
    original = stallguard.Watchdog.adopt

    def adopt(wd: Any, key: Any, state: Any, *, since: float, beat: float | None = None) -> bool:
        if how == "time":  # the join, not the state's entry
            return original(wd, key, state, since=key.joined, beat=key.joined)
        return original(wd, key, "WaitingForInput", since=since, beat=beat)  # the first state

    stallguard.Watchdog.adopt = adopt  # type: ignore[method-assign]
    try:
        yield
    finally:
        stallguard.Watchdog.adopt = original  # type: ignore[method-assign]


def model(moves: list[tuple[float, int]], steps: list[float]):
    """What the docs promise for one request joining at T0 in WaitingForInput: a
    change is applied at the next queue call with its own time, unless the room has
    moved on by then (only the latest change between two calls counts, its stay in the
    state it left ends there); the request expires in the first call at or past its
    current state's start plus the deadline. Returns ``(expiry (state, start, at) or
    None, when it left the queue, {state: (stays, total seconds)})``."""
    room, state, since, pending, stays = WFI, WFI, T0, None, []
    calls = sorted(T0 + t for t in steps)
    tail = max([T0, *calls])
    calls += [tail + k for k in range(1, 61)]  # then one a second, as run() does
    changes = sorted((T0 + t, status) for t, status in moves)
    for call in calls:
        while changes and changes[0][0] <= call:
            t, status = changes.pop(0)
            if status > room:  # update_status only moves forward
                room, pending = status, (status, t)
        if pending is not None:
            stays.append((NAMES[state], pending[1] - since))
            (state, since), pending = pending, None
        if state == SUCCESS:
            return None, call, _totals(stays)
        if call >= since + DEADLINES[NAMES[state]]:
            stays.append((NAMES[state], call - since))
            return (NAMES[state], since, call), call, _totals(stays)
    raise AssertionError("the model never ends")


def _totals(stays: list[tuple[str, float]]) -> dict[str, tuple[int, float]]:
    out: dict[str, tuple[int, float]] = {}
    for label, seconds in stays:
        count, total = out.get(label, (0, 0.0))
        out[label] = (count + 1, round(total + seconds, 6))
    return out


def run(moves: list[tuple[float, int]], steps: list[float], how: str | None = None):
    """The same on the real queue: the request joins at T0 (enrolled by a queue call
    at T0); *moves*: ``(seconds after T0, KVPoll)`` update_status calls; *steps*: queue
    calls (seconds after T0), then one a second until it is gone (at most 60)."""
    clock = FakeClock(T0)
    config = {"prefill": {"deadlines": DEADLINES}}
    with installed(config, clock=clock), record_expiries() as expiries, corrupted(how):
        sched = sgs.FakeScheduler()
        sender = sgs.make_sender(sgs.make_manager("nixl"), sgs.next_room())
        sgs.set_status(sender, WFI)
        sched.prefill(sgs.make_request("r", sender, prefilled=False))
        sched.step()
        events = sorted([(T0 + t, 0, s) for t, s in moves] + [(T0 + t, 1, 0) for t in steps])
        tail = max([T0, *(T0 + t for t in steps)])
        events = sorted(events + [(tail + k, 1, 0) for k in range(1, 61)])
        gone_at = None
        for t, kind, status in events:
            clock.set(t)
            if kind == 1:
                sched.step()
                if "r" not in sched.inflight_rids():
                    gone_at = t
                    break
            elif status > int(sender.poll()):
                sgs.set_status(sender, status)
        guard = sched._stallguard_inflight_guard
        for lane in guard.checks:
            lane.flush()
        [wd] = guard.watchdogs.values()
        recorded = {
            label: (s.distribution.count, round(s.distribution.total, 6))
            for label, s in wd.statistics().states.items()
            if s.distribution.count
        }
    got = [(e.state_label, e.entered_at, gone_at) for e in expiries]
    return got, gone_at, recorded


def check(moves, steps, how=None):
    expiry, left_at, stays = model(moves, steps)
    got, gone_at, recorded = run(moves, steps, how)
    # exactly once, its latest state, from that state's entry, in the first queue call
    # at or past the deadline; or never, if it concluded first
    assert got == ([] if expiry is None else [expiry])
    assert gone_at == left_at
    assert recorded == stays  # time in state, young or not


MOVES = st.lists(
    st.tuples(
        st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0, 3.5, 3.9, 4.5, 6.0]),
        st.sampled_from([WFI, TRANSFERRING, SUCCESS]),
    ),
    max_size=4,
)
STEPS = st.lists(st.sampled_from([0.25, 1.0, 2.5, 3.95, 4.0, 4.1, 7.0, 9.5, 15.0]), max_size=6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(moves=MOVES, steps=STEPS)
@example(moves=[(1.0, TRANSFERRING)], steps=[1.5, 2.0, 4.0, 13.0])  # changed while young
@example(moves=[(3.9, TRANSFERRING)], steps=[4.0, 15.9, 16.0])  # just before handover
@example(moves=[(4.5, TRANSFERRING)], steps=[4.0, 16.5])  # after handover
def test_the_latest_state_expires_from_its_own_entry(moves, steps):
    check(moves, steps)


@pytest.mark.parametrize("how", ["time", "state"])
def test_controls_a_wrong_handover_is_caught(how):
    # WaitingForInput at T0, Transferring at T0 + 1 (young), handed over at T0 + 4:
    # due at T0 + 13; the wrong time makes it T0 + 12, the wrong state T0 + 9
    with pytest.raises(AssertionError):
        check([(1.0, TRANSFERRING)], [2.0, 4.0, 9.0, 12.0, 13.0], how)
    check([(1.0, TRANSFERRING)], [2.0, 4.0, 9.0, 12.0, 13.0])  # as shipped: it holds


def test_a_request_leaving_young_costs_the_watchdog_nothing_but_its_stays():
    clock = FakeClock(T0)
    with installed({"prefill": {"deadlines": DEADLINES}}, clock=clock):
        sched = sgs.FakeScheduler()
        mgr = sgs.make_manager("nixl")
        senders = []
        for i in range(50):
            sender = sgs.make_sender(mgr, sgs.next_room())
            sgs.set_status(sender, WFI)
            sched.prefill(sgs.make_request(f"r{i}", sender, prefilled=False))
            senders.append(sender)
        sched.step()
        clock.advance(1)
        for sender in senders:
            sgs.set_status(sender, TRANSFERRING)
        sched.step()
        clock.advance(1)
        for sender in senders:
            sgs.set_status(sender, SUCCESS)
        sched.step()
        guard = sched._stallguard_inflight_guard
        [lane] = [lane for lane in guard.checks if lane.backend == "nixl"]
        assert sched.inflight_rids() == [] and guard.entries == {}
        assert len(lane.wd) == 0 and lane.wd.snapshot().expired == 0
        assert len(lane.young) == 0  # compacted as they left
        lane.flush()
        states = lane.wd.statistics().states
        assert states["WaitingForInput"].distribution.count == 50
        assert states["Transferring"].distribution.count == 50
        assert round(states["Transferring"].distribution.total, 6) == 50.0
