"""Real stallguard-sglang expositions for the Prometheus rules test
(tests/test_prometheus_rules.py), made in a fresh process (prometheus_client must see
PROMETHEUS_MULTIPROC_DIR at its first import, as in a scheduler process).

Traffic through the REAL SGLang inflight queue with the adapter installed (real
NixlKVSenders over a real NixlKVManager's status plumbing, the transfer engine faked as
in tests/sglang_support; one FakeClock): healthy requests every 0.1 s, one request that
never leaves WaitingForInput (failed by its state deadline: ``reason="state"``) and one
that never progresses in Transferring (failed by its progress window:
``reason="stall"``). Two rounds in the same process: the exposition after each, read
from the multiprocess directory as SGLang's ``/metrics`` reads it.

The scheduler's ``metrics_collector`` holds only the ``labels`` SGLang's
``SchedulerMetricsCollector`` would (model_name, engine_type, ranks): it stands in for
SGLang running with ``--enable-metrics``, which needs a model. The quarantine gauges
are set through the adapter's own ``_metrics.set_quarantined`` (what the decode
transfer guard calls): a decode quarantine needs a real decode engine, covered by
test_adapter_dec_quarantine.py.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

T0 = 1000.0
WFI, TRANSFERRING, SUCCESS = 2, 3, 4
STEP = 0.1
#: SGLang's scheduler labels (SchedulerMetricsCollector.labels) of the fake scheduler
LABELS = {
    "model_name": "tiny-pd",
    "engine_type": "prefill",
    "tp_rank": "0",
    "pp_rank": "0",
    "moe_ep_rank": "0",
}
CONFIG = {
    "prefill": {
        "mode": "enforce",
        "deadlines": {
            "Bootstrapping": "none",  # no deadline: no deadline series
            "WaitingForInput": 10,
            "Transferring": {"seconds": 60, "stall": 15},
        },
    }
}
#: page size x pages of the quarantine gauges, per round
PAGE_BYTES = 4096


def _round(sched: Any, mgr: Any, clock: Any, n: int, tag: str, seed: int) -> dict[str, str]:
    import sglang_support as sgs

    rng = random.Random(seed)
    plan = [
        (f"{tag}-r{i}", T0 + (i // 2) * STEP, rng.uniform(0.01, 0.3), rng.uniform(0.2, 1.5))
        for i in range(n)
    ]
    plan.append((f"{tag}-stuck-wfi", T0 + 1.0, float("inf"), 0.0))
    plan.append((f"{tag}-stuck-transfer", T0 + 2.0, 0.05, float("inf")))
    start = clock()
    plan = [(rid, start - T0 + at, w, x) for rid, at, w, x in plan]
    ends = max(t + w + x for _, t, w, x in plan if w + x != float("inf")) + 20
    pending = sorted(plan, key=lambda p: p[1])
    moves: list[tuple[float, int, Any]] = []
    while clock() < ends:
        while pending and pending[0][1] <= clock():
            rid, at, wait, transfer = pending.pop(0)
            sender = sgs.make_sender(mgr, sgs.next_room())
            sgs.set_status(sender, WFI)
            sched.prefill(sgs.make_request(rid, sender, prefilled=False))
            if wait != float("inf"):
                moves.append((at + wait, TRANSFERRING, sender))
                if transfer != float("inf"):
                    moves.append((at + wait + transfer, SUCCESS, sender))
        moves.sort(key=lambda m: m[0])
        while moves and moves[0][0] <= clock():
            _, status, sender = moves.pop(0)
            if sender.kv_mgr.request_status.get(sender.bootstrap_room) not in (0, None):
                sgs.set_status(sender, status)
        sched.step()
        clock.advance(STEP)
    for _ in range(3):  # idle iterations: the last stays are exported
        clock.advance(1.0)
        sched.step()
    return {rid: c.outcome for rid, c in sched.conclusions.items() if rid.startswith(tag)}


def expositions(metrics_dir: str, n: int) -> dict[str, Any]:
    """Two rounds of traffic; the multiprocess directory's exposition after each."""
    import sglang_support as sgs
    from stallguard_sglang import _metrics
    from stallguard_sglang._advise import read_source
    from stallguard_sglang.testing import installed

    from stallguard.testing import FakeClock

    sgs.setup_context(0, 1)
    clock = FakeClock(T0)
    out: dict[str, Any] = {"labels": LABELS, "config": CONFIG, "outcomes": {}, "texts": []}
    with installed(CONFIG, clock=clock):
        sched = sgs.FakeScheduler()
        sched.metrics_collector = SimpleNamespace(labels=dict(LABELS))
        mgr = sgs.make_manager("nixl")
        for i, (pages, overdue) in enumerate(((4, 0), (8, 1))):
            out["outcomes"].update(_round(sched, mgr, clock, n, f"round{i}", seed=7 + i))
            labels = _metrics.prepare(LABELS)
            _metrics.set_quarantined(
                "mooncake", {"decode-peer-0": (pages, pages * PAGE_BYTES, overdue)}, labels
            )
            out["texts"].append(read_source(multiproc_dir=metrics_dir))
    sgs.teardown_context()
    return out
