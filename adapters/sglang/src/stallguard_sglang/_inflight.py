"""The hooks: per-state deadlines for the requests in SGLang's prefill queues.

How it works (docs/sglang.md has the why):

* A **queue guard** belongs to one queue: a scheduler's ``disagg_prefill_inflight_queue``
  or a ``PrefillBootstrapQueue``'s ``queue``. Around each call of the queue's method it
  (1) applies the state changes captured since the last call, (2) enrolls the requests
  that joined the queue meanwhile, (3) hands the requests whose state has lasted long
  enough to the watchdog (see ``_Lane``) and runs the deadline check once, (4) calls
  SGLang's method, and (5) forgets the requests that left.
  Enrollment is O(new requests): SGLang only appends to these lists between calls and
  replaces them with a new list at the end of each call, so new requests are the tail
  past what the guard saw last time. Anything else (a replaced or shrunk list, requests
  that left without being returned) falls back to a full rescan.
* A request's state changes are observed **where SGLang makes them**: for
  ``CommonKVSender`` backends every change goes through the manager's
  ``update_status(room, status)`` (often on a transfer thread), which is hooked; the
  hook appends ``(entry, status, clock())`` to its lane's event queue (a deque append:
  atomic, no lock). ``FakeKVSender`` keeps its own state; ``send()`` and ``abort()`` are
  hooked the same way. The queue call applies the events, in order, before its deadline
  check: each with the time it was captured (``Watchdog.observe(..., at=)``), and only
  if the room's current status (read back: ``update_status`` only moves a room forward,
  or to Failed) is the one the event reports, so a state's clock starts when SGLang
  entered it, never earlier. Everything else the guard does (enroll, check, fail,
  forget) runs on the scheduler thread that runs the queue method, so only the event
  queue is shared with other threads.
* Deadlines count from when the request entered the queue: at enrollment the watchdog
  observes the request's current state, whatever it was before.
* A request found overdue is failed the way SGLang fails it (``conclude_failure``, which
  also tells decode; ``record_failure`` + ``update_status(Failed)`` on releases without
  it; ``conclude_state = Failed`` for ``FakeKVSender``). The queue list is never touched:
  every rank must pass the same vector to the poll all-reduce, and the MIN reduction
  then concludes the request on every rank in the same iteration, through SGLang's own
  failure path.
"""

from __future__ import annotations

import collections
import logging
import time
import weakref
from collections.abc import Callable
from typing import Any

from stallguard import Deadline, Expiry, Spec, Watchdog

from . import _metrics, _stats_export
from ._config import Config
from ._profiles import (
    PROFILES,
    BackendProfile,
    bootstrap_queue_deadline,
    bootstrap_queue_guarded,
    effective_deadlines,
    format_support_table,
    support_table,
)
from .package import nixl_has_bootstrap_timeout, sglang_version

__all__ = [
    "INFLIGHT_TARGET",
    "BOOTSTRAP_TARGET",
    "UPDATE_STATUS_TARGET",
    "FAKE_SEND_TARGET",
    "FAKE_ABORT_TARGET",
    "Runtime",
    "hook_plan",
    "runtime",
]

log = logging.getLogger("stallguard.sglang")

INFLIGHT_TARGET = (
    "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin."
    "process_disagg_prefill_inflight_queue"
)
BOOTSTRAP_TARGET = "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue.pop_bootstrapped"
UPDATE_STATUS_TARGET = "sglang.srt.disaggregation.common.conn.CommonKVManager.update_status"
FAKE_SEND_TARGET = "sglang.srt.disaggregation.fake.conn.FakeKVSender.send"
FAKE_ABORT_TARGET = "sglang.srt.disaggregation.fake.conn.FakeKVSender.abort"

#: ``KVPoll`` values (plain ints in SGLang) -> state names.
KVPOLL = ("Failed", "Bootstrapping", "WaitingForInput", "Transferring", "Success")
_FAILED, _BOOTSTRAPPING, _WAITING, _TRANSFERRING, _SUCCESS = range(5)
_CONCLUDED = frozenset((_FAILED, _SUCCESS))  # observed terminal: no longer tracked
_LIVE = frozenset((_BOOTSTRAPPING, _WAITING, _TRANSFERRING))
#: stale pending handovers tolerated beyond twice the queue's size before compacting
_SLACK = 1024
_TERMINAL = ("Success", "Failed")

