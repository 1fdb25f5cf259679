"""Queue guards: per-state deadlines for the requests in one SGLang prefill queue.

A :class:`QueueGuard` belongs to one queue: a scheduler's ``disagg_prefill_inflight_queue``
or a ``PrefillBootstrapQueue``'s ``queue``. Around each call of the queue's method
(``_hooks.py``) it

1. **applies the state changes captured since the last call** (:meth:`Lane.apply_events`):
   each is observed with the time SGLang entered the state
   (``Watchdog.observe(key, state, at=since)``), or renews a progress window
   (``Watchdog.heartbeat(key, at=...)``);
2. **enrolls the requests that joined the queue** meanwhile: each is observed in its
   current state from now (deadlines count from when a request entered the queue);
3. **runs the deadline check once** per watchdog (``Watchdog.check()``): a request found
   overdue is failed the way SGLang fails it;
4. calls SGLang's method; then
5. **forgets the requests that left** (``Watchdog.forget``).

While a request is **young** (less than half the lane's shortest deadline or progress
window since it joined: none of its deadlines can be due), the lane keeps it itself: its
state, that state's start and its last progress on its :class:`Entry`, written by the
captured changes, its stays batched for the watchdog's statistics
(``Watchdog.record_stays``). The first queue call past that hands it to the watchdog
with exactly those starts (``Watchdog.adopt``); from then on the watchdog does all the
deadline bookkeeping as above. Most requests leave young and never reach the watchdog.

Enrollment is O(new requests): SGLang only appends to these lists between calls and
replaces them with a new list at the end of each call, so new requests are the tail past
what the guard saw last time. Anything else (a replaced or shrunk list, requests that
left without being returned) falls back to a full rescan.

State changes are captured **where SGLang makes them** (``_hooks.py``): for
``CommonKVSender`` backends every change goes through the manager's
``update_status(room, status)`` (often on a transfer thread), whose hook appends
``(entry, status, clock())`` to the lane's event queue (a deque append: atomic, no lock);
``FakeKVSender`` keeps its own state, and its ``send()`` / ``abort()`` are hooked the same
way. An event is applied only if the room's current status, read back
(``update_status`` only moves a room forward, or to Failed), is the one the event reports:
an event for a state the room has already left is skipped (its successor's event
follows), so a state's clock starts when SGLang entered it, never earlier. Everything
else (enroll, check, fail, forget) runs on the scheduler thread that runs the queue
method: only the event queue is shared with other threads.

A request found overdue is failed the way SGLang fails it (``conclude_failure``, which
also tells decode; ``record_failure`` + ``update_status(Failed)`` on releases without it;
``conclude_state = Failed`` for ``FakeKVSender``). The queue list is never touched: every
rank must pass the same vector to the poll all-reduce, and the MIN reduction then
concludes the request on every rank in the same iteration, through SGLang's own failure
path.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Mapping
from typing import Any, Literal

from stallguard import CONCLUDED, Deadline, Expiry, Spec, Watchdog

from ._kvpoll import FAILED, KVPOLL, LIVE, SUCCESS, TERMINAL_STATES, WAITING
from ._profiles import (
    PROFILES,
    BackendProfile,
    bootstrap_queue_deadline,
    bootstrap_queue_guarded,
    effective_deadlines,
)
from ._runtime import Runtime
from ._stats_export import LaneStats

__all__ = ["ATTRIBUTE_PREFIX", "Entry", "Lane", "QueueGuard", "QueueMembership", "read_state"]

log = logging.getLogger("stallguard.sglang")

#: The namespace of the span attributes the adapter sets.
ATTRIBUTE_PREFIX = "stallguard.sglang."
_RID = ATTRIBUTE_PREFIX + "rid"
_ROOM = ATTRIBUTE_PREFIX + "bootstrap_room"
#: the engine's request id under the name SGLang's and vLLM's own spans give it
GEN_AI_REQUEST_ID = "gen_ai.request.id"
#: the served model (OpenTelemetry's GenAI semantic conventions), when SGLang names it
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"

# Attributes the adapter sets on SGLang objects (names nobody else uses).
ROOMS = "_stallguard_rooms"  # on a CommonKVManager: room -> Entry
FAKE = "_stallguard_entry"  # on a FakeKVSender: its Entry

_UNSEEN: Any = object()
#: young requests' stays kept for the watchdog's statistics before a batch is recorded
#: (they are recorded at least before every export, about once a second)
FLUSH = 512

QueueKind = Literal["inflight", "bootstrap", "prealloc", "transfer"]


class Lane:
    """One backend's watchdog within one queue guard, the requests it holds itself
    while they are young (see the module docstring), and the state changes the hooks
    captured for its requests (``events``: ``(entry, KVPoll value, clock reading)``,
    appended by any thread, applied in order by the scheduler thread)."""

    __slots__ = (
        "backend",
        "clock",
        "common",
        "events",
        "guard",
        "half",
        "heartbeat",
        "stale",
        "static",
        "stats",
        "stays",
        "wd",
        "young",
    )

    def __init__(
        self, guard: QueueGuard, backend: str, profile: BackendProfile, wd: Watchdog[Any]
    ) -> None:
        self.guard = guard
        self.backend = backend
        self.common = profile.common
        self.wd = wd
        self.clock = wd.clock
        # states with a progress window: a repeated update_status of the same state (a
        # NIXL worker moving the next chunk) renews it.
        deadlines = wd.spec.deadlines
        self.heartbeat = frozenset(
            KVPOLL.index(str(state)) for state, d in deadlines.items() if d.stall is not None
        )
        #: a request is handed to the watchdog this long after it joined: half the
        #: shortest deadline or progress window (none can be due before the whole)
        self.half = (
            min(
                (s for d in deadlines.values() for s in (d.seconds, d.stall) if s is not None),
                default=math.inf,
            )
            / 2
        )
        #: the requests the lane holds itself, in the order they joined (and some that
        #: left: ``stale`` of them, compacted away when they are half)
        self.young: collections.deque[Entry] = collections.deque()
        self.stale = 0
        #: stays of requests the watchdog never saw, for its statistics: ``(state
        #: label, seconds)``, recorded in one batch per queue call
        self.stays: list[tuple[str, float]] = []
        self.events: collections.deque[tuple[Entry, int, float]] = collections.deque()
        #: the span attributes every request of this lane shares (absent ones left out)
        self.static = _attributes(
            backend=backend, tp_rank=guard.tp_rank, dp_rank=guard.dp_rank, queue=guard.kind
        )
        self.static.update(model_attribute(guard.metric_labels))
        self.stats = LaneStats(
            wd, guard.kind, backend, guard.tp_rank, wd.clock, guard.metric_labels
        )

    def enroll(self, entry: Entry, now: float) -> None:
        """A request that joined the queue at *now*, in its current state: held by the
        lane (young) until :meth:`hand_over` gives it to the watchdog."""
        state = entry.state = read_state(entry)
        entry.since = entry.beat = entry.joined = now
        if state in LIVE:  # (else concluding already, or its room is gone: it leaves now)
            self.young.append(entry)
        else:
            entry.young = False

    def hand_over(self, now: float) -> None:
        """Give the watchdog every young request that joined at least :attr:`half`
        ago (none of its deadlines can be due before ``joined + 2 * half``), in its
        state with that state's real start (``Watchdog.adopt``: exact starts)."""
        young = self.young
        last = now - self.half
        wd = self.wd
        while young and young[0].joined <= last:
            entry = young.popleft()
            if not entry.young:
                self.stale -= 1  # it left the queue meanwhile
                continue
            entry.young = False
            state = entry.state
            if state not in LIVE:
                continue  # concluded while young: it leaves the queue in this call
            wd.adopt(entry, KVPOLL[state], since=entry.since, beat=entry.beat)
            # span attributes: computed only if the request expires (describe_entry)
            parent = _trace_parent(entry.req)
            if parent is not None:
                wd.annotate(entry, trace_parent=parent)

    def left_young(self, entry: Entry) -> None:
        """A young request left the queue: its last stay goes to the statistics."""
        entry.young = False
        state = entry.state
        if state in LIVE:
            self.stays.append((KVPOLL[state], max(0.0, self.clock() - entry.since)))
        self.stale += 1
        young = self.young
        if 2 * self.stale > len(young):  # (amortised O(1): at most twice the young ones)
            self.young = collections.deque(e for e in young if e.young)
            self.stale = 0

    def apply_events(self) -> None:
        """Apply the state changes the hooks captured since the last call (scheduler
        thread, before ``check()``): on a young request's own record, or, once the
        watchdog has it, with ``Watchdog.observe`` / ``heartbeat``."""
        events = self.events
        popleft = events.popleft
        wd = self.wd
        beats = self.heartbeat
        for _ in range(len(events)):  # what is there now; later ones wait for next time
            entry, status, at = popleft()
            if not entry.live:
                continue
            state = read_state(entry)
            if state == entry.state:
                if status == state and state in beats:
                    if not entry.young:
                        wd.heartbeat(entry, at=at)
                    elif at > entry.beat:  # a window only ever extends
                        entry.beat = at
                continue
            if state != status:
                # the event is for a state the room has since left (its successor's
                # event follows), or one that did not take (a concluded room): taking
                # the room's current state from it would start that state's clock early
                continue
            if entry.young:
                old: Any = entry.state
                if old in LIVE:  # its stay in that state ends: to the statistics
                    stay = at - entry.since
                    if stay > 0:
                        entry.since = entry.beat = at
                    else:  # a state never starts before the one it ends
                        stay = 0.0
                    self.stays.append((KVPOLL[old], stay))
                entry.state = state
                continue
            entry.state = state
            # a terminal state untracks the request; the core never starts a state
            # before the one it ends, nor before the request's enrollment
            wd.observe(entry, KVPOLL[state], at=at)

    def flush(self) -> None:
        """Record the stays of young requests in the watchdog's statistics."""
        stays = self.stays
        if stays:
            self.stays = []
            self.wd.record_stays(stays)


