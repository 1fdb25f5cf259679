"""The REAL SGLang 0.5.23 decode queues on a CPU, for the decode-side adapter tests.

Real: the bootstrap server (``NixlKVBootstrapServer``, in a process of its own with two
prefill ranks: a DP-2 prefill, ``round_robin``, so decode must ask the bootstrap server
which rank holds each room), the prefill ``NixlKVManager``s and ``NixlKVSender``s there,
the decode ``NixlKVManager`` in DECODE mode with its heartbeat thread, the
``NixlKVReceiver``s, ``DecodePreallocQueue.pop_preallocated`` (pending resolution through
``/query_dp_ranks``, handshake polling, failure removal, admission, ``send_metadata``),
``DecodeTransferQueue.pop_transferred`` (metadata gate, failure path, deferred release),
``resolve_deferred_releases``, SGLang's ``MetadataBuffers`` (CPU tensors), the poll
all-reduce over a gloo group. NIXL moves host memory over UCX/TCP loopback.

Stand-ins, each for what needs a GPU or a model server:

* ``HostPools`` stands in for the GPU memory pools (``ReqToTokenPool``,
  ``TokenToKVPoolAllocator``, the KV cache): the decode KV regions are host buffers
  registered with NIXL, ``free_slots`` sets how many requests decode has room for;
  ``HostPreallocQueue`` overrides only the queue's memory-budget and allocation helpers
  (``_allocatable_token_budgets``, ``_pre_alloc``) to use it.
* The scheduler holds just the attributes the queue methods read; its output streamer,
  tree cache and ``release_kv_cache`` record what the queues do.
* Requests are ``SimpleNamespace`` objects with the fields the queues read.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from stallguard.testing import free_port, stop_and_wait

_EXAMPLES = str(Path(__file__).resolve().parents[3] / "examples")
if _EXAMPLES not in sys.path:
    sys.path.append(_EXAMPLES)

# The demo's loopback engine environment (NIXL: UCX over TCP; Mooncake: TCP).
from pd_wedge._env import ENGINE_ENV  # noqa: E402

HOST = "127.0.0.1"
os.environ.update(ENGINE_ENV)

# The decode queues and their stand-ins live with the demo, which runs them too.
from pd_wedge._decode_queues import (  # noqa: E402
    DecodeNode,
    DecodeSide,
    HostPools,
    _Recorder,
    make_request,
    metadata_buffers,
)

# --------------------------------------------------------------------------- prefill peer


def _prefill_main(
    conn: Any,
    port: int,
    policy: str,
    engine: str = "nixl",
    layout: dict[str, int] | None = None,
) -> None:
    """The prefill process: the bootstrap server and two prefill ranks (DP 2), over
    host pools of *layout* (``pd_wedge._kv.Layout`` fields; default 256 pages of 2 KiB,
    64 metadata rows)."""
    try:
        os.environ.update(ENGINE_ENV)
        import numpy as np
        from pd_wedge import _dp_prefill, _kv

        _dp_prefill.install_context(engine, port, policy)
        server = _kv.start_bootstrap_server(engine, port)
        shape = dict(num_pages=256, aux_rows=64)
        shape.update(layout or {})
        ranks = _dp_prefill.PrefillRanks(engine, port, _kv.Layout(**shape))
        conn.send(("ready", os.getpid()))
        while True:
            op, args_ = conn.recv()
            try:
                if op == "register":  # the prefill scheduler creates the room's sender
                    result: Any = ranks.register(*args_)
                elif op == "status":
                    result = ranks.status(*args_)
                elif op == "send":  # the prefill forward pass done: send the KV
                    ranks.wait_and_send(*args_)
                    result = True
                elif op == "complete":  # prefill_complete: the forward pass is done,
                    # decode may allocate (SGLang's scheduler calls this after prefill)
                    ranks.senders[args_[0]].mark_prefill_complete()
                    result = ranks.status(args_[0])
                elif op == "finish":  # the inflight queue: concluded, sender cleared
                    result = _finish(ranks, *args_)
                elif op == "fill":  # the forward pass writes the room's KV (its pattern)
                    # into the source pages send() reads: pages 0 .. npages-1
                    room, npages = args_
                    ranks.pool.fill(room, np.arange(npages), 0)
                    result = True
                elif op == "fail":  # what stallguard's prefill failure does, then
                    # SGLang's inflight queue at its next call: conclude_failure (decode
                    # is told), failure_exception() (the sender cleared) and the source
                    # pages released (the caller refills them: the next request's KV)
                    room, reason = args_
                    ranks.mgr.conclude_failure(bootstrap_room=room, failure_reason=reason)
                    try:
                        ranks.senders[room].failure_exception()
                    except Exception as e:
                        result = str(e)
                    else:
                        result = None
                elif op == "outstanding":  # the room's chunks dequeued or posted and
                    # not yet settled (SGLang's count behind the drain ACK)
                    result = int(ranks.mgr._staging_outstanding.get(args_[0], 0))
                elif op == "stop":
                    conn.send(("ok", None))
                    break
                else:
                    raise ValueError(op)
                conn.send(("ok", result))
            except Exception:
                conn.send(("err", traceback.format_exc()))
        del server
    except BaseException:
        try:
            conn.send(("err", traceback.format_exc()))
        except Exception:
            pass
    finally:
        os._exit(0)  # NIXL's bootstrap thread is not a daemon


def _finish(ranks: Any, room: int, timeout: float = 10.0) -> int:
    """What the prefill inflight queue does with a sent room: poll until it concludes,
    then ``clear()`` the sender on Success (under ``prefill_complete`` that is when
    decode is told Success). Returns the concluded state."""
    deadline = time.monotonic() + timeout
    while (state := ranks.poll(room)) not in (0, 4):  # Failed, Success
        if time.monotonic() > deadline:
            raise TimeoutError(f"room {room}: still {state} after {timeout} s")
        time.sleep(0.01)
    if state == 4:
        ranks.senders[room].clear()
    return state


class PrefillPeer:
    """The prefill process: ``register(room)`` makes its scheduler create the room's
    sender (which registers the room's DP rank with the bootstrap server)."""

    def __init__(
        self, policy: str = "early", engine: str = "nixl", layout: dict[str, int] | None = None
    ) -> None:
        self.engine = engine
        self.port = free_port()
        self.addr = f"{HOST}:{self.port}"
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_prefill_main, args=(child, self.port, policy, engine, layout), daemon=True
        )
        self.proc.start()
        child.close()
        self.pid: int | None = None

    def wait_ready(self, timeout: float = 180.0) -> PrefillPeer:
        """Block until the prefill process is up (imports take 10-60 s here)."""
        if self.pid is not None:
            return self
        if not self.conn.poll(timeout):
            self.close()
            raise TimeoutError(f"the prefill process did not come up within {timeout} s")
        status, payload = self.conn.recv()
        if status != "ready":
            self.close()
            raise RuntimeError(f"the prefill process failed:\n{payload}")
        self.pid = payload
        return self

    def call(self, op: str, *args: Any, timeout: float = 30.0) -> Any:
        self.conn.send((op, args))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"prefill {op}{args}: no answer within {timeout} s")
        status, payload = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"prefill {op}{args} failed:\n{payload}")
        return payload

    def freeze(self, timeout: float = 10.0) -> None:
        """SIGSTOP the prefill process and wait until every one of its threads is
        stopped (its transfer workers and engine threads with it)."""
        assert self.pid is not None
        stop_and_wait(self.pid, timeout)

    def thaw(self) -> None:
        assert self.pid is not None
        os.kill(self.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.pid is not None and self.proc.is_alive():
            os.kill(self.pid, signal.SIGCONT)  # a stopped process cannot stop itself
        if self.proc.is_alive():
            try:
                self.conn.send(("stop", ()))
                self.conn.poll(5)
            except Exception:
                pass
            self.proc.join(5)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)