# Attributes the adapter sets on SGLang objects (names nobody else uses).
_ROOMS = "_stallguard_rooms"  # on a CommonKVManager: room -> _Entry
_FAKE = "_stallguard_entry"  # on a FakeKVSender: its _Entry
_INFLIGHT_GUARD = "_stallguard_inflight_guard"  # on a scheduler
_BOOTSTRAP_GUARD = "_stallguard_bootstrap_guard"  # on a PrefillBootstrapQueue

_UNSEEN: Any = object()

_BACKEND_MODULES = {
    "sglang.srt.disaggregation.nixl.conn": "nixl",
    "sglang.srt.disaggregation.mooncake.conn": "mooncake",
    "sglang.srt.disaggregation.ascend.conn": "ascend",
    "sglang.srt.disaggregation.mori.conn": "mori",
    "sglang.srt.disaggregation.fake.conn": "fake",
}


class Runtime:
    """Process-wide adapter state: the configuration, the clock, the queue guards."""

    def __init__(self, config: Config, *, version: str | None = None) -> None:
        self.config = config
        self.version = version if version is not None else sglang_version()
        #: the clock every new watchdog uses (tests swap in a FakeClock).
        self.clock: Callable[[], float] = time.monotonic
        self._backend_of: dict[type, str | None] = {}
        self._table_logged = False
        #: every queue guard alive in this process (weakly: they die with their queue).
        self.guards: weakref.WeakSet[_QueueGuard] = weakref.WeakSet()
        #: exceptions the hooks caught (and logged) instead of breaking the scheduler loop.
        self.errors = 0

    def backend_of(self, sender: object) -> str | None:
        """The profile name of *sender*'s class, from the SGLang module defining it (or
        a base class: subclasses keep their parent's profile)."""
        cls = type(sender)
        try:
            return self._backend_of[cls]
        except KeyError:
            pass
        backend = None
        for klass in cls.__mro__:
            backend = _BACKEND_MODULES.get(klass.__module__)
            if backend is not None:
                break
        if backend is None:
            log.warning(
                "stallguard-sglang: %s.%s is not a KV sender class it knows; its requests "
                "are not guarded",
                cls.__module__,
                cls.__qualname__,
            )
        self._backend_of[cls] = backend
        return backend

    def log_support_table(self, backends: list[str]) -> None:
        """Log the support table once per process (at the first queue call)."""
        if self._table_logged:
            return
        self._table_logged = True
        rows = support_table(self.config, backends, version=self.version)
        log.info(
            "stallguard-sglang: deadlines (config %s, SGLang %s):\n%s",
            self.config.source,
            self.version,
            format_support_table(rows, version=self.version),
        )


_runtime: Runtime | None = None


def runtime() -> Runtime | None:
    """The adapter's process-wide state, or None if it was never installed."""
    return _runtime


def set_runtime(rt: Runtime | None) -> None:
    global _runtime
    _runtime = rt


