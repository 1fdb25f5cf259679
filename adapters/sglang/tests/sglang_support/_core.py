"""Real SGLang prefill objects driven without a GPU, model, transfer engine or scheduler.

Works for sglang 0.5.23 and 0.5.17 (branching on `sglang.__version__`); recipes in
shared/notes/sglang.md section 11 and shared/notes/sglang-0.5.17.md section 7.

What is real: `NixlKVManager`/`MooncakeKVManager` methods (status plumbing, failure
records, `conclude_failure`), `NixlKVSender`/`MooncakeKVSender` (poll, bootstrap
deadline, `failure_exception`, `abort`, `clear`), the prefill mixin's
`process_disagg_prefill_inflight_queue`, `handle_inflight_transfer_failure`,
`handle_pending_bootstrap`, `handle_bootstrap_failure`, `PrefillBootstrapQueue.pop_bootstrapped`,
the MIN all-reduce of polls over a real gloo group.

What is fake: managers are built with `object.__new__` (no NIXL agent, Mooncake engine,
ZMQ sockets, bootstrap server), so nothing is transferred and empty `transfer_infos`
means `conclude_failure` notifies no decode peer; the scheduler only has the
attributes the queue code reads; requests are `SimpleNamespace`s; `release_kv_cache`
(module-level name in `sglang.srt.disaggregation.prefill`) is replaced by a recorder,
and the scheduler's `send_kv_chunk` / `checkpoint_disagg_prefill` only record (they
would touch KV memory pools).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
import time
from collections import defaultdict
from types import SimpleNamespace
from typing import Any, Literal

import sglang
import torch.distributed as dist
from sglang.srt.disaggregation import prefill as _prefill_mod
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import KVTransferError
from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager, MooncakeKVSender
from sglang.srt.disaggregation.nixl.conn import NixlKVManager, NixlKVSender
from sglang.srt.disaggregation.prefill import (
    PrefillBootstrapQueue,
    SchedulerDisaggregationPrefillMixin,
)
from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator
from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH
from sglang.srt.runtime_context import get_context, get_parallel

from ._env import version_tuple

__all__ = [
    "SGLANG_VERSION",
    "LEGACY",
    "KVPoll",
    "KVTransferError",
    "Backend",
    "setup_context",
    "make_manager",
    "make_sender",
    "set_status",
    "fail_sender",
    "make_request",
    "FakeScheduler",
    "Event",
    "Conclusion",
    "install_release_kv_cache_patch",
    "uninstall_release_kv_cache_patch",
    "single_process_group",
    "UNOWNED_KV_RELEASES",
]

SGLANG_VERSION: str = sglang.__version__
#: True for sglang < 0.5.18: NIXL has no prefill bootstrap deadline, senders take
#: (dest_tp_ranks, pp_rank), no `conclude_failure`, `get_parallel().override(...)`.
LEGACY: bool = version_tuple(SGLANG_VERSION) < (0, 5, 18)

Backend = Literal["nixl", "mooncake"]
_MANAGERS = {"nixl": NixlKVManager, "mooncake": MooncakeKVManager}
_SENDERS = {NixlKVManager: NixlKVSender, MooncakeKVManager: MooncakeKVSender}
DEFAULT_BOOTSTRAP_ADDR = "127.0.0.1:8998"

# --------------------------------------------------------------------------- context

_context_state: dict[str, Any] = {"server_args": None, "parallel": None, "rank": None}


def setup_context(rank: int = 0, world: int = 1, **server_args: Any) -> None:
    """Publish a dummy ServerArgs (`tp_size=world`, plus `server_args` fields) and the
    parallel ranks (`tp_rank = attn_tp_rank = rank`) for this process.

    0.5.23: `get_context().override_server_args(...).install()` and
    `get_parallel().override_permanently(...)`; 0.5.17: the same server-args override and
    `get_parallel().override(...)`, a context manager kept open until the next call.
    Calling again replaces the previous setup (the previous override is restored first).
    Needed before creating senders (their ctor reads `get_parallel()`).
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world size {world}")
    teardown_context()
    ov = get_context().override_server_args(tp_size=world, **server_args)
    ov.install()
    _context_state["server_args"] = ov
    ranks = dict(tp_rank=rank, attn_tp_rank=rank)
    if LEGACY:
        cm = get_parallel().override(**ranks)
        cm.__enter__()
        _context_state["parallel"] = cm
    else:
        get_parallel().override_permanently(**ranks)
    _context_state["rank"] = rank


