"""The scheduler's data-parallel rank on stallguard's span (``--dp-size`` > 1).

Under SGLang's data parallelism each replica is a scheduler process of its own with the
same ``tp_rank`` (0 at ``--tp 1``); SGLang tells them apart by its ``dp_rank`` metric
label, which it sets only in a data-parallel server. The adapter's counters carry that
label already (SGLang's scheduler labels); its span gets ``stallguard.sglang.dp_rank``
from it, on prefill and on decode, and nothing without one. Against the REAL SGLang
0.5.23 prefill queue (sglang_support) and the decode guard itself.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import sglang_support as sgs
from stallguard_sglang.testing import installed

from stallguard.testing import FakeClock, record_expiries

SKIP = sgs.skip_reason("0.5.23")
pytestmark = [pytest.mark.sglang, pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]

TRANSFERRING, T0, DEADLINE = 3, 1000.0, 20
CONFIG = {"prefill": {"deadlines": {"Transferring": DEADLINE}}}
DP_RANK = "stallguard.sglang.dp_rank"


@pytest.fixture(scope="module", autouse=True)
def _context():
    sgs.setup_context(0, 1)
    yield
    sgs.teardown_context()


def test_the_dp_rank_is_read_from_sglang_s_label() -> None:
    from stallguard_sglang._hooks import _dp_rank

    assert _dp_rank({"dp_rank": "1"}) == 1 and _dp_rank({"dp_rank": "0"}) == 0
    assert _dp_rank({"dp_rank": ""}) is None  # no DP: the label is left empty
    assert _dp_rank({}) is None and _dp_rank({"dp_rank": "None"}) is None


def _stuck_on(labels: dict[str, object] | None) -> dict[str, object]:
    """The span attributes of a request failed in Transferring by a scheduler whose
    SGLang metric labels are *labels* (None: SGLang's collector has none)."""
    clock = FakeClock(T0)
    with installed(CONFIG, clock=clock), record_expiries() as expiries:
        sched = sgs.FakeScheduler()
        if labels is not None:
            sched.metrics_collector.labels = labels  # what SGLang's collector carries
        sender = sgs.make_sender(sgs.make_manager("nixl"), sgs.next_room())
        for status in (2, TRANSFERRING):
            sgs.set_status(sender, status)
        sched.prefill(sgs.make_request("stuck", sender, pending_bootstrap=False, prefilled=False))
        sched.step()
        clock.set(T0 + DEADLINE + 0.001)
        sched.step()
        assert "stuck" not in sched.inflight_rids()
    (expiry,) = expiries
    return dict(expiry.attributes)


def test_a_dp_replica_s_failure_names_its_dp_rank() -> None:
    labels = {"model_name": "m", "engine_type": "prefill", "tp_rank": 0, "dp_rank": 1}
    attributes = _stuck_on(labels)
    assert attributes[DP_RANK] == 1 and attributes["stallguard.sglang.tp_rank"] == 0
    assert attributes["gen_ai.request.model"] == "m"
    assert DP_RANK not in _stuck_on(None)  # no DP: no attribute, no placeholder


def test_a_decode_replica_s_span_names_its_dp_rank() -> None:
    from stallguard_sglang import _runtime
    from stallguard_sglang._decode import _DecodeGuard

    entry = SimpleNamespace(rid="r", room=7, backend="nixl")
    with installed({"decode": {"transfer": {"WaitingForInput": 10}}}):
        rt = _runtime.runtime()
        assert rt is not None
        replica = _DecodeGuard(rt, "transfer", 0, {}, dp_rank=1)._describe(entry)
        single = _DecodeGuard(rt, "transfer", 0, {})._describe(entry)
    assert replica[DP_RANK] == 1 and replica["stallguard.sglang.tp_rank"] == 0
    assert DP_RANK not in single