class _Lane:
    """One backend's watchdog within one queue guard.

    **Watched late** (the default): a request is handed to the watchdog only once its
    current state has lasted ``lag`` seconds, half the shortest deadline: no deadline
    can be due earlier, and most requests leave the queue long before, so most never
    cost the watchdog anything. Until then the lane keeps the state and the time it
    was entered on the entry. The handover observes that state with its real start
    (``observe(..., at=since)``); pending handovers wait in one FIFO ordered by that
    start, so the watchdog's deadline clocks stay in time order. A watched request that
    changes state again is forgotten by the watchdog and waits for its new state's
    handover. The handover runs before ``check()`` in the same queue call, so a request
    is failed at the first call past its deadline, as if it had been watched all along.

    **Watched at once** (``direct``), when a state has a progress window (``stall``):
    its renewals (``heartbeat``) must reach the watchdog as they happen, so every
    request is observed from enrollment and every change as it is applied.
    """

    __slots__ = (
        "backend",
        "clock",
        "common",
        "direct",
        "events",
        "guard",
        "heartbeat",
        "lag",
        "pending",
        "profile",
        "static",
        "stats",
        "wd",
    )

    def __init__(
        self, guard: _QueueGuard, backend: str, profile: BackendProfile, wd: Watchdog[Any]
    ) -> None:
        self.guard = guard
        self.backend = backend
        self.profile = profile
        self.common = profile.common
        self.wd = wd
        self.clock = wd.clock
        deadlines = wd.spec.deadlines
        # states with a progress window: a repeated update_status of the same state (a
        # NIXL worker moving the next chunk) renews it.
        self.heartbeat = frozenset(
            KVPOLL.index(str(state)) for state, d in deadlines.items() if d.stall is not None
        )
        self.direct = bool(self.heartbeat)
        bounds = [v for d in deadlines.values() for v in (d.seconds, d.stall) if v is not None]
        #: how long a state lasts before the watchdog sees it (None: nothing can expire)
        self.lag: float | None = min(bounds) / 2 if bounds else None
        #: handovers, ordered by state start: (due, entry, state start)
        self.pending: collections.deque[tuple[float, _Entry, float]] = collections.deque()
        #: (entry, KVPoll value, clock reading) from the hooks, any thread, in order
        self.events: collections.deque[tuple[_Entry, int, float]] = collections.deque()
        self.static = {
            "sglang.backend": backend,
            "sglang.tp_rank": -1 if guard.tp_rank is None else guard.tp_rank,
            "sglang.queue": guard.kind,
        }
        self.stats = _stats_export.LaneStats(wd, guard.kind, backend, guard.tp_rank, wd.clock)

    def watch(self, entry: _Entry) -> None:
        """Hand *entry* to the watchdog: its span attributes, and its current state
        since it started (and the last renewal of its progress window)."""
        entry.watched = True
        state = entry.state
        if state not in _LIVE:
            return
        req = entry.req
        wd = self.wd
        wd.observe(entry, KVPOLL[state], at=entry.since)
        if entry.beat is not None:
            wd.heartbeat(entry, at=entry.beat)
        attributes = {"sglang.rid": str(req.rid), "sglang.bootstrap_room": entry.room}
        attributes.update(self.static)
        wd.annotate(entry, attributes=attributes, trace_parent=_trace_parent(req))

    def hand_over(self, now: float) -> None:
        """Watch the requests whose state has lasted ``lag`` at *now* (before
        ``check()``)."""
        pending = self.pending
        watch = self.watch
        while pending and pending[0][0] <= now:
            _, entry, since = pending.popleft()
            if _awaits_handover(entry, since):
                watch(entry)

    def compact(self) -> None:
        """Drop the pending handovers that went stale (their request left or changed
        state): keeps ``pending`` within twice the queue plus ``_SLACK`` records."""
        self.pending = collections.deque(
            record for record in self.pending if _awaits_handover(record[1], record[2])
        )

    def apply_events(self) -> None:
        """Apply the state changes the hooks captured since the last call (scheduler
        thread, before ``check()``)."""
        events = self.events
        popleft = events.popleft
        wd = self.wd
        beats = self.heartbeat
        for _ in range(len(events)):  # what is there now; later ones wait for next time
            entry, status, at = popleft()
            if not entry.live:
                continue
            state = entry.sender.conclude_state  # _read_state, inlined: this is per event
            if state is None:
                statuses = entry.statuses
                state = statuses.get(entry.room) if statuses is not None else _read_state(entry)
            if state == entry.state:
                if status == state and state in beats:
                    if entry.watched:
                        wd.heartbeat(entry, at=at)
                    elif entry.beat is None or at > entry.beat:
                        entry.beat = at
                continue
            if state != status:
                # the event is for a state the room has since left (its successor's
                # event follows), or one that did not take (a concluded room): taking
                # the room's current state from it would start that state's clock early
                continue
            self.stats.record(entry.state, at - entry.since)
            since = entry.since
            if at > since:  # a state never starts before enrollment or its predecessor
                since = entry.since = at
            entry.state = state
            entry.beat = None
            if entry.watched:
                if self.direct:
                    wd.observe(entry, KVPOLL[state], at=since)
                    continue
                if state in _CONCLUDED:  # tell the watchdog how it ended (statistics)
                    wd.observe(entry, KVPOLL[state], at=since)
                else:
                    wd.forget(entry, remember=False)
                entry.watched = False
            if state in _LIVE and self.lag is not None:
                self.pending.append((since + self.lag, entry, since))