def describe_entry(entry: Any) -> dict[str, Any]:
    """The span attributes of an expiring request (the lanes' ``describe``): its rid,
    room and what every request of its lane shares."""
    rid = str(entry.rid)
    attributes: dict[str, Any] = {GEN_AI_REQUEST_ID: rid, _RID: rid}
    if entry.room is not None:
        attributes[_ROOM] = entry.room
    attributes.update(entry.lane.static)
    return attributes


def model_attribute(metric_labels: Mapping[str, str]) -> dict[str, str]:
    """``gen_ai.request.model`` from SGLang's ``model_name`` label, if it has one."""
    model = metric_labels.get("model_name")
    return {GEN_AI_REQUEST_MODEL: model} if model else {}


def _attributes(**values: Any) -> dict[str, Any]:
    """Span attributes under ``stallguard.sglang.*``; values that are None are left out
    (no placeholders)."""
    return {ATTRIBUTE_PREFIX + k: v for k, v in values.items() if v is not None}


class Entry:
    """One enrolled request, and its key in the watchdog: unique per stay in the queue
    (a requeued request, or a client reusing a rid, gets a new one), shown as the rid."""

    __slots__ = (
        "beat",
        "forced",
        "joined",
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
        "young",
    )

    def __init__(
        self,
        lane: Lane,
        req: Any,
        sender: Any,
        room: Any,
        mgr: Any,
        rooms: dict[Any, Entry] | None,
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
        #: the sender state (KVPoll value) the guard last observed
        self.state: int | None = None
        #: the failure reason, once stallguard failed the request
        self.forced: str | None = None
        #: held by its lane, not (yet) by the watchdog; then, the start of its state,
        #: the last renewal of its progress window, and when it joined the queue
        self.young = True
        self.since = self.beat = self.joined = 0.0

    def __repr__(self) -> str:
        return repr(self.rid)

    def __str__(self) -> str:
        return str(self.rid)


def read_state(entry: Entry) -> int | None:
    """The request's local sender state now (a ``KVPoll`` value: an int), or None if
    its room is gone (cleared: the request is concluding)."""
    concluded: int | None = entry.sender.conclude_state
    if concluded is not None:
        return concluded
    statuses = entry.statuses
    if statuses is not None:
        return statuses.get(entry.room)
    return SUCCESS if entry.sender.has_sent else WAITING


def _trace_parent(req: Any) -> Any:
    """SGLang's per-request OpenTelemetry context (``req.time_stats.trace_ctx``'s root
    span context) when SGLang tracing is on, else None. Attribute reads only."""
    ctx = getattr(getattr(req, "time_stats", None), "trace_ctx", None)
    if ctx is None or getattr(ctx, "tracing_enable", False) is not True:
        return None
    parent = getattr(ctx, "root_span_context", None)
    return parent if isinstance(parent, dict) else None  # an opentelemetry Context


class QueueMembership:
    """Which requests are in one queue list, kept in step with it at O(new requests) per
    call (see the module docstring); shared by the prefill and the decode queue guards.

    Subclasses say how to enroll new items (:meth:`_enroll`, which must put each entry
    in :attr:`entries` under :meth:`key`) and how to forget an entry (:meth:`_leave`).
    """

    def idle(self) -> None:
        """Called instead of the around-call work when the queue is empty and nothing
        is enrolled (nothing to do unless a subclass has periodic work)."""

    def __init__(self) -> None:
        #: key(item) -> the subclass's entry
        self.entries: dict[int, Any] = {}
        self.seen_list: list[Any] | None = None
        self.seen_len = 0
        self.seen_tail: Any = None
        #: full rescans so far (for tests: the steady state never needs one)
        self.rescans = 0

    @staticmethod
    def key(item: Any) -> int:
        """An item's key: ``id()`` of the object SGLang's method returns when the item
        leaves (the item itself here)."""
        return id(item)

    def sync(self, queue: list[Any]) -> None:
        """Enroll the items that joined *queue* since the last call (the tail past what
        was seen), or rescan it if it changed any other way."""
        n = len(queue)
        seen = self.seen_len
        appended = queue is self.seen_list and n >= seen
        if appended and (seen == 0 or queue[seen - 1] is self.seen_tail):
            if n > seen:
                self._enroll(queue[seen:])
        else:
            self._resync(queue)
        self._remember(queue)

    def after(self, queue: list[Any], before_len: int, left: list[Any]) -> None:
        """Forget the items SGLang's call removed from the queue (*left*: the objects
        :meth:`key` names, and any that left silently), and remember the new list."""
        if left:
            pop = self.entries.pop
            leave = self._leave
            for obj in left:
                entry = pop(id(obj), None)
                if entry is not None:
                    leave(entry)
        if len(queue) != before_len - len(left):
            self._resync(queue)
        self._remember(queue)

    def _remember(self, queue: list[Any]) -> None:
        self.seen_list = queue
        self.seen_len = len(queue)
        self.seen_tail = queue[-1] if queue else None

    def _resync(self, queue: list[Any]) -> None:
        """O(len(queue)): make the enrolled set exactly the queue's members."""
        self.rescans += 1
        key = self.key
        present = {key(item) for item in queue}
        for k in [k for k in self.entries if k not in present]:
            self._leave(self.entries.pop(k))
        new = [item for item in queue if key(item) not in self.entries]
        if new:
            self._enroll(new)

    def _enroll(self, items: list[Any]) -> None:
        raise NotImplementedError

    def _leave(self, entry: Any) -> None:
        raise NotImplementedError


class QueueGuard(QueueMembership):
    """Guards one queue list (see the module docstring)."""

    def __init__(
        self,
        rt: Runtime,
        kind: QueueKind,
        tp_rank: int | None,
        metric_labels: Mapping[str, str] | None = None,
        *,
        dp_rank: int | None = None,
    ) -> None:
        self.rt = rt
        self.kind: QueueKind = kind
        self.tp_rank = tp_rank
        #: the scheduler's data-parallel rank (``--dp-size`` > 1 only: each replica is a
        #: scheduler with the same tp_rank, and only this tells them apart on a span)
        self.dp_rank = dp_rank
        #: SGLang's own scheduler metric labels (model_name, tp_rank, ...), for joins
        self.metric_labels: Mapping[str, str] = metric_labels or {}
        QueueMembership.__init__(self)
        self.lanes: dict[str, Lane | None] = {}
        self.checks: tuple[Lane, ...] = ()
        rt.guards.add(self)

    # ------------------------------------------------------------------ lanes

    def _spec(self, backend: str) -> tuple[dict[str, Deadline], str]:
        config = self.rt.config
        if self.kind == "inflight":
            return dict(effective_deadlines(config, backend)), config.prefill.mode
        seconds = bootstrap_queue_deadline(config)
        mode = config.bootstrap_queue.mode
        deadlines = {
            "Bootstrapping": Deadline(seconds=seconds),
            "WaitingForInput": Deadline(),  # waits for a metadata buffer: back-pressure
            "Transferring": Deadline(),
        }
        return deadlines, config.bootstrap_queue.auto_mode if mode == "auto" else mode

    def lane(self, backend: str) -> Lane | None:
        """The lane of *backend*, created at first use; None if this queue does not
        guard that backend."""
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
                name=f"sglang.{self.kind}.{backend}",
                deadlines=deadlines,
                terminal=TERMINAL_STATES,
            )
            wd: Watchdog[Any] = Watchdog(
                spec,
                clock=self.rt.clock,
                on_expire=self.on_expire if mode == "enforce" else None,
                mode="enforce" if mode == "enforce" else "report",
                # keys are unique per stay in the queue and the hooks drop events for
                # requests that left: no need to remember concluded keys
                memory=1,
                statistics=True,  # time in state on /metrics, for `advise`
                describe=describe_entry,
            )
            lane = Lane(self, backend, PROFILES[backend], wd)
            self.checks = (*self.checks, lane)
        self.lanes[backend] = lane
        return lane

    @property
    def watchdogs(self) -> dict[str, Watchdog[Any]]:
        """The watchdog of each backend this queue has seen (and guards)."""
        return {name: lane.wd for name, lane in self.lanes.items() if lane is not None}

    def requests(self) -> list[tuple[Entry, str, float]]:
        """Every live request this guard's deadlines cover, as ``(entry, state label,
        the state's start)``: the young ones from their lane's record, the others from
        the watchdog's snapshot (a view for tests and debugging: O(requests))."""
        out: list[tuple[Entry, str, float]] = []
        for lane in self.checks:
            for e in lane.young:
                state: Any = e.state
                if e.young and state in LIVE:
                    out.append((e, KVPOLL[state], e.since))
            out += [(r.key, str(r.state), r.entered_at) for r in lane.wd.snapshot().requests]
        return out

    # ------------------------------------------------------------------ around a call

    def idle(self) -> None:
        """The queue is empty: export what its last requests left to ``/metrics``, once
        the export period is up (so a scrape after the traffic stops sees every stay)."""
        for lane in self.checks:
            if lane.stays:
                lane.flush()
            lane.stats.tick(lane.clock())

    def before(self, queue: list[Any]) -> None:
        """Apply the state changes captured since the last call, enroll what joined
        *queue* meanwhile, then check deadlines once."""
        for lane in self.checks:
            if lane.events:
                lane.apply_events()
        self.sync(queue)
        for lane in self.checks:
            now = lane.clock()
            young = lane.young
            if young and young[0].joined <= now - lane.half:
                lane.hand_over(now)
            expired = lane.wd.check()  # enforce: QueueGuard.on_expire fails them
            # time in state to /metrics about once a second; the expiries' counts at once
            # (the young requests' stays reach the watchdog's statistics just before)
            stats = lane.stats
            if expired or now >= stats.due:
                lane.flush()
                stats.tick(now, expired)
            elif len(lane.stays) >= FLUSH:
                lane.flush()

    # ------------------------------------------------------------------ membership

    def _enroll(self, reqs: list[Any]) -> None:
        entries = self.entries
        last: Lane | None = None
        kind: Any = None  # the sender class of the last lane looked up
        now = 0.0
        for req in reqs:
            if id(req) in entries:
                continue
            sender = getattr(req, "disagg_kv_sender", None)
            if sender.__class__ is kind:  # (a batch's senders are usually of one class)
                lane = last
            else:
                lane = None if sender is None else self._lane_of(sender)
                if lane is None:
                    continue
                kind = sender.__class__
                if lane is not last:  # one clock read per lane and batch
                    last = lane
                    now = lane.clock()
            assert lane is not None
            entry = entries[id(req)] = _new_entry(lane, req, sender)
            # (the state is read after the entry is in the rooms map: a change this read
            # misses finds the entry there and is captured as an event, at or after now)
            lane.enroll(entry, now)

    def _lane_of(self, sender: Any) -> Lane | None:
        """The lane of *sender*'s backend (None: not a backend this queue guards)."""
        backend: str | None = self.rt.backends.get(type(sender), _UNSEEN)
        if backend is _UNSEEN:
            backend = self.rt.backend_of(sender)
        if backend is None:
            return None
        lane: Lane | None = self.lanes.get(backend, _UNSEEN)
        return self.lane(backend) if lane is _UNSEEN else lane

    def _leave(self, entry: Entry) -> None:
        """Forget a request that left the queue (already out of ``entries``)."""
        entry.live = False
        rooms = entry.rooms
        if rooms is not None:
            if rooms.get(entry.room) is entry:
                del rooms[entry.room]
        elif getattr(entry.sender, FAKE, None) is entry:
            delattr(entry.sender, FAKE)
        if entry.young:  # the watchdog never saw it
            entry.lane.left_young(entry)
        elif entry.state in LIVE:  # the watchdog may track it
            entry.lane.wd.forget(entry, remember=False)
        # the entry may live on a little (the watchdog's last tombstone, a captured
        # event): do not keep the finished request alive with it
        entry.req = entry.sender = None

    def _rekey(self, entry: Entry) -> None:
        """Track *entry*'s request under a new entry, in its current state from now
        (the old key's expiry is being withdrawn, which concludes that key)."""
        new = Entry(entry.lane, entry.req, entry.sender, entry.room, entry.mgr, entry.rooms)
        entry.live = False  # events captured for the old entry are dropped
        rooms = entry.rooms
        if rooms is not None:
            if rooms.get(entry.room) is entry:
                rooms[entry.room] = new
        elif getattr(entry.sender, FAKE, None) is entry:
            setattr(entry.sender, FAKE, new)
        key = id(entry.req)
        if self.entries.get(key) is entry:
            self.entries[key] = new
        new.lane.enroll(new, new.lane.clock())

    # ------------------------------------------------------------------ enforcement

    def on_expire(self, expiry: Expiry[Any]) -> object:
        """Fail an overdue request through SGLang's own failure path (enforce mode),
        unless it concluded meanwhile (then the expiry is withdrawn: no span, log or
        count says it was failed)."""
        entry = expiry.key
        if not isinstance(entry, Entry) or not entry.live:
            return CONCLUDED  # it left the queue: SGLang concluded it
        state = read_state(entry)
        if state is None or state in (SUCCESS, FAILED):
            log.info(
                "stallguard-sglang: %s concluded (%s) as its deadline fired; not failing it",
                entry.rid,
                "cleared" if state is None else KVPOLL[state],
            )
            return CONCLUDED
        if KVPOLL[state] != expiry.state_label:
            # a transfer thread moved it on between the check's decision and now: the
            # phase it overstayed ended in time. Withdrawn; its new phase is tracked
            # under a new key from now (at most one pass later than the change: never
            # failed early)
            log.info(
                "stallguard-sglang: %s left %s (now %s) as its deadline fired; not failing it",
                entry.rid,
                expiry.state_label,
                KVPOLL[state],
            )
            self._rekey(entry)
            return CONCLUDED
        reason = _reason(expiry, entry, self.kind)
        entry.forced = reason
        if entry.lane.common:
            _fail_common(entry.mgr, entry.room, reason)
        else:
            entry.sender.conclude_state = FAILED
        return None


def _new_entry(lane: Lane, req: Any, sender: Any) -> Entry:
    """The entry of *req* (its sender *sender*) joining *lane*, found from the sender's
    rooms map (a CommonKVSender's manager) or the sender itself (fake)."""
    room = getattr(req, "bootstrap_room", None)
    if not lane.common:
        entry = Entry(lane, req, sender, room, None, None)
        setattr(sender, FAKE, entry)
        return entry
    mgr = sender.kv_mgr
    rooms = getattr(mgr, ROOMS, None)
    if rooms is None:
        rooms = {}
        setattr(mgr, ROOMS, rooms)
    entry = Entry(lane, req, sender, room, mgr, rooms)
    rooms[room] = entry
    return entry


def _reason(expiry: Expiry[Any], entry: Entry, queue: str) -> str:
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
    mgr.update_status(room, FAILED)
