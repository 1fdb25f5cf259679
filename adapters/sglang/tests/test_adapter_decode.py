"""stallguard-sglang on the REAL SGLang 0.5.23 decode queues (issue 13), on both transfer
engines: NIXL and Mooncake (the module's fixtures are parametrized over the engine).

Real (sglang_decode_support.py says what stands in for the GPU memory pools): a prefill
process with SGLang's bootstrap server and two prefill ranks of the engine (DP 2,
round_robin), the decode ``NixlKVManager`` / ``MooncakeKVManager`` in DECODE mode, its
``KVReceiver``s, ``DecodePreallocQueue.pop_preallocated``,
``DecodeTransferQueue.pop_transferred``, ``resolve_deferred_releases``,
``MetadataBuffers``, transfers over NIXL (UCX/TCP) or the Mooncake transfer engine (TCP).
The ``prefill_complete`` allocation policy (prealloc ``WaitingForPrefill``) runs on
Mooncake only: SGLang 0.5.23 supports it on no other engine (see below).

stallguard's clock is a FakeClock; SGLang's own timeouts run on the wall clock at their
300 s defaults, far beyond these tests.

Slow: the processes import SGLang and start the engines (about 10-20 s per prefill
process on an idle 2-core machine, much more on a loaded one); the tests of an engine
share them.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sglang_decode_support as ds
import sglang_support as sgs

SKIP = sgs.skip_reason("0.5.23")
pytestmark = [
    pytest.mark.sglang,
    pytest.mark.slow,
    pytest.mark.skipif(SKIP is not None, reason=SKIP or ""),
]

T0 = 1000.0
BOOTSTRAPPING, WFI, SUCCESS = 1, 2, 4
# distinct deadlines, so that a failure says which phase fired
PREALLOC = {"Bootstrapping": 30, "WaitingForPrefill": 40, "WaitingForInput": 5}
TRANSFER = {"WaitingForInput": 10, "Transferring": 15}
CONFIG = {"decode": {"prealloc": PREALLOC, "transfer": TRANSFER}}


@pytest.fixture(scope="module", params=["nixl", "mooncake"])
def engine(request):
    """The transfer engine of the module's processes: every test below runs on both."""
    return request.param


def start_peer(policy, engine):
    p = ds.PrefillPeer(policy, engine=engine)
    try:
        import sglang.srt.disaggregation.decode  # noqa: F401  (import while it starts)

        p.wait_ready()
    except BaseException:
        p.close()
        raise
    return p


def start_node(peer, policy):
    # a decode KV manager reads the allocation policy when it is created
    ds.install_decode_context(peer.port, policy, engine=peer.engine)
    node = ds.DecodeNode(peer.addr, engine=peer.engine)
    node.policy = policy
    return node


@pytest.fixture(scope="module")
def peer(engine):
    p = start_peer("early", engine)
    yield p
    p.close()


@pytest.fixture(scope="module")
def node(peer):
    n = start_node(peer, "early")
    yield n
    n.close()


@contextlib.contextmanager
def guarded(config=CONFIG):
    from stallguard_sglang.testing import installed

    from stallguard.testing import FakeClock, record_expiries

    clock = FakeClock(T0)
    with installed(config, clock=clock), record_expiries() as expiries:
        yield clock, expiries


def make_side(node):
    # the policy is process-wide server args, read at each init(): this node's
    ds.install_decode_context(node.port, node.policy, engine=node.engine)
    return ds.DecodeSide(node, free_slots=2)


@pytest.fixture
def side(node):
    s = make_side(node)
    yield s
    s.close()


def forced(queue, state, backend):
    """The forced-failure count for *queue*, *state* and *backend* (whatever SGLang's
    own labels)."""
    from prometheus_client import REGISTRY

    return sum(
        sample.value
        for metric in REGISTRY.collect()
        for sample in metric.samples
        if sample.name == "sglang:stallguard_forced_failures_total"
        and sample.labels.get("queue") == queue
        and sample.labels.get("state") == state
        and sample.labels.get("backend") == backend
    )