# --------------------------------------------------------------------------- decode peer


def _decode_main(
    conn: Any, port: int, engine: str, layout: dict[str, int], release_timeout: float
) -> None:
    """A decode process: SGLang's real decode queues (:class:`DecodeSide`) over a real
    decode manager connected to the prefill whose bootstrap server listens on *port*;
    driven over *conn*, so the driver can SIGSTOP it mid-transfer."""
    try:
        os.environ.update(ENGINE_ENV)
        import numpy as np
        from pd_wedge import _kv

        install_decode_context(port, "early", engine=engine)
        node = DecodeNode(f"{HOST}:{port}", engine=engine, layout=_kv.Layout(**layout))
        side = DecodeSide(node, free_slots=2)
        side.transfer.deferred_kv_release_timeout = release_timeout
        dreqs: dict[str, Any] = {}
        pages: dict[str, Any] = {}
        conn.send(("ready", os.getpid()))
        while True:
            op, args_ = conn.recv()
            try:
                if op == "add":  # a request for *room*, admitted: metadata sent
                    rid, room, npages = args_
                    dreq = side.add(rid, room)
                    dreq.req.origin_input_ids = list(range(npages))
                    side.step()
                    slot = dreq.req.kv.req_pool_idx
                    pages[rid] = side.host.req_to_token[slot].numpy()
                    for buf in side.kv.kv:
                        buf[pages[rid]] = 0
                    dreqs[rid] = dreq
                    result: Any = [int(p) for p in pages[rid]]
                elif op == "step":
                    side.step()
                    result = {
                        "done": list(side.done),
                        "aborted": side.aborted(),
                        "transfer": side.rids("transfer"),
                        "deferred": [e[0].req.rid for e in side.transfer._deferred_releases],
                        "free_slots": side.host.available_size(),
                    }
                elif op == "count":  # bytes of rid's pages holding *room*'s pattern
                    rid, room = args_
                    result = sum(
                        int(np.count_nonzero(buf[pages[rid]] == _kv.HostPool.pattern(room, r)))
                        for r, buf in enumerate(side.kv.kv)
                    )
                elif op == "stop":
                    conn.send(("ok", None))
                    break
                else:
                    raise ValueError(op)
                conn.send(("ok", result))
            except Exception:
                conn.send(("err", traceback.format_exc()))
    except BaseException:
        try:
            conn.send(("err", traceback.format_exc()))
        except Exception:
            pass
    finally:
        os._exit(0)


