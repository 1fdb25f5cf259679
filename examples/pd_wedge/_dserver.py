"""The decode-side faults' decode server: SGLang's real decode queues (``_decode_queues``:
``pop_preallocated``, ``pop_transferred``, ``resolve_deferred_releases`` over a real decode
``KVManager`` of the chosen engine) run once per scheduler loop pass, the way
``process_decode_queue`` runs them.

As in ``_prefill.py``, stallguard is not mentioned in this file: whether it runs is decided
by the process environment (``STALLGUARD_SGLANG_CONFIG``) and SGLang's ``load_plugins()``.
What this file adds is measurement: when each queue call of each pass started, when each
request first took part in each queue's call, when its room's status changed (a probe on
the manager instance), and when and how it left. From these the driver knows, for every
request, which decode phase it was in, since when, and so when stallguard's deadline for
that phase was due: the same rule the adapter documents (a phase is counted from the later
of the request's first call in the queue and the change that started the phase).
"""

from __future__ import annotations

import os
import re
import time
from multiprocessing.connection import Connection

from sglang.srt.disaggregation import decode as sglang_decode
from sglang.srt.plugins import load_plugins

from . import _decode_queues, _kv, _rpc

TARGET = "pop_preallocated"
_FAILED, _BOOTSTRAPPING, _WAITING, _TRANSFERRING, _SUCCESS = range(5)
#: "... spent 1.5s in Bootstrapping in the decode prealloc queue, ..." (the adapter's reason)
_REASON = re.compile(r" in (\w+) in the decode (prealloc|transfer) queue")


def phase_of(queue: str, dreq) -> str:
    """The request's decode phase, as docs/sglang-internals.md "The decode side" defines them."""
    receiver = dreq.kv_receiver
    state = receiver.conclude_state
    if state is None:
        state = receiver.kv_mgr.request_status.get(receiver.bootstrap_room)
    state = None if state is None else int(state)
    if state is None or state == _FAILED:
        return "Failed"
    if queue == "prealloc":
        if state == _SUCCESS:
            return "Success"
        if state == _BOOTSTRAPPING:
            if getattr(receiver, "bootstrap_infos", None) is not None:
                return "WaitingForPrefill"
            return "Bootstrapping"
        return "WaitingForInput"
    return "Transferring" if state == _SUCCESS else "WaitingForInput"


