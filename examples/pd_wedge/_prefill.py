"""The prefill side: SGLang's real prefill scheduler code around real KV senders.

A model server's prefill scheduler (``Scheduler`` + ``SchedulerDisaggregationPrefillMixin``)
runs, per loop iteration: receive requests -> bootstrap queue (``pop_bootstrapped``) ->
``resolve_waiting_queue_bootstrap`` -> forward pass -> ``process_batch_result`` (send the last
KV chunk, append to ``disagg_prefill_inflight_queue``) -> ``process_disagg_prefill_inflight_queue``.

``MiniPrefillScheduler`` runs that same sequence with SGLang's own methods (inherited from the
real mixin and the real ``PrefillBootstrapQueue``), on a real KV manager of the chosen engine
and real ``KVSender``s. What it does not have is a model: the "forward pass" writes a byte
pattern into the request's pages, and the few scheduler attributes that belong to the model's
memory pools are small stand-ins, each marked below with what it stands in for.

stallguard is not mentioned anywhere in this file: whether it runs is decided only by the
process environment (``STALLGUARD_SGLANG_CONFIG``) and SGLang's ``load_plugins()``, exactly as
in ``run_scheduler_process``.
"""

from __future__ import annotations

import faulthandler
import os
import time
from collections import deque
from multiprocessing.connection import Connection
from types import SimpleNamespace

import numpy as np
import torch.distributed as dist
from sglang.srt.disaggregation import prefill as sglang_prefill
from sglang.srt.disaggregation.base import KVPoll
from sglang.srt.disaggregation.prefill import (
    PrefillBootstrapQueue,
    SchedulerDisaggregationPrefillMixin,
)
from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator, TransferBackend
from sglang.srt.managers.schedule_batch import FINISH_ABORT
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.plugins import load_plugins

from stallguard.testing import stop_and_wait

from . import _kv, _rpc

STATE_NAMES = {
    KVPoll.Failed: "Failed",
    KVPoll.Bootstrapping: "Bootstrapping",
    KVPoll.WaitingForInput: "WaitingForInput",
    KVPoll.Transferring: "Transferring",
    KVPoll.Success: "Success",
}
TARGET = "process_disagg_prefill_inflight_queue"


# --------------------------------------------------------------------------- stand-ins


class _TimeStats:
    """Stands in for ``ReqTimeStats`` (Prometheus/trace bookkeeping of a served request)."""

    trace_ctx = SimpleNamespace(abort=lambda abort_info=None: None)

    def __getattr__(self, name):  # set_completion_time, set_bootstrap_done_time, ...
        if name.startswith("set_"):
            return lambda *a, **k: None
        raise AttributeError(name)

    def compute_and_observe_kv_transfer_metrics(self, metric):
        return None


class Req:
    """Stands in for ``sglang.srt.managers.schedule_batch.Req``, which needs a tokenizer,
    sampling params and a model config to construct. Carries the fields the prefill
    disaggregation code reads; ``origin_input_ids`` sets how many KV pages are sent."""

    def __init__(self, rid: str, room: int, tokens: int, pages: np.ndarray, slot: int, dest: str):
        self.rid = rid
        self.bootstrap_room = room
        self.bootstrap_host = _kv.HOST
        self.disagg_prefill_dp_rank = None
        self.origin_input_ids = list(range(tokens))
        self.sampling_params = SimpleNamespace(max_new_tokens=None)
        self.disagg_kv_sender = None
        self.pending_bootstrap = False
        self.metadata_buffer_index = -1
        self.prefill_attempt_count = 0
        self.is_retracted = False
        self.swa_branching_seqlen = None
        self.finished_reason = None
        self.to_finish = None
        self.return_logprob = False
        self.return_routed_experts = False
        self.cache_request_handle = None
        self.session = None
        self.kv = SimpleNamespace(holds_kv=True, holds_mamba=False, cache_protected_len=0)
        self.time_stats = _TimeStats()
        self.start_send_idx = 0
        self.disagg_decode_prefix_len = 0
        # harness bookkeeping (not read by SGLang)
        self.kv_pages = pages
        self.kv_slot = slot
        self.dest = dest  # which decode the router sent it to

    def release_mm_inputs_on_abort(self) -> None:  # no multimodal inputs here
        pass


class _TreeCache:
    """Stands in for the radix cache: nothing is cached across requests in this demo."""

    def finish(self, handle, outcome) -> None:
        pass