class DecodePeer(PrefillPeer):
    """A decode process (:func:`_decode_main`) for the prefill *peer*: ``add``,
    ``step``, ``count`` over RPC; ``freeze`` / ``thaw`` as for the prefill."""

    def __init__(
        self, peer: PrefillPeer, layout: dict[str, int], release_timeout: float = 30.0
    ) -> None:
        self.engine = peer.engine
        self.port = peer.port
        self.addr = peer.addr
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_decode_main,
            args=(child, peer.port, peer.engine, layout, release_timeout),
            daemon=True,
        )
        self.proc.start()
        child.close()
        self.pid = None


# --------------------------------------------------------------------------- decode side


def install_decode_context(
    bootstrap_port: int,
    policy: str = "early",
    *,
    engine: str = "nixl",
    rank: int = 0,
    world: int = 1,
) -> None:
    """The decode server args SGLang's decode classes read: the transfer *engine* and
    the allocation *policy* (read by a KV manager when it is created, and by
    ``CommonKVReceiver.init`` and the prealloc queue at every call)."""
    from sglang.srt.runtime_context import get_context

    get_context().override_server_args(
        disaggregation_mode="decode",
        disaggregation_transfer_backend=engine,
        disaggregation_bootstrap_port=bootstrap_port,
        disaggregation_decode_allocation_policy=policy,
        host=HOST,
        tp_size=world,
    ).install()
    from pd_wedge import _kv

    _kv.single_rank(tp_rank=rank, attn_tp_rank=rank)


