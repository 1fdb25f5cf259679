"""The decode guard's promises, tried against random sequences (hypothesis):

* a request is failed by stallguard at most once, and concluded by the queue once;
* a request whose receiver failed (a transport failure, an abort) is never failed by
  stallguard, whose reason would replace SGLang's; in the prealloc queue no concluded
  request is; in the transfer queue a receiver that concluded Success is failed only if
  the queue still holds it a whole ``Transferring`` deadline after the Success (the
  metadata gate or HiCache held it back), counted from the Success;
* stallguard fails a request only once its phase has lasted its deadline;
* a request that left the queue is forgotten everywhere (guard, watchdog, manager).

Real: SGLang 0.5.23's ``NixlKVReceiver`` (``poll``, ``failure_exception``, ``abort``,
``clear``) over the real ``CommonKVManager.update_status`` / ``record_failure`` of a
``NixlKVManager`` built with ``object.__new__`` (no NIXL agent, ZMQ or bootstrap: no
prefill is involved here), and the adapter's real hooks (installed with
``stallguard_sglang.testing.installed``). Stand-in: ``conclude`` plays the part of the
queue method's conclusion step (remove the requests whose poll is terminal, as
``pop_transferred`` / ``pop_preallocated`` do); the real methods are exercised in
test_adapter_decode.py.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import sglang_decode_support as ds
import sglang_support as sgs
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

SKIP = sgs.skip_reason("0.5.23")
pytestmark = [pytest.mark.sglang, pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]

FAILED, BOOTSTRAPPING, WFI, SUCCESS = 0, 1, 2, 4
DEADLINES = {
    "prealloc": {"Bootstrapping": 7, "WaitingForPrefill": 9, "WaitingForInput": 5},
    "transfer": {"WaitingForInput": 4, "Transferring": 6},
}


@pytest.fixture(scope="module", autouse=True)
def _context():
    sgs.setup_context(0, 1, disaggregation_mode="decode")
    yield
    sgs.teardown_context()


op = st.one_of(
    st.tuples(st.just("add"), st.booleans()),  # (handshake done already?)
    st.tuples(st.just("status"), st.integers(0, 30), st.sampled_from([WFI, SUCCESS, FAILED])),
    st.tuples(st.just("abort"), st.integers(0, 30)),
    st.tuples(st.just("advance"), st.floats(0, 8)),
    st.tuples(st.just("call"), st.just(0)),
    st.tuples(st.just("call"), st.just(1)),  # (queue calls are the most frequent event)
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["prealloc", "transfer"]), ops=st.lists(op, min_size=4, max_size=50))
# found by hypothesis: an abort of a Success still held in the transfer queue (the room
# is marked Failed before the receiver is latched) once expired as Transferring
@example(kind="transfer", ops=[("add", False), ("call", 0), ("status", 0, 4), ("advance", 6.0)])
def test_decode_guard_fails_once_and_never_a_concluded_request(kind, ops):
    from sglang.srt.disaggregation.common.conn import KVTransferError
    from sglang.srt.disaggregation.nixl.conn import NixlKVReceiver
    from stallguard_sglang import _decode
    from stallguard_sglang.testing import installed

    from stallguard.testing import FakeClock, record_expiries

    clock = FakeClock(1000.0)
    mgr = ds.offline_decode_manager()
    qobj = SimpleNamespace(queue=[], scheduler=None)
    all_reqs: list = []
    concluded: dict[str, list[str]] = defaultdict(list)
    settled: set[str] = set()  # receivers that failed before a queue call
    succeeded: dict[str, float] = {}  # transfer queue: when the receiver concluded Success
    terminal_ok = (FAILED, SUCCESS) if kind == "transfer" else (FAILED,)

    def conclude(q):
        """Stand-in for the queue method's conclusion step."""
        keep, left = [], []
        for dreq in q.queue:
            state = int(dreq.kv_receiver.poll())
            if state == FAILED:
                try:
                    dreq.kv_receiver.failure_exception()
                except KVTransferError as e:
                    concluded[dreq.req.rid].append(str(e))
                left.append(dreq)
            elif state in terminal_ok:
                concluded[dreq.req.rid].append("success")
                dreq.kv_receiver.clear()
                left.append(dreq)
            else:
                keep.append(dreq)
        q.queue = keep
        # pop_transferred returns the Reqs; pop_preallocated the DecodeRequests
        return [d.req for d in left] if kind == "transfer" else (left, [])

    around = _decode.transfer_around if kind == "transfer" else _decode.prealloc_around
    config = {"decode": {kind: DEADLINES[kind]}}
    with installed(config, clock=clock), record_expiries() as expiries:
        for step in ops:
            name = step[0]
            if name == "add":
                rid = f"r{len(all_reqs)}"
                receiver = NixlKVReceiver(mgr, "127.0.0.1:1", 7000 + len(all_reqs))
                if step[1] or kind == "transfer":
                    mgr.update_status(receiver.bootstrap_room, WFI)
                dreq = SimpleNamespace(req=SimpleNamespace(rid=rid), kv_receiver=receiver)
                all_reqs.append(dreq)
                qobj.queue.append(dreq)
            elif name in ("status", "abort") and qobj.queue:
                dreq = qobj.queue[step[1] % len(qobj.queue)]
                receiver = dreq.kv_receiver
                if name == "abort":
                    receiver.abort()
                elif step[2] == SUCCESS and kind == "prealloc":
                    pass  # a prealloc receiver never concludes Success (SGLang raises)
                elif step[2] == FAILED:
                    mgr.record_failure(receiver.bootstrap_room, "transport error")
                    mgr.update_status(receiver.bootstrap_room, FAILED)
                else:
                    mgr.update_status(receiver.bootstrap_room, step[2])
                state = int(receiver.poll())
                if state == FAILED:
                    settled.add(dreq.req.rid)
                elif state == SUCCESS:
                    succeeded.setdefault(dreq.req.rid, clock())
            elif name == "advance":
                clock.advance(step[1])
            elif name == "call":
                around(lambda q: conclude(q), qobj)
        # end: conclude everything still queued, then one last call
        for dreq in list(qobj.queue):
            dreq.kv_receiver.abort()
        around(lambda q: conclude(q), qobj)
        guard = getattr(qobj, "_stallguard_decode_guard", None)
        if guard is not None:
            assert guard.entries == {} and len(guard.wd) == 0
            # every change goes through update_status here, on this thread: the guard
            # always knows the phase, so no expiry ever needs withdrawing (a non-zero
            # count is a phase the hooks missed, as the abort of a gated Success once was)
            assert guard.wd.snapshot().withdrawn == 0
        assert getattr(mgr, "_stallguard_decode_rooms", {}) == {}
    forced = [str(e.key) for e in expiries]
    assert len(forced) == len(set(forced))  # at most once
    for rid, outcomes in concluded.items():
        assert len(outcomes) == 1, (rid, outcomes)  # concluded once
        if "stallguard" in outcomes[0]:
            assert rid not in settled, f"{rid} was failed after it concluded"
            assert rid in forced
    for e in expiries:
        rid = str(e.key)
        assert e.elapsed >= e.deadline
        assert "stallguard" in concluded[rid][0]
        if rid in succeeded:
            assert e.state_label == "Transferring" and e.entered_at >= succeeded[rid]