def scenario(peer, side):
    """One request in each phase SGLang leaves unbounded, and one in a bounded one:

    * "unknown": its room is never registered with the bootstrap server: pending
      before init() (prealloc Bootstrapping);
    * "in-transfer": admitted, metadata sent, the prefill never sends (transfer
      WaitingForInput: SGLang's own 300 s bound);
    * "gated": admitted; the prefill sends its KV, but the metadata row it writes
      carries no room, so SGLang's metadata gate shows the concluded Success as
      Transferring (transfer Transferring);
    * "no-memory": handshake done, decode has no free slot (prealloc WaitingForInput).
    """
    rooms = {rid: ds.next_room() for rid in ("unknown", "in-transfer", "gated", "no-memory")}
    for rid in ("in-transfer", "gated", "no-memory"):
        peer.call("register", rooms[rid])
    for rid in ("unknown", "in-transfer", "gated"):
        side.add(rid, rooms[rid])
    side.step()  # resolved through /query_dp_ranks, init(), admitted, metadata sent
    side.add("no-memory", rooms["no-memory"])
    side.step()
    peer.call("send", rooms["gated"], 4, False)
    gated = next(d.kv_receiver for d in side.transfer.queue if d.req.rid == "gated")
    assert ds.wait_until(lambda: int(gated.poll()) == SUCCESS, 30)
    side.step()
    assert phases(side) == {
        "pending": ["unknown"],
        "prealloc": ["unknown", "no-memory"],
        "transfer": ["in-transfer", "gated"],
    }
    return rooms


def phases(side):
    return {
        "pending": side.pending_rids(),
        "prealloc": side.rids("prealloc"),
        "transfer": side.rids("transfer"),
    }


def receivers(side):
    return {d.req.rid: d.kv_receiver for d in side.prealloc.queue + side.transfer.queue}


def test_unbounded_decode_phases_stay_without_stallguard(peer, side):
    scenario(peer, side)
    held = receivers(side)
    for _ in range(10):
        side.step()
        time.sleep(0.05)
    assert phases(side) == {
        "pending": ["unknown"],
        "prealloc": ["unknown", "no-memory"],
        "transfer": ["in-transfer", "gated"],
    }
    # SGLang has no clock on the unbounded ones: no init_time, no prefill-wait start
    for rid in ("unknown", "no-memory"):
        assert held[rid].init_time is None and held[rid]._prefill_wait_start is None
    assert int(held["unknown"].poll()) == BOOTSTRAPPING
    assert int(held["no-memory"].poll()) == WFI
    assert int(held["gated"].poll()) == SUCCESS  # concluded, still held by the gate
    assert held["in-transfer"].init_time is not None  # SGLang's own 300 s clock
    assert side.aborted() == {}


DUE = [  # (rid, queue, phase, deadline), in deadline order
    ("no-memory", "prealloc", "WaitingForInput", PREALLOC["WaitingForInput"]),
    ("in-transfer", "transfer", "WaitingForInput", TRANSFER["WaitingForInput"]),
    ("gated", "transfer", "Transferring", TRANSFER["Transferring"]),
    ("unknown", "prealloc", "Bootstrapping", PREALLOC["Bootstrapping"]),
]


def test_each_phase_fails_at_its_deadline_through_sglangs_path(peer, side):
    before = {(q, phase): forced(q, phase, peer.engine) for _, q, phase, _ in DUE}
    with guarded() as (clock, expiries):
        rooms = scenario(peer, side)
        for rid, queue, phase, deadline in DUE:
            clock.set(T0 + deadline - 0.001)
            side.step()
            assert rid in side.rids(queue), f"{rid} failed before its deadline"
            clock.set(T0 + deadline)
            side.step()
            assert rid not in side.rids(queue), f"{rid} not failed at its deadline"
            message = side.aborted()[rid]
            kind = "transfer" if queue == "transfer" else "handshake"
            assert f"Decode {kind} failed" in message
            assert f"spent {deadline:.1f}s in {phase} in the decode {queue} queue" in message
            if rid == "in-transfer":
                # prefill may still write into its pages: SGLang holds them (and the
                # metadata row) in its deferred release, taken over by stallguard's
                # quarantine: freed only once prefill ACKs the drain
                held = [entry[0].req.rid for entry in side.transfer._deferred_releases]
                assert held == ["in-transfer"]
                assert [e[2] for e in side.transfer._deferred_releases] == [float("inf")]
                quarantine = side.transfer._stallguard_decode_guard.quarantine
                assert [str(h.key) for h in quarantine.holds()] == ["in-transfer"]
        assert side.pending_rids() == [] and phases(side)["transfer"] == []
        # the ABORTs reached the prefill, whose senders for those rooms failed
        for rid in ("in-transfer", "no-memory"):
            assert ds.wait_until(lambda rid=rid: peer.call("status", rooms[rid]) == 0, 10)
        # prefill's drain ACK lets SGLang free the held pages and metadata row
        assert ds.wait_until(
            lambda: side.step() is not None and not side.transfer._deferred_releases, 40
        )
        assert side.host.available_size() == 2
        assert side.allocator.available_size() == side.allocator.size
        # the two transfer-queue failures were held (and ACKed); the prealloc ones
        # held no pages and published none: nothing to quarantine
        assert quarantine.holds() == [] and quarantine.snapshot().released == {"transfer_done": 2}
    fired = [(str(e.key), e.state_label, e.deadline) for e in expiries]
    assert fired == [(rid, phase, float(d)) for rid, _, phase, d in DUE]  # each once
    for _, queue, phase, _ in DUE:
        assert forced(queue, phase, peer.engine) == before[(queue, phase)] + 1
    attrs = {str(e.key): e.attributes for e in expiries}
    assert attrs["unknown"]["stallguard.sglang.queue"] == "prealloc"
    assert attrs["gated"]["stallguard.sglang.queue"] == "transfer"
    assert attrs["gated"]["stallguard.sglang.backend"] == peer.engine


