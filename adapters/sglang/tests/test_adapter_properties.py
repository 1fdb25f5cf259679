"""Property tests of the adapter's documented guarantees on the REAL SGLang 0.5.23 queue.

Random interleavings of requests joining the prefill inflight queue, ``update_status``
state changes (as transfer threads make them), SGLang's own failures, clock moves and
queue calls, run against a small reference model of what docs/sglang.md promises:

* a request in a live state is failed (enforce) or reported (report) in the **first
  queue call at or past** ``since + deadline`` of its current state, never before, where
  ``since`` is when ``update_status`` entered the state, or the queue call that enrolled
  it if it entered the state before it joined the queue;
* a request that concluded (Success, or failed by SGLang) before that call is never
  failed nor reported;
* each stuck request is failed exactly once (``FakeScheduler`` raises if SGLang concludes
  a request twice), with ``entered_at`` its state's real start; in report mode each state
  entry is reported once and nothing is failed;
* with a progress window (``stall``) on Transferring, a repeated
  ``update_status(Transferring)`` renews it from the time it ran: the request fails at
  the first call at or past its last progress plus the window (or its state deadline,
  whichever comes first).

Time is a FakeClock; nothing sleeps.
"""

from __future__ import annotations

from typing import Any

import pytest
import sglang_support as sgs
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from stallguard_sglang.testing import installed

from stallguard.testing import FakeClock, record_expiries

SKIP = sgs.skip_reason("0.5.23")
pytestmark = [pytest.mark.sglang, pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]

FAILED, WFI, TRANSFERRING, SUCCESS = 0, 2, 3, 4
NAMES = {WFI: "WaitingForInput", TRANSFERRING: "Transferring"}
DEADLINES = {"Bootstrapping": 30, "WaitingForInput": 10, "Transferring": 20}
SECONDS = {WFI: 10.0, TRANSFERRING: 20.0}
T0 = 1000.0


@pytest.fixture(scope="module", autouse=True)
def _context():
    sgs.setup_context(0, 1)
    yield
    sgs.teardown_context()


class Model:
    """What the docs promise, for one scheduler's inflight queue."""

    def __init__(self, stall: float | None = None) -> None:
        self.stall = stall  # a progress window on Transferring (enforce mode only)
        self.state: dict[str, int] = {}  # rid -> current KVPoll value
        self.since: dict[str, float] = {}  # rid -> start of its current state (enrolled)
        self.progress: dict[str, float] = {}  # rid -> its latest progress (stall window)
        self.queued: list[str] = []
        self.pending: set[str] = set()  # joined, not yet enrolled by a queue call
        self.reported: set[tuple[str, int, float]] = set()  # report mode: state entries

    def join(self, rid: str, state: int) -> None:
        self.state[rid] = state
        self.queued.append(rid)
        self.pending.add(rid)

    def change(self, rid: str, state: int, now: float) -> None:
        if state != self.state[rid]:
            self.state[rid] = state
            if rid not in self.pending:
                self.since[rid] = self.progress[rid] = now
        elif rid not in self.pending:  # the same state again: progress (a NIXL chunk)
            self.progress[rid] = now

    def due(self, rid: str) -> tuple[float, str]:
        """When the request's current state expires, and why."""
        state, since = self.state[rid], self.since[rid]
        due, reason = since + SECONDS[state], "state"
        if self.stall is not None and state == TRANSFERRING:
            window = self.progress[rid] + self.stall
            if window < due:
                due, reason = window, "stall"
        return due, reason

    def step(self, now: float, mode: str) -> tuple[set[str], set[tuple[Any, ...]], set[str]]:
        """One queue call at *now*: (failed by stallguard, expiries, concluded by SGLang)."""
        for rid in self.pending:
            self.since[rid] = self.progress[rid] = now
        self.pending.clear()
        failed, expiries, concluded = set(), set(), set()
        for rid in self.queued:
            state = self.state[rid]
            if state in (SUCCESS, FAILED):
                concluded.add(rid)
                continue
            since = self.since[rid]
            due, reason = self.due(rid)
            if now >= due and (rid, state, since) not in self.reported:
                # entered_at: the start of the clock that fired
                start = since if reason == "state" else self.progress[rid]
                expiries.add((rid, NAMES[state], start, reason))
                if mode == "enforce":
                    failed.add(rid)
                else:
                    self.reported.add((rid, state, since))
        self.queued = [rid for rid in self.queued if rid not in failed | concluded]
        return failed, expiries, concluded


