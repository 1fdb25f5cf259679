"""The state-mapping layer: a disaggregated request's phases, fed to stallguard's core.

Pure Python (no vLLM import), so its promises are tested with random event sequences
and a fake clock. The connector (``connector.py``) calls one method per phase change,
where vLLM makes it, and :meth:`PhaseTracker.step` once per scheduler step; ``step``
returns the requests to fail, which the connector hands to its workers through vLLM's
connector metadata.

Phases (docs/vllm.md has the table with vLLM's own bounds):

========== ======== ===========================================================
phase      side     from / until
========== ======== ===========================================================
Queued     decode   added with ``do_remote_prefill`` / blocks allocated (or gone)
Receiving  decode   blocks allocated, ``WAITING_FOR_REMOTE_KVS`` / transfer ends
AbortedHeld decode  finished (abort, error) while Receiving / transfer ends
HeldForRead prefill prefill done, blocks held for the decode / ``finished_sending``
========== ======== ===========================================================

A request failed in ``Receiving`` (or overdue in ``AbortedHeld``) leaves its blocks in
**quarantine** (:attr:`PhaseTracker.quarantine`, a :class:`stallguard.Quarantine`): the
client gets its error at once, the blocks stay held until NIXL reports every transfer
into them over (``finished_recving``: each handle ``DONE`` or ``ERR``), however long that
takes. A hold older than the ``Quarantined`` deadline is escalated, never freed.

Promises (tests/test_vllm_phases.py tries to break them):

* a request is ordered failed at most once, ever;
* a request whose transfer ended (``done``) or that was never tracked is never
  ordered failed;
* a request is ordered failed in the first :meth:`step` at or past its phase's
  deadline, counted from when it entered the phase, and never before;
* ``Queued`` is only ever reported, never failed;
* ``HeldForRead`` is only reported when the connector cannot release a hold;
* a failed request's blocks are released from quarantine only by its transfer's end
  (:meth:`PhaseTracker.done`), never by a deadline.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from stallguard import Expiry, Hold, Quarantine, Spec, StateStatistics, Watchdog
from stallguard.adapters import BOUNDS, LADDER, expiries_since

from ._config import Config

__all__ = [
    "ABORTED_HELD",
    "DONE",
    "EXPORT_PERIOD",
    "GEN_AI_REQUEST_ID",
    "HELD_FOR_READ",
    "QUARANTINED",
    "QUEUED",
    "RECEIVING",
    "Orders",
    "PhaseTracker",
]

QUEUED = "Queued"
RECEIVING = "Receiving"
ABORTED_HELD = "AbortedHeld"
HELD_FOR_READ = "HeldForRead"
QUARANTINED = "Quarantined"
DONE = "Done"
#: vLLM's request id under the name vLLM's own spans give it (``SpanAttributes``)
GEN_AI_REQUEST_ID = "gen_ai.request.id"


@dataclass(frozen=True)
class Orders:
    """What one scheduler step asks the workers to do.

    Attributes:
        fail_recv: decode requests whose receive the workers report failed (vLLM's
            ``failed_recving``), releasing their in-flight transfer handles first.
            The workers never release a transfer handle that is still in flight: the
            blocks stay with the failed request (quarantined) until NIXL reports it
            ``DONE`` or ``ERR``.
        release_send: prefill requests whose held blocks the workers release (vLLM's
            lease-expiry path: reported in ``finished_sending``) once the decode has
            stopped heartbeating for them.
    """

    fail_recv: frozenset[str] = field(default_factory=frozenset)
    release_send: frozenset[str] = field(default_factory=frozenset)

    def __bool__(self) -> bool:
        return bool(self.fail_recv or self.release_send)


_NO_ORDERS = Orders()

#: Seconds between two time-in-state exports (:meth:`PhaseTracker.take_stays`).
EXPORT_PERIOD = 1.0
# ladder bucket j = the fine buckets BOUNDS[a:b] (every ladder value is one of BOUNDS);
# the same reduction stallguard-sglang's export makes (its _stats_export.py)
_ENDS = (*(BOUNDS.index(v) + 1 for v in LADDER), len(BOUNDS))
_SLICES: tuple[tuple[int, int], ...] = tuple(zip((0, *_ENDS[:-1]), _ENDS, strict=True))


class PhaseTracker:
    """One engine's disaggregated requests, by phase, with stallguard's deadlines.

    Args:
        config: the deadlines and the mode (``"off"`` is the caller's business: do not
            build a tracker).
        clock: seconds, never going backwards (tests: a ``FakeClock``).
        attributes: span attributes added to every request (engine id, role).
        releases_sends: whether the connector can release a prefill's held blocks
            (its refinement knows how); if not, an overdue ``HeldForRead`` is only
            reported (counted ``reported``), never ordered released.
    """

    def __init__(
        self,
        config: Config,
        *,
        clock: Callable[[], float] = time.monotonic,
        attributes: Mapping[str, Any] | None = None,
        releases_sends: bool = True,
    ) -> None:
        if config.mode not in ("enforce", "report"):
            raise ValueError(f"a PhaseTracker needs mode enforce or report, got {config.mode!r}")
        self.config = config
        self.clock = clock
        self.attributes = dict(attributes or {})
        self.enforce = config.mode == "enforce"
        self.releases_sends = releases_sends
        self.transfers: Watchdog[str] = Watchdog(
            Spec(
                name="vllm_kv_transfer",
                deadlines={
                    RECEIVING: config.receiving,
                    ABORTED_HELD: config.aborted_held,
                    HELD_FOR_READ: config.held_for_read,
                },
                terminal=[DONE],
            ),
            clock=clock,
            mode=config.mode,
            memory=1 << 16,
            statistics=True,  # time in state on /metrics (take_stays), for advise
        )
        # Report-only prefill holds, for a connector that cannot release one safely
        self.holds: Watchdog[str] | None = None
        if not releases_sends:
            self.holds = Watchdog(
                Spec(
                    name="vllm_kv_held",
                    deadlines={HELD_FOR_READ: config.held_for_read},
                    terminal=[DONE],
                ),
                clock=clock,
                mode="report",
                memory=1 << 16,
                statistics=True,  # its expiries' counts (take_counts)
            )
        # Report-only: a request without blocks cannot be failed from a connector.
        self.queue: Watchdog[str] = Watchdog(
            Spec(name="vllm_kv_queued", deadlines={QUEUED: config.queued}, terminal=[DONE]),
            clock=clock,
            mode="report",
            memory=1 << 16,
            statistics=True,
        )
        #: failed (or aborted) requests' blocks, held until their transfer ends
        self.quarantine: Quarantine[str] = Quarantine(
            "vllm_kv_quarantine", deadline=config.quarantined, clock=clock, unit="blocks"
        )
        #: the per-peer quarantine figures last handed to the metrics
        self._shipped: tuple[tuple[str, int, int, int, int], ...] = ()
        #: rid -> (peer engine id, blocks, bytes) of each request in Receiving
        self._memory: dict[str, tuple[str, int, int]] = {}
        #: quarantine holds escalated (past the Quarantined deadline), since start, and
        #: those not yet taken by :meth:`take_counts` (the expiries' counts are the
        #: core's: ``StateStatistics.forced`` / ``.reported``)
        self._overdue = 0
        self._overdue_sent = 0
        #: per watchdog: its expiries' counts already taken (``expiries_since``)
        self._sent: dict[str, dict[tuple[str, str, str], int]] = {}
        #: a check returned expiries since the last take_counts (else it has none)
        self._expired = False
        #: per phase: ladder-bucket counts and sum already exported (take_stays)
        self._stays_sent: dict[str, tuple[list[int], float]] = {}
        self._stays_due = -float("inf")

    # ------------------------------------------------------------------ phase changes

    def queued(self, rid: str, *, trace_headers: Mapping[str, str] | None = None) -> None:
        """Decode: a request that will receive its KV remotely was added."""
        self.queue.observe(rid, QUEUED)
        self._annotate(self.queue, rid, "decode", trace_headers)

    @staticmethod
    def _end(wd: Watchdog[str], rid: str) -> None:
        """*rid* left *wd*'s phases, if it was in one. (The core remembers a terminal
        state seen first as a finished request and drops later live events for it;
        these calls often concern requests the watchdog never tracked, such as a decode
        request that was never queued, and must not bury their ids.)"""
        if rid in wd:
            wd.observe(rid, DONE)

    def receiving(
        self,
        rid: str,
        *,
        trace_headers: Mapping[str, str] | None = None,
        peer: str = "",
        blocks: int = 0,
        nbytes: int = 0,
    ) -> None:
        """Decode: blocks allocated, the request waits for remote KV from *peer* (the
        prefill's engine id) into *blocks* blocks (*nbytes* bytes): what is quarantined
        if the request fails."""
        self._end(self.queue, rid)
        self._memory[rid] = (peer, blocks, nbytes)
        self.transfers.observe(rid, RECEIVING)
        self._annotate(self.transfers, rid, "decode", trace_headers)

    def not_receiving(self, rid: str) -> None:
        """Decode: allocated without a remote transfer to wait for (full local hit)."""
        self._end(self.queue, rid)

    def finished(self, rid: str) -> bool:
        """The scheduler finished the request (any status). Returns True if its blocks
        stay held for a transfer still running (it moved to ``AbortedHeld``)."""
        self._end(self.queue, rid)
        if self.transfers.state_of(rid) == RECEIVING:
            self.transfers.observe(rid, ABORTED_HELD)
            return True
        return False

    def held_for_read(self, rid: str, *, trace_headers: Mapping[str, str] | None = None) -> None:
        """Prefill: the prefill finished, its blocks are held for the decode's read."""
        wd = self.transfers if self.holds is None else self.holds
        wd.observe(rid, HELD_FOR_READ)
        self._annotate(wd, rid, "prefill", trace_headers)

    def done(self, rid: str, *, failed: bool = False) -> Hold[str] | None:
        """The transfer ended (``finished_recving`` / ``finished_sending``; *failed*:
        reported in ``failed_recving`` too, a handle ended in ``ERR``): NIXL holds no
        handle into its blocks any more. Releases its quarantine, if any (returned)."""
        self._end(self.queue, rid)
        self._end(self.transfers, rid)
        if self.holds is not None:
            self._end(self.holds, rid)
        self._memory.pop(rid, None)
        if rid in self.quarantine:
            return self.quarantine.release(
                rid, proof="transfer_error" if failed else "transfer_done"
            )
        return None

    # ------------------------------------------------------------------ deadlines

    def step(self, now: float | None = None) -> Orders:
        """Run the deadline checks (once per scheduler step). Cheap when nothing is due:
        two clock reads and two comparisons."""
        if now is None:
            now = self.clock()
        self._check_reported(now)
        expiries = self.transfers.check(now)
        if not expiries:
            return _NO_ORDERS
        self._expired = True
        return self._orders(expiries) if self.enforce else _NO_ORDERS

    def _check_reported(self, now: float) -> None:
        """The checks whose expiries are only reported: the queue, the quarantine
        (counting its overdue holds), the report-only prefill holds."""
        if self.queue.check(now):
            self._expired = True
        self._overdue += len(self.quarantine.check(now))
        if self.holds is not None and self.holds.check(now):
            self._expired = True

    def _orders(self, expiries: list[Expiry[str]]) -> Orders:
        """What the connector must do about the transfers' *expiries* (enforce): fail
        the overdue receives (their blocks quarantined), quarantine the overdue aborted
        ones, release the overdue prefill holds."""
        fail: set[str] = set()
        release: set[str] = set()
        for expiry in expiries:
            phase = str(expiry.state)
            rid = expiry.key
            if phase == RECEIVING:
                fail.add(rid)  # the client's error now; the blocks stay (quarantine)
                self._hold(rid)
            elif phase == ABORTED_HELD:
                self._hold(rid)  # finished already; vLLM keeps its blocks: escalate
            elif phase == HELD_FOR_READ:
                release.add(rid)
        if not fail and not release:
            return _NO_ORDERS
        return Orders(frozenset(fail), frozenset(release))

    def take_counts(self) -> Counter[tuple[str, str, str]]:
        """The counts since the last call, ``(kind, phase, reason) -> n`` (for vLLM's
        connector stats): the watchdogs' forced and reported expiries (the core's
        counts), and ``("quarantine_overdue", "Quarantined", "state")``. Cheap when
        nothing expired since the last call."""
        out: Counter[tuple[str, str, str]] = Counter()
        if self._expired:
            self._expired = False
            for wd in self._watchdogs():
                sent = self._sent.setdefault(wd.spec.name, {})
                out.update(expiries_since(wd.statistics(), sent))
        if self._overdue > self._overdue_sent:
            out["quarantine_overdue", QUARANTINED, "state"] = self._overdue - self._overdue_sent
            self._overdue_sent = self._overdue
        return out

    @property
    def counts(self) -> Counter[tuple[str, str]]:
        """``(kind, phase) -> n`` since start, kind ``"forced"``, ``"reported"`` (the
        watchdogs' expiries, the core's counts) or ``"quarantine_overdue"``."""
        out: Counter[tuple[str, str]] = Counter()
        for wd in self._watchdogs():
            for label, st in wd.statistics().states.items():
                for kind, by_reason in (("forced", st.forced), ("reported", st.reported)):
                    if by_reason:
                        out[kind, label] += sum(by_reason.values())
        if self._overdue:
            out["quarantine_overdue", QUARANTINED] = self._overdue
        return out

    def _watchdogs(self) -> tuple[Watchdog[str], ...]:
        return (self.queue, self.transfers, *self._holds())

    def _holds(self) -> tuple[Watchdog[str], ...]:
        """The prefill holds' watchdog, if there is one (report-only holds)."""
        return () if self.holds is None else (self.holds,)

    def take_stays(self, now: float | None = None) -> list[list[Any]] | None:
        """Time in state for the metrics, at most once per ``EXPORT_PERIOD`` (1 s): one
        row per phase, ``[phase, counts, seconds, deadline, oldest_age]``, *counts* the
        stays recorded since the last export per ladder bucket
        (``stallguard.adapters.LADDER`` then +Inf), *seconds* their sum, *deadline* the
        phase deadline (None: none), *oldest_age* the oldest request in the phase now
        (0: none). None between exports (cheap: one comparison)."""
        if now is None:
            now = self.clock()
        if now < self._stays_due:
            return None
        self._stays_due = now + EXPORT_PERIOD
        rows: list[list[Any]] = []
        for wd in (self.queue, self.transfers):
            ages = _oldest_ages(wd, now)
            rows += [
                self._stays_row(label, st, ages.get(label, 0.0))
                for label, st in wd.statistics().states.items()
            ]
        return rows

    def _stays_row(self, label: str, st: StateStatistics, oldest: float) -> list[Any]:
        """Phase *label*'s row of :meth:`take_stays` (its stays since the last export)."""
        dist = st.distribution
        fine = dist.counts
        counts = [sum(fine[a:b]) for a, b in _SLICES]
        sent, total = self._stays_sent.get(label, ([0] * len(counts), 0.0))
        delta = [c - b for c, b in zip(counts, sent, strict=True)]
        self._stays_sent[label] = (counts, dist.total)
        return [label, delta, dist.total - total, st.deadline, oldest]

    def take_quarantine(self) -> list[list[Any]] | None:
        """The quarantine per peer, ``[[peer, holds, blocks, bytes, overdue], ...]``, if
        it changed since the last call (for the Prometheus gauges), else None. Cheap
        when nothing is or was quarantined."""
        if not self.quarantine and not self._shipped:
            return None
        snap = self.quarantine.snapshot()
        rows = tuple((p.peer, p.holds, p.units, p.nbytes, p.overdue) for p in snap.by_peer.values())
        if rows == self._shipped:
            return None
        self._shipped = rows
        return [list(r) for r in rows]

    def phase_of(self, rid: str) -> str | None:
        """The phase *rid* is tracked in (None: not tracked)."""
        if rid in self.quarantine:
            return QUARANTINED
        for wd in (self.transfers, self.queue, *self._holds()):
            state = wd.state_of(rid)
            if state is not None:
                return str(state)
        return None

    def __len__(self) -> int:
        return sum(map(len, self._watchdogs()))

    # ------------------------------------------------------------------ internals

    def _hold(self, rid: str) -> None:
        peer, blocks, nbytes = self._memory.get(rid, ("", 0, 0))
        self.quarantine.hold(
            rid,
            peer=peer,
            units=blocks,
            nbytes=nbytes,
            attributes={GEN_AI_REQUEST_ID: rid, "vllm.request_id": rid, **self.attributes},
        )

    def _annotate(
        self,
        wd: Watchdog[str],
        rid: str,
        side: str,
        trace_headers: Mapping[str, str] | None,
    ) -> None:
        attributes = {
            GEN_AI_REQUEST_ID: rid,
            "vllm.request_id": rid,  # the 0.1 name, kept one release
            "vllm.kv_side": side,
            **self.attributes,
        }
        wd.annotate(rid, attributes=attributes, trace_parent=trace_headers or None)


def _oldest_ages(wd: Watchdog[str], now: float) -> dict[str, float]:
    """The age of the oldest request in each of *wd*'s phases at *now* (0: none in it)."""
    summaries = wd.snapshot(requests=False, now=now).states
    return {label: summary.oldest_age or 0.0 for label, summary in summaries.items()}
