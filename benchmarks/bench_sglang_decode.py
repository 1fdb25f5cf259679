#!/usr/bin/env python3
"""What stallguard-sglang costs SGLang's decode queues.

Runs the REAL ``DecodePreallocQueue.pop_preallocated`` and
``DecodeTransferQueue.pop_transferred`` of the installed SGLang (0.5.23) with N queued
requests in each queue (real ``NixlKVReceiver`` objects over a ``NixlKVManager``'s status
plumbing without a transfer engine: ``sglang_decode_support.OfflineNode``), in two arms
that alternate iteration by iteration in this one process:

* ``disabled``: SGLang as shipped (the functions the hooks wrap, called directly);
* ``enabled``: the adapter's hooks (``stallguard_sglang.testing.installed``: the same
  functions SGLang's ``load_plugins()`` would apply).

Each arm has its own queues, manager and receivers. Every iteration of every arm does the
same work: two prealloc requests fail (``record_failure`` + ``update_status(Failed)``)
and the KV of two transfer requests lands (their metadata row written, untimed, then
``update_status(Success)``), all through the arm's ``update_status``; then
``pop_preallocated`` and ``pop_transferred`` run (SGLang aborts the two failed ones and
commits the two that landed, freeing their metadata rows); four new requests join
afterwards, outside the timing, so N stays constant. SGLang's error log lines for the
failures are silenced (both arms). The prealloc requests wait for decode memory (no free
slot), the transfer ones for their KV: SGLang polls every one of them each call.

Prints the median per-iteration time of each arm and the enabled/disabled ratio of the
medians. ``--quick`` only checks that the script works.
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "adapters" / "sglang" / "tests"))

FAILED, WFI, SUCCESS = 0, 2, 4
CONFIG = {  # nothing may expire while the queues are timed
    "decode": {
        "prealloc": {"Bootstrapping": 1e6, "WaitingForPrefill": 1e6, "WaitingForInput": 1e6},
        "transfer": {"WaitingForInput": 1e6, "Transferring": 1e6},
    }
}


class Arm:
    def __init__(self, ds: Any, n: int, update_status: Any, pop_pre: Any, pop_tr: Any) -> None:
        self.node = ds.OfflineNode(aux_rows=2 * n + 64)
        self.side = ds.DecodeSide(self.node, free_slots=0, deferred_release=False)
        self.ds = ds
        self.update_status = update_status
        self.pop_pre = pop_pre
        self.pop_tr = pop_tr
        self.room = 10_000
        for _ in range(n):
            self.add_prealloc()
            self.add_transfer()
        self.side.transfer.queue = list(self.side.transfer.queue)

    def _receiver(self, rid: str) -> Any:
        from sglang.srt.disaggregation import decode as decode_mod
        from sglang.srt.disaggregation.nixl.conn import NixlKVReceiver

        self.room += 1
        receiver = NixlKVReceiver(self.node.mgr, self.node.addr, self.room)
        self.update_status(self.node.mgr, self.room, WFI)
        req = self.ds.make_request(rid, self.room, self.node.port)
        return decode_mod.DecodeRequest(req=req, kv_receiver=receiver)

    def add_prealloc(self) -> None:
        dreq = self._receiver(f"p{self.room}")
        dreq.waiting_for_input = True
        self.side.prealloc.queue.append(dreq)

    def add_transfer(self) -> None:
        dreq = self._receiver(f"t{self.room}")
        dreq.metadata_buffer_index = self.side.allocator.alloc()
        self.side.transfer.queue.append(dreq)

    def iterate(self) -> float:
        mgr = self.node.mgr
        pq, tq = self.side.prealloc, self.side.transfer
        doomed = [pq.queue[0].kv_receiver, pq.queue[1].kv_receiver]
        landed = tq.queue[:2]
        for dreq in landed:  # prefill wrote the metadata row with the KV (untimed)
            self.node.metadata.bootstrap_room[dreq.metadata_buffer_index, 0] = (
                dreq.req.bootstrap_room
            )
        t0 = time.perf_counter()
        for receiver in doomed:
            mgr.record_failure(receiver.bootstrap_room, "transport error")
            self.update_status(mgr, receiver.bootstrap_room, FAILED)
        for dreq in landed:
            self.update_status(mgr, dreq.req.bootstrap_room, SUCCESS)
        self.pop_pre(pq)
        self.pop_tr(tq)
        elapsed = time.perf_counter() - t0
        for _ in range(2):
            self.add_prealloc()
            self.add_transfer()
        return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1000, help="requests in each queue")
    parser.add_argument("--iterations", type=int, default=2000, help="per arm")
    parser.add_argument("--quick", action="store_true", help="tiny run: checks the script only")
    args = parser.parse_args(argv)
    if args.quick:
        args.n, args.iterations = 50, 20

    import sglang_decode_support as ds
    import sglang_support as sgs
    from sglang.srt.disaggregation import decode as decode_mod
    from sglang.srt.disaggregation.common.conn import CommonKVManager
    from stallguard_sglang.testing import installed

    sgs.setup_context(0, 1, disaggregation_mode="decode")
    logging.getLogger("sglang.srt.disaggregation.decode").setLevel(logging.CRITICAL)
    pre, tr = decode_mod.DecodePreallocQueue, decode_mod.DecodeTransferQueue
    plain = (CommonKVManager.update_status, pre.pop_preallocated, tr.pop_transferred)
    with installed(CONFIG):
        hooked = (CommonKVManager.update_status, pre.pop_preallocated, tr.pop_transferred)
        assert all(h is not p for h, p in zip(hooked, plain, strict=True)), "hooks not applied"
        arms = {
            "disabled": Arm(ds, args.n, *plain),
            "enabled": Arm(ds, args.n, *hooked),
        }
        times: dict[str, list[float]] = {name: [] for name in arms}
        for arm in arms.values():  # warm up
            for _ in range(max(3, args.iterations // 20)):
                arm.iterate()
        for _ in range(args.iterations):
            for name, arm in arms.items():
                times[name].append(arm.iterate())
        guards = [arms["enabled"].side.prealloc._stallguard_decode_guard]
        guards.append(arms["enabled"].side.transfer._stallguard_decode_guard)
        sizes = [(len(g.entries), len(g.wd)) for g in guards]
        # (the two requests of each queue that joined after the last call are not enrolled yet)
        expected = (args.n - 2, args.n - 2)
        assert all(s == expected for s in sizes), f"the enabled arm is not guarded: {sizes}"
    gc.collect()
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"| N | disabled | enabled | enabled/disabled |  (sglang {sgs.sglang_version()})")
    print("|---|---|---|---|")
    print(
        f"| {args.n} | {med['disabled'] * 1e6:.0f} µs | {med['enabled'] * 1e6:.0f} µs | "
        f"{med['enabled'] / med['disabled']:.3f} |"
    )
    for arm in arms.values():
        arm.side.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