STEP = st.tuples(st.just("step"))
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("join"), st.sampled_from([WFI, TRANSFERRING])),
        st.tuples(st.just("advance"), st.sampled_from([0.5, 1.0, 2.5, 5.0, 9.5, 10.0, 20.0])),
        st.tuples(st.just("set"), st.integers(0, 7), st.sampled_from([WFI, TRANSFERRING, SUCCESS])),
        st.tuples(st.just("fail"), st.integers(0, 7)),
        STEP,
        # (a change between two queue calls, then time passing: the change's own time
        # must start the state's clock, not the queue call that applies it)
        st.tuples(
            st.just("set-advance-step"),
            st.integers(0, 7),
            st.sampled_from([TRANSFERRING, SUCCESS]),
            st.sampled_from([0.5, 2.5, 5.0]),
        ),
    ),
    min_size=3,
    max_size=50,
)


def expand(ops):
    for op in ops:
        if op[0] == "set-advance-step":
            yield ("set", op[1], op[2])
            yield ("advance", op[3])
            yield ("step",)
        else:
            yield op


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, mode=st.sampled_from(["enforce", "report", "enforce-stall"]))
@example(  # a state's clock starts at its update_status, not at the next queue call
    ops=[
        ("join", WFI),
        ("step",),
        ("advance", 1.0),
        ("set", 0, TRANSFERRING),
        ("advance", 5.0),
        ("step",),
        ("advance", 20.0),
        ("step",),
    ],
    mode="enforce",
)
def test_random_interleavings_against_the_reference_model(ops, mode):
    clock = FakeClock(T0)
    deadlines: dict[str, Any] = dict(DEADLINES)
    stall = None
    if mode == "enforce-stall":  # a repeated update_status(Transferring) is progress
        mode, stall = "enforce", 5.0
        deadlines["Transferring"] = {"seconds": SECONDS[TRANSFERRING], "stall": stall}
    config = {"prefill": {"mode": mode, "deadlines": deadlines}}
    model = Model(stall)
    with installed(config, clock=clock), record_expiries() as expiries:
        sched = sgs.FakeScheduler()
        mgr = sgs.make_manager("nixl")
        reqs: dict[str, object] = {}
        for op in [*expand(ops), ("step",)]:
            kind = op[0]
            if kind == "join":
                rid = f"r{len(reqs)}"
                sender = sgs.make_sender(mgr, sgs.next_room())
                for status in (WFI, TRANSFERRING):
                    if status <= op[1]:
                        sgs.set_status(sender, status)
                reqs[rid] = req = sgs.make_request(rid, sender, prefilled=False)
                sched.prefill(req)
                model.join(rid, op[1])
            elif kind == "advance":
                clock.advance(op[1])
            elif kind in ("set", "fail"):
                live = [rid for rid in model.queued if model.state[rid] not in (SUCCESS, FAILED)]
                if not live:
                    continue
                rid = live[op[1] % len(live)]
                sender = reqs[rid].disagg_kv_sender
                if kind == "fail":
                    sgs.fail_sender(sender, "transport error")
                    model.change(rid, FAILED, clock())
                elif op[2] >= model.state[rid]:  # update_status only moves forward
                    # (the same state again is a repeated update_status: progress)
                    sgs.set_status(sender, op[2])
                    model.change(rid, op[2], clock())
            else:
                seen = len(expiries)
                before = set(sched.conclusions)
                sched.step()
                failed, expected, concluded = model.step(clock(), mode)
                got = {(str(e.key), e.state_label, e.entered_at, e.reason) for e in expiries[seen:]}
                assert got == expected, f"at {clock() - T0}"
                assert len(expiries) - seen == len(expected)  # once each
                new = {rid: sched.conclusions[rid] for rid in set(sched.conclusions) - before}
                assert set(new) == failed | concluded
                for rid, conclusion in new.items():
                    by_us = conclusion.message is not None and "stallguard" in conclusion.message
                    assert by_us == (rid in failed), (rid, conclusion)
                    if model.state[rid] == SUCCESS:
                        assert conclusion.outcome == "success"
                    else:
                        assert conclusion.outcome == "transfer_failed"
                assert sched.inflight_rids() == model.queued
        # every change went through update_status on this thread: the guard always knew
        # the state, so no expiry ever needed withdrawing (stallguard.CONCLUDED)
        guard = getattr(sched, "_stallguard_inflight_guard", None)
        if guard is not None:
            assert all(wd.snapshot().withdrawn == 0 for wd in guard.watchdogs.values())
        if mode == "report":
            assert all("stallguard" not in (c.message or "") for c in sched.conclusions.values())
