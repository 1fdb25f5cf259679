"""The decode quarantine's promises, tried against random sequences (hypothesis, a
FakeClock, no sleeps):

* the pages of a request stallguard failed in the transfer queue are never freed
  without a proof (the prefill's drain ACK for its room), even though SGLang's own
  deferred-release timeout is 0 here (SGLang alone would free them at its next pass),
  and even once the hold is overdue (escalated once, still held);
* every hold is released once its proof came (at SGLang's next release pass), exactly
  once, through SGLang's own release (pages, metadata row);
* requests SGLang failed itself (a transport failure) keep SGLang's own release.

Real: SGLang 0.5.23's ``DecodeTransferQueue.pop_transferred``, ``_defer_release``,
``resolve_deferred_releases`` (with its gloo all-reduce over one rank), real
``NixlKVReceiver``s (``poll``, ``failure_exception``, ``ensure_abort_notified`` arming
the drain-ACK tracker) over a ``NixlKVManager``'s status and ACK plumbing built with
``object.__new__`` (sglang_decode_support.OfflineNode: no NIXL agent, ZMQ or prefill;
the ABORT's send to the prefill fails, as best effort, and the ACK is
``note_abort_ack``, what the manager's listener thread calls when one arrives).
"""

from __future__ import annotations

import time

import pytest
import sglang_decode_support as ds
import sglang_support as sgs
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

SKIP = sgs.skip_reason("0.5.23")
pytestmark = [pytest.mark.sglang, pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]

FAILED, WFI = 0, 2
DEADLINE = 4.0
QUARANTINE = 6.0
CONFIG = {"decode": {"transfer": {"WaitingForInput": DEADLINE}, "quarantine": QUARANTINE}}


@pytest.fixture(scope="module", autouse=True)
def _context():
    sgs.setup_context(0, 1, disaggregation_mode="decode")
    yield
    sgs.teardown_context()


op = st.one_of(
    st.tuples(st.just("add"), st.just(0)),
    st.tuples(st.just("advance"), st.floats(0, 8)),
    st.tuples(st.just("ack"), st.integers(0, 20)),  # the prefill's drain ACK for a room
    st.tuples(st.just("transport"), st.integers(0, 20)),  # a failure SGLang sees itself
    st.tuples(st.just("step"), st.just(0)),
    st.tuples(st.just("step"), st.just(1)),  # (loop passes are the most frequent event)
)


def _unreachable(*args, **kwargs):
    raise ConnectionError("no prefill in this test")


def _node():
    node = ds.OfflineNode()
    mgr = node.mgr
    # the decode manager's drain-ACK tracker (CommonKVManager.__init__ in DECODE mode)
    mgr._deferred_abort_ack_tracker = {}
    mgr._deferred_abort_generation = 0
    mgr.waiting_timeout = 1e9  # SGLang's own WAITING_TIMEOUT (wall clock): never, here
    return node


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=4, max_size=40))
# found by hypothesis: a hold exactly one deadline old, whose age (a difference of two
# float readings) rounds just below the deadline, is overdue (the model's rounding)
@example(
    ops=[
        ("add", 0),
        ("advance", 6.068699040742702),
        ("step", 0),
        ("advance", 5.068699040742702),
        ("advance", 7.310523425332002),
    ]
)
def test_quarantined_pages_are_freed_only_on_a_proof_and_exactly_once(ops):
    from stallguard_sglang.testing import installed

    from stallguard.testing import FakeClock, record_expiries

    clock = FakeClock(1000.0)
    node = _node()
    mgr = node.mgr
    side = ds.DecodeSide(node, free_slots=0, deferred_release=True)
    side.transfer.deferred_kv_release_timeout = 0.0  # SGLang alone: freed at once
    rooms: dict[str, int] = {}
    acked: set[str] = set()  # rids whose room the prefill ACKed
    transport: set[str] = set()  # rids SGLang failed itself
    try:
        with installed(CONFIG, clock=clock), record_expiries() as expiries:

            def forced() -> set[str]:
                return {str(e.key) for e in expiries if e.mode == "enforce"}

            def step() -> None:
                before = list(side.released)
                side.step()
                for rid in side.released[len(before) :]:
                    if rid in forced():
                        # never freed without the proof
                        assert rid in acked, f"{rid} freed without its drain ACK"

            def ack(rid: str) -> None:
                state = mgr._deferred_abort_ack_tracker.get(rooms[rid])
                if state is not None:  # armed: the ABORT was sent with a generation
                    mgr.note_abort_ack(rooms[rid], 0, state.generation)
                    acked.add(rid)

            for name, arg in ops:
                if name == "add":
                    rid = f"r{len(rooms)}"
                    room = 9000 + len(rooms)
                    dreq = side.add_waiting(rid, room, "transfer")
                    receiver = dreq.kv_receiver
                    # what init() and send_metadata() leave on the receiver
                    receiver.bootstrap_infos = [{"rank_ip": "127.0.0.1", "rank_port": 1}]
                    receiver.init_time = time.time()
                    receiver._connect_to_bootstrap_server = _unreachable
                    rooms[rid] = room
                elif name == "advance":
                    clock.advance(arg)
                elif name == "step":
                    step()
                elif rooms:
                    rid = sorted(rooms)[arg % len(rooms)]
                    if name == "ack":
                        ack(rid)
                    elif rid in side.rids("transfer") and rid not in forced():
                        mgr.record_failure(rooms[rid], "transport error")
                        mgr.update_status(rooms[rid], FAILED)
                        transport.add(rid)
            # overdue holds are escalated, never freed
            step()
            clock.advance(QUARANTINE)
            step()
            guard = getattr(side.transfer, "_stallguard_decode_guard", None)
            quarantine = guard.quarantine if guard is not None else None
            if quarantine is not None:
                held = {str(h.key) for h in quarantine.holds()}
                assert held == forced() - acked
                for h in quarantine.holds():
                    # due at since + deadline (as the watchdog computes it: the
                    # difference of two clock readings can round just below it)
                    assert h.overdue == (h.since + QUARANTINE <= clock())
            # the end: every request fails (deadline), every armed room is ACKed
            clock.advance(DEADLINE)
            step()
            for rid in list(rooms):
                ack(rid)
            step()
            step()
            assert side.transfer.queue == [] and side.transfer._deferred_releases == []
            if quarantine is not None:
                assert quarantine.holds() == [] and guard.holds == {} and guard.forced == {}
                snapshot = quarantine.snapshot()
                assert snapshot.released == ({"transfer_done": len(forced())} if forced() else {})
    finally:
        side.close()
    # every request freed exactly once; stallguard's only after their ACK
    assert sorted(side.released) == sorted(rooms)
    assert forced().isdisjoint(transport)
    assert forced() | transport == set(rooms)
    assert side.allocator.available_size() == side.allocator.size
