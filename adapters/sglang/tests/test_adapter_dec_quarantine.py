"""(Order no longer matters: SGLang's Mooncake transfer engine is one per process and kept
the buffers of a finished module's decode node registered, so a later node whose buffers
landed at the same addresses was refused and received nothing. Nodes are now retired
after their module, ``DecodeNode.close``: buffers deregistered, memory kept; both orders pass.)

Issue 19, SGLang decode: a forced failure never hands memory to another request while
a transfer may still write it. On the REAL SGLang 0.5.23 decode queues and a real
prefill process (sglang_decode_support.py), over NIXL (UCX/TCP) and Mooncake (TCP).

Each round: a decode request ("victim") publishes 8 destination pages; the prefill fills
its source pages with the room's non-zero pattern and starts the WRITE (8 pages x 1 MiB
x 4 KV buffers = 32 MiB); once the first bytes land on decode the prefill is SIGSTOPped
(every thread), mid-WRITE. The victim is failed (by stallguard at its deadline, or, in
the control, by SGLang's own waiting timeout). SGLang's deferred-release timeout is
1 s here (30 s by default): past it, SGLang frees the pages "anyway". A new owner then
takes the freed pages if they were freed (an allocator reusing the pages freed last),
else other pages, and writes its own pattern (254, a byte no room pattern has). The
prefill resumes; its WRITE completes. Then the new owner's bytes are compared exactly.

* control, SGLang's native path: the victim's pages are freed while the WRITE is
  posted, given to the new owner, and the rest of the WRITE overwrites it;
* stallguard: the pages stay quarantined past SGLang's timeout (and past
  ``[decode] quarantine``: escalated, still held), the new owner gets other pages and
  keeps every byte, the late WRITE lands in the quarantined pages (counted), and the
  prefill's drain ACK frees them: nothing is left behind.

The prefill side (the last test), in the same processes plus a decode process of its
own that can be frozen: stallguard's prefill failure of a ``Transferring`` room is
``conclude_failure`` (the room Failed, decode told; ``_guard._fail_common``); SGLang's
inflight queue then concludes it at its next call (``handle_inflight_transfer_failure``:
``failure_exception()``, which clears the sender, and ``release_kv_cache``: the source
pages go back to the pool and the next request's forward pass writes its KV into them).
A WRITE already posted from those pages keeps reading them: with the decode frozen the
engine gets the rest of the bytes onto the wire only once decode drains its socket, so
it reads the *next* request's KV into the failed request's decode pages (the control
counts them). Safe by construction all the same: those pages belong to the failed
request alone. Its prefill never sends ``Success`` for a room with a recorded failure or
a cleared room (``conclude_transfer``, common/conn.py:868-883), so decode concludes
``Failed``; decode's deferred release holds the pages until the prefill's drain ACK
(decode ABORTs a failure it did not start, ``force_arm``, decode.py:2899-2908); the next
request, which owns the source pages now, transfers its own KV intact.

About 30-60 s per engine, mostly the processes starting (they start in parallel).
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import numpy as np
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
DEADLINE = 10.0  # transfer WaitingForInput (stallguard's FakeClock)
QUARANTINE = 20.0  # [decode] quarantine (FakeClock)
RELEASE_TIMEOUT = 1.0  # SGLang's deferred-release timeout here (real seconds; 30 by default)
CONFIG = {"decode": {"transfer": {"WaitingForInput": DEADLINE}, "quarantine": QUARANTINE}}
LAYOUT = dict(layers=2, page_bytes=1 << 20, num_pages=32, aux_rows=16)
PAGES = 8  # one HostPools slot
OWNER = 254  # the new owner's byte: room patterns are 1..251
ROUNDS = 2
TOTAL = PAGES * LAYOUT["page_bytes"] * 2 * LAYOUT["layers"]
WFI = 2


@pytest.fixture(scope="module", params=["nixl", "mooncake"])
def engine(request):
    return request.param


@pytest.fixture(scope="module")
def procs(engine):
    """The prefill process, and a decode process of its own for the prefill-side test
    (started together: their imports overlap)."""
    prefill = ds.PrefillPeer("early", engine, layout=LAYOUT)
    decode = ds.DecodePeer(prefill, LAYOUT, release_timeout=30.0)
    try:
        import sglang.srt.disaggregation.decode  # noqa: F401  (import while they start)

        prefill.wait_ready()
        decode.wait_ready()
        yield prefill, decode
    finally:
        decode.close()
        prefill.close()


@pytest.fixture(scope="module")
def peer(procs):
    return procs[0]


@pytest.fixture(scope="module")
def node(peer):
    from pd_wedge import _kv

    ds.install_decode_context(peer.port, "early", engine=peer.engine)
    n = ds.DecodeNode(peer.addr, engine=peer.engine, layout=_kv.Layout(**LAYOUT))
    yield n
    n.close()


@pytest.fixture
def side(node):
    ds.install_decode_context(node.port, "early", engine=node.engine)
    s = ds.DecodeSide(node, free_slots=2)
    s.transfer.deferred_kv_release_timeout = RELEASE_TIMEOUT
    yield s
    s.close()


def prefill_bytes(side, room, pages):
    """Bytes of *pages* (every KV buffer) that hold the room's prefill pattern."""
    from pd_wedge import _kv

    return sum(
        int(np.count_nonzero(buf[pages] == _kv.HostPool.pattern(room, r)))
        for r, buf in enumerate(side.kv.kv)
    )