def _awaits_handover(entry: _Entry, since: float) -> bool:
    """Whether a pending handover of *entry*'s state that started at *since* still
    holds: stale if the request left, changed state since, or is already watched."""
    return entry.live and entry.since == since and not entry.watched


class _Entry:
    """One enrolled request, and its key in the watchdog: unique per stay in the queue
    (a requeued request, or a client reusing a rid, gets a new one), shown as the rid."""

    __slots__ = (
        "beat",
        "forced",
        "lane",
        "live",
        "mgr",
        "req",
        "rid",
        "room",
        "rooms",
        "sender",
        "since",
        "state",
        "statuses",
        "watched",
    )

    def __init__(
        self,
        lane: _Lane,
        req: Any,
        sender: Any,
        room: Any,
        mgr: Any,
        rooms: dict[Any, _Entry] | None,
        since: float,
    ) -> None:
        self.lane = lane
        self.req = req
        self.rid = req.rid
        self.sender = sender
        self.room = room
        self.mgr = mgr
        # CommonKVSender backends: the manager's room -> status map (None for fake)
        self.statuses: dict[Any, int] | None = None if mgr is None else mgr.request_status
        self.rooms = rooms  # the manager's room -> entry map (None for fake)
        self.live = True
        #: the sender state the guard last applied, since when (on the lane's clock:
        #: from enrollment, whatever state the request was in before), and the last
        #: renewal of its progress window
        self.state: int | None = None
        self.since = since
        self.beat: float | None = None
        #: tracked by the lane's watchdog (see _Lane)
        self.watched = False
        #: the failure reason, once stallguard failed the request
        self.forced: str | None = None

    def __repr__(self) -> str:
        return repr(self.rid)

    def __str__(self) -> str:
        return str(self.rid)


def _read_state(entry: _Entry) -> int | None:
    """The request's local sender state now (a ``KVPoll`` value: an int), or None if
    its room is gone (cleared: the request is concluding)."""
    concluded = entry.sender.conclude_state
    if concluded is not None:
        return concluded  # type: ignore[no-any-return]
    statuses = entry.statuses
    if statuses is not None:
        return statuses.get(entry.room)
    return _SUCCESS if entry.sender.has_sent else _WAITING


def _trace_parent(req: Any) -> Any:
    """SGLang's per-request OpenTelemetry context (``req.time_stats.trace_ctx``'s root
    span context) when SGLang tracing is on, else None. Attribute reads only."""
    ctx = getattr(getattr(req, "time_stats", None), "trace_ctx", None)
    if ctx is None or getattr(ctx, "tracing_enable", False) is not True:
        return None
    parent = getattr(ctx, "root_span_context", None)
    return parent if isinstance(parent, dict) else None  # an opentelemetry Context


def _tp_rank(owner: Any) -> int | None:
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().tp_rank)
    except Exception:
        pass
    for holder in (getattr(owner, "ps", None), owner):
        rank = getattr(holder, "tp_rank", None)
        if isinstance(rank, int):
            return rank
    return None


