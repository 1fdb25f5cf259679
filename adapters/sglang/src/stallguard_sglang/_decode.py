"""The decode side: per-phase deadlines for the requests in SGLang's decode queues.

A decode request waits in ``DecodePreallocQueue.queue`` (and, before ``init()``, in its
``pending_reqs``, which shares the same ``DecodeRequest`` objects) until decode memory is
allocated and its metadata sent, then in ``DecodeTransferQueue.queue`` until its KV has
landed. Its phases (docs/sglang.md has the table, with what SGLang bounds on its own):

* prealloc ``Bootstrapping``: ``init()`` not called yet (the bootstrap server does not
  know the room yet);
* prealloc ``WaitingForPrefill``: ``init()`` called, receiver still ``Bootstrapping``
  (``prefill_complete``: waiting for the prefill forward pass);
* prealloc ``WaitingForInput``: handshake done, waiting for decode memory;
* transfer ``WaitingForInput``: metadata sent, waiting for the KV;
* transfer ``Transferring``: the receiver concluded ``Success`` but the queue still holds
  it (metadata gate, HiCache restore).

The mechanism is the thin one: one :class:`~stallguard.Watchdog` per queue, keyed by one
entry per stay in the queue; the phase is observed (``observe(..., at=)``) where SGLang
changes it (``CommonKVManager.update_status`` and ``CommonKVReceiver.init``, AFTER hooks,
any thread) and at enrollment; the queue method's AROUND hook enrolls the requests that
joined, runs ``check()`` once, calls SGLang's method and forgets the requests that left.
No scheduling of its own.

A forced failure does what SGLang's own waiting timeout does: ``record_failure``, room
``Failed`` (and the receiver latched ``Failed``, so ``init()`` of a pending request is a
no-op and a ``Success`` held back by the gate is failed too), and
``ensure_abort_notified()`` (the ABORT to prefill, where ``init()`` created a bootstrap;
drain ACKs armed once metadata was sent). The queue list is never touched: SGLang's next
poll, MIN all-reduced over the ranks, concludes it on every rank (the client gets its
error in that call).

Failing is not freeing. A request failed in the transfer queue has published its page
indices, and a prefill frozen mid-WRITE completes that WRITE when it resumes (measured:
docs/sglang.md). SGLang holds such pages in its deferred release until the prefill's
drain ACK (sent only once its transfer worker has no chunk of the room dequeued or
posted) or ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT`` (30 s), then frees
them "anyway". For the requests stallguard failed, the transfer hook **takes that
release over**: right after the ``pop_transferred`` call that deferred them it sets their
entry's timeout to infinity (so SGLang's own ``resolve_deferred_releases`` frees them on
the drain ACK alone, still MIN all-reduced over the ranks) and holds them in a
:class:`stallguard.Quarantine` (``[decode] quarantine`` seconds before a hold is
escalated: ERROR log, a ``Quarantined`` report span, the quarantine gauges; never freed on
a timer). A request failed before its metadata was sent (the prealloc queue) holds no
pages and the prefill has no address to write to: nothing to quarantine.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from typing import Any

from stallguard import CONCLUDED, Expiry, Quarantine, Spec, Watchdog

from . import _metrics
from ._config import DECODE_PHASES, Config
from ._guard import (
    GEN_AI_REQUEST_ID,
    QueueMembership,
    _attributes,
    _trace_parent,
    model_attribute,
)
from ._hooks import Site, _dp_rank, _tp_rank, around_queue
from ._hooks import update_status_around as _prefill_update_status
from ._profiles import decode_deadlines, decode_support_table, format_support_table
from ._runtime import Runtime, report_error, runtime
from ._stats_export import LaneStats

__all__ = [
    "PREALLOC_TARGET",
    "RECEIVER_INIT_TARGET",
    "TRANSFER_TARGET",
    "UPDATE_STATUS_TARGET",
    "hook_plan",
]

log = logging.getLogger("stallguard.sglang")

PREALLOC_TARGET = "sglang.srt.disaggregation.decode.DecodePreallocQueue.pop_preallocated"
TRANSFER_TARGET = "sglang.srt.disaggregation.decode.DecodeTransferQueue.pop_transferred"
RECEIVER_INIT_TARGET = "sglang.srt.disaggregation.common.conn.CommonKVReceiver.init"
UPDATE_STATUS_TARGET = "sglang.srt.disaggregation.common.conn.CommonKVManager.update_status"

_FAILED, _BOOTSTRAPPING, _WAITING, _TRANSFERRING, _SUCCESS = range(5)

# Attributes the adapter sets on SGLang objects (names nobody else uses).
_ROOMS = "_stallguard_decode_rooms"  # on a decode CommonKVManager: room -> _Entry
_ENTRY = "_stallguard_decode_entry"  # on a CommonKVReceiver: its _Entry
_GUARD = "_stallguard_decode_guard"  # on a DecodePreallocQueue / DecodeTransferQueue
_PROOF = "transfer_done"  # what SGLang's drain ACK proves (see _Hold)
#: The span/log words for what an overdue hold gets: SGLang 0.5.23's decode side has no
#: connection of its own to the prefill it could tear down (its NIXL agent never adds
#: the prefill as a remote agent; the prefill's engine writes into decode's registered
#: memory over connections the prefill opened).
OVERDUE_ACTION = (
    "holding: no decode-side teardown of the prefill's transfers exists; restart or "
    "kill the prefill (docs/sglang.md)"
)

_TABLE_LOGGED = "_stallguard_decode_table_logged"  # on the Runtime


def _prealloc_phase(receiver: Any, status: int | None) -> str:
    if status is None or status == _FAILED:
        return "Failed"
    if status == _SUCCESS:
        return "Success"
    if status == _BOOTSTRAPPING:
        # init() resolved the prefill and created its bootstrap: waiting for prefill
        if getattr(receiver, "bootstrap_infos", None) is not None:
            return "WaitingForPrefill"
        return "Bootstrapping"
    return "WaitingForInput"  # decode receivers never report Transferring


def _transfer_phase(receiver: Any, status: int | None) -> str:
    if status is None or status == _FAILED:
        return "Failed"
    if status == _SUCCESS:
        return "Transferring"  # concluded, but still queued: gate or HiCache holds it
    return "WaitingForInput"


class _Entry:
    """One ``DecodeRequest``'s stay in one decode queue, and its key in the watchdog
    (shown as the rid)."""

    __slots__ = (
        "backend",
        "dreq",
        "forced",
        "guard",
        "live",
        "mgr",
        "rank",
        "receiver",
        "rid",
        "room",
    )

    def __init__(self, guard: _DecodeGuard, dreq: Any, receiver: Any, backend: str) -> None:
        self.guard = guard
        self.dreq: Any = dreq
        self.rid = dreq.req.rid
        self.receiver: Any = receiver
        self.mgr: Any = receiver.kv_mgr
        self.room = receiver.bootstrap_room
        self.backend = backend
        self.live = True
        #: the position of the phase last observed in the queue's phase order (phases
        #: only move forward: update_status keeps the max, Failed is terminal)
        self.rank = 0
        #: the failure reason, once stallguard failed the request
        self.forced: str | None = None

    def status(self) -> int | None:
        """The receiver's local state now (None: its room was cleared). A room marked
        ``Failed`` is failed whatever the receiver concluded before: SGLang's
        ``abort()`` of a concluded ``Success`` (held back by the metadata gate) marks the
        room ``Failed`` before it latches the receiver, and its ``update_status`` hook
        must see the failure."""
        status = self.mgr.request_status.get(self.room)
        if status is not None and int(status) == _FAILED:
            return _FAILED
        state = self.receiver.conclude_state
        if state is not None:
            return int(state)
        return None if status is None else int(status)

    def __repr__(self) -> str:
        return repr(self.rid)

    def __str__(self) -> str:
        return str(self.rid)


class _Hold:
    """A request stallguard failed in the transfer queue whose pages SGLang deferred:
    the key of its quarantine hold (shown as the rid).

    Released only when SGLang's own ``resolve_deferred_releases`` freed the entry,
    which, with its timeout taken over (infinite), happens only once the room's drain
    ACK came from every prefill rank that got the metadata: the prefill sends it from
    ``_maybe_ack_drained_abort`` (common/conn.py) only while ``_staging_outstanding`` for
    the room is 0, which its transfer workers decrement only after every NIXL handle of
    the chunk is ``DONE`` (or all settled after an error), or after Mooncake's
    synchronous ``send_kvcache`` returned; a chunk whose writes may still land poisons
    the room (``poison_deferred_ack_room``: no ACK ever). The room is marked ``Failed``
    before the ACK target is registered, so a chunk dequeued later is skipped unsent.
    """

    __slots__ = ("backend", "dreq", "peer", "rid", "room")

    def __init__(self, dreq: Any, backend: str) -> None:
        self.dreq: Any = dreq
        self.rid = dreq.req.rid
        receiver = dreq.kv_receiver
        self.room = getattr(receiver, "bootstrap_room", None)
        self.backend = backend
        self.peer = _peer_of(receiver)

    def __repr__(self) -> str:
        return repr(self.rid)

    def __str__(self) -> str:
        return str(self.rid)


def _peer_of(receiver: Any) -> str:
    """The prefill rank(s) that may still write into a receiver's pages."""
    infos = getattr(receiver, "bootstrap_infos", None) or ()
    peers = []
    for info in infos:
        ip = _info_field(info, "rank_ip")
        if ip is not None:
            peers.append(f"{ip}:{_info_field(info, 'rank_port')}")
    return ",".join(sorted(set(peers))) or str(getattr(receiver, "bootstrap_addr", "?"))