def test_healthy_requests_are_untouched_and_nothing_is_left_behind(peer, side):
    config = {"decode": {"prealloc": {"WaitingForInput": 20}, "transfer": TRANSFER}}
    with guarded(config) as (clock, expiries):
        rooms = {f"ok{i}": ds.next_room() for i in range(3)}
        for rid, room in rooms.items():
            peer.call("register", room)
            side.add(rid, room)
        sent: set[str] = set()
        for _ in range(300):  # two slots for three requests: the third waits its turn
            clock.advance(0.02)  # each phase lasts well within its deadline
            side.step()
            for rid in side.rids("transfer"):
                if rid not in sent:
                    sent.add(rid)
                    peer.call("send", rooms[rid], 4, True)
            if len(side.done) == 3:
                break
            time.sleep(0.02)
        assert sorted(side.done) == sorted(rooms)
        guards = [side.prealloc._stallguard_decode_guard, side.transfer._stallguard_decode_guard]
        assert all(g.entries == {} and len(g.wd) == 0 for g in guards)
        assert getattr(side.mgr, "_stallguard_decode_rooms", {}) == {}
    assert expiries == [] and side.aborted() == {}


def test_report_mode_fails_nothing(peer, side):
    config = {"decode": {"mode": "report", "prealloc": PREALLOC, "transfer": TRANSFER}}
    with guarded(config) as (clock, expiries):
        scenario(peer, side)
        clock.set(T0 + 100)
        for _ in range(3):
            side.step()
        assert phases(side)["transfer"] == ["in-transfer", "gated"]
        assert side.pending_rids() == ["unknown"]
    assert side.aborted() == {}
    assert sorted((str(e.key), e.mode) for e in expiries) == [
        ("gated", "report"),
        ("in-transfer", "report"),
        ("no-memory", "report"),
        ("unknown", "report"),
    ]


def test_queue_calls_skipped_while_retracted_fail_overdue_requests_at_the_first_call(peer, side):
    """process_decode_queue returns before the queue calls while retracted_queue is
    non-empty: stallguard's clocks keep running, and the first call after fails every
    request overdue by then, in that one call."""
    with guarded() as (clock, expiries):
        scenario(peer, side)
        clock.advance(1000)  # no queue call for 1000 s
        side.step()
        assert phases(side) == {"pending": [], "prealloc": [], "transfer": []}
    assert sorted(str(e.key) for e in expiries) == ["gated", "in-transfer", "no-memory", "unknown"]


def test_an_abort_of_a_gated_success_is_not_a_deadline_expiry(peer, side):
    """The client-abort path (``AbortReq``: the scheduler calls ``kv_receiver.abort()``
    on each transfer-queue request) on a request whose KV arrived but which SGLang's
    metadata gate still holds (concluded Success, shown as Transferring): SGLang fails
    it with its own reason at the next call; stallguard has nothing left to expire.
    (``abort()`` marks the room Failed before it latches the receiver: the adapter once
    read the stale Success in its ``update_status`` hook and later emitted a
    Transferring expiry for the aborted request.)"""
    with guarded() as (clock, expiries):
        room = ds.next_room()
        peer.call("register", room)
        side.add("gated", room)
        side.step()
        assert side.rids("transfer") == ["gated"]
        peer.call("send", room, 4, False)  # the metadata row carries no room
        receiver = receivers(side)["gated"]
        assert ds.wait_until(lambda: int(receiver.poll()) == SUCCESS, 30)
        side.step()
        assert side.rids("transfer") == ["gated"]  # held by the gate
        clock.set(T0 + 1)
        receiver.abort()  # AbortReq
        assert int(receiver.poll()) == 0
        clock.set(T0 + TRANSFER["Transferring"])  # the next queue call comes late
        side.step()
        assert side.rids("transfer") == []
        assert "Aborted by AbortReq." in side.aborted()["gated"]
        assert "stallguard" not in side.aborted()["gated"]
        assert ds.wait_until(
            lambda: side.step() is not None and not side.transfer._deferred_releases, 40
        )
    assert [(str(e.key), e.state_label) for e in expiries] == []