class _QueueGuard:
    """Guards one queue list (see the module docstring)."""

    def __init__(self, rt: Runtime, kind: str, tp_rank: int | None) -> None:
        self.rt = rt
        self.kind = kind  # "inflight" | "bootstrap"
        self.tp_rank = tp_rank
        self.entries: dict[int, _Entry] = {}  # id(req) -> entry
        self.lanes: dict[str, _Lane | None] = {}
        self.checks: tuple[_Lane, ...] = ()
        self.seen_list: list[Any] | None = None
        self.seen_len = 0
        self.seen_tail: Any = None
        self.rescans = 0
        rt.guards.add(self)

    # ------------------------------------------------------------------ lanes

    def _spec(self, backend: str) -> tuple[dict[str, Deadline], str]:
        config = self.rt.config
        if self.kind == "inflight":
            return effective_deadlines(config, backend), config.prefill.mode
        seconds = bootstrap_queue_deadline(config)
        mode = config.bootstrap_queue.mode
        deadlines = {
            "Bootstrapping": Deadline(seconds=seconds),
            "WaitingForInput": Deadline(),  # waits for a metadata buffer: back-pressure
            "Transferring": Deadline(),
        }
        return deadlines, "enforce" if mode == "auto" else mode

    def _lane(self, backend: str) -> _Lane | None:
        try:
            return self.lanes[backend]
        except KeyError:
            pass
        lane = None
        if self.kind == "inflight" or bootstrap_queue_guarded(
            self.rt.config, backend, self.rt.version
        ):
            deadlines, mode = self._spec(backend)
            spec = Spec(
                name=f"sglang.{self.kind}.{backend}", deadlines=deadlines, terminal=_TERMINAL
            )
            wd: Watchdog[Any] = Watchdog(
                spec,
                clock=self.rt.clock,
                on_expire=self._on_expire if mode == "enforce" else None,
                mode=mode,  # type: ignore[arg-type]
                # keys are unique per stay in the queue and the hooks drop events for
                # requests that left: no need to remember concluded keys
                memory=1,
            )
            lane = _Lane(self, backend, PROFILES[backend], wd)
            self.checks = (*self.checks, lane)
        self.lanes[backend] = lane
        return lane

    @property
    def watchdogs(self) -> dict[str, Watchdog[Any]]:
        """The watchdog of each backend this queue has seen (and guards)."""
        return {name: lane.wd for name, lane in self.lanes.items() if lane is not None}

    # ------------------------------------------------------------------ around a call

    def before(self, queue: list[Any]) -> None:
        """Apply the state changes captured since the last call, enroll what joined
        *queue* meanwhile, then check deadlines once."""
        for lane in self.checks:
            if lane.events:
                lane.apply_events()
        n = len(queue)
        seen = self.seen_len
        appended = queue is self.seen_list and n >= seen
        if appended and (seen == 0 or queue[seen - 1] is self.seen_tail):
            if n > seen:
                self._enroll(queue[seen:])
        else:
            self._resync(queue)
        self.seen_list = queue
        self.seen_len = n
        self.seen_tail = queue[-1] if n else None
        for lane in self.checks:
            now = lane.clock()
            pending = lane.pending
            if pending and pending[0][0] <= now:
                lane.hand_over(now)
            expiries = lane.wd.check(now)
            lane.stats.tick(now)
            if expiries and lane.wd.mode == "report":
                for expiry in expiries:
                    _metrics.count(
                        "reported", self.kind, lane.backend, expiry.state_label, self.tp_rank
                    )

    def after(self, queue: list[Any], before_len: int, left: list[Any]) -> None:
        """Forget the requests SGLang's call removed from the queue (*left*, and any
        that left silently), and remember the new list."""
        if left:
            pop = self.entries.pop
            leave = self._leave
            for req in left:
                entry = pop(id(req), None)
                if entry is not None:
                    leave(entry)
            for lane in self.checks:
                if len(lane.pending) > 2 * len(self.entries) + _SLACK:
                    lane.compact()
        if len(queue) != before_len - len(left):
            self._resync(queue)
        self.seen_list = queue
        self.seen_len = len(queue)
        self.seen_tail = queue[-1] if queue else None

    # ------------------------------------------------------------------ membership

    def _resync(self, queue: list[Any]) -> None:
        """O(len(queue)): make the enrolled set exactly the queue's members."""
        self.rescans += 1
        present = {id(req) for req in queue}
        gone = [entry for rid, entry in self.entries.items() if rid not in present]
        for entry in gone:
            del self.entries[id(entry.req)]
            self._leave(entry)
        new = [req for req in queue if id(req) not in self.entries]
        if new:
            self._enroll(new)

    def _enroll(self, reqs: list[Any]) -> None:
        rt = self.rt
        entries = self.entries
        lanes = self.lanes
        backend_of = rt._backend_of
        last: _Lane | None = None
        now = 0.0
        for req in reqs:
            if id(req) in entries:
                continue
            sender = getattr(req, "disagg_kv_sender", None)
            if sender is None:
                continue
            backend = backend_of.get(type(sender), _UNSEEN)
            if backend is _UNSEEN:
                backend = rt.backend_of(sender)
            lane = lanes.get(backend, _UNSEEN) if backend is not None else None
            if lane is _UNSEEN:
                lane = self._lane(backend)
            if lane is None:
                continue
            if lane is not last:  # one clock read per lane and batch
                last = lane
                now = lane.clock()
            room = req.bootstrap_room
            if lane.common:
                mgr = sender.kv_mgr
                rooms = getattr(mgr, _ROOMS, None)
                if rooms is None:
                    rooms = {}
                    setattr(mgr, _ROOMS, rooms)
                entry = _Entry(lane, req, sender, room, mgr, rooms, now)
                rooms[room] = entry
            else:
                entry = _Entry(lane, req, sender, room, None, None, now)
                setattr(sender, _FAKE, entry)
            entries[id(req)] = entry
            # (read after the entry is in the rooms map: a change this read misses
            # finds the entry there and is captured as an event)
            state = entry.state = _read_state(entry)
            if lane.direct:
                lane.watch(entry)
            elif state in _LIVE and lane.lag is not None:
                lane.pending.append((now + lane.lag, entry, now))

    def _leave(self, entry: _Entry) -> None:
        """Forget a request that left the queue (already out of ``entries``)."""
        entry.live = False
        entry.lane.stats.leave(entry)
        rooms = entry.rooms
        if rooms is not None:
            if rooms.get(entry.room) is entry:
                del rooms[entry.room]
        elif getattr(entry.sender, _FAKE, None) is entry:
            delattr(entry.sender, _FAKE)
        if entry.watched and entry.state not in _CONCLUDED:  # the watchdog tracks it
            entry.lane.wd.forget(entry, remember=False)
        # the entry may live on a little (a pending handover, the watchdog's last
        # tombstone): do not keep the finished request alive with it
        entry.req = entry.sender = None

    # ------------------------------------------------------------------ enforcement

    def _on_expire(self, expiry: Expiry[Any]) -> None:
        entry = expiry.key
        if not isinstance(entry, _Entry) or not entry.live:
            return
        state = _read_state(entry)
        if state is None or state in (_SUCCESS, _FAILED):
            log.info(
                "stallguard-sglang: %s concluded (%s) as its deadline fired; not failing it",
                entry.rid,
                "cleared" if state is None else KVPOLL[state],
            )
            return
        reason = _reason(expiry, entry, self.kind)
        entry.forced = reason
        lane = entry.lane
        if lane.common:
            _fail_common(entry.mgr, entry.room, reason)
        else:
            entry.sender.conclude_state = _FAILED
        _metrics.count("forced", self.kind, lane.backend, expiry.state_label, self.tp_rank)


