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
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

HOST = "127.0.0.1"
ENGINE_ENV = {"SGLANG_HOST_IP": HOST, "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"}
os.environ.update(ENGINE_ENV)

_EXAMPLES = str(Path(__file__).resolve().parents[3] / "examples")
if _EXAMPLES not in sys.path:
    sys.path.append(_EXAMPLES)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- prefill peer


def _prefill_main(conn: Any, port: int, policy: str) -> None:
    """The prefill process: the bootstrap server and two prefill ranks (DP 2)."""
    try:
        os.environ.update(ENGINE_ENV)
        from pd_wedge import _kv
        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.runtime_context import get_context, get_parallel

        get_context().override_server_args(
            disaggregation_mode="prefill",
            disaggregation_transfer_backend="nixl",
            disaggregation_bootstrap_port=port,
            disaggregation_decode_allocation_policy=policy,
            host=HOST,
            dp_size=2,
            load_balance_method="round_robin",
        ).install()
        server = _kv.start_bootstrap_server("nixl", port)
        layout = _kv.Layout(num_pages=256, aux_rows=64)
        managers = []
        for rank in (0, 1):
            get_parallel().override_permanently(
                tp_rank=0,
                attn_tp_rank=0,
                attn_cp_rank=0,
                attn_dp_rank=0,  # system DP: the rank is kv_args.system_dp_rank
                attn_dcp_rank=0,
                pp_rank=0,
                moe_ep_rank=0,
                moe_tp_rank=0,
                moe_dp_rank=0,
                pp_group=None,
                dp_size=2,
                num_dp_ranks=2,
                load_balance_method="round_robin",
            )
            pool = _kv.HostPool(layout)
            args = pool.kv_args()
            args.system_dp_rank = rank
            meta = metadata_buffers(layout.aux_rows)
            args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = meta.get_buf_infos()
            pool.meta = meta
            mgr = _kv.kv_class("nixl", "MANAGER")(
                args, _kv.DisaggregationMode.PREFILL, get_context().server_args, False
            )
            managers.append((mgr, pool))
        senders: dict[int, Any] = {}
        sender_cls = _kv.kv_class("nixl", "SENDER")
        conn.send(("ready", os.getpid()))
        while True:
            op, args_ = conn.recv()
            try:
                if op == "register":  # the prefill scheduler creates the room's sender
                    (room,) = args_
                    senders[room] = sender_cls(managers[0][0], f"{HOST}:{port}", room)
                    result: Any = int(senders[room].poll())
                elif op == "status":
                    (room,) = args_
                    result = int(managers[0][0].request_status.get(room, -1))
                elif op == "send":  # the prefill forward pass done: send the KV
                    room, npages, write_room = args_
                    meta = managers[0][1].meta
                    row = room % layout.aux_rows  # each room its own metadata row
                    meta.bootstrap_room[row, 0] = room if write_room else 0
                    sender = senders[room]
                    deadline = time.monotonic() + 10
                    while int(sender.poll()) != KVPoll.WaitingForInput:
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"room {room}: no decode metadata")
                        time.sleep(0.01)
                    import numpy as np

                    sender.init(npages, row)
                    sender.send(np.arange(npages, dtype=np.int32))
                    result = True
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


class PrefillPeer:
    """The prefill process: ``register(room)`` makes its scheduler create the room's
    sender (which registers the room's DP rank with the bootstrap server)."""

    def __init__(self, policy: str = "early") -> None:
        self.port = free_port()
        self.addr = f"{HOST}:{self.port}"
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_prefill_main, args=(child, self.port, policy), daemon=True)
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

    def close(self) -> None:
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


# --------------------------------------------------------------------------- decode side


def metadata_buffers(rows: int) -> Any:
    """SGLang's own ``MetadataBuffers`` (CPU tensors), the same on both sides."""
    import torch
    from sglang.srt.disaggregation.utils import MetadataBuffers

    return MetadataBuffers(
        size=rows, hidden_size=8, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=0
    )


class DecodeNode:
    """The decode server's KV manager: a real ``NixlKVManager`` in DECODE mode over host
    buffers and SGLang's ``MetadataBuffers``, connected to the prefill's bootstrap
    server (``try_ensure_parallel_info``). Shared by the tests of a module."""

    def __init__(self, peer_addr: str) -> None:
        from pd_wedge import _kv

        self.addr = peer_addr
        self.port = int(peer_addr.rsplit(":", 1)[1])
        self.layout = _kv.Layout(num_pages=256, aux_rows=64)
        self.kv = _kv.HostPool(self.layout)
        self.metadata = metadata_buffers(self.layout.aux_rows)
        kv_args = self.kv.kv_args()
        kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = (
            self.metadata.get_buf_infos()
        )
        self.mgr = _kv.kv_class("nixl", "MANAGER")(
            kv_args, _kv.DisaggregationMode.DECODE, _kv.get_context().server_args, False
        )
        deadline = time.monotonic() + 60
        while not self.mgr.try_ensure_parallel_info(peer_addr):
            if time.monotonic() > deadline:
                raise TimeoutError(f"decode could not fetch prefill parallel info from {peer_addr}")
            time.sleep(0.05)


