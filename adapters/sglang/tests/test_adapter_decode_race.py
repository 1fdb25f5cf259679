"""A decode request whose phase moves on between the check's decision and the
enforcement is not failed (issue 20): SGLang's ``update_status`` writes the room's new
status, and its AFTER hook (where the adapter observes it) runs a moment later on the
transfer thread; a check in between finds the request overdue in its old phase. The
enforcement reads the phase now, withdraws the expiry and tracks the new phase.

Real: SGLang 0.5.23's ``NixlKVReceiver`` over an offline ``NixlKVManager`` (as in
test_adapter_decode_properties.py) and the adapter's real hooks; the queue call is the
same stand-in as there.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import sglang_decode_support as ds
import sglang_support as sgs

SKIP = sgs.skip_reason("0.5.23")
pytestmark = [pytest.mark.sglang, pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]

WFI, SUCCESS = 2, 4
DEADLINES = {"transfer": {"WaitingForInput": 4, "Transferring": 6}}


@pytest.fixture(scope="module", autouse=True)
def _context():
    sgs.setup_context(0, 1, disaggregation_mode="decode")
    yield
    sgs.teardown_context()


def _setup(mgr, rid):
    from sglang.srt.disaggregation.nixl.conn import NixlKVReceiver

    receiver = NixlKVReceiver(mgr, "127.0.0.1:1", 7000)
    mgr.update_status(receiver.bootstrap_room, WFI)
    return SimpleNamespace(req=SimpleNamespace(rid=rid), kv_receiver=receiver)


@pytest.mark.parametrize("gated", [False, True])
def test_a_success_landing_as_the_deadline_fires_is_not_failed(gated):
    """*gated*: the queue keeps the concluded request (SGLang's metadata gate), so its
    new phase, Transferring, must be guarded from then on: failed once it lasted its own
    deadline, and not before."""
    from stallguard_sglang import _decode
    from stallguard_sglang.testing import installed

    from stallguard.testing import FakeClock, record_expiries

    clock = FakeClock(1000.0)
    mgr = ds.offline_decode_manager()
    dreq = _setup(mgr, "late-kv")
    room = dreq.kv_receiver.bootstrap_room
    q = SimpleNamespace(queue=[dreq], scheduler=None)
    outcome: list[str] = []

    def pop_transferred(q):
        left = []
        for d in list(q.queue):
            state = int(d.kv_receiver.poll())
            if state == 0 or (state == SUCCESS and not gated):
                outcome.append("failed" if state == 0 else "success")
                q.queue.remove(d)
                left.append(d.req)
        return left

    with installed({"decode": DEADLINES}, clock=clock), record_expiries() as expiries:
        _decode.transfer_around(pop_transferred, q)  # enrolled in WaitingForInput
        clock.advance(DEADLINES["transfer"]["WaitingForInput"] + 1)
        # SGLang's update_status body (the transfer thread), its AFTER hook not yet run
        mgr.request_status[room] = SUCCESS
        _decode.transfer_around(pop_transferred, q)
        guard = q._stallguard_decode_guard
        assert expiries == []
        assert guard.wd.snapshot().withdrawn == 1
        if not gated:
            assert outcome == ["success"]
            return
        moved = clock()
        assert outcome == [] and [str(r.state) for r in guard.wd.snapshot().requests] == [
            "Transferring"
        ]
        while clock() + 1 < moved + DEADLINES["transfer"]["Transferring"]:
            clock.advance(1)
            _decode.transfer_around(pop_transferred, q)
            assert outcome == [] and expiries == []
        clock.advance(moved + DEADLINES["transfer"]["Transferring"] - clock())
        _decode.transfer_around(pop_transferred, q)
        _decode.transfer_around(pop_transferred, q)
    assert [(str(e.state), e.elapsed) for e in expiries] == [("Transferring", 6.0)]
    assert outcome == ["failed"]
