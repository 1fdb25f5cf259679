"""The SGLang hook functions, and which ones a configuration needs (:func:`hook_plan`).

* :func:`inflight_around` / :func:`bootstrap_around`: around the prefill inflight queue's
  ``process_disagg_prefill_inflight_queue`` and the bootstrap queue's
  ``pop_bootstrapped``; both run :func:`around_queue` (the guard's before / SGLang's
  method / the guard's after), from the description of their queue in a :class:`Site`.
* :func:`update_status_around`: captures every ``CommonKVManager.update_status`` of an
  enrolled room, with the clock reading, for the next queue call to apply.
* :func:`fake_after`: the same for ``FakeKVSender.send`` / ``.abort``.

A hook never breaks SGLang's loop: an exception in the adapter's part is logged and
counted (``Runtime.errors``), and SGLang's method runs regardless.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from . import _metrics
from ._config import Config
from ._guard import FAKE, ROOMS, QueueGuard, QueueKind, read_state
from ._profiles import PROFILES
from ._runtime import report_error, runtime
from .package import nixl_has_bootstrap_timeout

__all__ = [
    "BOOTSTRAP_TARGET",
    "FAKE_ABORT_TARGET",
    "FAKE_SEND_TARGET",
    "INFLIGHT_TARGET",
    "UPDATE_STATUS_TARGET",
    "Site",
    "around_queue",
    "bootstrap_around",
    "fake_after",
    "hook_plan",
    "inflight_around",
    "update_status_around",
]

INFLIGHT_TARGET = (
    "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin."
    "process_disagg_prefill_inflight_queue"
)
BOOTSTRAP_TARGET = "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue.pop_bootstrapped"
UPDATE_STATUS_TARGET = "sglang.srt.disaggregation.common.conn.CommonKVManager.update_status"
FAKE_SEND_TARGET = "sglang.srt.disaggregation.fake.conn.FakeKVSender.send"
FAKE_ABORT_TARGET = "sglang.srt.disaggregation.fake.conn.FakeKVSender.abort"


@dataclass(frozen=True)
class Site:
    """One guarded queue method: where its guard and its queue list live on the object
    the method is called on, which scheduler owns it, and which requests a call's
    result says left the queue."""

    kind: QueueKind
    method: str  # for error messages
    guard_attr: str  # the QueueGuard, on the object the method is called on
    queue_attr: str  # the queue list, on the same object
    scheduler: Callable[[Any], Any]  # that object -> its scheduler
    left: Callable[[Any], list[Any]]  # the method's result -> the requests that left


def _popped(result: Any) -> list[Any]:
    # pop_bootstrapped returns the bootstrapped requests, or (bootstrapped, failed)
    if isinstance(result, tuple):
        return [req for part in result for req in part]
    return list(result)


INFLIGHT = Site(
    kind="inflight",
    method="process_disagg_prefill_inflight_queue",
    guard_attr="_stallguard_inflight_guard",
    queue_attr="disagg_prefill_inflight_queue",
    scheduler=lambda sched: sched,
    left=lambda done: done,
)
BOOTSTRAP = Site(
    kind="bootstrap",
    method="pop_bootstrapped",
    guard_attr="_stallguard_bootstrap_guard",
    queue_attr="queue",
    scheduler=lambda bq: getattr(bq, "scheduler", None),
    left=_popped,
)

# Note: the hooks read their state with getattr(), never through obj.__dict__: in CPython
# 3.11+ touching __dict__ materializes the instance dict, which makes every later
# attribute access on that object slower (SGLang reads manager attributes per poll).


def around_queue(
    site: Site, original: Callable[..., Any], owner: Any, *args: Any, **kwargs: Any
) -> Any:
    """Run SGLang's queue method *original* on *owner* inside its queue guard: apply
    captured changes, enroll, check (before); forget what left (after)."""
    guard: QueueGuard | None = getattr(owner, site.guard_attr, None)
    if guard is None:
        guard = _new_guard(owner, site)
        if guard is None:
            return original(owner, *args, **kwargs)
    queue = getattr(owner, site.queue_attr)
    if not queue and not guard.entries:
        guard.idle()  # periodic work only (the prefill guard's /metrics export)
        return original(owner, *args, **kwargs)
    try:
        guard.before(queue)
    except Exception:
        report_error(f"{site.method} (before)")
    n = len(queue)
    result = original(owner, *args, **kwargs)
    try:
        guard.after(getattr(owner, site.queue_attr), n, site.left(result))
    except Exception:
        report_error(f"{site.method} (after)")
    return result


def inflight_around(original: Callable[..., Any], sched: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of the prefill mixin's ``process_disagg_prefill_inflight_queue``."""
    return around_queue(INFLIGHT, original, sched, *args, **kwargs)