def install_decode_context(
    bootstrap_port: int, policy: str = "early", *, rank: int = 0, world: int = 1
) -> None:
    from sglang.srt.runtime_context import get_context, get_parallel

    get_context().override_server_args(
        disaggregation_mode="decode",
        disaggregation_transfer_backend="nixl",
        disaggregation_bootstrap_port=bootstrap_port,
        disaggregation_decode_allocation_policy=policy,
        host=HOST,
        tp_size=world,
    ).install()
    get_parallel().override_permanently(
        tp_rank=rank,
        attn_tp_rank=rank,
        attn_cp_rank=0,
        attn_dp_rank=0,
        attn_dcp_rank=0,
        pp_rank=0,
        moe_ep_rank=0,
        moe_tp_rank=0,
        moe_dp_rank=0,
        pp_group=None,
    )


class OfflineNode:
    """A decode node without a transfer engine or prefill (for benchmarks and quick
    checks): a real ``NixlKVManager``'s status plumbing, built with ``object.__new__``
    (no NIXL agent, ZMQ or bootstrap server), over the same host buffers and
    ``MetadataBuffers`` as :class:`DecodeNode`."""

    def __init__(self, aux_rows: int = 64) -> None:
        import threading as _threading
        from collections import defaultdict

        from pd_wedge import _kv
        from sglang.srt.disaggregation.nixl.conn import NixlKVManager

        self.addr = f"{HOST}:1"
        self.port = 1
        self.layout = _kv.Layout(num_pages=256, aux_rows=aux_rows)
        self.kv = _kv.HostPool(self.layout)
        self.metadata = metadata_buffers(aux_rows)
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
        self.mgr = mgr


class HostPools:
    """Stands in for decode's GPU memory pools: ``free_slots`` requests fit, each in a
    run of ``slot_pages`` pages of the host KV buffers the decode manager registered."""

    def __init__(self, pool: Any, free_slots: int, slot_pages: int = 8) -> None:
        import torch

        self.pool = pool  # pd_wedge._kv.HostPool: the registered host buffers
        self.slot_pages = slot_pages
        slots = pool.layout.num_pages // slot_pages
        self.free = list(range(slots))
        self.budget = free_slots
        self.req_to_token = torch.arange(slots * slot_pages, dtype=torch.int64).reshape(
            slots, slot_pages
        )
        self.released: list[Any] = []

    # ReqToTokenPool
    def available_size(self) -> int:
        return max(0, min(self.budget, len(self.free)))

    def alloc_slot(self) -> int:
        self.budget -= 1
        return self.free.pop(0)

    def free_slot(self, slot: int) -> None:
        self.free.append(slot)
        self.budget += 1


class _Recorder:
    def __init__(self) -> None:
        self.streamed: list[tuple[str, Any]] = []
        self.released: list[str] = []

    def stream_output(self, reqs: list[Any], *args: Any, **kwargs: Any) -> None:
        for req in reqs:
            self.streamed.append((req.rid, req.finished_reason))


def _queue_classes() -> tuple[type, type]:
    from sglang.srt.disaggregation import decode as decode_mod

    class HostPreallocQueue(decode_mod.DecodePreallocQueue):
        """SGLang's ``DecodePreallocQueue``; only its memory-budget and allocation
        helpers are replaced, by ``HostPools`` (GPU memory pools stand-in)."""

        def _allocatable_token_budgets(self, *args: Any, **kwargs: Any) -> int:
            return self.host.available_size() * self.host.slot_pages

        def _prealloc_reservation_fits(self, *args: Any, **kwargs: Any) -> bool:
            return self.host.available_size() > 0

        def _pre_alloc(self, req: Any, *args: Any, **kwargs: Any) -> Any:
            slot = self.host.alloc_slot()
            req.kv.req_pool_idx = slot
            req.kv.holds_kv = True
            req.kv.is_kv_released = False
            return self.host.req_to_token[slot]

    return HostPreallocQueue, decode_mod.DecodeTransferQueue