def teardown_context() -> None:
    """Undo `setup_context` (no-op if it was not called)."""
    cm = _context_state.pop("parallel", None)
    if cm is not None:
        cm.__exit__(None, None, None)
    elif _context_state.get("rank") is not None and not LEGACY:
        get_parallel().clear_stamp()
    ov = _context_state.pop("server_args", None)
    if ov is not None:
        ov.restore()
    _context_state.update(server_args=None, parallel=None, rank=None)


def _current_rank() -> int:
    return int(get_parallel().tp_rank)


def single_process_group() -> dist.ProcessGroup:
    """The default gloo group of world size 1 (an in-process HashStore, no sockets),
    initialised on first use. The queue code all-reduces polls, so even one rank needs
    a group. Returns the WORLD group, whatever its size, if one is already initialised."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD


# --------------------------------------------------------------------------- managers / senders


def make_manager(backend: Backend, bootstrap_timeout: float = 300.0, *, attn_dp_rank: int = 0):
    """A real `NixlKVManager` / `MooncakeKVManager` made with `object.__new__` and only
    the attributes the sender, the status plumbing and the queues read (both versions'
    lists; the extra ones are harmless). Only the transfer engine side is missing."""
    try:
        cls = _MANAGERS[backend]
    except KeyError:
        raise ValueError(f"backend must be one of {sorted(_MANAGERS)}, not {backend!r}") from None
    mgr = object.__new__(cls)
    attrs = dict(
        request_status={},
        failure_records={},
        failure_lock=threading.Lock(),
        is_dummy_cp_rank=False,
        bootstrap_timeout=bootstrap_timeout,
        transfer_infos={},
        req_to_decode_prefix_len={},
        attn_dp_rank=attn_dp_rank,
        kv_item_lens_sum=0,
        state_item_lens_sum=0,
        _kv_replica_factor=1,
        # 0.5.23
        _staging_outstanding=defaultdict(int),
        _deferred_ack_targets={},
        _deferred_ack_poisoned_rooms=set(),
        deferred_bootstrap=None,
        enable_deferred_decode_kv_release=False,
        # 0.5.17
        enable_all_cp_ranks_for_transfer=False,
        exceptions={},
        enable_staging=False,
        _staging_ctx=None,
        enable_trace=False,
    )
    for k, v in attrs.items():
        setattr(mgr, k, v)
    return mgr


def make_sender(mgr, room: int, *, bootstrap_addr: str = DEFAULT_BOOTSTRAP_ADDR):
    """A real `NixlKVSender` / `MooncakeKVSender` for `room` on `mgr` (state
    Bootstrapping). Needs `setup_context()` first. Ctor: 0.5.23 `(mgr, addr, room)`;
    0.5.17 `(mgr, addr, room, dest_tp_ranks=[tp_rank], pp_rank=0)`."""
    cls = _SENDERS[type(mgr)]
    if LEGACY:
        return cls(mgr, bootstrap_addr, room, [_current_rank()], 0)
    return cls(mgr, bootstrap_addr, room)


def set_status(sender, status: int) -> None:
    """Move the sender's room forward as the transfer engine would
    (`kv_mgr.update_status`; only ever moves forward, Failed is terminal)."""
    sender.kv_mgr.update_status(sender.bootstrap_room, status)


def fail_sender(sender, reason: str) -> None:
    """Fail the sender's room the way a watchdog would: 0.5.23 `kv_mgr.conclude_failure`
    (also notifies decode peers, none here); 0.5.17 `record_failure` + `update_status(Failed)`."""
    mgr, room = sender.kv_mgr, sender.bootstrap_room
    if hasattr(mgr, "conclude_failure"):
        mgr.conclude_failure(bootstrap_room=room, failure_reason=reason)
    else:
        mgr.record_failure(room, reason)
        mgr.update_status(room, KVPoll.Failed)


# --------------------------------------------------------------------------- release_kv_cache

#: `release_kv_cache` calls whose tree cache is not a FakeScheduler's (should stay empty).
UNOWNED_KV_RELEASES: list[tuple[Any, tuple, dict]] = []
_patch_state: dict[str, Any] = {"original": None}


def _recording_release_kv_cache(req, tree_cache, *args, **kwargs):
    record = getattr(tree_cache, "record_kv_release", None)
    if record is None:
        UNOWNED_KV_RELEASES.append((req, args, kwargs))
    else:
        record(req, args, kwargs)
    _mark_kv_released(req)


def install_release_kv_cache_patch() -> None:
    """Replace `sglang.srt.disaggregation.prefill.release_kv_cache` (the module-level
    name the queue code calls; defined in mem_cache/common.py) with a recorder that hands
    the call to the fake tree cache. Idempotent; FakeScheduler() installs it."""
    if _patch_state["original"] is None:
        _patch_state["original"] = _prefill_mod.release_kv_cache
        _prefill_mod.release_kv_cache = _recording_release_kv_cache


def uninstall_release_kv_cache_patch() -> None:
    if _patch_state["original"] is not None:
        _prefill_mod.release_kv_cache = _patch_state["original"]
        _patch_state["original"] = None


# --------------------------------------------------------------------------- requests


class _TimeStats:
    """`req.time_stats`: records the calls the prefill queues make."""

    def __init__(self, rid: str):
        self.rid = rid
        self.calls: list[str] = []
        self.trace_ctx = SimpleNamespace(abort=self._abort, aborts=[])

    def _abort(self, abort_info=None, **kw):
        self.trace_ctx.aborts.append(abort_info)

    def compute_and_observe_kv_transfer_metrics(self, metric):
        self.calls.append("compute_and_observe_kv_transfer_metrics")
        return None

    def __getattr__(self, name: str):
        if name.startswith("set_") or name.startswith("reset_"):
            return lambda *a, **k: self.calls.append(name)
        raise AttributeError(name)


def _kv_state(prefilled: bool):
    if LEGACY:
        return None  # 0.5.17: `req.kv` is None until prefilled (plus req_pool_idx)
    return SimpleNamespace(
        holds_kv=prefilled, holds_mamba=False, is_kv_released=not prefilled, cache_protected_len=0
    )


def _mark_prefilled(req) -> None:
    if LEGACY:
        req.req_pool_idx = 0
        req.kv = SimpleNamespace(stub="prefilled KV")
    else:
        req.kv.holds_kv = True
        req.kv.is_kv_released = False


def _mark_kv_released(req) -> None:
    if LEGACY:
        req.req_pool_idx = None
        req.kv = None
    elif getattr(req, "kv", None) is not None:
        req.kv.holds_kv = False
        req.kv.is_kv_released = True


def make_request(
    rid: str,
    sender,
    *,
    pending_bootstrap: bool = False,
    prefilled: bool = True,
    bootstrap_host: str = "127.0.0.1",
    num_tokens: int = 8,
    **extra: Any,
):
    """The `SimpleNamespace` request the prefill queues read (fields of both versions).

    `pending_bootstrap=True` models an optimistic-prefill request parked before its
    bootstrap finished. `prefilled=False` models a request still in the bootstrap queue
    (holds no KV; `FakeScheduler.prefill()` flips it). `extra` overrides any field.
    """
    req = SimpleNamespace(
        rid=rid,
        bootstrap_room=sender.bootstrap_room,
        bootstrap_host=bootstrap_host,  # anything but FAKE_BOOTSTRAP_HOST "2.2.2.2"
        disagg_kv_sender=sender,
        disagg_prefill_dp_rank=None,
        pending_bootstrap=pending_bootstrap,
        prefill_attempt_count=0,
        is_retracted=False,
        finished_reason=None,
        to_finish=None,
        return_logprob=False,
        return_routed_experts=False,
        metadata_buffer_index=-1,
        cache_request_handle=SimpleNamespace(rid=rid),  # lets tree_finish events name the rid
        origin_input_ids=list(range(num_tokens)),
        swa_branching_seqlen=None,
        start_send_idx=0,
        req_pool_idx=None,
        mamba_pool_idx=None,
        kv=_kv_state(False),
        time_stats=_TimeStats(rid),
    )
    if prefilled:
        _mark_prefilled(req)
    for k, v in extra.items():
        setattr(req, k, v)
    return req


# --------------------------------------------------------------------------- scheduler


@dataclasses.dataclass(frozen=True)
class Event:
    """Something the real queue code did to a request, in scheduler iteration `iteration`.

    kind: "stream" (detail: finished_reason), "release_kv" (detail: kwargs, e.g.
    checkpoint), "tree_finish" (detail: outcome name), "release_aborted",
    "handle_inflight_transfer_failure", "handle_bootstrap_failure",
    "send_kv_chunk" (detail: last_chunk), "checkpoint", "metric" (detail: counter name).
    """

    iteration: int
    kind: str
    rid: str | None
    detail: Any = None


@dataclasses.dataclass(frozen=True)
class Conclusion:
    """How a request left the queues, from the stream output the scheduler emitted.

    outcome: "success" (FINISH_LENGTH), "transfer_failed" (handle_inflight_transfer_failure,
    which also covers `abort()`ed senders: message contains "Aborted by AbortReq."),
    "bootstrap_failed" (handle_bootstrap_failure), or "aborted" (any other FINISH_ABORT).
    """

    rid: str
    iteration: int
    outcome: str
    message: str | None


class _TreeCache:
    def __init__(self, sched: FakeScheduler):
        self._sched = sched
        self.cache_controller = None

    def finish(self, handle, outcome):
        self._sched._event(
            "tree_finish", getattr(handle, "rid", None), getattr(outcome, "name", str(outcome))
        )

    def release_aborted_request(self, rid):
        self._sched._event("release_aborted", rid, "tree_cache")

    def record_kv_release(self, req, args, kwargs):
        self._sched._event("release_kv", req.rid, dict(kwargs) or args or None)


class _OutputStreamer:
    def __init__(self, sched: FakeScheduler):
        self._sched = sched

    def stream_output(self, reqs, return_logprob=False, *rest, **kw):
        for req in reqs:
            self._sched._on_streamed(req)


class _MetricsCollector:
    def __init__(self, sched: FakeScheduler):
        self._sched = sched

    def __getattr__(self, name: str):
        if name.startswith("increment_"):
            return lambda *a, **k: self._sched._event("metric", None, name)
        raise AttributeError(name)


class _ReqToTokenPool:
    def __init__(self, free_slots: int):
        self.free_slots = free_slots

    def available_size(self) -> int:
        return self.free_slots


class FakeScheduler(SchedulerDisaggregationPrefillMixin):
    """A subclass of the REAL `SchedulerDisaggregationPrefillMixin` holding just what its
    queue methods read. Records what they do (`events`, `conclusions`, `released`) per
    scheduler iteration (`iteration`, advanced by `step()` / `pop_bootstrapped()`).

    group: the gloo group polls are MIN-reduced over (attn-TP and attn-CP); default
    `single_process_group()`. metadata_buffers: size of the real
    `ReqToMetadataIdxAllocator`. optimistic_prefill_attempts: 0.5.17 reads it from
    `server_args` here; 0.5.23 from the published context (`setup_context(
    optimistic_prefill_attempts=...)`), so pass it to both when testing optimistic prefill.
    """

    scheduler_stage_metrics = None  # 0.5.23: @scheduler_stage_method reads it

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        metadata_buffers: int = 16,
        optimistic_prefill_attempts: int = 0,
        free_req_slots: int = 16,
    ):
        install_release_kv_cache_patch()
        if group is None:
            group = single_process_group()
        self.group = group
        self.iteration = 0
        self.events: list[Event] = []
        self.conclusions: dict[str, Conclusion] = {}
        self.done_per_iteration: dict[int, list[str]] = {}

        self.disagg_prefill_inflight_queue: list = []
        self.waiting_queue: list = []
        self.attn_cp_cpu_group = group
        self.attn_tp_cpu_group = group
        self.tree_cache = _TreeCache(self)
        self.output_streamer = _OutputStreamer(self)
        self.metrics_reporter = SimpleNamespace(
            enable_metrics=False, kv_transfer_latency_ms=None, kv_transfer_speed_gb_s=None
        )
        self.metrics_collector = _MetricsCollector(self)
        self.req_to_metadata_buffer_idx_allocator = ReqToMetadataIdxAllocator(metadata_buffers)
        self.req_to_token_pool = _ReqToTokenPool(free_req_slots)
        self.token_to_kv_pool_allocator = SimpleNamespace(page_size=1)
        self.disagg_prefill_pending_chunk_rids: set = set()
        self.processed_tokens_counter = 0
        self.enable_hicache_storage = False
        # 0.5.17 reads these from the scheduler instead of the runtime context
        self.server_args = SimpleNamespace(optimistic_prefill_attempts=optimistic_prefill_attempts)
        self.ps = SimpleNamespace(tp_rank=_current_rank(), pp_rank=0)
        self.disagg_prefill_bootstrap_queue = self._make_bootstrap_queue()

    # -- the real bootstrap queue, minus its KV manager
    def _make_bootstrap_queue(self) -> PrefillBootstrapQueue:
        q = object.__new__(PrefillBootstrapQueue)
        q.queue = []
        q.pp_size = 1
        q.pp_rank = 0
        q.scheduler = self
        q.scheduler_stage_metrics = None
        q.req_to_metadata_buffer_idx_allocator = self.req_to_metadata_buffer_idx_allocator
        return q

    # -- recording
    def _event(self, kind: str, rid: str | None, detail: Any = None) -> None:
        self.events.append(Event(self.iteration, kind, rid, detail))

    def _on_streamed(self, req) -> None:
        reason = req.finished_reason
        self._event("stream", req.rid, reason)
        if isinstance(reason, FINISH_ABORT):
            msg = reason.message
            if msg.startswith("Prefill transfer failed"):
                outcome = "transfer_failed"
            elif msg.startswith("Prefill bootstrap failed"):
                outcome = "bootstrap_failed"
            else:
                outcome = "aborted"
        elif isinstance(reason, FINISH_LENGTH):
            outcome, msg = "success", None
        else:
            outcome, msg = f"unexpected:{type(reason).__name__}", None
        if req.rid in self.conclusions:
            raise AssertionError(
                f"request {req.rid} concluded twice: {self.conclusions[req.rid]} "
                f"and now {outcome} in iteration {self.iteration}"
            )
        self.conclusions[req.rid] = Conclusion(req.rid, self.iteration, outcome, msg)

    def events_for(self, rid: str, kind: str | None = None) -> list[Event]:
        return [e for e in self.events if e.rid == rid and (kind is None or e.kind == kind)]

    @property
    def released(self) -> list[str]:
        """rids whose KV was released (patched `release_kv_cache`), in order."""
        return [e.rid for e in self.events if e.kind == "release_kv"]

    # -- the real failure handlers, observed (they still run; hooks on the mixin apply)
    def handle_inflight_transfer_failure(self, req):
        self._event("handle_inflight_transfer_failure", req.rid)
        return super().handle_inflight_transfer_failure(req)

    def handle_bootstrap_failure(self, req):
        self._event("handle_bootstrap_failure", req.rid)
        return super().handle_bootstrap_failure(req)

    # -- methods of the real Scheduler that the mixin calls
    def _release_aborted_request(self, req) -> None:  # managers/scheduler.py (0.5.23)
        self._event("release_aborted", req.rid, "scheduler")

    def send_kv_chunk(self, req, last_chunk: bool = False, *args, **kwargs) -> None:
        self._event("send_kv_chunk", req.rid, last_chunk)

    def checkpoint_disagg_prefill(self, req) -> None:
        self._event("checkpoint", req.rid)

    # -- driving
    def inflight_rids(self) -> list[str]:
        return [r.rid for r in self.disagg_prefill_inflight_queue]

    def step(self, rids_to_check: list[str] | None = None) -> list:
        """One scheduler iteration of the REAL `process_disagg_prefill_inflight_queue`."""
        self.iteration += 1
        done = self.process_disagg_prefill_inflight_queue(rids_to_check)
        self.done_per_iteration[self.iteration] = [r.rid for r in done]
        return done

    def admit(self, *reqs) -> None:
        """Put requests (prefilled=False) into the real bootstrap queue, as `add()` would."""
        for req in reqs:
            req.pending_bootstrap = True
            self.disagg_prefill_bootstrap_queue.queue.append(req)

    def pop_bootstrapped(self) -> list:
        """One iteration of the REAL `PrefillBootstrapQueue.pop_bootstrapped`."""
        self.iteration += 1
        q = self.disagg_prefill_bootstrap_queue
        return q.pop_bootstrapped()

    def prefill(self, *reqs) -> None:
        """The forward pass finished: the requests hold KV and enter the inflight queue
        (what `process_batch_result_disagg_prefill` does)."""
        for req in reqs:
            _mark_prefilled(req)
            self.disagg_prefill_inflight_queue.append(req)


def wait_until(predicate, timeout: float, interval: float = 0.01) -> bool:
    """Poll `predicate` until true or `timeout` seconds pass; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return bool(predicate())
        time.sleep(interval)


_room_counter = itertools.count(1000)


def next_room() -> int:
    """A fresh bootstrap room number (unique within this process)."""
    return next(_room_counter)


@contextlib.contextmanager
def scoped_context(rank: int = 0, world: int = 1, **server_args: Any):
    """`setup_context` as a context manager."""
    setup_context(rank, world, **server_args)
    try:
        yield
    finally:
        teardown_context()
