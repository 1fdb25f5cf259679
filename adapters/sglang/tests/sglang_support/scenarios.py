"""Reference scenarios over the real SGLang prefill queues, as module-level functions so
they can run in `run_ranks` children or under another interpreter via `run_in_python`.
They return plain data (dicts of str/int/float/bool/lists) for the caller to assert on.

Used by tests/sglang/test_real_sglang_smoke.py; adapter tests can reuse them.
"""

from __future__ import annotations

import time
from typing import Any

from ._core import (
    LEGACY,
    SGLANG_VERSION,
    FakeScheduler,
    KVPoll,
    fail_sender,
    make_manager,
    make_request,
    make_sender,
    set_status,
    setup_context,
)
from ._dist import RankInfo

__all__ = ["inflight_states", "fail_on_rank0_only", "bootstrap_wedge", "call_many"]


def _summary(sched: FakeScheduler) -> dict[str, Any]:
    return {
        "conclusions": {
            rid: (c.iteration, c.outcome, c.message) for rid, c in sched.conclusions.items()
        },
        "inflight": sched.inflight_rids(),
        "events": [(e.iteration, e.kind, e.rid) for e in sched.events],
    }


def inflight_states(
    backend: str = "nixl", reason: str = "stalled in Transferring", setup: bool = True
) -> dict[str, Any]:
    """Five real senders in the inflight queue of one rank:

    * "success": Success before iteration 1;
    * "transferring": Transferring in iteration 1, Success before iteration 2;
    * "waiting": WaitingForInput throughout;
    * "failed": failed with `fail_sender` (0.5.23: `kv_mgr.conclude_failure`);
    * "aborted": `sender.abort()` (what `Scheduler.abort_request` does for inflight requests).

    Runs two iterations of the real inflight queue.
    """
    if setup:
        setup_context(0, 1)
    sched = FakeScheduler()
    mgr = make_manager(backend)
    rooms = {"success": 31, "transferring": 32, "waiting": 33, "failed": 34, "aborted": 35}
    senders = {rid: make_sender(mgr, room) for rid, room in rooms.items()}
    initial = {rid: int(s.poll()) for rid, s in senders.items()}
    for s in senders.values():
        set_status(s, KVPoll.WaitingForInput)
    set_status(senders["transferring"], KVPoll.Transferring)
    set_status(senders["success"], KVPoll.Transferring)
    set_status(senders["success"], KVPoll.Success)
    fail_sender(senders["failed"], reason)
    senders["aborted"].abort()
    sched.prefill(*(make_request(rid, s) for rid, s in senders.items()))
    sched.step()
    after_1 = _summary(sched)
    set_status(senders["transferring"], KVPoll.Success)
    sched.step()
    return {
        "version": SGLANG_VERSION,
        "backend": backend,
        "sender_class": type(senders["success"]).__name__,
        "manager_class": type(mgr).__name__,
        "fail_primitive": (
            "conclude_failure"
            if hasattr(mgr, "conclude_failure")
            else "record_failure+update_status"
        ),
        "initial_polls": initial,
        "after_iteration_1": after_1,
        "after_iteration_2": _summary(sched),
        "rooms_left": sorted(mgr.request_status),
        "free_metadata_buffers": sched.req_to_metadata_buffer_idx_allocator.available_size(),
    }


