"""Hypothesis tests of the generic guard's bookkeeping: the scheduler side's
PhaseTracker and the worker side's FailLedger driven together, the way
``StallguardConnector`` wires them, under random sequences of requests, clock moves,
connector verdicts (fail / wait / drop) and inner-connector ends, proven or not (a
Mooncake end from the decode's own timeout proves nothing; see connector.py).

Promises tried (docs/vllm.md, _ledger.py):

* a receive is reported in ``failed_recving`` at most once, only after the scheduler
  ordered it, and the scheduler orders it only at or past its Receiving deadline;
* the blocks of a receive reported failed are freed (its end passed on to the
  scheduler) only by an end the connector proved, never before; an unproven end keeps
  them held (quarantined) and the hold is released only by a later proven end;
* the end of a receive never failed is passed on in the step it comes;
* the blocks of a receive are reported as load errors (vLLM's scheduler fails the
  request on them at once) exactly in the step it is reported failed, once, and only
  when the scheduler sent them with the order;
* for a connector whose refinement cannot release prefill holds, an overdue
  ``HeldForRead`` is reported, never ordered released.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from stallguard_vllm._config import Config
from stallguard_vllm._ledger import FailLedger
from stallguard_vllm._phases import PhaseTracker

from stallguard.testing import FakeClock

RIDS = st.sampled_from([f"r{i}" for i in range(4)])
#: the blocks each receive writes into; the scheduler knows them for r0 and r2 only
#: (r1, r3: as with several KV cache groups, where it sends none)
BLOCKS = {f"r{i}": tuple(range(10 * i, 10 * i + 4)) for i in range(4)}
KNOWN = {"r0", "r2"}
VERDICTS = st.sampled_from(["fail", "wait", "drop"])
RECEIVING = 3.0
CONFIG = Config(
    queued=5.0, receiving=RECEIVING, aborted_held=2.0, held_for_read=4.0, quarantined=6.0
)


class GuardMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock(100.0)
        self.tracker = PhaseTracker(CONFIG, clock=self.clock, releases_sends=False)
        self.ledger = FailLedger()
        self.verdicts: dict[str, str] = {}
        # the model
        self.started: dict[str, float] = {}  # rid -> when Receiving began
        self.in_flight: set[str] = set()  # the inner connector has not ended it
        self.unproven_end: set[str] = set()  # ended, but without proof
        self.reported_failed: list[str] = []
        self.ordered_at: dict[str, float] = {}
        self.freed: set[str] = set()  # ends passed on to the scheduler
        self.released_sends = 0
        self.load_errors: set[int] = set()
        self.used: set[str] = set()

    @rule(rid=RIDS)
    def receive(self, rid: str) -> None:
        if rid in self.used:
            return  # request ids are unique in vLLM
        self.used.add(rid)
        self.tracker.receiving(rid, peer="P", blocks=4, nbytes=4096)
        self.started[rid] = self.clock()
        self.in_flight.add(rid)

    @rule(rid=RIDS, verdict=VERDICTS)
    def refinement_says(self, rid: str, verdict: str) -> None:
        self.verdicts[rid] = verdict

    @rule(rid=RIDS, proven=st.booleans())
    def inner_ends(self, rid: str, proven: bool) -> None:
        """The inner connector reports *rid* in finished_recving this step."""
        if rid not in self.in_flight and rid not in self.unproven_end:
            return
        was_failed = rid in self.ledger.failed
        passed = self.ledger.ends({rid}, set() if proven else {rid})
        self.in_flight.discard(rid)
        if was_failed and not proven:
            assert passed == set(), "an unproven end freed a failed request's blocks"
            self.unproven_end.add(rid)
            return
        assert passed == {rid}
        self.unproven_end.discard(rid)
        self.freed.add(rid)
        self.tracker.done(rid)

    @rule(dt=st.floats(min_value=0.0, max_value=2.5))
    def step(self, dt: float) -> None:
        self.clock.advance(dt)
        orders = self.tracker.step()
        now = self.clock()
        for rid in orders.fail_recv:
            assert rid not in self.ordered_at, f"{rid} ordered failed twice"
            assert now - self.started[rid] >= RECEIVING
            self.ordered_at[rid] = now
        self.released_sends += len(orders.release_send)
        self.ledger.order(orders.fail_recv, {r: BLOCKS[r] for r in orders.fail_recv & KNOWN})
        before = set(self.ledger.failed)
        due = self.ledger.due(lambda r: self.verdicts.get(r, "fail"))  # type: ignore[arg-type, return-value]
        failed_now = self.ledger.failed - before
        assert due == failed_now - KNOWN, "failed_recving: exactly the failed without blocks"
        for rid in failed_now:
            assert rid in self.ordered_at, f"{rid} reported failed without an order"
            assert rid not in self.reported_failed, f"{rid} reported failed twice"
            assert rid not in self.freed
            self.reported_failed.append(rid)
        errors = self.ledger.take_load_errors()
        assert errors == {b for rid in failed_now & KNOWN for b in BLOCKS[rid]}
        assert not errors & self.load_errors, "blocks reported as load errors twice"
        self.load_errors |= errors

    @rule(rid=RIDS)
    def prefill_holds(self, rid: str) -> None:
        key = f"p-{rid}"
        if key not in self.used:
            self.used.add(key)
            self.tracker.held_for_read(key)

    @invariant()
    def failed_blocks_held_until_proof(self) -> None:
        for rid in self.reported_failed:
            if rid not in self.freed:
                assert rid in self.ledger.failed
                assert rid in self.tracker.quarantine, f"{rid} failed but not quarantined"
            else:
                assert rid not in self.tracker.quarantine

    @invariant()
    def nothing_released_on_prefill(self) -> None:
        assert self.released_sends == 0
        assert self.tracker.counts[("forced", "HeldForRead")] == 0


TestGuard = GuardMachine.TestCase
TestGuard.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_drop_verdict_lets_the_transfer_succeed() -> None:
    ledger = FailLedger()
    ledger.order({"a", "b"})
    assert ledger.due(lambda r: "drop" if r == "a" else "wait") == set()
    assert ledger.ordered == {"b"}
    assert ledger.ends({"a"}) == {"a"}
    assert ledger.due(lambda r: "fail") == {"b"}
    assert ledger.due(lambda r: "fail") == set()  # once
    ledger.order({"b"})  # an order for a receive already failed is ignored
    assert ledger.ordered == set()
    assert ledger.ends({"b"}, {"b"}) == set() and ledger.withheld == {"b"}
    assert ledger.ends({"b"}) == {"b"} and not ledger.failed and not ledger.withheld


def test_load_errors_are_the_failed_receives_blocks_once() -> None:
    ledger = FailLedger()
    ledger.order({"a", "b", "c"}, {"a": [1, 2], "b": (3,), "x": (9,)})
    # a fails by its blocks, not in failed_recving; b's transfer completed
    assert ledger.due(lambda r: {"a": "fail", "b": "drop"}.get(r, "wait")) == set()  # type: ignore[arg-type, return-value]
    assert ledger.failed == {"a"}
    assert ledger.take_load_errors() == {1, 2}
    assert ledger.take_load_errors() == set()  # taken once
    assert ledger.blocks == {}  # b dropped: its blocks forgotten; c: none were sent
    assert ledger.due(lambda r: "fail") == {"c"}  # no blocks sent: failed_recving
    assert ledger.take_load_errors() == set()
    ledger.order({"d"}, {"d": (4,)})
    assert ledger.ends({"d"}) == {"d"}  # ended before its failure was due
    assert ledger.blocks == {} and ledger.due(lambda r: "fail") == set()
    assert ledger.take_load_errors() == set()