def _reason(expiry: Expiry[Any], entry: _Entry, queue: str) -> str:
    if expiry.reason == "stall":
        what = f"went {expiry.elapsed:.1f}s without progress in KVPoll.{expiry.state_label}"
        window = "progress window"
    else:
        what = f"spent {expiry.elapsed:.1f}s in KVPoll.{expiry.state_label}"
        window = "deadline"
    return (
        f"stallguard: request {entry.rid} (bootstrap_room {entry.room}, "
        f"{entry.lane.backend}) {what} in the prefill {queue} queue, past its "
        f"{expiry.deadline:g}s {window}"
    )


def _fail_common(mgr: Any, room: int, reason: str) -> None:
    """Fail a CommonKVSender's room the way SGLang does."""
    conclude = getattr(mgr, "conclude_failure", None)
    if conclude is not None:
        try:
            conclude(bootstrap_room=room, failure_reason=reason)
            return
        except Exception:
            # e.g. telling a dead decode peer failed: still fail the room locally
            log.exception("stallguard-sglang: conclude_failure(%s) raised; failing locally", room)
    mgr.record_failure(room, reason)
    mgr.update_status(room, _FAILED)


# --------------------------------------------------------------------------- the hooks


def _report_error(where: str) -> None:
    rt = _runtime
    if rt is not None:
        rt.errors += 1
    log.exception("stallguard-sglang: error in %s; the request queue is not guarded", where)