def test_init_under_prefill_complete_starts_the_waiting_for_prefill_phase():
    """``init()`` under ``prefill_complete`` changes no status (the receiver stays
    Bootstrapping, waiting for the prefill's forward pass): its AFTER hook starts the
    ``WaitingForPrefill`` phase, with its own deadline, from the init. Stand-in: the
    bootstrap ``init()`` would fetch from the bootstrap server is set by hand, and the
    hooked ``init`` is told it ran (``receiver_init_after``)."""
    from sglang.srt.disaggregation.nixl.conn import NixlKVReceiver
    from stallguard_sglang import _decode
    from stallguard_sglang.testing import installed

    from stallguard.testing import FakeClock, record_expiries

    clock = FakeClock(1000.0)
    mgr = ds.offline_decode_manager()
    qobj = SimpleNamespace(queue=[], scheduler=None)
    receiver = NixlKVReceiver(mgr, "127.0.0.1:1", 8001)
    qobj.queue.append(SimpleNamespace(req=SimpleNamespace(rid="r"), kv_receiver=receiver))

    def keep(q):  # stand-in for pop_preallocated: nothing concludes here
        return ([], [])

    config = {"decode": {"prealloc": {"Bootstrapping": 5, "WaitingForPrefill": 30}}}
    with installed(config, clock=clock), record_expiries() as expiries:
        _decode.prealloc_around(keep, qobj)
        guard = qobj._stallguard_decode_guard
        [entry] = guard.entries.values()
        assert guard.wd.state_of(entry) == "Bootstrapping"
        clock.advance(4)
        receiver.bootstrap_infos = [{"rank_ip": "127.0.0.1"}]  # what init() resolves
        _decode.receiver_init_after(None, receiver)
        assert guard.wd.state_of(entry) == "WaitingForPrefill"
        clock.advance(29.9)  # 33.9 s in the queue: past Bootstrapping's 5 s, not 30 s of this
        _decode.prealloc_around(keep, qobj)
        assert expiries == []
        clock.advance(0.1)
        _decode.prealloc_around(keep, qobj)
    assert [(e.state_label, e.entered_at) for e in expiries] == [("WaitingForPrefill", 1004.0)]
    assert receiver.conclude_state == 0 and "WaitingForPrefill" in mgr.failure_records[8001]