def _info_field(info: Any, name: str) -> Any:
    """Field *name* of a receiver's bootstrap info, a dict or an object (None if it
    has none)."""
    return info.get(name) if isinstance(info, dict) else getattr(info, name, None)


#: per decode queue: how a receiver's status reads as a phase, and the terminal phases
_KINDS: dict[str, tuple[Callable[[Any, int | None], str], tuple[str, ...]]] = {
    "prealloc": (_prealloc_phase, ("Success", "Failed")),
    "transfer": (_transfer_phase, ("Failed",)),
}


def _new_quarantine(rt: Runtime) -> Quarantine[_Hold]:
    """The transfer queue's quarantine (enforce mode): the pages of the requests
    stallguard failed, held until the prefill proves its writes into them over."""
    return Quarantine(
        "sglang.decode.quarantine",
        deadline=rt.config.decode.quarantine,
        clock=rt.clock,
        unit="pages",
        overdue_action=OVERDUE_ACTION,
    )


def _held_size(dreq: Any) -> tuple[int, int]:
    """(pages, bytes) the request's published destination spans: its tokens in pages,
    times the bytes a page takes over every KV buffer (what a WRITE can reach)."""
    try:
        kv_args = dreq.kv_receiver.kv_mgr.kv_args
        page_size = max(1, int(getattr(kv_args, "page_size", 1) or 1))
        pages = -(-len(dreq.req.origin_input_ids) // page_size)
        per_page = sum(int(n) for n in getattr(kv_args, "kv_item_lens", ()) or ())
        return pages, pages * per_page
    except Exception:
        return 0, 0


class _DecodeGuard(QueueMembership):
    """Guards one decode queue list: its watchdog, its entries, their phases."""

    def __init__(
        self,
        rt: Runtime,
        kind: str,
        tp_rank: int | None,
        metric_labels: dict[str, str] | None = None,
        *,
        dp_rank: int | None = None,
    ) -> None:
        config = rt.config
        self.rt = rt
        self.kind = kind  # "prealloc" | "transfer"
        self.tp_rank = tp_rank
        #: the scheduler's data-parallel rank (``--dp-size`` > 1 only; as on prefill)
        self.dp_rank = dp_rank
        #: SGLang's own scheduler metric labels (model_name, tp_rank, ...), for joins
        self.metric_labels: dict[str, str] = metric_labels or {}
        self.phase_of: Callable[[Any, int | None], str]
        self.phase_of, terminal = _KINDS[kind]
        order = ("", *DECODE_PHASES[kind])
        self.order = {phase: i for i, phase in enumerate(order)}
        self.order["Success"] = self.order["Failed"] = len(order)
        mode = config.decode.mode
        spec = Spec(
            name=f"sglang.decode.{kind}",
            deadlines=decode_deadlines(config, kind),
            terminal=terminal,
        )
        self.wd: Watchdog[_Entry] = Watchdog(
            spec,
            clock=rt.clock,
            on_expire=self._on_expire if mode == "enforce" else None,
            mode=mode,  # type: ignore[arg-type]
            memory=1,  # keys are unique per stay; a left entry is never observed again
            statistics=True,  # time in state on /metrics (queue decode.<kind>), for advise
            describe=self._describe,
        )
        self.clock = self.wd.clock
        #: time-in-state export, made at the first check (the backend is known then)
        self.stats: LaneStats | None = None
        self.lock = threading.Lock()  # phase updates come from transfer threads too
        QueueMembership.__init__(self)  # entries: id(DecodeRequest.req) -> _Entry
        self.backend: str | None = None
        #: transfer queue: requests stallguard failed, until SGLang deferred (or freed)
        #: them: id(DecodeRequest) -> (DecodeRequest, backend)
        self.forced: dict[int, tuple[Any, str]] = {}
        #: transfer queue: the deferred releases taken over: id(DecodeRequest) -> _Hold
        self.holds: dict[int, _Hold] = {}
        self.quarantine: Quarantine[_Hold] | None = None
        self._peers_shown: set[tuple[str, str]] = set()
        if kind == "transfer" and mode == "enforce":
            self.quarantine = _new_quarantine(rt)
        rt.guards.add(self)  # type: ignore[arg-type]

    @property
    def watchdogs(self) -> dict[str, Watchdog[Any]]:
        """This queue's watchdog, under the backend of its requests (the transfer
        queue's quarantine is :attr:`quarantine`)."""
        return {self.backend or "decode": self.wd}

    def _describe(self, entry: _Entry) -> dict[str, Any]:
        """The span attributes of an expiring request (the watchdog's ``describe``)."""
        rid = str(entry.rid)
        return {
            GEN_AI_REQUEST_ID: rid,
            **_attributes(
                rid=rid,
                bootstrap_room=entry.room,
                backend=entry.backend,
                tp_rank=self.tp_rank,
                dp_rank=self.dp_rank,
                queue=self.kind,
            ),
            **model_attribute(self.metric_labels),
        }

    # ------------------------------------------------------------------ phases

    def refresh(self, entry: _Entry, at: float) -> None:
        """Observe *entry*'s phase as of *at* if it moved forward (any thread)."""
        with self.lock:
            if not entry.live:
                return
            phase = self.phase_of(entry.receiver, entry.status())
            rank = self.order[phase]
            if rank <= entry.rank:
                return
            entry.rank = rank
            self.wd.observe(entry, phase, at=at)

    # ------------------------------------------------------------------ around a call

    @staticmethod
    def key(item: Any) -> int:
        """A ``DecodeRequest``'s key: its ``Req`` (what ``pop_transferred`` returns)."""
        return id(item.req)

    def before(self, queue: list[Any]) -> None:
        """Enroll what joined *queue* since the last call, then check deadlines once."""
        self.sync(queue)
        now = self.clock()
        self._export(now, self.wd.check(now))

    def idle(self) -> None:
        """The queue is empty and nothing is enrolled: export what its last requests
        left to ``/metrics`` once the export period is up (so a scrape after the traffic
        stops sees every stay, as on the prefill side)."""
        if self.stats is not None:
            self._export(self.clock())

    def _export(self, now: float, expired: object = ()) -> None:
        """Time in state to /metrics, about once a second, and the counts of expiries
        at once after a check that *expired* something (labels: queue ``prealloc`` /
        ``transfer``; the backend of its requests)."""
        stats = self.stats
        if stats is None:
            if self.backend is None:
                return  # nothing enrolled yet: nothing recorded
            stats = self.stats = LaneStats(
                self.wd,
                self.kind,
                self.backend,
                self.tp_rank,
                self.clock,
                self.metric_labels,
            )
        stats.tick(now, expired)

    # ------------------------------------------------------------------ membership

    def _enroll(self, dreqs: list[Any]) -> None:
        now = self.clock()
        for dreq in dreqs:
            key = id(dreq.req)
            if key in self.entries:
                continue
            receiver = getattr(dreq, "kv_receiver", None)
            backend = self._backend_of(receiver)
            if backend is None:
                continue
            if self.backend is None:
                self.backend = backend
            entry = self.entries[key] = _Entry(self, dreq, receiver, backend)
            _reachable(entry, receiver)
            # (read after the entry is reachable from the hooks: a change this read
            # misses is observed by the hook)
            self.refresh(entry, now)
            # span attributes: computed only if the request expires (_describe)
            parent = _trace_parent(dreq.req)
            if parent is not None:
                self.wd.annotate(entry, trace_parent=parent)

    def _backend_of(self, receiver: Any) -> str | None:
        """The backend of a request's *receiver*; None for none to guard (no
        receiver, or a FakeKVReceiver, which concludes on its own)."""
        if receiver is None or not hasattr(receiver, "kv_mgr"):
            return None
        backend = self.rt.backend_of(receiver)
        return None if backend == "fake" else backend

    def _leave(self, entry: Any) -> None:
        with self.lock:
            entry.live = False
        self.wd.forget(entry, remember=False)
        rooms = getattr(entry.mgr, _ROOMS, None)
        if rooms is not None and rooms.get(entry.room) is entry:
            del rooms[entry.room]
        receiver = entry.receiver
        if getattr(receiver, _ENTRY, None) is entry:
            setattr(receiver, _ENTRY, None)
        # the watchdog may keep the key a little longer: not the request with it
        entry.dreq = entry.receiver = entry.mgr = None

    # ------------------------------------------------------------------ enforcement

    def _on_expire(self, expiry: Expiry[Any]) -> object:
        """Fail an overdue request the way SGLang's waiting timeout does, unless it
        concluded meanwhile (then the expiry is withdrawn)."""
        entry = expiry.key
        if not isinstance(entry, _Entry) or not entry.live or entry.forced is not None:
            return CONCLUDED
        status = entry.status()
        if self._concluded(status):
            log.info(
                "stallguard-sglang: %s concluded as its decode deadline fired; not failing it",
                entry.rid,
            )
            return CONCLUDED
        phase = self.phase_of(entry.receiver, status)
        if phase != expiry.state_label:
            # a transfer thread moved it on between the check's decision and now (its
            # update_status hook had not observed it yet): the phase it overstayed
            # ended in time, e.g. its KV just arrived (SGLang's own timeout checks
            # Success first too). Withdrawn; the new phase is tracked under a new key
            # from now (at most one call later than the change: never failed early)
            log.info(
                "stallguard-sglang: %s left %s (now %s) as its decode deadline fired; "
                "not failing it",
                entry.rid,
                expiry.state_label,
                phase,
            )
            self._rekey(entry)
            return CONCLUDED
        reason = (
            f"stallguard: request {entry.rid} (bootstrap_room {entry.room}, "
            f"{entry.backend}) spent {expiry.elapsed:.1f}s in {expiry.state_label} in "
            f"the decode {self.kind} queue, past its {expiry.deadline:g}s deadline"
        )
        self._fail(entry, reason)
        return None

    def _concluded(self, status: int | None) -> bool:
        """Whether a receiver *status* says the request concluded (its room cleared,
        failed, or, in the prealloc queue, its metadata sent)."""
        return (
            status is None or status == _FAILED or (self.kind == "prealloc" and status == _SUCCESS)
        )

    def _fail(self, entry: _Entry, reason: str) -> None:
        """Fail *entry*'s request for *reason* (remembered for the quarantine when
        there is one)."""
        entry.forced = reason
        if self.quarantine is not None:
            self.forced[id(entry.dreq)] = (entry.dreq, entry.backend)
        fail_receiver(entry.receiver, reason)

    def _rekey(self, entry: _Entry) -> None:
        """Track *entry*'s request under a new entry, in its current phase from now
        (the old key's expiry is being withdrawn, which concludes that key)."""
        new = _Entry(self, entry.dreq, entry.receiver, entry.backend)
        with self.lock:
            entry.live = False
        key = id(entry.dreq.req)
        if self.entries.get(key) is entry:
            self.entries[key] = new
        rooms = getattr(entry.mgr, _ROOMS, None)
        if rooms is not None and rooms.get(entry.room) is entry:
            rooms[entry.room] = new
        if getattr(entry.receiver, _ENTRY, None) is entry:
            setattr(entry.receiver, _ENTRY, new)
        self.refresh(new, self.clock())

    # ------------------------------------------------------------------ quarantine

    def take_over(self, tq: Any) -> None:
        """After a ``pop_transferred`` call (and at every later one): take over the
        deferred release of the requests stallguard failed, release the holds SGLang
        freed on the drain ACK, escalate the overdue ones. Cheap when nothing is held."""
        quarantine = self.quarantine
        if quarantine is None or not (self.forced or self.holds):
            return
        deferred = getattr(tq, "_deferred_releases", None)
        if deferred is None:
            deferred = []
        changed = False
        if self.forced:
            changed |= self._adopt(tq, deferred, quarantine)
        if self.holds:
            changed |= self._release_acked(deferred, quarantine)
        if quarantine.check():
            changed = True
        if changed:
            self._show_quarantine(quarantine)

    def _release_acked(self, deferred: list[Any], quarantine: Quarantine[_Hold]) -> bool:
        """Release the holds whose deferred release SGLang resolved (the prefill ACKed
        the drain: gone from *deferred*, and freed); whether any was."""
        changed = False
        present = {id(item[0]) for item in deferred}
        for key in [k for k in self.holds if k not in present]:
            hold = self.holds[key]
            if hold.dreq.kv_receiver is not None:
                # dropped without SGLang's _do_release (a release that raised, or
                # release_memory_occupation): not freed, so it stays in the ledger
                continue
            del self.holds[key]
            released = quarantine.release(hold, proof=_PROOF)
            hold.dreq = None
            _log_released(hold, released, quarantine)
            changed = True
        return changed

    def _adopt(self, tq: Any, deferred: list[Any], quarantine: Quarantine[_Hold]) -> bool:
        changed = False
        for i, item in enumerate(deferred):
            key = id(item[0])
            found = self.forced.pop(key, None)
            if found is None or key in self.holds:
                continue
            # (decode_req, start_time, deadline, metadata_idx, required_acks): only the
            # drain ACK can release it now, through SGLang's own resolve
            deferred[i] = (item[0], item[1], math.inf, *item[3:])
            self._hold(key, *found, quarantine)
            changed = True
        if self.forced:
            self._freed_at_once(tq)
        return changed

    def _hold(self, key: int, dreq: Any, backend: str, quarantine: Quarantine[_Hold]) -> None:
        """Quarantine the pages of *dreq*, a request stallguard failed (*key*: its
        deferred release's)."""
        hold = _Hold(dreq, backend)
        pages, nbytes = _held_size(dreq)
        self.holds[key] = hold
        quarantine.hold(
            hold,
            peer=hold.peer,
            units=pages,
            nbytes=nbytes,
            attributes=_attributes(
                rid=str(hold.rid),
                bootstrap_room=hold.room,
                backend=backend,
                tp_rank=self.tp_rank,
                queue=self.kind,
            ),
        )

    def _freed_at_once(self, tq: Any) -> None:
        """Forget (with an error) the failed requests that left the queue without a
        deferred release: SGLang freed their pages at once."""
        queued = {id(d) for d in getattr(tq, "queue", ())}
        for key in [k for k in self.forced if k not in queued]:
            dreq, _ = self.forced.pop(key)
            # SGLang freed the pages at once: deferred release is off
            # (SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=0) or unsupported
            log.error(
                "stallguard-sglang: %s was failed with its metadata sent and SGLang "
                "freed its pages at once (deferred decode KV release is off or "
                "unsupported by this backend): a prefill that resumes may still "
                "write into them. Enable SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_"
                "RELEASE for stallguard to quarantine them",
                dreq.req.rid,
            )

    def _show_quarantine(self, quarantine: Quarantine[_Hold]) -> None:
        """The quarantine gauges, per (backend, peer); a peer whose holds all left is
        set to zero."""
        by_backend = _held_per_peer(quarantine)
        shown = {(b, p) for b, peers in by_backend.items() for p in peers}
        for backend, peer in self._peers_shown - shown:
            by_backend.setdefault(backend, {})[peer] = [0, 0, 0]
        self._peers_shown = shown
        for backend, peers in by_backend.items():
            _metrics.set_quarantined(
                backend,
                {peer: (row[0], row[1], row[2]) for peer, row in peers.items()},
                self.metric_labels,
            )


def _log_released(hold: _Hold, released: Any, quarantine: Quarantine[_Hold]) -> None:
    """Log the pages of *hold* freed on the drain ACK (*released*: the quarantine's
    record of them; None: it held nothing)."""
    if released is not None:
        log.info(
            "stallguard-sglang: %s (bootstrap_room %s): the prefill ACKed the "
            "drain; its %d quarantined pages freed after %.3fs",
            hold.rid,
            hold.room,
            released.units,
            quarantine.watchdog.clock() - released.since,
        )


def _held_per_peer(quarantine: Quarantine[_Hold]) -> dict[str, dict[str, list[int]]]:
    """backend -> peer -> [pages, bytes, overdue holds] of what *quarantine* holds."""
    by_backend: dict[str, dict[str, list[int]]] = {}
    for held in quarantine.holds():
        backend = held.key.backend
        row = by_backend.setdefault(backend, {}).setdefault(held.peer, [0, 0, 0])
        row[0] += held.units
        row[1] += held.nbytes
        row[2] += int(held.overdue)
    return by_backend


def _reachable(entry: _Entry, receiver: Any) -> None:
    """Make *entry* reachable from the hooks: in its manager's rooms map, and on its
    *receiver*."""
    rooms = getattr(entry.mgr, _ROOMS, None)
    if rooms is None:
        rooms = {}
        setattr(entry.mgr, _ROOMS, rooms)
    rooms[entry.room] = entry
    setattr(receiver, _ENTRY, entry)


def fail_receiver(receiver: Any, reason: str) -> None:
    """Fail a decode ``CommonKVReceiver`` the way SGLang's waiting timeout does: record
    the reason, mark the room Failed, latch the receiver Failed, and tell the prefill
    (``ensure_abort_notified``: only once ``init()`` created a bootstrap; it also arms
    the drain ACK once metadata was sent). SGLang's next poll concludes it."""
    mgr = receiver.kv_mgr
    room = receiver.bootstrap_room
    mgr.record_failure(room, reason)
    mgr.update_status(room, _FAILED)
    receiver.conclude_state = _FAILED
    notify = getattr(receiver, "ensure_abort_notified", None)
    if notify is not None:
        try:
            notify()
        except Exception:  # best effort, as SGLang's own notification is
            log.exception("stallguard-sglang: could not tell prefill about room %s", room)


# --------------------------------------------------------------------------- the hooks


def _guard(queue_obj: Any, kind: str) -> _DecodeGuard | None:
    """*queue_obj*'s guard, created at its first call; None when the decode side is off
    (or the adapter not installed)."""
    guard: _DecodeGuard | None = getattr(queue_obj, _GUARD, None)
    if guard is not None:
        return guard
    rt = runtime()
    if rt is None or rt.config.decode.mode == "off":
        return None
    try:
        _log_table(rt)
        sched = getattr(queue_obj, "scheduler", None)
        tp_rank = _tp_rank(sched)
        sglang_labels = _metrics.scheduler_labels(sched, tp_rank)
        labels = _metrics.prepare(sglang_labels)
        guard = _DecodeGuard(rt, kind, tp_rank, labels, dp_rank=_dp_rank(sglang_labels))
        setattr(queue_obj, _GUARD, guard)
        return guard
    except Exception:
        report_error(f"setting up the decode {kind} queue guard")
        return None


def _log_table(rt: Runtime) -> None:
    """Log the decode support table once per process (at the first decode queue call)."""
    rt.announce()
    if getattr(rt, _TABLE_LOGGED, False):
        return
    setattr(rt, _TABLE_LOGGED, True)
    rows = decode_support_table(rt.config)
    log.info(
        "stallguard-sglang: decode deadlines (config %s):\n%s",
        rt.config.source,
        format_support_table(rows, version=rt.version, second="policy"),
    )


def _preallocated(result: Any) -> list[Any]:
    # pop_preallocated returns (preallocated, failed) DecodeRequests; guards key by Req
    parts = result if isinstance(result, tuple) else ()
    return [dreq.req for part in parts for dreq in part]


PREALLOC = Site(
    kind="prealloc",
    method="pop_preallocated",
    guard_attr=_GUARD,
    queue_attr="queue",
    scheduler=lambda q: getattr(q, "scheduler", None),
    left=_preallocated,
)
TRANSFER = Site(
    kind="transfer",
    method="pop_transferred",
    guard_attr=_GUARD,
    queue_attr="queue",
    scheduler=lambda q: getattr(q, "scheduler", None),
    left=list,  # the Reqs whose KV arrived (failed ones leave silently: a rescan)
)


def prealloc_around(original: Callable[..., Any], q: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of ``DecodePreallocQueue.pop_preallocated``."""
    if _guard(q, "prealloc") is None:
        return original(q, *args, **kwargs)
    return around_queue(PREALLOC, original, q, *args, **kwargs)


def transfer_around(original: Callable[..., Any], q: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of ``DecodeTransferQueue.pop_transferred``; then the quarantine's
    take-over of the deferred releases of the requests stallguard failed."""
    guard = _guard(q, "transfer")
    if guard is None:
        return original(q, *args, **kwargs)
    result = around_queue(TRANSFER, original, q, *args, **kwargs)
    try:
        guard.take_over(q)
    except Exception:
        report_error("pop_transferred (quarantine)")
    return result


def update_status_after(
    result: Any, mgr: Any, bootstrap_room: Any, *args: Any, **kwargs: Any
) -> None:
    """AFTER hook of ``CommonKVManager.update_status``: observe an enrolled decode room's
    new phase (any thread)."""
    rooms = getattr(mgr, _ROOMS, None)
    if rooms:
        entry = rooms.get(bootstrap_room)
        if entry is not None:
            guard = entry.guard
            guard.refresh(entry, guard.clock())
    return None


def receiver_init_after(result: Any, receiver: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook of ``CommonKVReceiver.init``: ``Bootstrapping`` -> ``WaitingForPrefill``
    changes no status, so the hook observes it here."""
    entry = getattr(receiver, _ENTRY, None)
    if entry is not None:
        guard = entry.guard
        guard.refresh(entry, guard.clock())
    return None


def update_status_around(
    original: Callable[..., Any], mgr: Any, bootstrap_room: Any, status: Any
) -> Any:
    """AROUND hook of ``CommonKVManager.update_status`` when both sides need it: the
    prefill side's capture (:func:`stallguard_sglang._hooks.update_status_around`), then
    the decode side's (:func:`update_status_after`). One hook per target, so the method
    is wrapped once."""
    result = _prefill_update_status(original, mgr, bootstrap_room, status)
    update_status_after(result, mgr, bootstrap_room, status)
    return result


def _add_update_status(plan: list[tuple[str, Callable[..., Any], str]]) -> None:
    """The decode side's ``update_status`` hook into *plan*: combined with the prefill
    side's if *plan* has it (one hook per target), else on its own."""
    for i, (target, fn, _) in enumerate(plan):
        if target == UPDATE_STATUS_TARGET:
            if fn is not _prefill_update_status:
                raise ValueError(f"unexpected update_status hook {fn!r}")
            plan[i] = (UPDATE_STATUS_TARGET, update_status_around, "around")
            return
    plan.append((UPDATE_STATUS_TARGET, update_status_after, "after"))


def hook_plan(
    config: Config, plan: list[tuple[str, Callable[..., Any], str]] | None = None
) -> list[tuple[str, Callable[..., Any], str]]:
    """*plan* (the prefill side's hooks) plus the decode hooks *config* needs:
    ``(target, function, "around" | "after")``, one entry per target. Unchanged when
    ``[decode] mode = "off"``."""
    plan = list(plan or [])
    if config.decode.mode == "off":
        return plan
    _add_update_status(plan)
    plan += [
        (PREALLOC_TARGET, prealloc_around, "around"),
        (TRANSFER_TARGET, transfer_around, "around"),
        (RECEIVER_INIT_TARGET, receiver_init_after, "after"),
    ]
    return plan