class DecodeSide:
    """The decode scheduler's two queues over a real decode ``NixlKVManager``.

    ``add(rid, room)`` is SGLang's ``DecodePreallocQueue.add`` (receiver created; pending
    unless the prefill rank resolves from cache); ``step()`` runs what
    ``process_decode_queue`` runs, in its order: ``resolve_deferred_releases``,
    ``pop_preallocated`` (into the transfer queue), ``pop_transferred``."""

    def __init__(
        self,
        node: DecodeNode | OfflineNode,
        *,
        free_slots: int = 4,
        group: Any = None,
        deferred_release: bool = True,
    ) -> None:
        import torch.distributed as dist
        from sglang.srt.disaggregation import decode as decode_mod
        from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator, TransferBackend

        if group is None:
            if not dist.is_initialized():
                dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            group = dist.group.WORLD
        self.recorder = _Recorder()
        layout = node.layout
        self.kv = node.kv
        self.metadata = node.metadata
        self.mgr = node.mgr
        self.mgr.enable_deferred_decode_kv_release = deferred_release
        self.host = HostPools(self.kv, free_slots)
        self.allocator = ReqToMetadataIdxAllocator(layout.aux_rows)
        self.port = node.port
        self.group = group
        rec = self.recorder
        self.sched = SimpleNamespace(
            running_batch=SimpleNamespace(reqs=[]),
            enable_priority_scheduling=False,
            enable_hisparse=False,
            enable_lora=False,
            enable_decode_hicache=False,
            kv_checksum_computer=None,
            output_streamer=rec,
            metrics_reporter=SimpleNamespace(enable_metrics=False),
            waiting_queue=[],
            spec_algorithm=SimpleNamespace(is_none=lambda: True),
            batch_result_processor=SimpleNamespace(_maybe_update_reasoning_tokens=lambda *a: None),
        )
        prealloc_cls, transfer_cls = _queue_classes()
        tq = object.__new__(transfer_cls)
        tq.queue = []
        tq.gloo_group = group
        tq.req_to_metadata_buffer_idx_allocator = self.allocator
        tq.tp_rank = 0
        tq.metadata_buffers = self.metadata
        tq.scheduler = self.sched
        tq.enable_host_receive = False
        # the radix tree cache (decode's radix cache is off: nothing is locked)
        tq.tree_cache = SimpleNamespace(unlock=lambda *a: None, finish=lambda *a: None)
        tq.spec_algorithm = self.sched.spec_algorithm
        tq._skipped_checksum_signatures = set()
        tq.enable_staging = False
        tq.staging_handler = None
        tq.enable_deferred_kv_release = deferred_release
        tq.deferred_kv_release_timeout = 30.0
        tq._deferred_releases = []
        pq = object.__new__(prealloc_cls)
        pq.host = self.host
        pq.req_to_token_pool = self.host
        pq.token_to_kv_pool_allocator = SimpleNamespace(
            page_size=1,
            prealloc_fits_assumes_reclaim=lambda: False,
            translate_kv_indices_for_transfer=lambda idx: idx,
        )
        pq.token_to_kv_pool = SimpleNamespace(page_size=1)
        pq.draft_token_to_kv_pool = None
        pq.is_mla_backend = False
        pq.metadata_buffers = self.metadata
        pq.req_to_metadata_buffer_idx_allocator = self.allocator
        pq.scheduler = self.sched
        pq.transfer_queue = tq
        pq.tree_cache = tq.tree_cache
        pq.tree_cache.supports_mamba = lambda: False
        pq.host_pool = None
        pq.host_reserved_tokens = 0
        pq.gloo_group = group
        pq._num_published_destinations = 0
        pq.tp_rank = 0
        pq.gpu_id = 0
        pq.bootstrap_port = self.port
        pq.max_total_num_tokens = layout.num_pages
        pq.pp_rank = 0
        pq.pp_size = 1
        pq.num_reserved_decode_tokens = 0
        pq.transfer_backend = TransferBackend.NIXL
        pq.queue = []
        pq.retracted_queue = []
        pq.pending_reqs = []
        pq._prefill_dp_rank_queries = {}
        pq._ensure_retry_count = {}
        pq._max_ensure_retries = 15
        pq._ensure_last_attempt_time = {}
        pq._ensure_retry_interval = 1.0
        pq.held_rebootstrap_reqs = []
        pq.enable_staging = False
        pq.kv_manager = self.mgr
        pq.kv_checksum_signature = 0
        self.sched.disagg_decode_prealloc_queue = pq
        self.sched.disagg_decode_transfer_queue = tq
        self.prealloc = pq
        self.transfer = tq
        self._decode_mod = decode_mod
        self.done: list[str] = []
        self.iteration = 0
        self.released: list[str] = []
        # release_kv_cache (mem_cache/common.py) frees GPU pages: record it and give the
        # request's pages back to the host pools instead
        self._original_release = decode_mod.release_kv_cache

        def release(req: Any, tree_cache: Any, *args: Any, **kwargs: Any) -> None:
            self.released.append(req.rid)
            if req.kv.req_pool_idx is not None:
                self.host.free_slot(req.kv.req_pool_idx)
                req.kv.req_pool_idx = None

        decode_mod.release_kv_cache = release

    def close(self) -> None:
        self._decode_mod.release_kv_cache = self._original_release

    def add(self, rid: str, room: int) -> Any:
        """A request arrives from the router (SGLang's ``DecodePreallocQueue.add``)."""
        req = make_request(rid, room, self.port)
        self.prealloc._create_receiver_and_enqueue(req)  # add()'s path, minus the
        # capacity check that reads the GPU pools
        dreq = self.prealloc.queue[-1]
        rank = self.prealloc._resolve_prefill_dp_rank(req)
        if rank is not None:
            self.prealloc._init_receiver(dreq, rank)
        else:
            self.prealloc.pending_reqs.append(dreq)
        return dreq

    def add_waiting(self, rid: str, room: int, queue: str) -> Any:
        """A request whose handshake is done, put straight into *queue*: ``"prealloc"``
        (waiting for decode memory) or ``"transfer"`` (metadata sent, waiting for the
        KV), as SGLang's queues hold them at that point."""
        from sglang.srt.disaggregation.nixl.conn import NixlKVReceiver

        receiver = NixlKVReceiver(self.mgr, f"{HOST}:{self.port}", room)
        self.mgr.update_status(room, 2)  # WaitingForInput
        dreq = self._decode_mod.DecodeRequest(
            req=make_request(rid, room, self.port), kv_receiver=receiver
        )
        if queue == "prealloc":
            dreq.waiting_for_input = True
            self.prealloc.queue.append(dreq)
        else:
            dreq.metadata_buffer_index = self.allocator.alloc()
            self.transfer.queue.append(dreq)
        return dreq

    def step(self) -> list[str]:
        """One ``process_decode_queue`` pass (without its retraction gate)."""
        self.iteration += 1
        self.transfer.resolve_deferred_releases()
        admitted, _ = self.prealloc.pop_preallocated()
        self.transfer.extend(admitted)
        done = self.transfer.pop_transferred()
        self.done += [r.rid for r in done]
        for req in done:  # (the request decodes and finishes: its slot is free again)
            self.host.free_slot(req.kv.req_pool_idx)
            req.kv.req_pool_idx = None
        return [r.rid for r in done]

    def rids(self, queue: str) -> list[str]:
        q = self.prealloc if queue == "prealloc" else self.transfer
        return [d.req.rid for d in q.queue]

    def pending_rids(self) -> list[str]:
        return [d.req.rid for d in self.prealloc.pending_reqs]

    def aborted(self) -> dict[str, str]:
        """rid -> abort message, for the requests SGLang streamed as aborted."""
        return {
            rid: reason.message
            for rid, reason in self.recorder.streamed
            if reason is not None and hasattr(reason, "message")
        }


