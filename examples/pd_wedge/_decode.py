"""The decode side: SGLang's real KV manager and ``KVReceiver``s, driven like decode's
prealloc and transfer queues drive them (``init`` -> ``send_metadata`` -> poll).

There is no model and no decode scheduler: a receiver that reaches Success has its pages
checked byte for byte against the pattern the prefill side wrote, then the pages go back
to the pool. The faults this side injects on request are a real process-level fault (SIGKILL of
this very process) or a real "never answers" behaviour (rooms are
accepted from the router but no receiver is ever created for them). The freeze (SIGSTOP)
is sent by the prefill worker, the moment it hands a room for this decode to its engine.
"""

from __future__ import annotations

import os
import signal
import time
from collections import deque
from multiprocessing.connection import Connection

import numpy as np
from sglang.srt.disaggregation.base import KVPoll
from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator

from . import _kv, _rpc


class SlotPool:
    """Fixed-size page runs. Runs of failed rooms are quarantined until ``reset``:
    a frozen peer's write may still land there later (SGLang's decode protects itself
    with deferred release; this stand-in pool simply never reuses them mid-scenario)."""

    def __init__(self, num_pages: int, slot_pages: int):
        self.slot_pages = slot_pages
        self.free = deque(range(num_pages // slot_pages))
        self.quarantine: list[int] = []
        self.aux_quarantine: list[int] = []

    def alloc(self, tokens: int) -> tuple[int, np.ndarray]:
        if tokens > self.slot_pages:
            raise ValueError(f"tokens={tokens} exceeds slot_pages={self.slot_pages}")
        slot = self.free.popleft()  # IndexError if exhausted: sized generously
        start = slot * self.slot_pages
        return slot, np.arange(start, start + tokens, dtype=np.int32)

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def reset(self, aux_alloc) -> None:
        self.free.extend(self.quarantine)
        self.quarantine.clear()
        for row in self.aux_quarantine:
            aux_alloc.free(row)
        self.aux_quarantine.clear()


def run(conn: Connection, spec: dict) -> None:
    engine, ports = spec["engine"], spec["bootstrap_ports"]
    layout = _kv.Layout(**spec["layout"])
    _kv.install_context("decode", engine, ports[0])
    pool = _kv.HostPool(layout)
    mgr = _kv.make_manager(engine, "decode", pool)

    def connect(ports: list[int]) -> None:
        """Fetch the parallel info of each prefill's bootstrap server (once per address;
        prefills started after this decode are added by the driver the same way)."""
        for port in ports:
            addr = f"{_kv.HOST}:{port}"
            deadline = time.monotonic() + 30
            while not mgr.try_ensure_parallel_info(addr):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"decode could not fetch prefill parallel info from {addr}")
                time.sleep(0.05)

    # One decode serves every prefill of the run (one bootstrap address each).
    connect(ports)
    if engine == "mooncake":
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
            get_mooncake_transfer_engine,
        )

        # Prefill shards its transfer workers by the sum of the destination ports.
        shard_port = int(get_mooncake_transfer_engine().get_session_id().rsplit(":", 1)[1])
    else:
        shard_port = int(mgr.rank_port)
    receiver_cls = _kv.kv_class(engine, "RECEIVER")
    slots = SlotPool(layout.num_pages, spec["slot_pages"])
    aux_alloc = ReqToMetadataIdxAllocator(layout.aux_rows)

    live: dict[int, tuple] = {}  # room -> (receiver, slot, pages, aux)
    outcome: dict[int, tuple] = {}  # room -> (status, verified, reason)
    flags = {"mute": False, "kill_after_init": False}
    counters = {"ignored": 0, "opened": 0}

    def open_room(room: int, tokens: int, port: int) -> None:
        if flags["mute"]:
            counters["ignored"] += 1  # accepted from the router, never answered
            return
        counters["opened"] += 1
        slot, pages = slots.alloc(tokens)
        aux = aux_alloc.alloc()
        pool.scrub(pages, aux)
        receiver = receiver_cls(mgr, f"{_kv.HOST}:{port}", room)
        live[room] = (receiver, slot, pages, aux)
        receiver.init(0)
        if flags["kill_after_init"]:
            # Dies in the middle of the bootstrap: registered, metadata never sent.
            os.kill(os.getpid(), signal.SIGKILL)
        receiver.send_metadata(pages, aux)

    def abort_room(room: int) -> None:
        entry = live.get(room)
        if entry is not None:
            entry[0].abort()

    def set_flag(name: str, value: bool = True) -> None:
        if name not in flags:
            raise ValueError(f"unknown decode flag {name!r}")
        flags[name] = value

    def collect() -> dict:
        return {"outcome": dict(outcome), "live": sorted(live), **counters}

    def reset() -> None:
        """Forget the scenario: abort receivers still waiting (as decode's own waiting
        timeout eventually would), and return quarantined pages."""
        for room in list(live):
            receiver, slot, _, aux = live.pop(room)
            receiver.abort()
            slots.quarantine.append(slot)
            slots.aux_quarantine.append(aux)
        outcome.clear()
        counters.update(ignored=0, opened=0)
        slots.reset(aux_alloc)

    running = True

    def shutdown() -> None:
        nonlocal running
        running = False

    handlers = {
        "open": open_room,
        "abort": abort_room,
        "flag": set_flag,
        "collect": collect,
        "reset": reset,
        "connect": connect,
        "ping": lambda: os.getpid(),
        "shard_port": lambda: shard_port,
        "shutdown": shutdown,
    }
    conn.send(("ready", os.getpid()))
    while running:
        if not _rpc.drain(conn, handlers, wait=0.005):
            break
        for room in list(live):
            receiver, slot, pages, aux = live[room]
            status = receiver.poll()
            if status == KVPoll.Success:
                ok = pool.check(room, pages, aux)
                receiver.clear()
                slots.release(slot)
                aux_alloc.free(aux)
                outcome[room] = ("ok", ok, "")
                del live[room]
            elif status == KVPoll.Failed:
                try:
                    receiver.failure_exception()
                    reason = ""
                except Exception as exc:
                    reason = str(exc)
                slots.quarantine.append(slot)
                slots.aux_quarantine.append(aux)
                outcome[room] = ("failed", False, reason)
                del live[room]