def changed(side, pages):
    """Bytes of the new owner's *pages* that are no longer its own."""
    return sum(int(np.count_nonzero(buf[pages] != OWNER)) for buf in side.kv.kv)


def start_write_and_freeze(peer, side, rid):
    """A victim with its metadata sent, the prefill frozen mid-WRITE. Returns
    (room, slot, pages, bytes landed before the freeze)."""
    room = ds.next_room()
    peer.call("register", room)
    dreq = side.add(rid, room)
    dreq.req.origin_input_ids = list(range(PAGES))
    side.step()
    assert side.rids("transfer") == [rid]
    slot = dreq.req.kv.req_pool_idx
    pages = side.host.req_to_token[slot].numpy()
    for buf in side.kv.kv:
        buf[pages] = 0
    peer.call("fill", room, PAGES)
    probes = [(buf, int(p)) for buf in side.kv.kv for p in (pages[0], pages[-1])]
    peer.call("send", room, PAGES, True)
    # the first bytes land (an event, not a time: up to 60 s on a loaded machine; a
    # short sleep between looks leaves the engine's threads the GIL)
    assert ds.wait_until(lambda: any(buf[p, 0] or buf[p, -1] for buf, p in probes), 60, 0.001)
    peer.freeze()
    landed = prefill_bytes(side, room, pages)
    total = PAGES * LAYOUT["page_bytes"] * 2 * LAYOUT["layers"]
    assert 0 < landed < total, f"not frozen mid-WRITE: {landed} of {total} bytes landed"
    return room, slot, pages, landed


def new_owner(side, victim_slot):
    """The next allocation: the victim's pages if they were freed, else other pages;
    written with the owner's pattern. Returns (slot, pages)."""
    host = side.host
    slot = victim_slot if victim_slot in host.free else host.free[0]
    host.free.remove(slot)
    host.budget -= 1
    pages = host.req_to_token[slot].numpy()
    for buf in side.kv.kv:
        buf[pages] = OWNER
    return slot, pages


def settle_after_thaw(peer, side, room):
    """The prefill's WRITE for *room* settled (its transfer worker counts nothing)."""
    assert ds.wait_until(lambda: peer.call("outstanding", room) == 0, 30, 0.05)


def gauge(name, engine):
    from prometheus_client import REGISTRY

    return sum(
        s.value
        for m in REGISTRY.collect()
        for s in m.samples
        if s.name == name and s.labels.get("backend") == engine
    )


