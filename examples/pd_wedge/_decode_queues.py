"""SGLang 0.5.23's REAL decode queues on a CPU: ``DecodePreallocQueue`` and
``DecodeTransferQueue`` over a real decode KV manager (NIXL or Mooncake) and host memory.

Shared by the demo's decode servers (``_dserver.py``) and stallguard-sglang's decode
tests (``adapters/sglang/tests/sglang_decode_support.py``).

Real: the decode ``KVManager`` of the chosen engine in DECODE mode with its heartbeat
thread, the ``KVReceiver``s, ``DecodePreallocQueue.pop_preallocated`` (pending resolution
through the bootstrap server's ``/query_dp_ranks``, handshake polling, failure removal,
admission, ``send_metadata``), ``DecodeTransferQueue.pop_transferred`` (metadata gate,
failure path, deferred release), ``resolve_deferred_releases``, SGLang's
``MetadataBuffers`` (CPU tensors), the poll all-reduce over a gloo group.

Stand-ins, each for what needs a GPU or a model server:

* ``HostPools`` stands in for the GPU memory pools (``ReqToTokenPool``,
  ``TokenToKVPoolAllocator``, the KV cache): the decode KV regions are host buffers
  registered with the engine, ``free_slots`` sets how many requests decode has room for;
  ``HostPreallocQueue`` overrides only the queue's memory-budget and allocation helpers
  (``_allocatable_token_budgets``, ``_pre_alloc``) to use it.
* The scheduler holds just the attributes the queue methods read; its output streamer,
  tree cache and ``release_kv_cache`` record what the queues do.
* Requests are ``SimpleNamespace`` objects with the fields the queues read.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

HOST = "127.0.0.1"  # = _kv.HOST (not imported here: this module must import without
# SGLang 0.5.23's runtime context, for the 0.5.17 tests that use make_request)


def metadata_buffers(rows: int) -> Any:
    """SGLang's own ``MetadataBuffers`` (CPU tensors), the same on both sides."""
    import torch
    from sglang.srt.disaggregation.utils import MetadataBuffers

    return MetadataBuffers(
        size=rows, hidden_size=8, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=0
    )


class DecodeNode:
    """The decode server's KV manager: a real ``KVManager`` of *engine* in DECODE mode
    over host buffers and SGLang's ``MetadataBuffers``, connected to the bootstrap
    server of every prefill in *peer_addrs* (``try_ensure_parallel_info``)."""

    def __init__(
        self,
        peer_addrs: str | list[str],
        engine: str = "nixl",
        layout: Any = None,  # _kv.Layout
    ) -> None:
        from . import _kv

        addrs = [peer_addrs] if isinstance(peer_addrs, str) else list(peer_addrs)
        self.engine = engine
        self.addr = addrs[0]
        self.port = int(self.addr.rsplit(":", 1)[1])
        self.layout = layout or _kv.Layout(num_pages=256, aux_rows=64)
        self.kv = _kv.HostPool(self.layout)
        self.metadata = metadata_buffers(self.layout.aux_rows)
        kv_args = self.kv.kv_args()
        kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = (
            self.metadata.get_buf_infos()
        )
        self.mgr = _kv.make_manager(engine, "decode", self.kv, kv_args=kv_args)
        for addr in addrs:
            deadline = time.monotonic() + 60
            while not self.mgr.try_ensure_parallel_info(addr):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"decode could not fetch prefill parallel info from {addr}")
                time.sleep(0.05)

    def close(self) -> None:
        """Retire the node. Mooncake's transfer engine is one per process (SGLang's
        ``init_mooncake_transfer_engine``) and keeps every buffer a manager registered: a
        later node whose buffers land at the same addresses is refused ("does not support
        overlapped memory region") and receives nothing. So a retired Mooncake node's
        buffers are deregistered, and the node is kept alive for the rest of the process
        (its memory is never handed to another node). ``MooncakeKVManager.teardown()`` is
        not used: it closes ZMQ sockets that the manager's receiving thread may still be
        reading, which aborts the process inside libzmq (``_term_acks > 0``). NIXL gives
        each manager an agent of its own, released with it."""
        if self.engine == "mooncake" and self not in _RETIRED:
            self.mgr.deregister_buffer_to_engine()
            _RETIRED.append(self)


#: retired decode nodes, kept so their registered memory is never reused (see close)
_RETIRED: list[DecodeNode] = []


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
    """The decode scheduler's two queues over a real decode ``KVManager``.

    ``add(rid, room)`` is SGLang's ``DecodePreallocQueue.add`` (receiver created; pending
    unless the prefill rank resolves from cache); ``step()`` runs what
    ``process_decode_queue`` runs, in its order: ``resolve_deferred_releases``,
    ``pop_preallocated`` (into the transfer queue), ``pop_transferred``."""

    def __init__(
        self,
        node: Any,  # DecodeNode, or any object with its attributes
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
        self.engine: str = getattr(node, "engine", "nixl")
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
        pq.transfer_backend = TransferBackend(self.engine)
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

    def add(self, rid: str, room: int, port: int | None = None) -> Any:
        """A request arrives from the router (SGLang's ``DecodePreallocQueue.add``), for
        the prefill whose bootstrap server listens on *port* (default: the node's)."""
        req = make_request(rid, room, self.port if port is None else port)
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
        from . import _kv

        receiver = _kv.kv_class(self.engine, "RECEIVER")(self.mgr, f"{HOST}:{self.port}", room)
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
