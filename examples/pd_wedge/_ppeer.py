"""The decode-side faults' prefill: a DP-2 prefill server's KV side (``_dp_prefill``),
and its bootstrap server in a process of its own, as SGLang runs it (the bootstrap
server lives in the HTTP server process, not in the scheduler).

The prefill loop is the KV part of a prefill scheduler and nothing more: a request that
arrives gets its ``KVSender`` (which registers the room with the bootstrap server), and
once decode's metadata has arrived (the sender is ``WaitingForInput``) its KV is sent.
The prefill-side guard is not what these faults are about (the prefill-side faults run
SGLang's real inflight queue, ``_prefill.py``); here the prefill is the faulty peer.

Faults, injected on request: the process stops itself (``SIGSTOP``: scheduler, transfer
engine threads and all), either when the next request arrives, before it registers it
("frozen before registration"), or once decode metadata has arrived for a room of each
decode server the driver names (it tags each room with the server it is for), before it
sends their KV ("frozen after send_metadata"). The driver sends ``SIGCONT``.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from multiprocessing.connection import Connection

from sglang.srt.disaggregation.base import KVPoll

from . import _dp_prefill, _kv, _rpc
from ._faults import ready_to_freeze

log = logging.getLogger("pd_wedge.ppeer")


def run_bootstrap(conn: Connection, spec: dict) -> None:
    """The bootstrap servers of the prefills (one port each), in one process."""
    servers = [_kv.start_bootstrap_server(spec["engine"], port) for port in spec["ports"]]
    conn.send(("ready", {"pid": os.getpid(), "servers": len(servers)}))
    while _rpc.drain(conn, {"ping": lambda: os.getpid()}, wait=0.5):
        pass


def run(conn: Connection, spec: dict) -> None:
    engine, port = spec["engine"], spec["bootstrap_port"]
    _dp_prefill.install_context(engine, port)
    ranks = _dp_prefill.PrefillRanks(engine, port, _kv.Layout(**spec["layout"]))
    flags = {"freeze_on_submit": False}
    # the tags (decode servers) of which a room must wait for its KV before the freeze;
    # empty: no freeze armed. Named by the driver, not read off the live rooms: under
    # load one decode server's rooms can all be done at the moment of the check, and
    # the freeze would then pin a request on the other one only.
    freeze_tags: set[str] = set()
    live: dict[int, int] = {}  # room -> pages, until the sender concludes
    tags: dict[int, str] = {}  # room -> the driver's tag (which decode server it is for)
    sent: set[int] = set()
    counters = {"registered": 0, "sent": 0, "succeeded": 0, "failed": 0}
    marks: list[float] = []  # when the driver's "mark" messages were handled

    def freeze() -> None:
        os.kill(os.getpid(), signal.SIGSTOP)  # returns when the driver sends SIGCONT

    def submit(room: int, pages: int, tag: str = "") -> None:
        if flags["freeze_on_submit"]:
            flags["freeze_on_submit"] = False
            freeze()  # frozen before this room (and every later one) is registered
        ranks.register(room)
        live[room] = pages
        tags[room] = tag
        counters["registered"] += 1

    def set_flag(name: str, value: bool = True) -> None:
        if name not in flags:
            raise ValueError(f"unknown prefill flag {name!r}")
        flags[name] = value

    def freeze_after_metadata(tags: list[str]) -> None:
        if not tags:
            raise ValueError("freeze_after_metadata needs the tags to wait for")
        freeze_tags.clear()
        freeze_tags.update(tags)

    def reset() -> dict:
        """Forget the scenario's rooms (a sender whose decode gave up before it sent its
        metadata waits for its bootstrap timeout in SGLang: the harness aborts it)."""
        left = len(live)
        for room in list(live):
            sender = ranks.senders.get(room)
            if sender is not None:
                sender.abort()
            ranks.forget(room)
        live.clear()
        tags.clear()
        sent.clear()
        freeze_tags.clear()
        out = {**counters, "left": left, "marks": list(marks)}
        counters.update(registered=0, sent=0, succeeded=0, failed=0)
        marks.clear()
        return out

    running = True

    def shutdown() -> None:
        nonlocal running
        running = False

    handlers = {
        "submit": submit,
        # handled after every message sent before it: when a resumed prefill has
        # worked through the requests that arrived while it was stopped
        "mark": lambda: marks.append(time.monotonic()),
        "flag": set_flag,
        "freeze_after_metadata": freeze_after_metadata,
        "reset": reset,
        "ping": lambda: os.getpid(),
        "shutdown": shutdown,
    }
    conn.send(("ready", {"pid": os.getpid()}))
    while running:
        if not _rpc.drain(conn, handlers, wait=0.005):
            break
        statuses = {room: ranks.poll(room) for room in list(live)}
        if freeze_tags and ready_to_freeze(
            statuses, tags, sent, freeze_tags, waiting=KVPoll.WaitingForInput
        ):
            freeze_tags.clear()
            freeze()
        for room, status in statuses.items():
            if status == KVPoll.WaitingForInput and room not in sent:
                if freeze_tags:
                    continue  # held until a room of every named tag waits
                try:
                    ranks.send(room, live[room])
                except Exception:  # e.g. decode's ABORT arrived meanwhile: SGLang logs it
                    log.exception("room %s: send failed", room)
                sent.add(room)
                counters["sent"] += 1
            elif status in (KVPoll.Success, KVPoll.Failed):
                counters["succeeded" if status == KVPoll.Success else "failed"] += 1
                del live[room]
                tags.pop(room, None)
                sent.discard(room)
                ranks.forget(room)
        time.sleep(0.005)
