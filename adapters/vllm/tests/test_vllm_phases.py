"""Hypothesis tests of the adapter's promises on its state-mapping layer (PhaseTracker),
with a FakeClock: random sequences of vLLM's phase changes, clock moves and scheduler
steps, checked against a model of what the docs promise (see _phases.py):

* a request is ordered failed at most once, ever;
* a request whose transfer ended (``done``) is never ordered failed afterwards;
* a request is ordered failed in the first step at or past its phase's deadline, counted
  from when it entered the phase, and never before;
* ``Queued`` is only ever reported, never failed; report mode never orders anything;
* a request failed in ``Receiving`` or overdue in ``AbortedHeld`` is quarantined, and
  leaves quarantine only when its transfer ends (``done``), never on a deadline; a hold
  past the ``Quarantined`` deadline is escalated once.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from stallguard_vllm._config import Config
from stallguard_vllm._phases import (
    ABORTED_HELD,
    HELD_FOR_READ,
    QUEUED,
    RECEIVING,
    PhaseTracker,
)

from stallguard.testing import FakeClock

RIDS = st.sampled_from([f"r{i}" for i in range(3)])
DEADLINES = {RECEIVING: 3.0, ABORTED_HELD: 2.0, HELD_FOR_READ: 4.0}
QUARANTINE = 6.0
CONFIG = Config(
    queued=5.0, receiving=3.0, aborted_held=2.0, held_for_read=4.0, quarantined=QUARANTINE
)


class TrackerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock(100.0)
        self.tracker = PhaseTracker(CONFIG, clock=self.clock)
        # the model: rid -> (phase, entered_at) for tracked transfers
        self.phase: dict[str, tuple[str, float]] = {}
        self.concluded: set[str] = set()  # done (while tracked) or ordered failed
        self.ordered: list[str] = []
        self.done_rids: set[str] = set()
        # rid -> [held since, overdue?] for quarantined requests
        self.quarantined: dict[str, list[float | bool]] = {}
        self.overdue = 0
        self.aborted_expiries = 0

    def _enter(self, rid: str, phase: str) -> None:
        if rid in self.concluded:
            return  # a concluded request is never re-armed
        current = self.phase.get(rid)
        if current is not None and current[0] == phase:
            return  # same phase again: the clock does not restart
        self.phase[rid] = (phase, self.clock())

    @rule(rid=RIDS)
    def queued(self, rid: str) -> None:
        self.tracker.queued(rid)

    @rule(rid=RIDS)
    def receiving(self, rid: str) -> None:
        self.tracker.receiving(rid)
        self._enter(rid, RECEIVING)

    @rule(rid=RIDS)
    def not_receiving(self, rid: str) -> None:
        self.tracker.not_receiving(rid)

    @rule(rid=RIDS)
    def finished(self, rid: str) -> None:
        held = self.tracker.finished(rid)
        current = self.phase.get(rid)
        expect = current is not None and current[0] == RECEIVING
        assert held == expect
        if expect:
            self._enter(rid, ABORTED_HELD)

    @rule(rid=RIDS)
    def held_for_read(self, rid: str) -> None:
        self.tracker.held_for_read(rid)
        self._enter(rid, HELD_FOR_READ)

    @rule(rid=RIDS, failed=st.booleans())
    def done(self, rid: str, failed: bool) -> None:
        released = self.tracker.done(rid, failed=failed)
        assert (released is not None) == (rid in self.quarantined)
        self.quarantined.pop(rid, None)
        if rid in self.phase:
            del self.phase[rid]
            self.concluded.add(rid)
            self.done_rids.add(rid)

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0, 5.0]))
    def advance(self, dt: float) -> None:
        self.clock.advance(dt)

    @rule(dt=st.sampled_from([0.5, 1.0, 2.5]))
    def advance_and_step(self, dt: float) -> None:
        """The scheduler's rhythm: time passes, then a step."""
        self.clock.advance(dt)
        self.step()

    @rule()
    def step(self) -> None:
        now = self.clock()
        for hold in self.quarantined.values():
            if not hold[1] and float(hold[0]) + QUARANTINE <= now:
                hold[1] = True
                self.overdue += 1
        expected_fail = set()
        expected_release = set()
        for rid, (phase, entered) in list(self.phase.items()):
            if entered + DEADLINES[phase] <= now:
                if phase == HELD_FOR_READ:
                    expected_release.add(rid)
                elif phase == RECEIVING:
                    expected_fail.add(rid)
                    self.quarantined[rid] = [now, False]
                else:  # AbortedHeld: the request ended; its blocks stay, quarantined
                    self.aborted_expiries += 1
                    self.quarantined[rid] = [now, False]
                del self.phase[rid]
                self.concluded.add(rid)
        orders = self.tracker.step()
        assert set(orders.fail_recv) == expected_fail
        assert set(orders.release_send) == expected_release
        for rid in orders.fail_recv | orders.release_send:
            assert rid not in self.ordered, f"{rid} ordered failed twice"
            assert rid not in self.done_rids, f"{rid} ordered failed after its transfer ended"
            self.ordered.append(rid)

    @invariant()
    def queued_never_forced(self) -> None:
        assert self.tracker.counts[("forced", QUEUED)] == 0

    @invariant()
    def forced_count_matches(self) -> None:
        forced = sum(n for (kind, _), n in self.tracker.counts.items() if kind == "forced")
        assert forced == len(self.ordered) + self.aborted_expiries

    @invariant()
    def quarantine_matches(self) -> None:
        """Held exactly while the model says so: never freed by a deadline."""
        q = self.tracker.quarantine
        assert {h.key for h in q.holds()} == set(self.quarantined)
        assert {h.key for h in q.holds() if h.overdue} == {
            rid for rid, (_, overdue) in self.quarantined.items() if overdue
        }
        assert self.tracker.counts[("quarantine_overdue", "Quarantined")] == self.overdue
        for rid in self.quarantined:
            assert self.tracker.phase_of(rid) == "Quarantined"