def run(conn: Connection, spec: dict) -> None:
    engine, ports = spec["engine"], spec["bootstrap_ports"]
    before = sglang_decode.DecodePreallocQueue.__dict__[TARGET]
    load_plugins()  # what run_scheduler_process does first
    hooked = sglang_decode.DecodePreallocQueue.__dict__[TARGET] is not before

    _kv.install_context("decode", engine, ports[0])
    layout = _kv.Layout(**spec["layout"])
    node = _decode_queues.DecodeNode([f"{_kv.HOST}:{p}" for p in ports], engine, layout)
    side = _decode_queues.DecodeSide(node, free_slots=spec["free_slots"])
    probe = _kv.StatusProbe(node.mgr)

    added: dict[str, float] = {}
    rooms: dict[str, int] = {}
    first_call: dict[str, dict[str, float]] = {"prealloc": {}, "transfer": {}}
    released: dict[str, tuple] = {}  # rid -> (t, ok, reason, queue, phase, since)
    # per pass: (prealloc call start, transfer call start, end, prealloc len, transfer
    # len, pending len, deferred releases)
    samples: list[tuple] = []
    streamed_seen = 0

    def since_of(rid: str, queue: str, phase: str) -> float:
        """When *rid*'s *phase* in *queue* started (the adapter's rule, see module doc)."""
        start = first_call[queue].get(rid, added.get(rid, 0.0))
        status = {"WaitingForInput": _WAITING, "Transferring": _SUCCESS}.get(phase)
        if status is not None and (queue, phase) != ("transfer", "WaitingForInput"):
            t = probe.entered(rooms[rid], status)
            if t is not None:
                start = max(start, t)
        return start

    def add(rid: str, room: int, port: int) -> None:
        added[rid] = time.monotonic()
        rooms[rid] = room
        side.add(rid, room, port)

    def snapshot() -> dict:
        """Every request in the decode queues: ``(rid, queue, phase, since)``; and when
        the last pass's calls of each queue started."""
        rows = []
        for queue, q in (("prealloc", side.prealloc), ("transfer", side.transfer)):
            for dreq in q.queue:
                rid = dreq.req.rid
                phase = phase_of(queue, dreq)
                rows.append((rid, queue, phase, since_of(rid, queue, phase)))
        last = samples[-1] if samples else (0.0, 0.0)
        return {"rows": rows, "last_call": {"prealloc": last[0], "transfer": last[1]}}

    def collect() -> dict:
        out = {
            "added": dict(added),
            "released": dict(released),
            "samples": list(samples),
            "left": snapshot()["rows"],
        }
        for rid in released:
            added.pop(rid, None)
            for calls in first_call.values():
                calls.pop(rid, None)
        released.clear()
        samples.clear()
        return out

    def reset() -> int:
        """End the scenario: abort what is still queued (a client giving up), step until
        SGLang has removed it, and forget everything measured."""
        nonlocal streamed_seen
        queued = [d for q in (side.prealloc, side.transfer) for d in q.queue]
        for dreq in queued:
            dreq.kv_receiver.abort()
        deadline = time.monotonic() + 5
        while (side.prealloc.queue or side.transfer.queue) and time.monotonic() < deadline:
            side.step()
            time.sleep(0.01)
        added.clear()
        rooms.clear()
        released.clear()
        samples.clear()
        for calls in first_call.values():
            calls.clear()
        side.recorder.streamed.clear()
        streamed_seen = 0
        side.done.clear()
        return len(side.prealloc.queue) + len(side.transfer.queue)

    running = True

    def shutdown() -> None:
        nonlocal running
        running = False

    handlers = {
        "add": add,
        "snapshot": snapshot,
        "collect": collect,
        "reset": reset,
        "ping": lambda: os.getpid(),
        "shutdown": shutdown,
    }
    conn.send(("ready", {"pid": os.getpid(), "hooked": hooked}))

    tick = float(spec["loop_interval"])
    pq, tq = side.prealloc, side.transfer
    next_t = time.monotonic()
    while running:
        if not _rpc.drain(conn, handlers):
            break
        # one process_decode_queue pass, in its order, each queue call timestamped
        tq.resolve_deferred_releases()
        t_pre = time.monotonic()
        for dreq in pq.queue:
            first_call["prealloc"].setdefault(dreq.req.rid, t_pre)
        admitted, _ = pq.pop_preallocated()
        tq.extend(admitted)
        t_tr = time.monotonic()
        for dreq in tq.queue:
            first_call["transfer"].setdefault(dreq.req.rid, t_tr)
        done = tq.pop_transferred()
        t_end = time.monotonic()
        for req in done:  # the request decodes and finishes: its slot is free again
            released[req.rid] = (t_tr, True, "", "transfer", "", 0.0)
            side.host.free_slot(req.kv.req_pool_idx)
            req.kv.req_pool_idx = None
        streamed = side.recorder.streamed
        for rid, reason in streamed[streamed_seen:]:
            message = getattr(reason, "message", None)
            if message is None or rid in released:
                continue
            match = _REASON.search(message)
            if match:  # failed by stallguard: which phase's deadline, counted from when
                phase, queue = match.group(1), match.group(2)
                released[rid] = (
                    t_pre if queue == "prealloc" else t_tr,
                    False,
                    message,
                    queue,
                    phase,
                    since_of(rid, queue, phase),
                )
            else:
                released[rid] = (t_end, False, message, "", "", 0.0)
        streamed_seen = len(streamed)
        samples.append(
            (
                t_pre,
                t_tr,
                t_end,
                len(pq.queue),
                len(tq.queue),
                len(pq.pending_reqs),
                len(tq._deferred_releases),
            )
        )
        next_t += tick
        delay = next_t - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        else:
            next_t = time.monotonic()