def _scheduler_backends(sched: Any) -> list[str]:
    bq = getattr(sched, "disagg_prefill_bootstrap_queue", None)
    backend = getattr(bq, "transfer_backend", None)
    name = getattr(backend, "value", backend)
    if isinstance(name, str) and name in PROFILES and name != "fake":
        return [name, "fake"]
    return list(PROFILES)


def _new_guard(owner: Any, attr: str, kind: str, sched: Any) -> _QueueGuard | None:
    rt = _runtime
    if rt is None:
        return None
    try:
        rt.log_support_table(_scheduler_backends(sched))
        _metrics.prepare()
        guard = _QueueGuard(rt, kind, _tp_rank(sched))
        setattr(owner, attr, guard)
        return guard
    except Exception:
        _report_error(f"setting up the {kind} queue guard")
        return None


# Note: the hooks read their state with getattr(), never through obj.__dict__: in CPython
# 3.11+ touching __dict__ materializes the instance dict, which makes every later
# attribute access on that object slower (SGLang reads manager attributes per poll).


def inflight_around(original: Callable[..., Any], sched: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of the prefill mixin's ``process_disagg_prefill_inflight_queue``."""
    guard = getattr(sched, _INFLIGHT_GUARD, None)
    if guard is None:
        guard = _new_guard(sched, _INFLIGHT_GUARD, "inflight", sched)
        if guard is None:
            return original(sched, *args, **kwargs)
    queue = sched.disagg_prefill_inflight_queue
    if not queue and not guard.entries:
        _stats_export.idle(guard.checks)
        return original(sched, *args, **kwargs)
    try:
        guard.before(queue)
    except Exception:
        _report_error("process_disagg_prefill_inflight_queue (before)")
    n = len(queue)
    result = original(sched, *args, **kwargs)
    try:
        guard.after(sched.disagg_prefill_inflight_queue, n, result)
    except Exception:
        _report_error("process_disagg_prefill_inflight_queue (after)")
    return result


def bootstrap_around(original: Callable[..., Any], bq: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of ``PrefillBootstrapQueue.pop_bootstrapped``."""
    guard = getattr(bq, _BOOTSTRAP_GUARD, None)
    if guard is None:
        guard = _new_guard(bq, _BOOTSTRAP_GUARD, "bootstrap", getattr(bq, "scheduler", None))
        if guard is None:
            return original(bq, *args, **kwargs)
    queue = bq.queue
    if not queue and not guard.entries:
        _stats_export.idle(guard.checks)
        return original(bq, *args, **kwargs)
    try:
        guard.before(queue)
    except Exception:
        _report_error("pop_bootstrapped (before)")
    n = len(queue)
    result = original(bq, *args, **kwargs)
    try:
        left = list(result[0]) + list(result[1]) if isinstance(result, tuple) else result
        guard.after(bq.queue, n, left)
    except Exception:
        _report_error("pop_bootstrapped (after)")
    return result


def update_status_around(
    original: Callable[..., Any], mgr: Any, bootstrap_room: Any, status: Any
) -> Any:
    """AROUND hook of ``CommonKVManager.update_status(bootstrap_room, status)``: after
    SGLang applied the change, observe the room's resulting status if it is enrolled."""
    result = original(mgr, bootstrap_room, status)
    rooms = getattr(mgr, _ROOMS, None)
    if rooms:
        entry = rooms.get(bootstrap_room)
        # update_status only moves a room forward (or to Failed): *status* equal to the
        # state last observed changes nothing, unless it renews a progress window
        if entry is not None and (status != entry.state or entry.lane.heartbeat):
            lane = entry.lane
            lane.events.append((entry, status, lane.clock()))
    return result


def fake_after(result: Any, sender: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook of ``FakeKVSender.send`` / ``.abort``."""
    entry = getattr(sender, _FAKE, None)
    if entry is not None:
        lane = entry.lane
        lane.events.append((entry, _read_state(entry), lane.clock()))  # type: ignore[arg-type]
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