def test_control_sglangs_deferred_release_hands_written_pages_to_a_new_owner(peer, side):
    """Without stallguard (SGLang's own waiting timeout fails the request): the fault is
    real, the new owner's bytes are overwritten with the victim's prefill KV."""
    room, slot, _, before = start_write_and_freeze(peer, side, "victim")
    t_frozen = time.monotonic()
    side.mgr.waiting_timeout = 0  # SGLang's WAITING_TIMEOUT, due now
    try:
        side.step()
    finally:
        side.mgr.waiting_timeout = 300
    assert "timed out" in side.aborted()["victim"]
    assert [e[0].req.rid for e in side.transfer._deferred_releases] == ["victim"]
    # "... without a full drain ack from prefill; releasing anyway."
    assert ds.wait_until(lambda: side.step() is not None and slot in side.host.free, 10)
    released_after = time.monotonic() - t_frozen
    owner_slot, owner_pages = new_owner(side, slot)
    assert owner_slot == slot  # the freed pages, reused
    assert changed(side, owner_pages) == 0
    peer.thaw()
    settle_after_thaw(peer, side, room)
    overwritten = changed(side, owner_pages)
    late = prefill_bytes(side, room, owner_pages)
    print(
        f"[{peer.engine}] control: {before} B landed before the freeze, pages freed "
        f"{released_after:.2f}s after it; after thaw {overwritten} B of the new owner's "
        f"{PAGES * LAYOUT['page_bytes'] * 4} overwritten ({late} B the victim's KV)"
    )
    assert overwritten > 0 and late == overwritten  # the rest of the victim's WRITE
    side.host.free_slot(owner_slot)


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_stallguard_quarantines_written_pages_until_the_drain_ack(peer, side, caplog, round_):
    from stallguard_sglang import _metrics
    from stallguard_sglang.testing import installed

    from stallguard.testing import FakeClock, record_expiries

    clock = FakeClock(T0)
    total = PAGES * LAYOUT["page_bytes"] * 4
    with installed(CONFIG, clock=clock), record_expiries() as expiries:
        side.step()  # (the guards exist)
        # what other guards of this process already show for this peer (a guard of an
        # earlier test still holding pages exports under the same labels)
        base = {
            name: gauge(name, peer.engine)
            for name in (
                _metrics.QUARANTINED_PAGES,
                _metrics.QUARANTINED_OVERDUE,
                _metrics.QUARANTINED_BYTES,
            )
        }
        room, slot, pages, before = start_write_and_freeze(peer, side, "victim")
        t_frozen = time.monotonic()
        clock.set(T0 + DEADLINE - 0.001)
        side.step()
        assert side.rids("transfer") == ["victim"]
        clock.set(T0 + DEADLINE)
        side.step()  # the client gets its error in the first call at the deadline
        t_failed = time.monotonic()
        assert "stallguard" in side.aborted()["victim"]
        assert side.rids("transfer") == []
        # past SGLang's own deferred-release timeout, then past [decode] quarantine
        time.sleep(RELEASE_TIMEOUT + 0.3)
        side.step()
        with caplog.at_level(logging.ERROR, logger="stallguard.quarantine"):
            clock.advance(QUARANTINE)
            side.step()
            side.step()
        held_while_frozen = slot not in side.host.free
        pages_shown = (
            gauge(_metrics.QUARANTINED_PAGES, peer.engine) - base[_metrics.QUARANTINED_PAGES]
        )
        overdue_shown = (
            gauge(_metrics.QUARANTINED_OVERDUE, peer.engine) - base[_metrics.QUARANTINED_OVERDUE]
        )
        owner_slot, owner_pages = new_owner(side, slot)
        frozen_for = time.monotonic() - t_frozen
        peer.thaw()
        settle_after_thaw(peer, side, room)
        quarantine = getattr(side.transfer._stallguard_decode_guard, "quarantine", None)
        # the drain ACK frees the quarantined pages through SGLang's own release
        assert ds.wait_until(
            lambda: side.step() is not None and not (quarantine and quarantine.holds()), 30
        )
        held_for = time.monotonic() - t_failed
        after = changed(side, owner_pages)
        late = prefill_bytes(side, room, pages)
        print(
            f"[{peer.engine}] round {round_}: {before} B landed before the freeze; "
            f"frozen {frozen_for:.2f}s; quarantined {held_for:.2f}s (freed on the drain "
            f"ACK); after thaw the quarantined pages hold {late} B of the victim's KV; "
            f"the new owner's bytes changed: {after}"
        )
        assert after == 0, f"{after} of the new owner's {total} bytes overwritten"
        assert held_while_frozen and owner_slot != slot
        assert late == total  # the late WRITE landed in the quarantined pages
        # escalated once while frozen (ERROR, gauges), still held; then freed by the ACK
        overdue = [
            r
            for r in caplog.records
            if r.name == "stallguard.quarantine" and r.levelno == logging.ERROR
        ]
        assert len(overdue) == 1 and "victim" in overdue[0].getMessage()
        assert (pages_shown, overdue_shown) == (PAGES, 1)
        assert quarantine is not None and quarantine.snapshot().released == {"transfer_done": 1}
        assert gauge(_metrics.QUARANTINED_PAGES, peer.engine) == base[_metrics.QUARANTINED_PAGES]
        assert gauge(_metrics.QUARANTINED_BYTES, peer.engine) == base[_metrics.QUARANTINED_BYTES]
        side.host.free_slot(owner_slot)
        # nothing left behind
        assert slot in side.host.free
        assert side.transfer._deferred_releases == []
        assert side.host.available_size() == 2
        assert side.allocator.available_size() == side.allocator.size
    fired = [(str(e.key), e.state_label, e.mode) for e in expiries]
    assert fired == [("victim", "WaitingForInput", "enforce"), ("victim", "Quarantined", "report")]