# --------------------------------------------------------------------------- prefill_complete
#
# Under disaggregation_decode_allocation_policy = "prefill_complete", decode's init()
# sends the prefill a BOOTSTRAP message and its receiver stays Bootstrapping (prealloc
# WaitingForPrefill: bootstrap_infos set, no decode memory held) until the prefill's
# scheduler calls mark_prefill_complete() after the forward pass, which tells decode
# WaitingForInput. SGLang's own bound there is WAITING_TIMEOUT (300 s default), on the
# wall clock from init() (_prefill_wait_start). The prefill's policy is published by its
# bootstrap server; decode fails a room whose policies differ, and requires a TP1/CP1/PP1
# prefill (the DP-2 peer's ranks are TP1).
#
# Mooncake only: SGLang 0.5.23 rejects prefill_complete with any other transfer backend
# (arg_groups/pd_disaggregation_hook.py, _validate_prefill_complete), and the NIXL prefill
# indeed cannot take it: NixlKVManager's bootstrap thread does not go through
# _make_worker_recv, so decode's BOOTSTRAP message kills it ("First message should be
# b'NixlMsgGuard'. Foreign traffic?"), and its rooms then never leave Bootstrapping.

PREFILL_COMPLETE_ENGINES = ("mooncake",)


@pytest.fixture(scope="module")
def pc_peer(engine):
    if engine not in PREFILL_COMPLETE_ENGINES:
        pytest.skip(f"SGLang 0.5.23 supports prefill_complete on Mooncake only, not {engine}")
    p = start_peer("prefill_complete", engine)
    yield p
    p.close()


@pytest.fixture(scope="module")
def pc_node(pc_peer):
    n = start_node(pc_peer, "prefill_complete")
    yield n
    n.close()


@pytest.fixture
def pc_side(pc_node):
    s = make_side(pc_node)
    yield s
    s.close()


def prefill_complete_scenario(pc_peer, side, clock=None):
    """ "stuck": its prefill never completes (WaitingForPrefill); "healthy": its prefill
    completes and sends its KV. Both are registered and initialised at T0 + 5 (when a
    clock is given); "healthy" completes without the clock moving."""
    rooms = {rid: ds.next_room() for rid in ("stuck", "healthy")}
    for rid, room in rooms.items():
        assert pc_peer.call("register", room) == BOOTSTRAPPING
        side.add(rid, room)
    assert side.pending_rids() == ["stuck", "healthy"]  # DP 2: the rank is asked for
    if clock is not None:
        clock.set(T0 + 5)
    side.step()  # resolved through /query_dp_ranks; init() sends BOOTSTRAP
    held = receivers(side)
    assert phases(side) == {"pending": [], "prealloc": ["stuck", "healthy"], "transfer": []}
    for rid in rooms:
        receiver = held[rid]
        assert receiver.bootstrap_infos is not None  # init() done
        assert receiver._prefill_wait_start is not None  # SGLang's WAITING_TIMEOUT clock
        assert receiver.init_time is None
        assert side.mgr.request_status[rooms[rid]] == BOOTSTRAPPING
    assert side.mgr.defer_decode_allocation  # the policy really is prefill_complete
    # the prefill's forward pass for "healthy" is done: decode may allocate
    pc_peer.call("complete", rooms["healthy"])
    assert ds.wait_until(lambda: side.mgr.request_status.get(rooms["healthy"]) == WFI, 10)
    side.step()  # admitted, metadata sent
    assert phases(side) == {"pending": [], "prealloc": ["stuck"], "transfer": ["healthy"]}
    pc_peer.call("send", rooms["healthy"], 4, True)
    # prefill_complete: prefill tells decode Success only when its inflight queue
    # clears the concluded sender
    assert pc_peer.call("finish", rooms["healthy"]) == SUCCESS
    assert ds.wait_until(lambda: side.step() == ["healthy"], 30)
    assert side.done == ["healthy"]
    assert phases(side)["prealloc"] == ["stuck"]
    return rooms, held["stuck"]