class _TimeStats:
    """``req.time_stats``: accepts the ``set_*`` calls the queues make."""

    trace_ctx = SimpleNamespace(tracing_enable=False)

    def set_bootstrap_done_time(self) -> None:  # called per waiting request per poll
        return None

    def __getattr__(self, name: str) -> Any:
        if name.startswith(("set_", "reset_")):
            return lambda *a, **k: None
        raise AttributeError(name)


def make_request(rid: str, room: int, port: int) -> Any:
    """The fields SGLang's decode queues read of a ``Req``."""
    return SimpleNamespace(
        rid=rid,
        bootstrap_room=room,
        bootstrap_host=HOST,
        bootstrap_port=port,
        disagg_prefill_dp_rank=None,
        origin_input_ids=list(range(4)),
        output_ids=[],
        finished_reason=None,
        finished_output=False,
        return_logprob=False,
        return_sampling_mask=False,
        priority=None,
        lora_id=None,
        is_retracted=False,
        sampling_params=SimpleNamespace(max_new_tokens=4),
        kv=SimpleNamespace(
            req_pool_idx=None,
            holds_kv=False,
            holds_mamba=False,
            is_kv_released=True,
            cache_protected_len=0,
            retraction_backup=None,
        ),
        time_stats=_TimeStats(),
        pd_rebootstrap_in_progress=False,
    )


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
    "next_room",
    "threading",
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