def test_a_prefill_failure_mid_write_never_finishes_decode_with_another_requests_kv(procs):
    prefill, decode = procs
    # warm up: the first room of the pair sets the connections up (UCX wire-up)
    warm = ds.next_room()
    prefill.call("register", warm)
    decode.call("add", "warm", warm, PAGES)
    prefill.call("fill", warm, PAGES)
    prefill.call("send", warm, PAGES, True)
    assert ds.wait_until(lambda: "warm" in decode.call("step")["done"], 60)
    assert decode.call("count", "warm", warm) == TOTAL
    victim, following = ds.next_room(), ds.next_room()
    prefill.call("register", victim)
    decode.call("add", "victim", victim, PAGES)
    assert ds.wait_until(lambda: prefill.call("status", victim) == WFI, 10)
    decode.freeze()
    prefill.call("fill", victim, PAGES)
    prefill.call("send", victim, PAGES, True)
    # the chunk is dequeued and its WRITE posted (SGLang's count behind the drain ACK)
    assert ds.wait_until(lambda: prefill.call("outstanding", victim) == 1, 10)
    reason = prefill.call("fail", victim, "stallguard: the test fails the Transferring room")
    assert "stallguard" in reason
    # the source pages released and reused: the next request's KV written into them
    prefill.call("fill", following, PAGES)
    assert prefill.call("outstanding", victim) == 1  # the WRITE still posted
    decode.thaw()
    assert ds.wait_until(lambda: "victim" in decode.call("step")["aborted"], 30)
    assert ds.wait_until(lambda: prefill.call("outstanding", victim) == 0, 30)
    state = decode.call("step")
    assert "victim" not in state["done"]  # failed, never finished
    own = decode.call("count", "victim", victim)
    mixed = decode.call("count", "victim", following)
    print(
        f"[{prefill.engine}] victim's decode pages after the thaw: {own} B its own KV, "
        f"{mixed} B the next request's (read from the reused source pages); "
        f"decode concluded it: {state['aborted']['victim'][:120]!r}"
    )
    assert mixed > 0  # the control: the late WRITE read the reused source pages
    assert own + mixed == TOTAL
    # decode holds the mixed pages until the prefill's drain ACK, then frees them
    assert ds.wait_until(
        lambda: (lambda s: s["deferred"] == [] and s["free_slots"] == 2)(decode.call("step")), 30
    )
    # the source pages' new owner transfers its own KV intact
    prefill.call("register", following)
    decode.call("add", "following", following, PAGES)
    prefill.call("send", following, PAGES, True)
    assert ds.wait_until(lambda: "following" in decode.call("step")["done"], 30)
    assert decode.call("count", "following", following) == TOTAL