def offline_decode_manager() -> Any:
    """A real SGLang 0.5.23 ``NixlKVManager``'s status plumbing (``update_status``,
    ``record_failure``, the receivers' reads), built with ``object.__new__``: no NIXL
    agent, ZMQ or bootstrap server (no prefill is involved)."""
    import threading as _threading
    from collections import defaultdict

    from sglang.srt.disaggregation.nixl.conn import NixlKVManager

    mgr = object.__new__(NixlKVManager)
    for name, value in dict(
        request_status={},
        failure_records={},
        failure_lock=_threading.Lock(),
        defer_decode_allocation=False,
        addr_to_rooms_tracker=defaultdict(set),
        prefill_response_tracker={},
        required_prefill_response_num_table={},
        prefill_info_table={},
        _deferred_ack_targets={},
        _deferred_ack_poisoned_rooms=set(),
        _staging_outstanding=defaultdict(int),
        deferred_bootstrap=None,
        enable_deferred_decode_kv_release=False,
    ).items():
        setattr(mgr, name, value)
    return mgr


class OfflineNode:
    """A decode node without a transfer engine or prefill (for benchmarks and quick
    checks): a real ``NixlKVManager``'s status plumbing, built with ``object.__new__``
    (no NIXL agent, ZMQ or bootstrap server), over the same host buffers and
    ``MetadataBuffers`` as :class:`DecodeNode`."""

    def __init__(self, aux_rows: int = 64) -> None:
        from pd_wedge import _kv

        self.addr = f"{HOST}:1"
        self.port = 1
        self.layout = _kv.Layout(num_pages=256, aux_rows=aux_rows)
        self.kv = _kv.HostPool(self.layout)
        self.metadata = metadata_buffers(aux_rows)
        self.mgr = offline_decode_manager()


_room = iter(range(5000, 10**9))


def next_room() -> int:
    return next(_room)