def fail_on_rank0_only(
    info: RankInfo,
    backends: tuple[str, ...] = ("nixl", "mooncake"),
    reason: str = "failed on rank 0",
    max_iterations: int = 3,
) -> dict[str, Any]:
    """For each backend, every rank holds the same three inflight requests:

    * "fail":  Transferring on every rank; rank 0 fails it (`fail_sender`) before iteration 1;
    * "skew":  Success on rank 0 only, Transferring elsewhere (MIN-reduce keeps it on all ranks);
    * "ok":    Success on every rank.

    Runs `max_iterations` iterations of the real inflight queue over the gloo group and
    returns, per backend, what each request concluded as and when.
    """
    out: dict[str, Any] = {"rank": info.rank, "version": SGLANG_VERSION}
    for backend in backends:
        sched = FakeScheduler(info.group)
        mgr = make_manager(backend)
        senders = {
            rid: make_sender(mgr, room) for rid, room in (("fail", 11), ("skew", 12), ("ok", 13))
        }
        for s in senders.values():
            set_status(s, KVPoll.WaitingForInput)
            set_status(s, KVPoll.Transferring)
        set_status(senders["ok"], KVPoll.Success)
        if info.rank == 0:
            set_status(senders["skew"], KVPoll.Success)
            fail_sender(senders["fail"], reason)
        sched.prefill(*(make_request(rid, s) for rid, s in senders.items()))
        local_polls = {rid: int(s.poll()) for rid, s in senders.items()}
        for _ in range(max_iterations):
            sched.step()
        out[backend] = {
            "local_polls_before": local_polls,
            "conclusions": {
                rid: (c.iteration, c.outcome, c.message) for rid, c in sched.conclusions.items()
            },
            "inflight": sched.inflight_rids(),
            "released_kv": sched.released,
            "release_aborted": [e.rid for e in sched.events if e.kind == "release_aborted"],
        }
    return out


def bootstrap_wedge(
    bootstrap_timeout: float = 0.5, observe: float = 2.0, interval: float = 0.05, setup: bool = True
) -> dict[str, Any]:
    """Optimistic prefill (`optimistic_prefill_attempts=1`) with decode never answering:
    a NIXL and a Mooncake request both stay `Bootstrapping`. They go through the real
    `pop_bootstrapped` (let through with `pending_bootstrap=True`), are "prefilled" into
    the inflight queue, and the real inflight queue runs every `interval` s for
    `observe` s. On 0.5.17 the NIXL request is never released (no NIXL bootstrap
    deadline); on >= 0.5.18 both are released after `bootstrap_timeout`.
    """
    if setup:
        setup_context(0, 1, optimistic_prefill_attempts=1)
    sched = FakeScheduler(optimistic_prefill_attempts=1)
    reqs = {}
    for backend, room in (("nixl", 21), ("mooncake", 22)):
        sender = make_sender(make_manager(backend, bootstrap_timeout=bootstrap_timeout), room)
        reqs[backend] = make_request(backend, sender, prefilled=False)
    sched.admit(*reqs.values())
    t0 = time.monotonic()
    popped = sched.pop_bootstrapped()
    sched.prefill(*popped)
    after_pop = {
        r.rid: {
            "pending_bootstrap": r.pending_bootstrap,
            "prefill_attempt_count": r.prefill_attempt_count,
            "metadata_buffer_index": r.metadata_buffer_index,
        }
        for r in popped
    }
    trace = []
    released_at = {}
    while time.monotonic() - t0 < observe:
        sched.step()
        elapsed = time.monotonic() - t0
        inflight = sched.inflight_rids()
        for rid in reqs:
            if rid not in inflight and rid not in released_at:
                released_at[rid] = round(elapsed, 3)
        trace.append((sched.iteration, round(elapsed, 3), inflight))
        time.sleep(interval)
    nixl = reqs["nixl"]
    return {
        "version": SGLANG_VERSION,
        "legacy": LEGACY,
        "popped": [r.rid for r in popped],
        "after_pop": after_pop,
        "iterations": sched.iteration,
        "trace": trace,
        "released_at": released_at,
        "conclusions": {
            rid: (c.iteration, c.outcome, c.message) for rid, c in sched.conclusions.items()
        },
        "inflight_at_end": sched.inflight_rids(),
        "nixl_pending_bootstrap": nixl.pending_bootstrap,
        "nixl_local_poll": int(nixl.disagg_kv_sender.poll()),
        "nixl_init_time": nixl.disagg_kv_sender.init_time,
        "free_metadata_buffers": sched.req_to_metadata_buffer_idx_allocator.available_size(),
        "metadata_buffers": sched.req_to_metadata_buffer_idx_allocator.size,
    }


def call_many(calls: dict[str, tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Run several scenarios of this module in one process (one sglang import):
    `{name: (function_name, kwargs)}` -> `{name: result}`."""
    return {name: globals()[fn](**kwargs) for name, (fn, kwargs) in calls.items()}