class _SlotPool:
    """Stands in for the model's KV pool allocator: fixed runs of pages per request."""

    def __init__(self, num_pages: int, slot_pages: int):
        self.slot_pages = slot_pages
        self.free = deque(range(num_pages // slot_pages))

    def available_size(self) -> int:
        return len(self.free)

    def alloc(self, tokens: int) -> tuple[int, np.ndarray]:
        slot = self.free.popleft()
        start = slot * self.slot_pages
        return slot, np.arange(start, start + tokens, dtype=np.int32)

    def release(self, slot: int) -> None:
        self.free.append(slot)


class MiniPrefillScheduler(SchedulerDisaggregationPrefillMixin):
    """The real prefill mixin on a scheduler object without a model (see module doc)."""

    scheduler_stage_metrics = None  # no stage metrics recorder
    # The real Scheduler method (cache/session cleanup of an aborted request).
    _release_aborted_request = Scheduler._release_aborted_request

    def __init__(self, engine: str, kv_manager, pool: _kv.HostPool, spec: dict, group):
        layout = pool.layout
        self.pool = pool
        self.kv_manager = kv_manager
        self.disagg_prefill_inflight_queue: list[Req] = []
        self.waiting_queue: list[Req] = []
        self.disagg_prefill_pending_chunk_rids: set[str] = set()
        self.attn_cp_cpu_group = group  # a real gloo group (world size 1)
        self.attn_tp_cpu_group = group
        self.enable_overlap = False
        self.kv_checksum_computer = None
        self.processed_tokens_counter = 0
        self.tree_cache = _TreeCache()
        self.metrics_reporter = SimpleNamespace(
            enable_metrics=False, kv_transfer_latency_ms=None, kv_transfer_speed_gb_s=None
        )
        self.req_to_metadata_buffer_idx_allocator = ReqToMetadataIdxAllocator(layout.aux_rows)
        self.slots = _SlotPool(layout.num_pages, spec["slot_pages"])
        # Stands in for req_to_token_pool (only its free-slot count is read here).
        self.req_to_token_pool = self.slots
        self.token_to_kv_pool_allocator = SimpleNamespace(page_size=1)
        self.streamed: list[tuple[float, Req]] = []
        self.output_streamer = SimpleNamespace(stream_output=self._stream_output)
        # Fault injection (harness): (decode name, pid) to SIGSTOP right before this
        # process hands the next room for that decode to its transfer engine.
        self.freeze_after_send: tuple[str, int] | None = None

        # SGLang's real bootstrap queue; its __init__ wants a model runner, so the
        # fields it would derive from one are set directly.
        bq = object.__new__(PrefillBootstrapQueue)
        bq.queue = []
        bq.scheduler = self
        bq.scheduler_stage_metrics = None
        bq.req_to_metadata_buffer_idx_allocator = self.req_to_metadata_buffer_idx_allocator
        bq.kv_manager = kv_manager
        bq.transfer_backend = TransferBackend(engine)
        bq.bootstrap_port = spec["bootstrap_port"]
        bq.pp_size = 1
        bq.max_input_len = spec["slot_pages"]
        self.disagg_prefill_bootstrap_queue = bq

    # -- stand-ins for the model-facing parts of the scheduler

    def _stream_output(self, reqs, return_logprob=False, *args, **kwargs) -> None:
        """Stands in for the output streamer (the HTTP response to the client)."""
        now = time.monotonic()
        for req in reqs:
            self.streamed.append((now, req))

    def send_kv_chunk(self, req: Req, last_chunk: bool = False, end_idx=None) -> None:
        """Stands in for ``_send_kv_chunk``'s page lookup in the model's ``req_to_token_pool``:
        the pages are the request's own run; the send itself is the real sender's."""
        assert last_chunk, "the demo's requests are a single chunk"
        self.pool.aux[req.metadata_buffer_index] = _kv.HostPool.pattern(req.bootstrap_room, 255)
        if self.freeze_after_send is not None and self.freeze_after_send[0] == req.dest:
            # Decode frozen mid-transfer: it has published its destination (the room is
            # bootstrapped), every thread of it is stopped, and then this side queues the
            # write, which can no longer complete. (Stopping it right *after* queueing the
            # write raced with the transfer thread: at CI on 2026-12-02 a small write
            # finished before the SIGSTOP took effect in 2 runs of 4, and no room stayed
            # in Transferring / WaitingForInput.)
            stop_and_wait(self.freeze_after_send[1])
            self.freeze_after_send = None
        req.disagg_kv_sender.send(req.kv_pages)

    def forward(self) -> None:
        """One scheduler iteration up to the inflight queue, with SGLang's own queue logic."""
        bq = self.disagg_prefill_bootstrap_queue
        self.waiting_queue.extend(bq.pop_bootstrapped())
        self.resolve_waiting_queue_bootstrap()
        batch, self.waiting_queue = self.waiting_queue, []
        for req in batch:  # the forward pass: KV for every page of the prompt
            for region, buf in enumerate(self.pool.kv):
                buf[req.kv_pages] = _kv.HostPool.pattern(req.bootstrap_room, region)
        for req in batch:  # as process_batch_result_disagg_prefill does for a last chunk
            self.checkpoint_disagg_prefill(req)
            self.disagg_prefill_inflight_queue.append(req)
            if not req.pending_bootstrap:
                self.send_kv_chunk(req, last_chunk=True)


def _release_kv_cache(req, tree_cache, checkpoint=False) -> None:
    """Stands in for ``mem_cache.common.release_kv_cache`` (frees the model KV pool pages)."""
    if req.kv.holds_kv:
        req.kv.holds_kv = False
        _SCHED.slots.release(req.kv_slot)


def _checkpoint_kv_cache(req, cache) -> None:
    """Stands in for ``mem_cache.common.checkpoint_kv_cache`` (radix-cache insertion)."""


_SCHED: MiniPrefillScheduler | None = None


# --------------------------------------------------------------------------- the process


def run(conn: Connection, spec: dict) -> None:
    global _SCHED
    engine, port = spec["engine"], spec["bootstrap_port"]

    # What run_scheduler_process does first: load SGLang plugins (stallguard-sglang is an
    # installed entry point; it activates itself only if STALLGUARD_SGLANG_CONFIG is set).
    before = SchedulerDisaggregationPrefillMixin.__dict__[TARGET]
    load_plugins()
    hooked = SchedulerDisaggregationPrefillMixin.__dict__[TARGET] is not before

    # Stand-ins for the model memory pool bookkeeping (see the functions' docstrings).
    sglang_prefill.release_kv_cache = _release_kv_cache
    sglang_prefill.checkpoint_kv_cache = _checkpoint_kv_cache

    _kv.install_context("prefill", engine, port)
    from sglang.srt.runtime_context import get_context

    get_context().override_server_args(
        disaggregation_mode="prefill",
        disaggregation_transfer_backend=engine,
        disaggregation_bootstrap_port=port,
        host=_kv.HOST,
        optimistic_prefill_attempts=1,
    ).install()
    # A file rendezvous: no port to race for with the other processes of the machine.
    dist.init_process_group("gloo", init_method=f"file://{spec['gloo_file']}", rank=0, world_size=1)
    group = dist.new_group([0], backend="gloo")

    layout = _kv.Layout(**spec["layout"])
    server = _kv.start_bootstrap_server(engine, port)
    pool = _kv.HostPool(layout)
    mgr = _kv.make_manager(engine, "prefill", pool)
    probe = _kv.StatusProbe(mgr)
    sched = _SCHED = MiniPrefillScheduler(engine, mgr, pool, spec, group)
    bq = sched.disagg_prefill_bootstrap_queue

    tick = float(spec["loop_interval"])
    reqs: dict[str, Req] = {}
    submitted: dict[str, tuple] = {}  # rid -> (t_submit, room, tokens)
    enrolled: dict[str, float] = {}  # rid -> first inflight-queue call it took part in
    # one per loop pass: (pass start, pass end, inflight queue length, bootstrap queue length)
    samples: list[tuple[float, float, int, int]] = []
    aborts_due: list[tuple[int, str]] = []  # (tick number, rid)
    tick_no = 0
    running = True

    def submit(rid: str, room: int, tokens: int, dest: str) -> None:
        slot, pages = sched.slots.alloc(tokens)
        req = Req(rid, room, tokens, pages, slot, dest)
        reqs[rid] = req
        submitted[rid] = (time.monotonic(), room, tokens)
        bq.add(req, num_kv_heads=1)  # real: creates the real KVSender

    def abort(rid: str, after_ticks: int = 0) -> None:
        aborts_due.append((tick_no + after_ticks, rid))

    def do_abort(rid: str) -> None:
        """What ``Scheduler.abort_request`` does for the prefill queues."""
        req = reqs.get(rid)
        if req is None or req.disagg_kv_sender is None:
            return
        if req in bq.queue:
            sched._release_aborted_request(req)
            req.disagg_kv_sender.abort()
        elif req in sched.disagg_prefill_inflight_queue:
            req.disagg_kv_sender.abort()

    def snapshot() -> dict:
        """Every request still in the bootstrap or inflight queue: ``(rid, queue, state,
        since)``, ``since`` being when it entered that state or the queue, whichever is
        later; and when the last inflight-queue pass started."""
        out = []
        queues = (("bootstrap", bq.queue), ("inflight", sched.disagg_prefill_inflight_queue))
        for where, queue in queues:
            for req in queue:
                room = req.bootstrap_room
                status = mgr.request_status.get(room)
                t_submit = submitted.get(req.rid, (0.0,))[0]
                with probe.lock:
                    changes = probe.log.get(room, ())
                    last = changes[-1][0] if changes else t_submit
                since = max(last, enrolled.get(req.rid, t_submit))
                out.append((req.rid, where, STATE_NAMES.get(status, str(status)), since))
        return {"rows": out, "last_pass": samples[-1][0] if samples else 0.0}

    def collect() -> dict:
        """Everything measured since the last collect (then forgotten)."""
        released = {}
        for t, req in sched.streamed:
            if req.rid in released:
                continue
            fr = req.finished_reason
            reason = fr.message if isinstance(fr, FINISH_ABORT) else ""
            released[req.rid] = (t, not isinstance(fr, FINISH_ABORT), reason)
        with probe.lock:
            rooms = {submitted[rid][1] for rid in submitted}
            transitions = {r: list(probe.log.get(r, ())) for r in rooms}
            for r in rooms:
                probe.log.pop(r, None)
        out = {
            "submitted": dict(submitted),
            "released": released,
            "transitions": transitions,
            "samples": list(samples),
            "enrolled": dict(enrolled),
            "left": snapshot()["rows"],
        }
        for rid in released:
            reqs.pop(rid, None)
        submitted.clear()
        enrolled.clear()
        samples.clear()
        sched.streamed.clear()
        return out

    def freeze_after_send(dest: str, pid: int) -> None:
        sched.freeze_after_send = (dest, pid)

    def abort_left() -> int:
        n = 0
        for rid, *_ in snapshot()["rows"]:
            do_abort(rid)
            n += 1
        return n

    def shutdown() -> None:
        nonlocal running
        running = False

    handlers = {
        "submit": submit,
        "abort": abort,
        "abort_left": abort_left,
        "freeze_after_send": freeze_after_send,
        "snapshot": snapshot,
        "collect": collect,
        "ping": lambda: os.getpid(),
        # what SGLang's /metrics would serve from this process (metrics off: the default
        # registry, where whatever a plugin exports lands)
        "metrics": lambda: __import__("prometheus_client").generate_latest().decode(),
        "shutdown": shutdown,
    }
    conn.send(("ready", {"pid": os.getpid(), "hooked": hooked, "server": repr(type(server))}))

    # Diagnostics: a loop pass that takes far longer than the loop interval has every
    # thread's stack written to this process's log (the scheduler loop must not block).
    slow_pass = max(0.5, 10 * tick)
    next_t = time.monotonic()
    while running:
        faulthandler.dump_traceback_later(slow_pass, exit=False)
        if not _rpc.drain(conn, handlers):
            break
        before = len(sched.disagg_prefill_inflight_queue)
        sched.forward()
        if aborts_due:
            due = [rid for n, rid in aborts_due if n <= tick_no]
            aborts_due[:] = [(n, rid) for n, rid in aborts_due if n > tick_no]
            for rid in due:
                do_abort(rid)
        pass_start = time.monotonic()
        for req in sched.disagg_prefill_inflight_queue[before:]:
            enrolled.setdefault(req.rid, pass_start)
        sched.process_disagg_prefill_inflight_queue()
        samples.append(
            (
                pass_start,
                time.monotonic(),
                len(sched.disagg_prefill_inflight_queue),
                len(bq.queue),
            )
        )
        faulthandler.cancel_dump_traceback_later()
        tick_no += 1
        next_t += tick
        delay = next_t - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        else:
            next_t = time.monotonic()