def wait_until(predicate: Any, timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return bool(predicate())
        time.sleep(interval)
    return True


__all__ = [
    "DecodeNode",
    "OfflineNode",
    "DecodeSide",
    "HostPools",
    "PrefillPeer",
    "free_port",
    "install_decode_context",
    "make_request",
    "offline_decode_manager",
    "next_room",
    "threading",
    "metadata_buffers",
    "wait_until",
]


# --------------------------------------------------------------------------- 0.5.17


def legacy_decode_transfer(deadline: float = 10.0) -> dict[str, Any]:
    """Under SGLang 0.5.17 (run with ``run_in_python`` in .venv-sglang0517): the real
    0.5.17 ``DecodeTransferQueue.pop_transferred`` over real ``NixlKVReceiver``s (their
    manager's status plumbing only, built with ``object.__new__``: no NIXL agent, no
    prefill), first without the adapter, then with it installed: a receiver whose
    transfer failed is concluded with SGLang's own reason either way, one that waits is
    left alone without the adapter and failed at its deadline with it."""
    import threading as _threading
    from collections import defaultdict

    import sglang
    import sglang_support as sgs
    import torch
    from sglang.srt.disaggregation import decode as decode_mod
    from sglang.srt.disaggregation.nixl.conn import NixlKVManager, NixlKVReceiver
    from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator
    from stallguard_sglang.testing import installed

    from stallguard.testing import FakeClock

    sgs.setup_context(0, 1)
    group = sgs.single_process_group()
    decode_mod.release_kv_cache = lambda *a, **k: None  # frees GPU pages: nothing here

    def run(clock: Any = None) -> dict[str, Any]:
        mgr = object.__new__(NixlKVManager)
        for name, value in dict(
            request_status={},
            failure_records={},
            failure_lock=_threading.Lock(),
            addr_to_rooms_tracker=defaultdict(set),
            prefill_response_tracker={},
            required_prefill_response_num_table={},
        ).items():
            setattr(mgr, name, value)
        rec = _Recorder()
        tq = object.__new__(decode_mod.DecodeTransferQueue)
        tq.queue = []
        tq.gloo_group = group
        tq.tp_rank = 0
        tq.scheduler = SimpleNamespace(
            enable_decode_hicache=False,
            enable_hisparse=False,
            output_streamer=rec,
            metrics_reporter=SimpleNamespace(enable_metrics=False),
            server_args=SimpleNamespace(disaggregation_transfer_backend="nixl"),
        )
        tq.enable_staging = False
        # the metadata rows prefill writes (GPU-side buffers in a server): room 0 = unwritten
        tq.metadata_buffers = SimpleNamespace(bootstrap_room=torch.zeros((8, 1), dtype=torch.int64))
        tq.req_to_metadata_buffer_idx_allocator = ReqToMetadataIdxAllocator(8)
        tq.tree_cache = SimpleNamespace(unlock=lambda *a: None, finish=lambda *a: None)
        for rid, room in (("failing", 41), ("waiting", 42)):
            receiver = NixlKVReceiver(mgr, f"{HOST}:1", room)
            mgr.update_status(room, 2)  # WaitingForInput: metadata sent
            dreq = decode_mod.DecodeRequest(
                req=make_request(rid, room, 1),
                kv_receiver=receiver,
                metadata_buffer_index=tq.req_to_metadata_buffer_idx_allocator.alloc(),
            )
            tq.queue.append(dreq)
        tq.pop_transferred()
        mgr.record_failure(41, "transport error")
        mgr.update_status(41, 0)
        for _ in range(3):
            if clock is not None:
                clock.advance(deadline / 2)
            tq.pop_transferred()
        return {
            "streamed": {rid: getattr(reason, "message", None) for rid, reason in rec.streamed},
            "queue": [d.req.rid for d in tq.queue],
        }

    out: dict[str, Any] = {"version": sglang.__version__, "without": run()}
    clock = FakeClock(1000.0)
    with installed({"decode": {"transfer": {"WaitingForInput": deadline}}}, clock=clock):
        hooked = {
            name: getattr(fn, "_stallguard_hook", None) is not None
            for name, fn in (
                ("pop_preallocated", decode_mod.DecodePreallocQueue.pop_preallocated),
                ("pop_transferred", decode_mod.DecodeTransferQueue.pop_transferred),
            )
        }
        out["with"] = run(clock)
        out["hooked"] = hooked
    return out


# --------------------------------------------------------------------------- ranks


def ranks_in_step(info: Any, iterations: int = 25) -> dict[str, Any]:
    """One rank of a real gloo group (``sglang_support.run_ranks``): both ranks hold the
    same decode requests (a prealloc one waiting for memory, a transfer one waiting for
    its KV) in SGLang's real queues, polled with the MIN all-reduce over the group. Rank
    0's clock runs 1 s per iteration, rank 1's 0.6 s: rank 0 reaches the deadlines
    first, and both ranks must conclude each request in the same iteration."""
    from stallguard_sglang.testing import installed

    from stallguard.testing import FakeClock, record_expiries

    node = OfflineNode()
    side = DecodeSide(node, free_slots=0, group=info.group, deferred_release=False)
    side.add_waiting("waiting", 61, "prealloc")
    side.add_waiting("stuck", 62, "transfer")
    clock = FakeClock(1000.0 + 1000 * info.rank)
    tick = 1.0 if info.rank == 0 else 0.6
    config = {"decode": {"prealloc": {"WaitingForInput": 20}, "transfer": {"WaitingForInput": 10}}}
    left: dict[str, int] = {}
    with installed(config, clock=clock), record_expiries() as expiries:
        for i in range(1, iterations + 1):
            clock.advance(tick)
            side.step()
            for rid in ("waiting", "stuck"):
                if rid not in left and rid not in side.rids("prealloc") + side.rids("transfer"):
                    left[rid] = i
    side.close()
    return {
        "rank": info.rank,
        "left": left,
        "aborted": side.aborted(),
        "expiries": [(str(e.key), e.state_label) for e in expiries],
    }