def test_waiting_for_prefill_stays_without_stallguard(pc_peer, pc_side):
    side = pc_side
    rooms, stuck = prefill_complete_scenario(pc_peer, side)
    for _ in range(10):
        side.step()
        time.sleep(0.05)
    assert phases(side) == {"pending": [], "prealloc": ["stuck"], "transfer": []}
    assert int(stuck.poll()) == BOOTSTRAPPING and stuck._prefill_wait_start is not None
    assert side.mgr.waiting_timeout == 300  # SGLang's own bound, on the wall clock
    assert pc_peer.call("status", rooms["stuck"]) == BOOTSTRAPPING  # no ABORT sent
    assert side.aborted() == {}


def test_waiting_for_prefill_fails_at_its_deadline_and_aborts_the_prefill(pc_peer, pc_side):
    side = pc_side
    deadline = PREALLOC["WaitingForPrefill"]
    before = forced("prealloc", "WaitingForPrefill", pc_peer.engine)
    with guarded() as (clock, expiries):
        rooms, stuck = prefill_complete_scenario(pc_peer, side, clock)
        assert pc_peer.call("status", rooms["stuck"]) == BOOTSTRAPPING
        # enrolled at T0 (Bootstrapping, deadline 30), WaitingForPrefill from T0 + 5
        clock.set(T0 + 5 + deadline - 0.001)
        side.step()
        assert phases(side)["prealloc"] == ["stuck"], "failed before its deadline"
        assert side.aborted() == {}
        clock.set(T0 + 5 + deadline)
        side.step()
        assert phases(side) == {"pending": [], "prealloc": [], "transfer": []}
        message = side.aborted()["stuck"]
        assert "Decode handshake failed" in message  # SGLang's prealloc failure path
        assert f"spent {deadline:.1f}s in WaitingForPrefill in the decode prealloc queue" in (
            message
        )
        assert stuck.abort_notified  # sent once (SGLang's clear() would send it too,
        # under prefill_complete, for a room that did not succeed)
        # the ABORT reached the prefill: under prefill_complete its manager fails the
        # room's bootstrap (DeferredBootstrap.fail) and the room itself
        assert ds.wait_until(lambda: pc_peer.call("status", rooms["stuck"]) == 0, 10)
        # decode cleared the room; nothing held: no pages, no metadata row
        assert rooms["stuck"] not in side.mgr.request_status
        assert side.transfer._deferred_releases == []
        assert side.host.available_size() == 2
        assert side.allocator.available_size() == side.allocator.size
        # a late completion on prefill no longer reaches decode's cleared room
        assert pc_peer.call("complete", rooms["stuck"]) == 0
        for _ in range(3):
            side.step()
        assert rooms["stuck"] not in side.mgr.request_status
    fired = [(str(e.key), e.state_label, e.deadline) for e in expiries]
    assert fired == [("stuck", "WaitingForPrefill", float(deadline))]
    assert forced("prealloc", "WaitingForPrefill", pc_peer.engine) == before + 1
    assert side.done == ["healthy"] and list(side.aborted()) == ["stuck"]


def test_two_gloo_ranks_conclude_each_request_in_the_same_iteration():
    """Real gloo group of two processes; the ranks' clocks disagree (1 s and 0.6 s per
    iteration): rank 0 fails each request at its deadline, SGLang's MIN all-reduce
    concludes it on both ranks in that same iteration, and rank 1 never fires."""
    r0, r1 = sgs.run_ranks(
        ds.ranks_in_step, world=2, timeout=240, server_args={"disaggregation_mode": "decode"}
    )
    # enrolled at the first iteration (rank 0's clock: +1 s), due 10 s / 20 s later
    assert r0["left"] == r1["left"] == {"stuck": 11, "waiting": 21}
    assert r0["expiries"] == [("stuck", "WaitingForInput"), ("waiting", "WaitingForInput")]
    assert r1["expiries"] == []
    assert "stallguard" in r0["aborted"]["stuck"] and "stallguard" in r0["aborted"]["waiting"]
    assert all("another rank" in message for message in r1["aborted"].values())
    assert sorted(r1["aborted"]) == ["stuck", "waiting"]