TestTracker = TrackerMachine.TestCase
TestTracker.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)

EVENTS = st.lists(
    st.tuples(
        st.sampled_from(
            ["queued", "receiving", "finished", "held_for_read", "done", "advance", "step"]
        ),
        RIDS,
        st.sampled_from([0.5, 1.0, 4.0]),
    ),
    max_size=60,
)


@settings(max_examples=80, deadline=None)
@given(events=EVENTS)
def test_report_mode_never_orders(events: list[tuple[str, str, float]]) -> None:
    clock = FakeClock(0.0)
    tracker = PhaseTracker(
        Config(mode="report", queued=1.0, receiving=1.0, aborted_held=1.0, held_for_read=1.0),
        clock=clock,
    )
    for name, rid, dt in events:
        if name == "advance":
            clock.advance(dt)
        elif name == "step":
            assert not tracker.step()
        else:
            getattr(tracker, name)(rid)
    assert not tracker.step()
    assert all(kind == "reported" for kind, _ in tracker.counts)


def test_queued_overstay_is_reported_once_and_never_failed() -> None:
    clock = FakeClock(0.0)
    tracker = PhaseTracker(CONFIG, clock=clock)
    tracker.queued("q")
    clock.advance(CONFIG.queued or 0)
    assert not tracker.step()
    clock.advance(100)
    assert not tracker.step()
    assert tracker.counts == {("reported", QUEUED): 1}
    assert tracker.take_counts() == {("reported", QUEUED, "state"): 1}
    assert tracker.take_counts() == {}


def test_mode_off_has_no_tracker() -> None:
    with pytest.raises(ValueError, match="mode enforce or report"):
        PhaseTracker(Config(mode="off"))


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.lists(
            st.tuples(st.sampled_from([QUEUED, RECEIVING, HELD_FOR_READ]), st.integers(1, 4000)),
            max_size=12,
        ),
        min_size=1,
        max_size=4,
    )
)
def test_exported_stays_add_up_to_the_recorder_at_every_ladder_bound(batches) -> None:
    """What take_stays ships (per-bucket deltas, however the stays fall between exports)
    adds up to the tracker's own time-in-state histogram at every ladder bound: what
    the Prometheus histogram on vLLM's /metrics holds. Between exports: None."""
    from stallguard._stats import LADDER

    clock = FakeClock(0.0)
    long = 1e4  # no deadline fires: only the recording is under test
    tracker = PhaseTracker(
        Config(
            mode="report",
            queued=long,
            receiving=long,
            aborted_held=long,
            held_for_read=long,
            quarantined=long,
        ),
        clock=clock,
    )
    shipped: dict[str, list[int]] = {}
    seconds: dict[str, float] = {}
    n = 0
    for batch in batches:
        for phase, ms in batch:
            n += 1
            rid = f"r{n}"
            if phase == QUEUED:
                tracker.queued(rid)
            elif phase == RECEIVING:
                tracker.receiving(rid, peer="P", blocks=1, nbytes=1)
            else:
                tracker.held_for_read(rid)
            clock.advance(ms / 1000)
            tracker.done(rid)
        rows = tracker.take_stays()
        assert rows is not None
        assert tracker.take_stays() is None  # at most once per EXPORT_PERIOD
        for phase, counts, total, _deadline, _oldest in rows:
            acc = shipped.setdefault(phase, [0] * len(counts))
            shipped[phase] = [a + c for a, c in zip(acc, counts, strict=True)]
            seconds[phase] = seconds.get(phase, 0.0) + total
        clock.advance(1.0)
    for wd in (tracker.queue, tracker.transfers):
        for phase, st_ in wd.statistics().states.items():
            dist = st_.distribution
            cumulative = 0
            for i, bound in enumerate(LADDER):
                cumulative += shipped[phase][i]
                assert cumulative == dist.count - dist.count_above(bound), (phase, bound)
            assert sum(shipped[phase]) == dist.count
            assert abs(seconds[phase] - dist.total) < 1e-6
