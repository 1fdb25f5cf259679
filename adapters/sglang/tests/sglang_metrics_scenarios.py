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


# --------------------------------------------------------------------------- decode

#: The decode server's labels (a decode pod: SGLang's scheduler labels, engine_type)
DECODE_LABELS = {**LABELS, "engine_type": "decode"}
DECODE_CONFIG = {
    "prefill": {"mode": "off"},
    "bootstrap_queue": {"mode": "off"},
    "decode": {
        "mode": "enforce",
        "prealloc": {"Bootstrapping": 20, "WaitingForPrefill": 8, "WaitingForInput": 30},
        "transfer": {"WaitingForInput": 10, "Transferring": 5},
    },
}
#: Decode memory: how many requests fit at once (the others wait in the prealloc queue)
DECODE_SLOTS = 4
BOOTSTRAPPING, SUCCESS_ = 1, 4


def _decode_round(side: Any, clock: Any, n: int, tag: str, seed: int) -> dict[str, Any]:
    """One round of decode traffic through the REAL decode queues: each request is
    created ``Bootstrapping`` (the prefill rank not resolved yet), then ``init()``
    resolves it (``WaitingForPrefill``), the prefill's forward pass ends
    (``WaitingForInput``: waiting for decode memory, of which :data:`DECODE_SLOTS`
    requests' worth exists), SGLang's ``pop_preallocated`` admits it (metadata sent:
    transfer ``WaitingForInput``), its KV lands (``Success``; the metadata row arrives a
    little later: ``Transferring`` behind SGLang's metadata gate), ``pop_transferred``
    commits it and it decodes (its memory freed). One request whose prefill never
    answers stays ``WaitingForPrefill`` and is failed by that deadline."""
    import time as _time

    import sglang_decode_support as ds
    from sglang.srt.disaggregation import decode as decode_mod
    from sglang.srt.disaggregation.nixl.conn import NixlKVReceiver

    rng = random.Random(seed)
    mgr = side.mgr
    node_addr = f"{ds.HOST}:1"
    events: list[tuple[float, int, str, Any]] = []  # (time, order, what, dreq)
    start = clock()
    order = iter(range(10**9))
    for i in range(n + 1):
        rid = f"{tag}-d{i}" if i < n else f"{tag}-stuck-prefill"
        at = start + i * STEP / 2
        events.append((at, next(order), "arrive", rid))
    events.sort(key=lambda e: (e[0], e[1]))
    live: dict[str, Any] = {}
    ends = start + (n + 1) * STEP / 2 + 30
    while clock() < ends and (events or live):
        now = clock()
        while events and events[0][0] <= now:
            _, _, what, arg = events.pop(0)
            if what == "arrive":
                room = ds.next_room()
                receiver = NixlKVReceiver(mgr, node_addr, room)
                # stand-in for the metadata message to the prefill (no prefill here): what
                # send_metadata leaves on the receiver when the message went out
                receiver.send_metadata = lambda *a, r=receiver, **k: setattr(
                    r, "init_time", _time.time()
                )
                mgr.update_status(room, BOOTSTRAPPING)
                dreq = decode_mod.DecodeRequest(
                    req=ds.make_request(arg, room, side.port), kv_receiver=receiver
                )
                side.prealloc.queue.append(dreq)
                live[arg] = dreq
                t = now + rng.uniform(0.01, 0.3)
                events.append((t, next(order), "init", dreq))
            elif what == "init":  # init(): the bootstrap server named the prefill rank
                arg.kv_receiver.bootstrap_infos = [
                    {"rank_ip": ds.HOST, "rank_port": 1, "is_dummy": False}
                ]
                mgr.update_status(arg.kv_receiver.bootstrap_room, BOOTSTRAPPING)
                if not arg.req.rid.endswith("stuck-prefill"):
                    events.append((now + rng.uniform(0.1, 1.0), next(order), "prefilled", arg))
            elif what == "prefilled":  # the prefill's forward pass is done
                arg.waiting_for_input = True
                mgr.update_status(arg.kv_receiver.bootstrap_room, WFI)
            elif what == "landed":  # the KV is in; its metadata row follows shortly
                mgr.update_status(arg.kv_receiver.bootstrap_room, SUCCESS_)
                events.append((now + rng.uniform(0.05, 0.3), next(order), "row", arg))
            elif what == "row":
                side.metadata.bootstrap_room[arg.metadata_buffer_index, 0] = arg.req.bootstrap_room
            events.sort(key=lambda e: (e[0], e[1]))
        before = set(side.rids("transfer"))
        side.step()
        for dreq in side.transfer.queue:  # admitted in this pass: its KV is on its way
            if dreq.req.rid not in before:
                events.append((clock() + rng.uniform(0.2, 1.5), next(order), "landed", dreq))
        events.sort(key=lambda e: (e[0], e[1]))
        queued = set(side.rids("prealloc")) | set(side.rids("transfer"))
        for rid in [r for r in live if r not in queued]:
            del live[rid]
        clock.advance(STEP)
    for _ in range(3):  # idle passes: the last stays are exported
        clock.advance(1.0)
        side.step()
    aborted = side.aborted()
    return {
        "done": sorted(r for r in side.done if r.startswith(tag)),
        "aborted": sorted(r for r in aborted if r.startswith(tag)),
        "left": sorted(live),
    }


def decode_expositions(metrics_dir: str, n: int) -> dict[str, Any]:
    """A decode pod: two rounds of traffic through SGLang's real decode queues; the
    multiprocess directory's exposition after each. Real: ``DecodePreallocQueue``
    (admission, failure path) and ``DecodeTransferQueue`` (metadata gate, commit) of
    SGLang 0.5.23, real ``NixlKVReceiver`` objects over a ``NixlKVManager``'s status
    plumbing (sglang_decode_support.OfflineNode: no NIXL agent, ZMQ or prefill), the
    poll all-reduce over a one-rank gloo group; stand-ins: the decode memory pools
    (``HostPools``) and the metadata message to the prefill (there is none)."""
    import logging

    import sglang_decode_support as ds
    import sglang_support as sgs
    from stallguard_sglang._advise import read_source
    from stallguard_sglang.testing import installed

    from stallguard.testing import FakeClock

    sgs.setup_context(0, 1, disaggregation_mode="decode")
    # SGLang logs an error line per failed request; the stuck one is expected
    logging.getLogger("sglang.srt.disaggregation.decode").setLevel(logging.CRITICAL)
    clock = FakeClock(T0)
    out: dict[str, Any] = {
        "labels": DECODE_LABELS,
        "config": DECODE_CONFIG,
        "rounds": [],
        "texts": [],
    }
    with installed(DECODE_CONFIG, clock=clock):
        node = ds.OfflineNode(aux_rows=2 * n + 64)
        mgr = node.mgr
        mgr.kv_args = node.kv.kv_args()  # (read by pop_preallocated: the state types)
        mgr.waiting_timeout = 1e9  # SGLang's own WAITING_TIMEOUT (wall clock): never
        side = ds.DecodeSide(node, free_slots=DECODE_SLOTS, deferred_release=False)
        side.sched.metrics_collector = SimpleNamespace(labels=dict(DECODE_LABELS))
        for i in range(2):
            out["rounds"].append(_decode_round(side, clock, n, f"round{i}", seed=17 + i))
            out["texts"].append(read_source(multiproc_dir=metrics_dir))
        side.close()
    sgs.teardown_context()
    return out