def bootstrap_around(original: Callable[..., Any], bq: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of ``PrefillBootstrapQueue.pop_bootstrapped``."""
    return around_queue(BOOTSTRAP, original, bq, *args, **kwargs)


def update_status_around(
    original: Callable[..., Any], mgr: Any, bootstrap_room: Any, status: Any
) -> Any:
    """AROUND hook of ``CommonKVManager.update_status(bootstrap_room, status)``: after
    SGLang applied the change, capture it if the room is enrolled."""
    result = original(mgr, bootstrap_room, status)
    rooms = getattr(mgr, ROOMS, None)
    if rooms:
        entry = rooms.get(bootstrap_room)
        # update_status only moves a room forward (or to Failed): *status* equal to the
        # state last observed changes nothing, unless it renews a progress window
        if entry is not None and (status != entry.state or entry.lane.heartbeat):
            lane = entry.lane
            lane.events.append((entry, status, lane.clock()))
    return result


def fake_after(result: Any, sender: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook of ``FakeKVSender.send`` / ``.abort``: capture its new state."""
    entry = getattr(sender, FAKE, None)
    if entry is not None:
        state = read_state(entry)
        if state is not None:
            lane = entry.lane
            lane.events.append((entry, state, lane.clock()))


def _scheduler_backends(sched: Any) -> list[str]:
    bq = getattr(sched, "disagg_prefill_bootstrap_queue", None)
    backend = getattr(bq, "transfer_backend", None)
    name = getattr(backend, "value", backend)
    if isinstance(name, str) and name in PROFILES and name != "fake":
        return [name, "fake"]
    return list(PROFILES)


def _tp_rank(sched: Any) -> int | None:
    try:
        from sglang.srt.runtime_context import (  # type: ignore[import-untyped]
            get_parallel,
        )

        return int(get_parallel().tp_rank)
    except Exception:
        pass
    for holder in (getattr(sched, "ps", None), sched):
        rank = getattr(holder, "tp_rank", None)
        if isinstance(rank, int):
            return rank
    return None


def _dp_rank(sglang_labels: Mapping[str, str]) -> int | None:
    """The scheduler's data-parallel rank, from SGLang's own ``dp_rank`` metric label,
    which SGLang sets only in a data-parallel server (``--dp-size`` > 1); None
    otherwise. Read from the labels before :func:`_metrics.prepare`, which keeps only
    the label names the process's first guard fixed."""
    value = str(sglang_labels.get("dp_rank", ""))
    return int(value) if value.isdigit() else None


def _new_guard(owner: Any, site: Site) -> QueueGuard | None:
    rt = runtime()
    if rt is None:
        return None
    try:
        sched = site.scheduler(owner)
        rt.log_support_table(_scheduler_backends(sched))
        tp_rank = _tp_rank(sched)
        sglang_labels = _metrics.scheduler_labels(sched, tp_rank)
        labels = _metrics.prepare(sglang_labels)
        guard = QueueGuard(rt, site.kind, tp_rank, labels, dp_rank=_dp_rank(sglang_labels))
        setattr(owner, site.guard_attr, guard)
        return guard
    except Exception:
        report_error(f"setting up the {site.kind} queue guard")
        return None


def hook_plan(config: Config, version: str | None) -> list[tuple[str, Callable[..., Any], str]]:
    """The hooks *config* needs on SGLang *version*: ``(target, function, "around" |
    "after")``. Empty when both queues are off."""
    plan: list[tuple[str, Callable[..., Any], str]] = []
    if config.prefill.mode != "off":
        plan.append((INFLIGHT_TARGET, inflight_around, "around"))
    boot = config.bootstrap_queue.mode
    if boot != "off" and (boot != "auto" or not nixl_has_bootstrap_timeout(version)):
        plan.append((BOOTSTRAP_TARGET, bootstrap_around, "around"))
    if plan:
        plan.append((UPDATE_STATUS_TARGET, update_status_around, "around"))
        if config.prefill.mode != "off":
            plan.append((FAKE_SEND_TARGET, fake_after, "after"))
            plan.append((FAKE_ABORT_TARGET, fake_after, "after"))
    return plan
